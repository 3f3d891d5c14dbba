// The communicator: validating a world, forming its rings, failing and aborting them, and
// running each collective as a Plan on the right ring.
#include "communicator.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <limits>

#include "algorithm.h"
#include "plans.h"
#include "reduce.h"
#include "transport/link_setup.h"

namespace ering {

RingView full_view(const std::vector<std::string>& peers, const std::vector<std::string>& hosts, int rank,
                   const WorldDigest& digest) {
  RingView v;
  v.size = int(peers.size());
  for (size_t r = 0; r < peers.size(); ++r) v.addresses[int(r)] = peers[r];
  if (!hosts.empty()) {
    if (hosts.size() != peers.size())
      throw CommError(ErrorKind::Invalid, "hosts: got " + std::to_string(hosts.size()) + " hosts for " +
                                              std::to_string(peers.size()) + " peers: give one host name per rank");
    for (size_t r = 0; r < hosts.size(); ++r) v.hosts[int(r)] = hosts[r];
    if (rank >= 0 && rank < v.size) v.layout = host_layout(hosts, rank);
  }
  v.digest = digest;
  return v;
}

namespace {

// A layout that does not fit the world (from a view received over the network): why, or "".
std::string layout_problem(const HostLayout& l, int rank, int size) {
  if (!l.known || !l.not_contiguous.empty()) return "";
  auto in = [&](int r) { return r >= 0 && r < size; };
  if (l.num_hosts < 1 || l.num_hosts > size || l.host < 0 || l.host >= l.num_hosts)
    return "host " + std::to_string(l.host) + " of " + std::to_string(l.num_hosts) + " hosts";
  if (l.local_size < 1 || l.local_rank < 0 || l.local_rank >= l.local_size || l.first + l.local_rank != rank ||
      !in(l.first) || !in(l.first + l.local_size - 1))
    return "local rank " + std::to_string(l.local_rank) + " of " + std::to_string(l.local_size) + " from rank " +
           std::to_string(l.first);
  if (!in(l.prev_leader) || !in(l.next_leader) || l.largest_host < l.local_size || l.largest_host > size)
    return "leaders " + std::to_string(l.prev_leader) + "/" + std::to_string(l.next_leader) + ", largest host " +
           std::to_string(l.largest_host);
  return "";
}

}  // namespace

Communicator::Communicator(Listener* listener, std::string job_id, std::string secret, uint64_t world_version,
                           int rank, RingView view, CommConfig cfg)
    : listener_(listener), job_id_(std::move(job_id)), secret_(std::move(secret)), world_version_(world_version),
      rank_(rank), size_(view.size), peers_(std::move(view.addresses)), hosts_(std::move(view.hosts)),
      digest_(view.digest), cfg_(cfg) {
  if (size_ < 1) throw CommError(ErrorKind::Invalid, "a communicator needs at least one peer address");
  if (rank_ < 0 || rank_ >= size_)
    throw CommError(ErrorKind::Invalid, "rank " + std::to_string(rank_) + " is outside a world of size " +
                                            std::to_string(size_));
  if (job_id_.empty() || job_id_.size() > kMaxJobIdBytes)
    throw CommError(ErrorKind::Invalid, "job id must be 1-255 bytes, got " + std::to_string(job_id_.size()));
  check_config(cfg_);
  for (auto& [r, h] : hosts_)
    if (h.empty()) throw CommError(ErrorKind::Invalid, "host names must not be empty");
  std::string bad = layout_problem(view.layout, rank_, size_);
  if (!bad.empty())
    throw CommError(ErrorKind::Invalid, "host layout does not fit rank " + std::to_string(rank_) + " of " +
                                            std::to_string(size_) + ": " + bad);
  hier_ = plan_hierarchy(view.layout, cfg_.algorithm);
  // Every ring neighbour's address must be known (a view names exactly these ranks).
  std::vector<int> needed{rank_, (rank_ + 1) % size_, (rank_ + size_ - 1) % size_};
  if (hier_.applies) {
    needed.push_back(hier_.first + (hier_.local_rank + 1) % hier_.local_size);
    needed.push_back(hier_.first + (hier_.local_rank + hier_.local_size - 1) % hier_.local_size);
    if (hier_.leader()) {
      needed.push_back(hier_.prev_leader);
      needed.push_back(hier_.next_leader);
    }
  }
  for (int r : needed)
    if (!peers_.count(r))
      throw CommError(ErrorKind::Invalid, "no ring address for rank " + std::to_string(r) + ", a ring neighbour of rank " +
                                              std::to_string(rank_) + ": the view must name every neighbour");
  // The peers' addresses are what they announced: a bad one is that peer's failure, which
  // form() reports naming it (ErrorKind::Unreachable), not a bad argument of this caller.
  if (size_ > 1 && !listener_)
    throw CommError(ErrorKind::Invalid, "a world of more than one rank needs a listener");
}

const std::string& Communicator::address_of(int rank) const { return peers_.at(rank); }

Algorithm Communicator::algorithm_for(size_t bytes) const { return choose_allreduce(bytes, cfg_, hier_); }

void Communicator::shutdown_links_locked() {
  for (auto* l : {&links_, &local_links_, &leader_links_, &reverse_links_})
    if (*l) (*l)->shutdown();
}

Communicator::~Communicator() {
  {
    std::lock_guard<std::mutex> g(err_mu_);
    shutdown_links_locked();
  }
  // Nobody will take a connection for this version any more: refuse late neighbours at once.
  if (listener_ && size() > 1) listener_->retire(world_version_);
}

void Communicator::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> g(err_mu_);
    if (abort_reason_.empty()) abort_reason_ = reason.empty() ? "aborted" : reason;
  }
  failed_.store(true);
  abort_.fire();
  // Wake every neighbour too (on every ring): they fail within a round trip instead of at their deadline.
  std::lock_guard<std::mutex> g(err_mu_);
  shutdown_links_locked();
}

