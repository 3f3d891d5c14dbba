// The communicator: the rings of one world version and their lifecycle (form, abort,
// close), and the collectives' entry points, which pick the Plan each call runs.
//
// Any failure poisons it: every ring is shut down so neighbours fail at once, and every
// later call fails with the first error. The caller discards it and forms a new one.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "algorithm.h"
#include "base/common.h"
#include "base/config.h"
#include "hierarchical.h"
#include "transport/link_setup.h"
#include "transport/links.h"
#include "transport/listener.h"

namespace ering {

// What a communicator is told of its world: its size, the addresses of the ranks it connects
// to, the layout of its host and the digest that names the world. A worker's rendezvous view
// is exactly this (O(1) ranks whatever the world's size); full_view() makes one from a full
// list of addresses (and hosts) for rings formed by hand.
struct RingView {
  int size = 0;
  std::map<int, std::string> addresses;  // ring address by rank: this rank's and every ring neighbour's
  std::map<int, std::string> hosts;      // host name by rank (the same ranks), or empty: every link over TCP
  HostLayout layout;                     // layout.known false: no hosts, flat ring only
  WorldDigest digest{};
};

// The view of `rank` in the world of `peers` (every rank's address) and `hosts` (every rank's
// host, or empty).
RingView full_view(const std::vector<std::string>& peers, const std::vector<std::string>& hosts, int rank,
                   const WorldDigest& digest);

class Communicator {
 public:
  Communicator(Listener* listener, std::string job_id, std::string secret, uint64_t world_version, int rank,
               RingView view, CommConfig cfg);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // Connects to the next rank and takes the previous rank's connection. Blocking; abort() breaks it.
  void form();
  // Fails every in-flight and later operation within milliseconds. Callable from any thread.
  void abort(const std::string& reason);

  void allreduce(void* buf, size_t count, DType dtype, ReduceOp op);
  void broadcast(void* buf, size_t bytes, int root);
  // out holds every rank's block, in rank order; in is this rank's block (may alias its place in out).
  void allgather(const void* in, void* out, const std::vector<uint64_t>& bytes_per_rank);
  // in holds one block per rank, in rank order, of counts[r] elements each; out (counts[rank]
  // elements) gets this rank's block reduced over every rank. in is left as it was.
  void reduce_scatter(const void* in, void* out, const std::vector<uint64_t>& counts, DType dtype, ReduceOp op);
  // Sends send_bytes of `send` to the next rank and receives recv_bytes from the previous
  // rank into `recv` (which must not overlap `send`). Each rank's recv_bytes must be its
  // previous rank's send_bytes, or both fail with a mismatch.
  void shift(const void* send, size_t send_bytes, void* recv, size_t recv_bytes);
  // shift() the other way round: sends to the previous rank, receives from the next one. In
  // a world of three or more it runs on the reverse ring, which the first call forms
  // (each rank connects to its previous rank, within the collective timeout), so a rank
  // relaying to a lower rank needs no detour round the whole ring.
  void shift_back(const void* send, size_t send_bytes, void* recv, size_t recv_bytes);
  void barrier();

  int rank() const { return rank_; }
  int size() const { return size_; }
  uint64_t world_version() const { return world_version_; }
  const CommConfig& config() const { return cfg_; }
  // How this rank's links run once formed: {"tcp"|"shm" to the next rank, from the previous one}.
  std::vector<std::string> link_kinds();
  const Hierarchy& hierarchy() const { return hier_; }
  // What allreduce runs for a buffer of this many bytes (choose_allreduce, algorithm.h).
  Algorithm algorithm_for(size_t bytes) const;
  // How the hierarchical path's links run once formed: {"local": [send, recv], "leaders": [...]}
  // as "tcp"/"shm" pairs, each empty when this rank has no such ring.
  std::vector<std::vector<std::string>> hierarchical_link_kinds();
  bool failed() const { return failed_.load(); }
  // Collectives started so far (fused buckets count once); the same on every rank.
  uint32_t ops_run() const { return seq_.load(); }

 private:
  template <class F>
  void guarded(const char* name, F&& body);
  void check_usable(const char* name);
  OpInfo make_op(const char* name, uint32_t tag, std::string describe);
  // allreduce() on each algorithm, for a world of two or more and a non-empty buffer.
  void allreduce_small(void* buf, size_t count, DType dtype, ReduceOp op, const OpInfo& info);
  // The ring and the hierarchy run on `buf` as it travels and accumulates (reduce.h, Widening).
  void allreduce_ring(char* buf, size_t count, DType dtype, ReduceOp op, const OpInfo& info);
  void allreduce_hierarchical(char* buf, size_t count, DType dtype, ReduceOp op, const OpInfo& info);
  void shutdown_links_locked();  // err_mu_ held
  RingToForm ring_to_form(uint8_t channel, int ring_size, int next, int prev) const;
  const std::string& address_of(int rank) const;
  // Forms `rings` (transport/link_setup.h), each into its member of `into`, under err_mu_ as
  // each comes up so abort() reaches it. Waits end early when `stop` fires (up to taking the
  // predecessors' connections) or `linking_stop` (the link set-up after): the communicator's
  // abort, or more.
  void form_rings(const std::vector<RingToForm>& rings, const std::vector<std::unique_ptr<Links>*>& into,
                  Clock::time_point deadline, const AbortSignal& stop, const AbortSignal& linking_stop);
  // The reverse ring, formed on first use by the collective `info`.
  Links& reverse_ring(const OpInfo& info);

  Listener* listener_;
  std::string job_id_, secret_;
  uint64_t world_version_;
  int rank_;
  int size_;
  std::map<int, std::string> peers_;  // the ring addresses this rank connects to, by rank
  std::map<int, std::string> hosts_;  // host names by rank, or empty: every link over TCP
  WorldDigest digest_;
  CommConfig cfg_;
  AbortSignal abort_;
  std::unique_ptr<Links> links_;         // the flat ring
  std::unique_ptr<Links> local_links_;   // the ring of this host's ranks (hierarchical, local_size >= 2)
  std::unique_ptr<Links> leader_links_;  // the ring of the hosts' leaders (hierarchical, leaders only)
  std::unique_ptr<Links> reverse_links_; // the flat ring's ranks the other way round (shift_back, size >= 3)
  Hierarchy hier_;
  bool formed_ = false;
  std::atomic<uint32_t> seq_{0};
  std::vector<char> scratch_;
  std::vector<char> leader_scratch_;  // the leaders' ring runs its phase beside the host-local ring
  std::vector<char> work_;            // reduce_scatter's copy of its input, reused across calls

  std::atomic<bool> failed_{false};
  std::mutex err_mu_;
  std::unique_ptr<CommError> first_error_;  // guarded by err_mu_
  std::string abort_reason_;                // guarded by err_mu_
};

}  // namespace ering
