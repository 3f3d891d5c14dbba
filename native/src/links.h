// The data plane of one ring: a Plan (what a collective sends and receives, as numbered
// segments) and the Links that move it between this rank and its two neighbours, with a
// no-progress deadline, abort, and the poison byte that tells a neighbour a failure was
// passed on.
//
// The links know connections and segments only; which bytes go where is the Plan's
// business (plans.h). TCP framing is in tcp_links.h, shared memory in shm.h.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <poll.h>
#include <string>
#include <vector>

#include "common.h"
#include "io.h"

namespace ering {

struct Span {
  char* ptr;
  size_t bytes;
};

// What one collective sends to the next rank and receives from the previous one,
// as numbered segments. Sends and receives each go in index order.
class Plan {
 public:
  virtual ~Plan() = default;
  virtual size_t num_sends() const = 0;
  virtual size_t num_recvs() const = 0;
  virtual Span send_span(size_t i) = 0;
  // Where segment i lands when a transport receives it into memory of the plan's choosing.
  virtual Span recv_span(size_t i) = 0;
  // Called once segment i has fully landed in recv_span(i) (e.g. to reduce it).
  virtual void received(size_t i) {}
  // For a transport whose bytes already sit in memory the plan can read (shared memory):
  // hands over bytes [offset, offset + n) of segment i. The default copies them to
  // recv_span(i); a plan may consume them in place instead (reduce straight from them).
  virtual void deliver(size_t i, size_t offset, const char* src, size_t n) {
    std::memcpy(recv_span(i).ptr + offset, src, n);
  }
  // Called once every byte of segment i went through deliver().
  virtual void delivered(size_t i) { received(i); }
  // The receive that must complete before send i may start, or -1 for none.
  virtual ptrdiff_t send_after(size_t i) const = 0;
};

struct OpInfo {
  const char* name;      // "allreduce", "broadcast", ...
  uint32_t seq;          // per-communicator operation counter, identical on every rank
  uint32_t tag;          // hash of what the op is (kind, dtype, op, size): catches mismatched calls
  std::string describe;  // for errors: "allreduce #7 (float32, 1000 elements, sum)"
};

struct LinkContext {
  int rank;
  int size;
  uint64_t world_version;
  int next_rank, prev_rank;
  std::string next_address, prev_address;  // as printed in messages (printable())
};

// A connection of another ring of the same communicator that a run() must watch while it
// waits: the hierarchical allreduce runs its phases on different rings, and a rank blocked
// in one phase must still learn at once that a neighbour it needs in a later phase gave up
// or died (FIN, RST or the poison byte; data and doorbells on it are left alone).
struct WatchFd {
  int fd;
  int peer;
  std::string name;
};
constexpr size_t kMaxWatch = 2;

// The data plane of one ring.
class Links {
 public:
  virtual ~Links() = default;
  virtual void run(Plan& plan, const OpInfo& op) = 0;
  // Shuts the connections down so neighbours fail fast: how one failure reaches every rank.
  virtual void shutdown() = 0;
  // How this rank sends to the next rank and receives from the previous one: "tcp" or "shm".
  virtual const char* send_kind() const { return "tcp"; }
  virtual const char* recv_kind() const { return "tcp"; }
  // This ring's two connections, for another ring's run() to watch.
  virtual std::vector<WatchFd> connections() const = 0;
  // What the next run() watches besides its own connections (at most kMaxWatch); cleared by the caller.
  void watch(std::vector<WatchFd> w) { watch_ = std::move(w); }
  virtual const LinkContext& context() const = 0;
  // Outside run(): throws op's CommError if a neighbour on this ring gave up or died.
  void check_alive(const OpInfo& op);

 protected:
  std::vector<WatchFd> watch_;
};

// Fills pollfd entries for the watched connections (FIN/RST and the urgent poison byte only).
size_t add_watched(const std::vector<WatchFd>& w, pollfd* out);
// Throws the op's CommError if a watched connection ended or carries the poison byte:
// `revents` from a poll() over add_watched()'s entries, or null to poll them now without waiting.
void check_watched(const std::vector<WatchFd>& w, const pollfd* polled, const LinkContext& ctx, const OpInfo& op);

// The poison byte: one TCP urgent byte a rank sends before shutting a connection down when
// it gives up, so a neighbour reports "propagated" instead of blaming a live rank.
void send_poison(int fd);
// What every Links does on giving up: the poison byte once on both connections, then
// shutdown() (not close(): safe while another thread polls them; FIN reaches both at once).
void give_up(std::atomic<bool>& poisoned, int next_fd, int prev_fd);
// Throws the CommError of a failed operation on this rank, naming op, version, rank and peer.
[[noreturn]] void link_failure(const LinkContext& ctx, ErrorKind kind, const OpInfo& op, int peer,
                               const std::string& what);
// A connection ended: "propagated" if the neighbour's poison byte came first, else the peer is lost.
[[noreturn]] void link_lost(const LinkContext& ctx, const OpInfo& op, bool propagated, int peer,
                            const std::string& name, const std::string& what);
// Reads a pending poison byte; true if there was one.
bool take_poison(int fd);
// After a short read: reads the poison byte if the read stopped at the urgent mark (the
// next read past it would discard it).
bool take_poison_at_mark(int fd);

}  // namespace ering