// One ring of this world version: the flat ring, for the hierarchical allreduce the
// host-local ring or the leaders' ring, or the reverse ring. All rings of a world version
// share the listener and differ by handshake channel.
RingToForm Communicator::ring_to_form(uint8_t channel, int ring_size, int next, int prev) const {
  auto same_host = [&](int other) {
    if (cfg_.transport != CommConfig::Transport::Auto) return false;
    auto mine = hosts_.find(rank_), theirs = hosts_.find(other);
    return mine != hosts_.end() && theirs != hosts_.end() && mine->second == theirs->second;
  };
  RingToForm r;
  r.channel = channel;
  r.ctx = LinkContext{rank_, ring_size, world_version_, next, prev, printable(address_of(next), 300),
                      printable(address_of(prev), 300), cfg_.dead_link_timeout};
  r.next_address = address_of(next);
  r.send.want_shm = same_host(next);
  r.recv.want_shm = same_host(prev);
  return r;
}

void Communicator::form_rings(const std::vector<RingToForm>& rings, const std::vector<std::unique_ptr<Links>*>& into,
                              Clock::time_point deadline, const AbortSignal& stop, const AbortSignal& linking_stop) {
  Forming how;
  how.listener = listener_;
  how.job_id = job_id_;
  how.secret = secret_;
  how.world_version = world_version_;
  how.rank = rank_;
  how.world_size = size();
  how.world_digest = digest_;
  how.deadline = deadline;
  how.collective_timeout = cfg_.timeout;
  how.dead_link_timeout = cfg_.dead_link_timeout;
  how.abort = &abort_;
  ering::form_rings(rings, how, stop, linking_stop, [&](size_t i, std::unique_ptr<Links> links) {
    std::lock_guard<std::mutex> g(err_mu_);  // where abort() reaches it from now on
    *into[i] = std::move(links);
  });
  std::lock_guard<std::mutex> g(err_mu_);
  if (abort_.fired()) shutdown_links_locked();  // abort() raced with the end of forming
}

