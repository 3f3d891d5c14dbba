// The hierarchical allreduce of a mixed world: where this rank sits (Hierarchy, a pure
// function of the hosts), and the pipelined leaders-only schedule over the host-local ring
// and the leaders' ring, as data: plans and the order they run in, which run_steps() executes
// on this thread. See native/README.md, "Hierarchical allreduce".
#pragma once

#include <string>
#include <vector>

#include "base/common.h"
#include "base/config.h"
#include "transport/links.h"

namespace ering {

// How the ranks of a world sit on hosts, as far as one rank needs it: its own host's place
// and the leaders next to it on the leaders' ring, never every rank's host. A worker gets it
// from its rendezvous view (O(1) whatever the world's size); host_layout() derives it from a
// full list of host names for rings formed by hand.
struct HostLayout {
  bool known = false;           // false: no host names given (every link over TCP, flat ring only)
  std::string not_contiguous;   // non-empty: the host whose ranks are not contiguous in rank order
  int num_hosts = 0, host = 0;  // hosts in rank order; this rank's host index
  int local_rank = 0, local_size = 1;  // place among the ranks of its host (leader: local rank 0)
  int first = 0;                       // global rank of this host's leader
  int prev_leader = 0, next_leader = 0;  // global ranks of the previous and next host's leaders
  int largest_host = 0;                // ranks on the host that has the most
};

// The layout of `rank` in a world whose ranks run on `hosts` (one name per rank, or empty: unknown).
HostLayout host_layout(const std::vector<std::string>& hosts, int rank);

// Where this rank sits in a mixed world, for the hierarchical allreduce.
struct Hierarchy {
  bool applies = false;  // >= 2 hosts, one of them with >= 2 ranks, each host's ranks contiguous
  std::string why_not;   // when it does not apply
  int num_hosts = 0, host = 0;         // hosts in rank order; this rank's host index
  int local_rank = 0, local_size = 1;  // place among the ranks of its host (leader: local rank 0)
  int first = 0;                       // global rank of this host's leader
  int prev_leader = 0, next_leader = 0;  // this leader's neighbours on the leaders' ring
  bool leader() const { return local_rank == 0; }
};

// The hierarchy of a rank placed as `layout` says, under the configured algorithm.
Hierarchy plan_hierarchy(const HostLayout& layout, CommConfig::AlgorithmSetting algorithm);

// What the schedule runs on; the communicator owns all of it.
struct HierarchicalRings {
  const Hierarchy& shape;
  Links* local;    // the ring of this host's ranks; null on a host of one rank
  Links* leaders;  // the ring of the hosts' leaders; null unless this rank leads its host
  size_t segment_bytes;
  int world_size;                     // Average divides by it, once, at the leaders
  std::vector<char>& local_scratch;   // for the plans on the host-local ring
  std::vector<char>& leader_scratch;  // for those on the leaders' ring, which run at the same time
};

// The allreduce of `count` elements in `buf` through the three phases, as the steps that run
// them on the two rings (run_steps, links.h); `info` is the whole operation (each phase and
// chunk gets its own tag and description from it, and its deadline).
Schedule hierarchical_allreduce(const HierarchicalRings& r, char* buf, size_t count, DType dtype, ReduceOp op,
                                const OpInfo& info);

}  // namespace ering
