// The hierarchical allreduce: the shape of a mixed world and the pipelined schedule.
#include "hierarchical.h"

#include <algorithm>
#include <memory>

#include "plans.h"
#include "reduce.h"

namespace ering {

HostLayout host_layout(const std::vector<std::string>& hosts, int rank) {
  HostLayout l;
  const int n = int(hosts.size());
  if (hosts.empty()) return l;
  l.known = true;
  // Hosts in rank order; a host whose ranks are not contiguous disables the schedule.
  std::vector<int> first_of_host, size_of_host;
  std::vector<std::string> names;
  for (int r = 0; r < n; ++r) {
    if (r == 0 || hosts[r] != hosts[r - 1]) {
      for (auto& nm : names)
        if (nm == hosts[r]) {
          l.not_contiguous = hosts[r];
          return l;
        }
      names.push_back(hosts[r]);
      first_of_host.push_back(r);
      size_of_host.push_back(0);
    }
    if (r == rank) {
      l.host = int(names.size()) - 1;
      l.local_rank = size_of_host.back();
    }
    l.largest_host = std::max(l.largest_host, ++size_of_host.back());
  }
  l.num_hosts = int(names.size());
  l.local_size = size_of_host[l.host];
  l.first = first_of_host[l.host];
  l.prev_leader = first_of_host[(l.host + l.num_hosts - 1) % l.num_hosts];
  l.next_leader = first_of_host[(l.host + 1) % l.num_hosts];
  return l;
}

Hierarchy plan_hierarchy(const HostLayout& l, CommConfig::AlgorithmSetting algorithm) {
  Hierarchy h;
  if (algorithm == CommConfig::AlgorithmSetting::Ring) {
    h.why_not = "algorithm is 'ring'";
    return h;
  }
  if (!l.known) {
    h.why_not = "no host names given";
    return h;
  }
  if (!l.not_contiguous.empty()) {
    h.why_not = "the ranks of host '" + l.not_contiguous + "' are not contiguous in rank order";
    return h;
  }
  if (l.num_hosts < 2) {
    h.why_not = "every rank is on one host";
    return h;
  }
  if (l.largest_host < 2) {
    h.why_not = "every host has one rank";
    return h;
  }
  h.applies = true;
  h.num_hosts = l.num_hosts;
  h.host = l.host;
  h.local_rank = l.local_rank;
  h.local_size = l.local_size;
  h.first = l.first;
  h.prev_leader = l.prev_leader;
  h.next_leader = l.next_leader;
  return h;
}

// Leaders-only schedule: (1) ring allreduce among the ranks of each host (shared memory),
// (2) ring allreduce among one leader per host (TCP), (3) broadcast from the leader along
// the host's ring. Every phase is a deterministic ring collective, so every leader ends with
// the same bits and hands exactly those to its host: the same bits on every rank. Average
// sums throughout and divides once, by the world size, where the leaders' phase completes
// each block.
//
// Pipelined by chunks: the buffer is cut into up to kMaxChunks chunks of at least
// kMinChunkBytes. A leader's two rings run at once: phase 2 of chunk c starts as soon as
// phase 1 of chunk c is done, and phase 3 of chunk c as soon as phase 2 of chunk c is done,
// so phase 1 of chunk c+1 and phase 3 of chunk c overlap phase 2. The host-local ring runs its
// steps in one fixed order on every rank of the host: 1(0), 1(1), 3(0), 1(2), 3(1), ...,
// 3(last). Chunking depends only on the size, so it is the same on every rank.
namespace {
constexpr size_t kMinChunkBytes = 2 << 20;
constexpr size_t kMaxChunks = 16;
}  // namespace

Schedule hierarchical_allreduce(const HierarchicalRings& r, char* buf, size_t count, DType dtype, ReduceOp op,
                                const OpInfo& info) {
  const Hierarchy& h = r.shape;
  const size_t esize = dtype_size(dtype);
  size_t chunks = std::min(kMaxChunks, std::max<size_t>(1, count * esize / kMinChunkBytes));
  const size_t chunk_elems = (count + chunks - 1) / chunks;
  chunks = (count + chunk_elems - 1) / chunk_elems;
  auto chunk = [&](size_t c) {
    size_t lo = c * chunk_elems, hi = std::min(count, lo + chunk_elems);
    return std::make_pair(buf + lo * esize, hi - lo);
  };
  auto phase = [&](uint32_t k, size_t c, const char* what) {
    OpInfo p = info;
    p.tag = op_tag({info.tag, k, c});  // a rank in another phase or chunk is a mismatch, not wrong numbers
    p.describe = info.describe + ", " + what +
                 (chunks > 1 ? ", chunk " + std::to_string(c + 1) + " of " + std::to_string(chunks) : "");
    return p;
  };
  Schedule s;
  // Each step's `after` names the phase before it on this rank's other ring; without that
  // ring (a host of one rank; a rank that leads no host) the ring's own order is enough.
  auto local_reduce = [&](size_t c) {
    auto [p, n] = chunk(c);
    return s.add(r.local, std::make_unique<AllreducePlan>(p, n, dtype, op == ReduceOp::Average ? ReduceOp::Sum : op,
                                                          h.local_rank, h.local_size, r.segment_bytes, r.local_scratch),
                 phase(1, c, "phase 1: host-local allreduce"));
  };
  auto leaders = [&](size_t c, ptrdiff_t after) {
    auto [p, n] = chunk(c);
    return s.add(r.leaders,
                 std::make_unique<AllreducePlan>(p, n, dtype, op, h.host, h.num_hosts, r.segment_bytes,
                                                 r.leader_scratch, r.world_size),
                 phase(2, c, "phase 2: leaders' allreduce"), after);
  };
  auto local_bcast = [&](size_t c, ptrdiff_t after) {
    auto [p, n] = chunk(c);
    return s.add(r.local, std::make_unique<BroadcastPlan>(p, n * esize, h.local_rank, h.local_size, 0, r.segment_bytes),
                 phase(3, c, "phase 3: host-local broadcast"), after);
  };
  if (!r.local) {  // a host of one rank: only the leaders' phase
    for (size_t c = 0; c < chunks; ++c) leaders(c, -1);
    return s;
  }
  // Every plan of a ring shares its scratch: the first one sizes it, and the others (same
  // dtype, same segments) find it large enough, so none moves it under another.
  std::vector<ptrdiff_t> crossed(chunks, -1);  // the step of phase 2 of each chunk, on a leader
  for (size_t c = 0; c < chunks; ++c) {
    const size_t reduced = local_reduce(c);
    if (r.leaders) crossed[c] = ptrdiff_t(leaders(c, ptrdiff_t(reduced)));
    if (c > 0) local_bcast(c - 1, crossed[c - 1]);
  }
  local_bcast(chunks - 1, crossed[chunks - 1]);
  return s;
}

}  // namespace ering