void Communicator::form() {
  if (formed_) throw CommError(ErrorKind::Invalid, "communicator is already formed");
  const int n = size();
  if (n == 1) {
    formed_ = true;
    return;
  }
  std::vector<RingToForm> rings;
  std::vector<std::unique_ptr<Links>*> into;
  rings.push_back(ring_to_form(kChannelFlat, n, (rank_ + 1) % n, (rank_ + n - 1) % n));
  into.push_back(&links_);
  if (hier_.applies) {
    const Hierarchy& h = hier_;
    if (h.local_size >= 2) {
      rings.push_back(ring_to_form(kChannelLocal, h.local_size, h.first + (h.local_rank + 1) % h.local_size,
                                   h.first + (h.local_rank + h.local_size - 1) % h.local_size));
      into.push_back(&local_links_);
    }
    if (h.leader()) {
      rings.push_back(ring_to_form(kChannelLeaders, h.num_hosts, h.next_leader, h.prev_leader));
      into.push_back(&leader_links_);
    }
  }
  Expectation e;
  e.active = true;
  e.job_id = job_id_;
  e.secret = secret_;
  e.world_version = world_version_;
  e.rank = uint32_t(rank_);
  e.world_size = uint32_t(n);
  e.world_digest = digest_;
  for (auto& r : rings) e.prev_rank[r.channel] = r.ctx.prev_rank;
  // The reverse ring forms later, at the first shift_back(): its predecessor is the flat
  // ring's next rank, whose connection the listener holds until then.
  if (n >= 3) e.prev_rank[kChannelReverse] = (rank_ + 1) % n;
  listener_->expect(e);
  try {
    form_rings(rings, into, Clock::now() + seconds(cfg_.form_timeout), abort_, abort_);
  } catch (CommError& err) {
    failed_.store(true);
    std::lock_guard<std::mutex> g(err_mu_);
    shutdown_links_locked();  // rings already formed: tell their neighbours at once
    if (!first_error_) first_error_ = std::make_unique<CommError>(err);
    throw;
  }
  formed_ = true;
}

Links& Communicator::reverse_ring(const OpInfo& info) {
  if (reverse_links_) return *reverse_links_;
  const int n = size();
  links_->check_alive(info);  // a neighbour gone since the last collective fails this one at once
  std::vector<RingToForm> rings = {ring_to_form(kChannelReverse, n, (rank_ + n - 1) % n, (rank_ + 1) % n)};
  // A failure here is the collective's (guarded() poisons the communicator), and so is the
  // deadline: a neighbour may reach its first backward shift as late as it may reach any
  // collective. A neighbour that died or gave up meanwhile is seen on the flat ring: its
  // connection to the previous rank (the one this rank sends to here) for every wait, since
  // that rank cannot finish without this one's bytes; the next rank's only until its
  // connection is taken, since it may then finish its part and close.
  auto flat = links_->connections();  // {to the next rank, from the previous rank}
  WatchWhileForming watch(flat, flat[1].fd, abort_);
  try {
    form_rings(rings, {&reverse_links_}, info.deadline, watch.any, watch.sender_side);
  } catch (CommError& err) {
    // Stopped by the flat ring: name the neighbour that ended it as a collective would.
    if (err.kind == ErrorKind::Aborted && !abort_.fired()) links_->check_alive(info);
    throw;
  }
  return *reverse_links_;
}

std::vector<std::string> Communicator::link_kinds() {
  std::lock_guard<std::mutex> g(err_mu_);
  if (!links_) return {};
  return {links_->send_kind(), links_->recv_kind()};
}

std::vector<std::vector<std::string>> Communicator::hierarchical_link_kinds() {
  std::lock_guard<std::mutex> g(err_mu_);
  std::vector<std::vector<std::string>> out(2);
  if (local_links_) out[0] = {local_links_->send_kind(), local_links_->recv_kind()};
  if (leader_links_) out[1] = {leader_links_->send_kind(), leader_links_->recv_kind()};
  return out;
}

void Communicator::check_usable(const char* name) {
  if (!formed_) throw CommError(ErrorKind::Invalid, std::string(name) + ": communicator is not formed");
  if (!failed_.load()) return;
  std::lock_guard<std::mutex> g(err_mu_);
  if (first_error_) {
    const CommError& e = *first_error_;
    throw CommError(e.kind, std::string(name) + " on a failed communicator (discard it and form a new one): " + e.what(),
                    name, e.world_version, e.rank, e.peer);
  }
  throw CommError(ErrorKind::Aborted,
                  std::string(name) + " at world version " + std::to_string(world_version_) + " on rank " +
                      std::to_string(rank_) + ": communicator aborted (" + abort_reason_ + ")",
                  name, int64_t(world_version_), rank_, -1);
}

OpInfo Communicator::make_op(const char* name, uint32_t tag, std::string describe) {
  uint32_t seq = seq_++;
  OpInfo info{name, seq, tag, std::string(name) + " #" + std::to_string(seq) + " (" + describe + ")",
              Clock::now() + seconds(cfg_.timeout), cfg_.timeout};
  info.call_tag = tag;
  return info;
}

