// Setting up a world version's rings: the handshake with each neighbour (connect.h, and the
// listener for the predecessor), then the LINK exchange on the same connection, which
// settles how each direction's data travels (TCP frames, or shared memory for a neighbour on
// this host), and the Links built on the result. The only place that knows the concrete
// ends (tcp_links.h, shm_links.h): above this file a ring is a Links, whatever carries it.
// See native/README.md, "Link set-up".
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/common.h"
#include "transport/handshake.h"
#include "transport/io.h"
#include "transport/links.h"
#include "transport/listener.h"

namespace ering {

struct LinkSettings {
  bool want_shm = false;  // both ends on one host and the transport allows it
  size_t slots = 8;
  size_t slot_bytes = 256 << 10;
};

// One ring this rank forms: which ring of the world version (the handshake's channel), its
// neighbours, where the next rank listens, and what each direction may run over.
struct RingToForm {
  uint8_t channel = kChannelFlat;
  LinkContext ctx;           // ring size, neighbours' ranks and printable addresses
  std::string next_address;  // as the next rank announced it
  LinkSettings send, recv;   // to the next rank, from the previous one
};

// Who forms the rings of one world version, and within what limits.
struct Forming {
  Listener* listener = nullptr;
  std::string job_id, secret;
  uint64_t world_version = 0;
  int rank = 0, world_size = 0;
  WorldDigest world_digest{};
  Clock::time_point deadline;
  double collective_timeout = 0;  // a neighbour that accepts no connection this long is unreachable (at most 30 s)
  double dead_link_timeout = 0;   // CommConfig::dead_link_timeout, for every ring connection
  const AbortSignal* abort = nullptr;  // the communicator's: every formed Links wakes on it
};

// Connects every ring's next rank, takes every previous rank's connection and sets up their
// links, in an order no cycle of ranks can wait on: every ring's connection and LINK go out
// before any predecessor is awaited, and every LINK_ACK is answered before any is awaited.
// Calls formed(i, links) as soon as ring i is up, so the caller can keep it where abort()
// reaches it; on failure closes what it opened and throws (CommError for op "form").
// Waits end early when `stop` fires (up to taking the predecessors' connections) or
// `linking_stop` (the link set-up after that: once this rank's LINK_ACK is out, its
// predecessor may finish its part of a collective and close).
void form_rings(const std::vector<RingToForm>& rings, const Forming& how, const AbortSignal& stop,
                const AbortSignal& linking_stop, const std::function<void(size_t, std::unique_ptr<Links>)>& formed);

// While a ring forms late (the reverse ring, at the first shift_back()), watches a formed
// ring's connections: `any` fires when `outer` fires or either connection ends or carries the
// poison byte; `sender_side` only for `outer` or the connection to `sender_side_fd`. Its one
// thread lives as long as the object, which the forming call it guards keeps on its stack:
// form_rings() ends by its own deadline, and the destructor stops the thread.
class WatchWhileForming {
 public:
  WatchWhileForming(std::vector<WatchFd> fds, int sender_side_fd, const AbortSignal& outer);
  ~WatchWhileForming();
  WatchWhileForming(const WatchWhileForming&) = delete;
  WatchWhileForming& operator=(const WatchWhileForming&) = delete;
  AbortSignal any, sender_side;

 private:
  void watch(std::vector<WatchFd> fds, int sender_side_fd, const AbortSignal& outer);
  AbortSignal done_;
  std::thread thread_;
};

}  // namespace ering
