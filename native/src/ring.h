// The communicator: forms a ring for one world version and runs collectives on it.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"
#include "listener.h"
#include "shm.h"

namespace ering {

struct CommConfig {
  double timeout_s = 30.0;       // longest a collective may go without moving a byte
  double form_timeout_s = 30.0;  // longest form() waits for both neighbours
  size_t segment_bytes = 1 << 20;
  size_t small_bytes = 32 << 10;  // allreduce at or below this size takes the small-message path
  // Auto: a neighbour on the same host (same entry in `hosts`) gets shared memory; Tcp: never.
  enum class Transport { Auto, Tcp } transport = Transport::Auto;
  // Allreduce algorithm. Ring: the flat ring always. Hierarchical: the hierarchical
  // schedule whenever the world allows it (see Hierarchy), else the ring. Auto: the
  // hierarchical schedule when the world allows it and the buffer is larger than
  // hierarchical_bytes, else the ring. The choice depends only on world shape, size and
  // config, so every rank makes the same one (the config must be the same on every rank).
  enum class Algorithm { Auto, Ring, Hierarchical } algorithm = Algorithm::Auto;
  size_t hierarchical_bytes = 4 << 20;
};

// Where this rank sits in a mixed world, for the hierarchical allreduce.
struct Hierarchy {
  bool applies = false;  // >= 2 hosts, one of them with >= 2 ranks, each host's ranks contiguous
  std::string why_not;   // when it does not apply
  int num_hosts = 0, host = 0;         // hosts in rank order; this rank's host index
  int local_rank = 0, local_size = 1;  // place among the ranks of its host (leader: local rank 0)
  int first = 0;                       // global rank of this host's leader
  std::vector<int> leaders;            // global rank of each host's leader, in host order
  bool leader() const { return local_rank == 0; }
};

class Communicator {
 public:
  Communicator(Listener* listener, std::string job_id, std::string secret, uint64_t world_version, int rank,
               std::vector<std::string> peers, CommConfig cfg, std::vector<std::string> hosts = {});
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
  void barrier();

  int rank() const { return rank_; }
  int size() const { return int(peers_.size()); }
  uint64_t world_version() const { return world_version_; }
  const CommConfig& config() const { return cfg_; }
  // How this rank's links run once formed: {"tcp"|"shm" to the next rank, from the previous one}.
  std::vector<std::string> link_kinds();
  const Hierarchy& hierarchy() const { return hier_; }
  // "ring" or "hierarchical": what allreduce runs for a buffer of this many bytes.
  const char* algorithm_for(size_t bytes) const;
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
  void hierarchical_allreduce(char* buf, size_t count, DType dtype, ReduceOp op, const OpInfo& info);
  void shutdown_links_locked();  // err_mu_ held
  Hierarchy plan_hierarchy() const;

  Listener* listener_;
  std::string job_id_, secret_;
  uint64_t world_version_;
  int rank_;
  std::vector<std::string> peers_;
  std::vector<std::string> hosts_;  // one host name per rank, or empty: every link over TCP
  CommConfig cfg_;
  AbortSignal abort_;
  std::unique_ptr<Links> links_;         // the flat ring
  std::unique_ptr<Links> local_links_;   // the ring of this host's ranks (hierarchical, local_size >= 2)
  std::unique_ptr<Links> leader_links_;  // the ring of the hosts' leaders (hierarchical, leaders only)
  Hierarchy hier_;
  bool formed_ = false;
  std::atomic<uint32_t> seq_{0};
  std::vector<char> scratch_;
  std::vector<char> leader_scratch_;  // the leaders' phase runs on its own thread

  std::atomic<bool> failed_{false};
  std::mutex err_mu_;
  std::unique_ptr<CommError> first_error_;  // guarded by err_mu_
  std::string abort_reason_;                // guarded by err_mu_
};

}  // namespace ering