template <class F>
void Communicator::guarded(const char* name, F&& body) {
  check_usable(name);
  try {
    try {
      body();
    } catch (CommError&) {
      throw;
    } catch (std::exception& other) {
      // e.g. bad_alloc after the op sequence advanced: the ring is out of step, so poison it.
      throw CommError(ErrorKind::Aborted, std::string(name) + " failed on rank " + std::to_string(rank_) + ": " +
                                              other.what(), name, int64_t(world_version_), rank_, -1);
    }
  } catch (CommError& err) {
    if (err.kind == ErrorKind::Invalid) throw;
    failed_.store(true);
    std::lock_guard<std::mutex> g(err_mu_);
    shutdown_links_locked();  // every ring: a neighbour blocked in any phase wakes at once
    if (err.kind == ErrorKind::Aborted && !abort_reason_.empty()) {
      CommError with_reason(err.kind, std::string(err.what()) + " (" + abort_reason_ + ")", err.op,
                            err.world_version, err.rank, err.peer);
      with_reason.call_seq = err.call_seq;
      with_reason.call_tag = err.call_tag;
      with_reason.call = err.call;
      err = with_reason;
    }
    if (!first_error_) first_error_ = std::make_unique<CommError>(err);
    throw err;
  }
}

void Communicator::allreduce(void* buf, size_t count, DType dtype, ReduceOp op) {
  guarded("allreduce", [&] {
    const int n = size();
    if (n == 1) {
      if (op == ReduceOp::Average) scale_down(buf, count, dtype, 1);
      return;
    }
    if (count == 0) return;
    uint32_t tag = op_tag({1, uint64_t(dtype), uint64_t(op), count});
    std::string what = std::string(dtype_name(dtype)) + ", " + std::to_string(count) + " elements, " + op_name(op);
    switch (algorithm_for(count * dtype_size(dtype))) {
      case Algorithm::SmallMessage:
        allreduce_small(buf, count, dtype, op, make_op("allreduce", tag, what));
        return;
      // 16-bit float sums travel and accumulate as float32 on these two, rounded once at the
      // end (Widening, reduce.h); the small-message path's reduce_many() does the same.
      case Algorithm::Ring: {
        OpInfo info = make_op("allreduce", tag, what);
        accumulate(buf, count, dtype, op, [&](char* data, DType as) { allreduce_ring(data, count, as, op, info); });
        return;
      }
      case Algorithm::Hierarchical: {
        OpInfo info = make_op("allreduce", op_tag({tag, 5}), what + ", hierarchical");
        accumulate(buf, count, dtype, op,
                   [&](char* data, DType as) { allreduce_hierarchical(data, count, as, op, info); });
        return;
      }
    }
  });
}

void Communicator::allreduce_small(void* buf, size_t count, DType dtype, ReduceOp op, const OpInfo& info) {
  // Gathers every rank's whole buffer (n-1 latency steps instead of 2(n-1)) and reduces
  // locally in rank order, which every rank does identically.
  const int n = size();
  const size_t bytes = count * dtype_size(dtype);
  std::vector<char> all(bytes * n);
  std::memcpy(all.data() + bytes * rank_, buf, bytes);
  Blocks b;
  for (int c = 0; c < n; ++c) {
    b.off.push_back(bytes * c);
    b.len.push_back(bytes);
  }
  b.max_len = bytes;
  AllgatherPlan plan(all.data(), b, rank_, n, std::max(bytes, cfg_.segment_bytes));
  links_->run(plan, info);
  std::vector<const void*> srcs(n);
  for (int c = 0; c < n; ++c) srcs[c] = all.data() + bytes * c;
  reduce_many(buf, srcs.data(), n, count, dtype, op);
}

void Communicator::allreduce_ring(char* buf, size_t count, DType dtype, ReduceOp op, const OpInfo& info) {
  AllreducePlan plan(buf, count, dtype, op, rank_, size(), cfg_.segment_bytes, scratch_);
  links_->run(plan, info);
}

