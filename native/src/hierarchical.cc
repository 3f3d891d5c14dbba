// The hierarchical allreduce: the shape of a mixed world and the pipelined schedule.
#include "hierarchical.h"

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

#include "plans.h"
#include "reduce.h"

namespace ering {

Hierarchy plan_hierarchy(const std::vector<std::string>& hosts, int rank, CommConfig::AlgorithmSetting algorithm) {
  Hierarchy h;
  const int n = int(hosts.size());
  if (algorithm == CommConfig::AlgorithmSetting::Ring) {
    h.why_not = "algorithm is 'ring'";
    return h;
  }
  if (hosts.empty()) {
    h.why_not = "no host names given";
    return h;
  }
  // Hosts in rank order; a host whose ranks are not contiguous disables the schedule.
  std::vector<int> first_of_host, size_of_host;
  std::vector<std::string> names;
  int max_local = 0;
  for (int r = 0; r < n; ++r) {
    if (r == 0 || hosts[r] != hosts[r - 1]) {
      for (auto& nm : names)
        if (nm == hosts[r]) {
          h.why_not = "the ranks of host '" + hosts[r] + "' are not contiguous in rank order";
          return h;
        }
      names.push_back(hosts[r]);
      first_of_host.push_back(r);
      size_of_host.push_back(0);
    }
    if (r == rank) {
      h.host = int(names.size()) - 1;
      h.local_rank = size_of_host.back();
    }
    max_local = std::max(max_local, ++size_of_host.back());
  }
  h.num_hosts = int(names.size());
  if (h.num_hosts < 2) {
    h.why_not = "every rank is on one host";
    return h;
  }
  if (max_local < 2) {
    h.why_not = "every host has one rank";
    return h;
  }
  h.applies = true;
  h.local_size = size_of_host[h.host];
  h.first = first_of_host[h.host];
  h.leaders = first_of_host;
  return h;
}

// Leaders-only schedule: (1) ring allreduce among the ranks of each host (shared memory),
// (2) ring allreduce among one leader per host (TCP), (3) broadcast from the leader along
// the host's ring. Every phase is a deterministic ring collective, so every leader ends with
// the same bits and hands exactly those to its host: the same bits on every rank. Average
// sums throughout and divides once, by the world size, at the leaders before the broadcast.
//
// Pipelined by chunks: the buffer is cut into up to kMaxChunks chunks of at least
// kMinChunkBytes, and on a leader the leaders' phase runs on a helper thread, chunk after
// chunk, while the calling thread runs the host-local ring: phase 1 of chunk c+1 and
// phase 3 of chunk c overlap phase 2 of chunk c+1 and c. The host-local ring runs its
// operations in one fixed order on every rank of the host: 1(0), 1(1), 3(0), 1(2), 3(1), ...,
// 3(last). Chunking depends only on the size, so it is the same on every rank.
namespace {
constexpr size_t kMinChunkBytes = 2 << 20;
constexpr size_t kMaxChunks = 16;
}  // namespace

void hierarchical_allreduce(const HierarchicalRings& r, char* buf, size_t count, DType dtype, ReduceOp op,
                            const OpInfo& info) {
  const Hierarchy& h = r.shape;
  const ReduceOp sum_op = op == ReduceOp::Average ? ReduceOp::Sum : op;
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
  // While a phase waits on one ring it may also watch another (see WatchFd).
  struct Watching {
    Links* links;
    Watching(Links* l, Links* other) : links(l) { if (other) links->watch(other->connections()); }
    ~Watching() { links->watch({}); }
  };
  auto local_reduce = [&](size_t c, Links* watch) {
    auto [p, n] = chunk(c);
    AllreducePlan plan(p, n, dtype, sum_op, h.local_rank, h.local_size, r.segment_bytes, r.scratch);
    Watching w(r.local, watch);
    r.local->run(plan, phase(1, c, "phase 1: host-local allreduce"));
  };
  auto leaders = [&](size_t c, std::vector<char>& scratch, Links* watch) {
    auto [p, n] = chunk(c);
    AllreducePlan plan(p, n, dtype, sum_op, h.host, h.num_hosts, r.segment_bytes, scratch);
    Watching w(r.leaders, watch);
    r.leaders->run(plan, phase(2, c, "phase 2: leaders' allreduce"));
    if (op == ReduceOp::Average) scale_down(p, n, dtype, r.world_size);
  };
  auto local_bcast = [&](size_t c) {
    auto [p, n] = chunk(c);
    BroadcastPlan plan(p, n * esize, h.local_rank, h.local_size, 0, r.segment_bytes);
    r.local->run(plan, phase(3, c, "phase 3: host-local broadcast"));
  };

  if (!r.local) {  // a host of one rank: only the leaders' phase
    for (size_t c = 0; c < chunks; ++c) leaders(c, r.scratch, nullptr);
    return;
  }
  if (!h.leader()) {  // the host-local ring's fixed order; the leader's broadcast paces it
    for (size_t c = 0; c < chunks; ++c) {
      local_reduce(c, nullptr);
      if (c > 0) local_bcast(c - 1);
    }
    local_bcast(chunks - 1);
    return;
  }
  if (chunks == 1) {  // nothing to overlap: one thread, each phase watching the ring of the next
    local_reduce(0, r.leaders);
    leaders(0, r.scratch, r.local);
    local_bcast(0);
    return;
  }
  // A leader: phase 2 on a helper thread. Either thread that fails shuts every ring down,
  // which wakes the other (and every neighbour); the first failure is the one reported.
  std::mutex mu;
  std::condition_variable cv;
  size_t reduced = 0, crossed = 0;  // chunks through phase 1 (this thread), phase 2 (helper)
  bool stop = false;
  std::exception_ptr helper_error;
  std::thread helper([&] {
    try {
      for (size_t c = 0; c < chunks; ++c) {
        {
          std::unique_lock<std::mutex> lk(mu);
          cv.wait(lk, [&] { return stop || reduced > c; });
          if (stop) return;
        }
        leaders(c, r.leader_scratch, nullptr);
        std::lock_guard<std::mutex> lk(mu);
        crossed = c + 1;
        cv.notify_all();
      }
    } catch (...) {
      {
        std::lock_guard<std::mutex> lk(mu);
        helper_error = std::current_exception();
      }
      r.give_up();
      cv.notify_all();
    }
  });
  // Waiting for the helper, this thread still looks after the host-local ring: a host mate
  // that gives up or dies meanwhile fails this rank now, not when the leaders' phase ends.
  auto wait_crossed = [&](size_t c) {
    const OpInfo waiting = phase(3, c, "waiting for the leaders' phase");
    std::unique_lock<std::mutex> lk(mu);
    while (crossed <= c && !helper_error) {
      if (r.abort.fired()) break;
      cv.wait_for(lk, std::chrono::milliseconds(2));
      if (crossed > c || helper_error) break;
      lk.unlock();
      r.local->check_alive(waiting);
      lk.lock();
    }
    if (helper_error) std::rethrow_exception(helper_error);
    if (crossed <= c) link_failure(r.local->context(), ErrorKind::Aborted, info, -1, "communicator aborted");
  };
  try {
    for (size_t c = 0; c < chunks; ++c) {
      // Watching the leaders' ring here too: while the helper waits for this chunk nobody
      // else looks at it, and a rank stuck on a live host mate must still hear of a failure.
      local_reduce(c, r.leaders);
      {
        std::lock_guard<std::mutex> lk(mu);
        reduced = c + 1;
      }
      cv.notify_all();
      if (c > 0) {
        wait_crossed(c - 1);
        local_bcast(c - 1);
      }
    }
    wait_crossed(chunks - 1);
    local_bcast(chunks - 1);
  } catch (...) {
    std::exception_ptr first;
    {
      std::lock_guard<std::mutex> lk(mu);
      stop = true;
      first = helper_error;  // the helper failed first: its error names the cause
    }
    cv.notify_all();
    r.give_up();  // wakes the helper if it waits in the leaders' ring
    helper.join();
    if (first) std::rethrow_exception(first);
    throw;
  }
  helper.join();
}

}  // namespace ering