void Communicator::allreduce_hierarchical(char* buf, size_t count, DType dtype, ReduceOp op, const OpInfo& info) {
  HierarchicalRings rings{hier_, local_links_.get(), leader_links_.get(), cfg_.segment_bytes, size(), scratch_,
                          leader_scratch_};
  // The phases' steps, run on this thread: a leader's two rings overlap in one loop. A
  // failure on either ring fails the whole, and guarded() shuts every ring down.
  run_steps(hierarchical_allreduce(rings, buf, count, dtype, op, info).steps);
}

void Communicator::broadcast(void* buf, size_t bytes, int root) {
  if (root < 0 || root >= size())
    throw CommError(ErrorKind::Invalid, "broadcast root rank " + std::to_string(root) + " is outside a world of size " +
                                            std::to_string(size()));
  guarded("broadcast", [&] {
    if (size() == 1 || bytes == 0) return;
    OpInfo info = make_op("broadcast", op_tag({2, bytes, uint64_t(root)}),
                          std::to_string(bytes) + " bytes from rank " + std::to_string(root));
    // The size may be what the root announced (broadcast_object): a relay could make it differ
    // on one rank, so the call a rank reports is the broadcast and its root only.
    info.call_tag = op_tag({2, uint64_t(root)});
    BroadcastPlan plan(static_cast<char*>(buf), bytes, rank_, size(), root, cfg_.segment_bytes);
    links_->run(plan, info);
  });
}

void Communicator::allgather(const void* in, void* out, const std::vector<uint64_t>& bytes_per_rank) {
  const int n = size();
  if (int(bytes_per_rank.size()) != n)
    throw CommError(ErrorKind::Invalid, "allgather needs one size per rank: got " + std::to_string(bytes_per_rank.size()) +
                                            " for a world of size " + std::to_string(n));
  guarded("allgather", [&] {
    Blocks b;
    size_t at = 0;
    uint32_t h = 3;
    for (int c = 0; c < n; ++c) {
      if (bytes_per_rank[c] > std::numeric_limits<size_t>::max() - at)
        throw CommError(ErrorKind::Invalid, "allgather: the per-rank sizes add up to 2**64 bytes or more");
      b.off.push_back(at);
      b.len.push_back(bytes_per_rank[c]);
      b.max_len = std::max<size_t>(b.max_len, bytes_per_rank[c]);
      at += bytes_per_rank[c];
      h = op_tag({h, bytes_per_rank[c]});
    }
    char* dst = static_cast<char*>(out) + b.off[rank_];
    if (dst != in && b.len[rank_]) std::memmove(dst, in, b.len[rank_]);
    if (n == 1) return;
    OpInfo info = make_op("allgather", h, std::to_string(at) + " bytes in all");
    info.call_tag = op_tag({3});   // the sizes came from the peers: the call a rank reports is "an allgather"
    AllgatherPlan plan(static_cast<char*>(out), b, rank_, n, cfg_.segment_bytes);
    links_->run(plan, info);
  });
}

void Communicator::reduce_scatter(const void* in, void* out, const std::vector<uint64_t>& counts, DType dtype,
                                  ReduceOp op) {
  const int n = size();
  if (int(counts.size()) != n)
    throw CommError(ErrorKind::Invalid, "reduce_scatter needs one count per rank: got " +
                                            std::to_string(counts.size()) + " for a world of size " + std::to_string(n));
  guarded("reduce_scatter", [&] {
    const size_t esize = dtype_size(dtype);
    size_t total = 0;
    uint32_t tag = op_tag({6, uint64_t(dtype), uint64_t(op)});
    for (uint64_t c : counts) {
      total += c;
      tag = op_tag({tag, c});
    }
    const size_t mine = counts[rank_];
    size_t before = 0;
    for (int c = 0; c < rank_; ++c) before += counts[c];
    if (n == 1) {
      if (mine) std::memmove(out, in, mine * esize);
      if (op == ReduceOp::Average) scale_down(out, mine, dtype, 1);
      return;
    }
    if (total == 0) return;
    // 16-bit sums travel and accumulate as float32 and are rounded once, as in allreduce.
    const Widening widening(dtype, op);
    const DType run_dtype = widening.dtype();
    const size_t run_esize = dtype_size(run_dtype);
    if (work_.size() < total * run_esize) work_.resize(total * run_esize);
    // The plan reads the caller's input where it lies and finishes the own block in `out`;
    // the input is copied first only when it must be widened, or when `out` overlaps the
    // input other than exactly as its own block (the plan would write where it still reads).
    const char* in_bytes = static_cast<const char*>(in);
    char* out_bytes = static_cast<char*>(out);
    const bool out_overlaps = out_bytes < in_bytes + total * esize && in_bytes < out_bytes + mine * esize &&
                              out_bytes != in_bytes + before * esize;
    const bool copy_in = widening.active() || out_overlaps;
    if (widening.active()) widening.widen(in, total, work_);
    else if (copy_in) std::memcpy(work_.data(), in, total * esize);
    Blocks b;
    size_t at = 0;
    for (int c = 0; c < n; ++c) {
      b.off.push_back(at * run_esize);
      b.len.push_back(counts[c] * run_esize);
      b.max_len = std::max<size_t>(b.max_len, counts[c] * run_esize);
      at += counts[c];
    }
    OpInfo info = make_op("reduce_scatter", tag, std::string(dtype_name(dtype)) + ", " + std::to_string(total) +
                                                     " elements, " + op_name(op));
    ReduceScatterPlan plan(copy_in ? work_.data() : in_bytes, work_.data(), copy_in ? nullptr : out_bytes,
                           std::move(b), run_dtype, op, rank_, n, cfg_.segment_bytes, scratch_);
    links_->run(plan, info);
    if (!copy_in) return;
    const char* block = work_.data() + before * run_esize;
    if (widening.active()) widening.narrow(out, block, mine);
    else if (mine) std::memcpy(out, block, mine * esize);
  });
}

void Communicator::shift(const void* send, size_t send_bytes, void* recv, size_t recv_bytes) {
  guarded("shift", [&] {
    if (size() == 1) {
      if (send_bytes != recv_bytes)
        throw CommError(ErrorKind::Invalid, "shift in a world of one: this rank sends " + std::to_string(send_bytes) +
                                                " bytes to itself and expects " + std::to_string(recv_bytes));
      if (send_bytes) std::memmove(recv, send, send_bytes);
      return;
    }
    // Sizes differ by link: each direction's tags name its own size, so a receiver that
    // expects another size than its sender sends fails at the first segment.
    OpInfo info = make_op("shift", op_tag({7, send_bytes}), std::to_string(send_bytes) + " bytes to rank " +
                                                                std::to_string((rank_ + 1) % size()) + ", " +
                                                                std::to_string(recv_bytes) + " from rank " +
                                                                std::to_string((rank_ + size() - 1) % size()));
    info.recv_tag = op_tag({7, recv_bytes});
    info.call_tag = op_tag({7});   // each link has its own size: the call is "a shift"
    ShiftPlan plan(static_cast<const char*>(send), send_bytes, static_cast<char*>(recv), recv_bytes,
                   cfg_.segment_bytes);
    links_->run(plan, info);
  });
}

void Communicator::shift_back(const void* send, size_t send_bytes, void* recv, size_t recv_bytes) {
  if (size() <= 2) {
    // The previous rank is the next one: a shift is a shift back.
    shift(send, send_bytes, recv, recv_bytes);
    return;
  }
  guarded("shift_back", [&] {
    OpInfo info = make_op("shift_back", op_tag({8, send_bytes}), std::to_string(send_bytes) + " bytes to rank " +
                                                                     std::to_string((rank_ + size() - 1) % size()) +
                                                                     ", " + std::to_string(recv_bytes) + " from rank " +
                                                                     std::to_string((rank_ + 1) % size()));
    info.recv_tag = op_tag({8, recv_bytes});
    info.call_tag = op_tag({8});
    Links& ring = reverse_ring(info);
    ShiftPlan plan(static_cast<const char*>(send), send_bytes, static_cast<char*>(recv), recv_bytes,
                   cfg_.segment_bytes);
    ring.run(plan, info);
  });
}

void Communicator::barrier() {
  guarded("barrier", [&] {
    const int n = size();
    if (n == 1) return;
    // An allgather of empty blocks: after n-1 steps every rank has heard from every other.
    OpInfo info = make_op("barrier", op_tag({4}), "barrier");
    Blocks b;
    b.off.assign(n, 0);
    b.len.assign(n, 0);
    AllgatherPlan plan(nullptr, b, rank_, n, cfg_.segment_bytes);
    links_->run(plan, info);
  });
}

}  // namespace ering
