// Ring collectives as Plans for the transport: which segment goes to the next rank,
// where the previous rank's segment lands, and what to do with it once it arrives.
//
// allreduce: reduce-scatter then allgather (2(n-1) steps, each rank sends 2(n-1)/n of the
// buffer). Every chunk is reduced along one fixed path around the ring and the finished
// chunk is then copied to everyone, so all ranks end with the same bits. Steps are not
// separated by barriers: segment k of step g+1 leaves as soon as segment k of step g has
// arrived and been reduced, which keeps both directions of every link busy.
#include "ring.h"

#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <exception>
#include <thread>

#include "connect.h"
#include "reduce.h"

namespace ering {
namespace {

inline size_t mod(long a, long n) { return size_t(((a % n) + n) % n); }

uint32_t fnv1a(std::initializer_list<uint64_t> words) {
  uint32_t h = 2166136261u;
  for (uint64_t w : words)
    for (int i = 0; i < 8; ++i) { h ^= uint8_t(w >> (8 * i)); h *= 16777619u; }
  return h;
}

// Blocks of a buffer, one per rank, in rank order.
struct Blocks {
  std::vector<size_t> off, len;  // bytes
  size_t max_len = 0;
};

Blocks even_blocks(size_t count, size_t esize, int n) {
  Blocks b;
  size_t base = count / n, rem = count % n, at = 0;
  for (int c = 0; c < n; ++c) {
    size_t elems = base + (size_t(c) < rem ? 1 : 0);
    b.off.push_back(at * esize);
    b.len.push_back(elems * esize);
    at += elems;
    b.max_len = std::max(b.max_len, elems * esize);
  }
  return b;
}

// Segment k of a block: [k*seg, min(len, (k+1)*seg)), possibly empty, so every rank
// uses the same number of segments per step whatever its block sizes.
Span segment(char* base, const Blocks& b, size_t block, size_t k, size_t seg) {
  size_t lo = std::min(b.len[block], k * seg), hi = std::min(b.len[block], (k + 1) * seg);
  return {base + b.off[block] + lo, hi - lo};
}

size_t segments_for(size_t max_len, size_t seg) { return std::max<size_t>(1, (max_len + seg - 1) / seg); }

class AllreducePlan : public Plan {
 public:
  AllreducePlan(char* buf, size_t count, DType dtype, ReduceOp op, int rank, int n, size_t seg_bytes,
                std::vector<char>& scratch)
      : buf_(buf), dtype_(dtype), op_(op), r_(rank), n_(n), esize_(dtype_size(dtype)) {
    blocks_ = even_blocks(count, esize_, n);
    seg_ = std::max(esize_, seg_bytes / esize_ * esize_);
    k_ = segments_for(blocks_.max_len, seg_);
    if (scratch.size() < seg_) scratch.resize(seg_);
    scratch_ = scratch.data();
  }
  size_t num_sends() const override { return size_t(2 * (n_ - 1)) * k_; }
  size_t num_recvs() const override { return num_sends(); }
  ptrdiff_t send_after(size_t i) const override { return i < k_ ? -1 : ptrdiff_t(i - k_); }
  Span send_span(size_t i) override { return segment(buf_, blocks_, send_block(i / k_), i % k_, seg_); }
  Span recv_span(size_t i) override {
    size_t g = i / k_;
    Span s = segment(buf_, blocks_, recv_block(g), i % k_, seg_);
    if (g < size_t(n_ - 1)) return {scratch_, s.bytes};  // reduce-scatter: land beside, then reduce
    return s;                                             // allgather: land in place
  }
  void received(size_t i) override {
    size_t g = i / k_;
    if (g >= size_t(n_ - 1)) return;
    Span s = segment(buf_, blocks_, recv_block(g), i % k_, seg_);
    reduce_into(s.ptr, scratch_, s.bytes / esize_, dtype_, op_);
    // The last reduce-scatter step completes this rank's own block: divide once, here.
    if (g == size_t(n_ - 2) && op_ == ReduceOp::Average) scale_down(s.ptr, s.bytes / esize_, dtype_, n_);
  }
  // Shared memory: reduce straight from the transport's memory, skipping the copy to scratch.
  // Same operands in the same order as received(), so the same bits.
  void deliver(size_t i, size_t offset, const char* src, size_t n) override {
    size_t g = i / k_;
    Span s = segment(buf_, blocks_, recv_block(g), i % k_, seg_);
    if (g < size_t(n_ - 1)) reduce_into(s.ptr + offset, src, n / esize_, dtype_, op_);
    else std::memcpy(s.ptr + offset, src, n);
  }
  void delivered(size_t i) override {
    size_t g = i / k_;
    if (g == size_t(n_ - 2) && op_ == ReduceOp::Average) {
      Span s = segment(buf_, blocks_, recv_block(g), i % k_, seg_);
      scale_down(s.ptr, s.bytes / esize_, dtype_, n_);
    }
  }

 private:
  size_t send_block(size_t g) const {
    if (g < size_t(n_ - 1)) return mod(long(r_) - long(g), n_);
    return mod(long(r_) + 1 - long(g - (n_ - 1)), n_);
  }
  size_t recv_block(size_t g) const {
    if (g < size_t(n_ - 1)) return mod(long(r_) - long(g) - 1, n_);
    return mod(long(r_) - long(g - (n_ - 1)), n_);
  }
  char* buf_;
  DType dtype_;
  ReduceOp op_;
  int r_, n_;
  size_t esize_, seg_, k_;
  Blocks blocks_;
  char* scratch_;
};

// Ring allgather of blocks already laid out in rank order in buf.
class AllgatherPlan : public Plan {
 public:
  AllgatherPlan(char* buf, Blocks blocks, int rank, int n, size_t seg_bytes)
      : buf_(buf), blocks_(std::move(blocks)), r_(rank), n_(n), seg_(std::max<size_t>(1, seg_bytes)) {
    k_ = segments_for(blocks_.max_len, seg_);
  }
  size_t num_sends() const override { return size_t(n_ - 1) * k_; }
  size_t num_recvs() const override { return num_sends(); }
  ptrdiff_t send_after(size_t i) const override { return i < k_ ? -1 : ptrdiff_t(i - k_); }
  Span send_span(size_t i) override { return segment(buf_, blocks_, mod(long(r_) - long(i / k_), n_), i % k_, seg_); }
  Span recv_span(size_t i) override {
    return segment(buf_, blocks_, mod(long(r_) - long(i / k_) - 1, n_), i % k_, seg_);
  }

 private:
  char* buf_;
  Blocks blocks_;
  int r_, n_;
  size_t seg_, k_;
};

// Pipelined chain from the root around the ring; the root's predecessor only receives.
class BroadcastPlan : public Plan {
 public:
  BroadcastPlan(char* buf, size_t bytes, int rank, int n, int root, size_t seg_bytes)
      : buf_(buf), bytes_(bytes), seg_(std::max<size_t>(1, seg_bytes)) {
    k_ = segments_for(bytes, seg_);
    is_root_ = rank == root;
    is_last_ = int(mod(long(rank) + 1, n)) == root;
  }
  size_t num_sends() const override { return is_last_ ? 0 : k_; }
  size_t num_recvs() const override { return is_root_ ? 0 : k_; }
  ptrdiff_t send_after(size_t i) const override { return is_root_ ? -1 : ptrdiff_t(i); }
  Span send_span(size_t i) override { return seg(i); }
  Span recv_span(size_t i) override { return seg(i); }

 private:
  Span seg(size_t i) const {
    size_t lo = std::min(bytes_, i * seg_), hi = std::min(bytes_, (i + 1) * seg_);
    return {buf_ + lo, hi - lo};
  }
  char* buf_;
  size_t bytes_, seg_, k_;
  bool is_root_, is_last_;
};

}  // namespace

Communicator::Communicator(Listener* listener, std::string job_id, std::string secret, uint64_t world_version,
                           int rank, std::vector<std::string> peers, CommConfig cfg, std::vector<std::string> hosts)
    : listener_(listener), job_id_(std::move(job_id)), secret_(std::move(secret)), world_version_(world_version),
      rank_(rank), peers_(std::move(peers)), hosts_(std::move(hosts)), cfg_(cfg) {
  if (peers_.empty()) throw CommError(ErrorKind::Invalid, "a communicator needs at least one peer address");
  if (rank_ < 0 || rank_ >= int(peers_.size()))
    throw CommError(ErrorKind::Invalid, "rank " + std::to_string(rank_) + " is outside a world of size " +
                                            std::to_string(peers_.size()));
  if (job_id_.empty() || job_id_.size() > kMaxJobIdBytes)
    throw CommError(ErrorKind::Invalid, "job id must be 1-255 bytes, got " + std::to_string(job_id_.size()));
  if (cfg_.timeout_s <= 0 || cfg_.form_timeout_s <= 0)
    throw CommError(ErrorKind::Invalid, "timeouts must be positive");
  if (cfg_.segment_bytes < 64) throw CommError(ErrorKind::Invalid, "segment_bytes must be at least 64");
  if (!hosts_.empty()) {
    if (hosts_.size() != peers_.size())
      throw CommError(ErrorKind::Invalid, "hosts: got " + std::to_string(hosts_.size()) + " hosts for " +
                                              std::to_string(peers_.size()) + " peers: give one host name per rank");
    for (auto& h : hosts_)
      if (h.empty()) throw CommError(ErrorKind::Invalid, "host names must not be empty");
  }
  hier_ = plan_hierarchy();
  // The peers' addresses are what they announced: a bad one is that peer's failure, which
  // form() reports naming it (ErrorKind::Unreachable), not a bad argument of this caller.
  if (peers_.size() > 1 && !listener_)
    throw CommError(ErrorKind::Invalid, "a world of more than one rank needs a listener");
}

Hierarchy Communicator::plan_hierarchy() const {
  Hierarchy h;
  const int n = size();
  if (cfg_.algorithm == CommConfig::Algorithm::Ring) {
    h.why_not = "algorithm is 'ring'";
    return h;
  }
  if (hosts_.empty()) {
    h.why_not = "no host names given";
    return h;
  }
  // Hosts in rank order; a host whose ranks are not contiguous disables the schedule.
  std::vector<int> first_of_host, size_of_host;
  std::vector<std::string> names;
  int max_local = 0;
  for (int r = 0; r < n; ++r) {
    if (r == 0 || hosts_[r] != hosts_[r - 1]) {
      for (auto& nm : names)
        if (nm == hosts_[r]) {
          h.why_not = "the ranks of host '" + hosts_[r] + "' are not contiguous in rank order";
          return h;
        }
      names.push_back(hosts_[r]);
      first_of_host.push_back(r);
      size_of_host.push_back(0);
    }
    if (r == rank_) {
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

const char* Communicator::algorithm_for(size_t bytes) const {
  if (!hier_.applies || size() < 2) return "ring";
  if (cfg_.algorithm == CommConfig::Algorithm::Hierarchical) return "hierarchical";
  return bytes > cfg_.hierarchical_bytes ? "hierarchical" : "ring";
}

void Communicator::shutdown_links_locked() {
  for (auto* l : {&links_, &local_links_, &leader_links_})
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

namespace {

// One ring being formed: the flat ring, or for the hierarchical allreduce the host-local
// ring or the leaders' ring. All rings of a world version share the listener and differ
// by handshake channel.
struct RingForm {
  uint8_t channel;
  LinkContext ctx;
  LinkSettings send_settings, recv_settings;
  int next_fd = -1, prev_fd = -1;
  std::unique_ptr<ShmRing> offered, send_ring, recv_ring;
  std::unique_ptr<Links>* into;
};

}  // namespace

void Communicator::form() {
  if (formed_) throw CommError(ErrorKind::Invalid, "communicator is already formed");
  const int n = size();
  if (n == 1) {
    formed_ = true;
    return;
  }
  auto same_host = [&](int other) {
    return cfg_.transport == CommConfig::Transport::Auto && !hosts_.empty() && hosts_[other] == hosts_[rank_];
  };
  std::vector<RingForm> rings;
  auto add_ring = [&](uint8_t channel, int ring_size, int next, int prev, std::unique_ptr<Links>* into) {
    RingForm f;
    f.channel = channel;
    f.ctx = LinkContext{rank_, ring_size, world_version_, next, prev, printable(peers_[next], 300),
                        printable(peers_[prev], 300)};
    f.send_settings.want_shm = same_host(next);
    f.recv_settings.want_shm = same_host(prev);
    f.into = into;
    rings.push_back(std::move(f));
  };
  add_ring(kChannelFlat, n, (rank_ + 1) % n, (rank_ + n - 1) % n, &links_);
  if (hier_.applies) {
    const Hierarchy& h = hier_;
    if (h.local_size >= 2)
      add_ring(kChannelLocal, h.local_size, h.first + (h.local_rank + 1) % h.local_size,
               h.first + (h.local_rank + h.local_size - 1) % h.local_size, &local_links_);
    if (h.leader())
      add_ring(kChannelLeaders, h.num_hosts, h.leaders[(h.host + 1) % h.num_hosts],
               h.leaders[(h.host + h.num_hosts - 1) % h.num_hosts], &leader_links_);
  }
  Expectation e;
  e.active = true;
  e.job_id = job_id_;
  e.secret = secret_;
  e.world_version = world_version_;
  e.rank = uint32_t(rank_);
  e.world_size = uint32_t(n);
  for (auto& f : rings) e.prev_rank[f.channel] = f.ctx.prev_rank;
  listener_->expect(e);
  auto seconds = [](double s) { return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s)); };
  auto deadline = Clock::now() + seconds(cfg_.form_timeout_s);
  try {
    // Every ring's connection and LINK go out before this rank waits for any predecessor,
    // and every LINK_ACK is answered before any is awaited, so no rank waits on a rank
    // that waits on it, whatever the rings.
    for (auto& f : rings) {
      Hello h;
      h.job_id = job_id_;
      h.world_version = world_version_;
      h.from_rank = uint32_t(rank_);
      h.to_rank = uint32_t(f.ctx.next_rank);
      h.world_size = uint32_t(n);
      h.channel = f.channel;
      random_bytes(h.nonce.data(), h.nonce.size());
      // A neighbour that accepts no connection for as long as a collective may go without
      // progress is not coming: give up on it then, even if the form deadline is later.
      f.next_fd = connect_ring_peer(peers_[f.ctx.next_rank], h, secret_, deadline, seconds(cfg_.timeout_s), abort_);
      f.offered = offer_link(f.next_fd, f.send_settings, f.ctx, deadline, abort_);
    }
    for (auto& f : rings) {
      f.prev_fd = listener_->take(world_version_, deadline, abort_, rank_, f.ctx.prev_rank, f.channel);
      f.recv_ring = accept_link(f.prev_fd, f.recv_settings, f.ctx, deadline, abort_);
    }
    for (auto& f : rings) {
      f.send_ring = finish_link(f.next_fd, std::move(f.offered), f.ctx, deadline, abort_);
      std::unique_ptr<Links> links;
      if (f.send_ring || f.recv_ring)
        links = std::make_unique<ShmLinks>(f.next_fd, f.prev_fd, std::move(f.send_ring), std::move(f.recv_ring), f.ctx,
                                           &abort_, cfg_.timeout_s);
      else
        links = std::make_unique<TcpLinks>(f.next_fd, f.prev_fd, f.ctx, &abort_, cfg_.timeout_s);
      f.next_fd = f.prev_fd = -1;  // owned by the links now
      std::lock_guard<std::mutex> g(err_mu_);
      *f.into = std::move(links);
    }
  } catch (CommError& err) {
    for (auto& f : rings) {
      if (f.next_fd >= 0) ::close(f.next_fd);
      if (f.prev_fd >= 0) ::close(f.prev_fd);
    }
    failed_.store(true);
    std::lock_guard<std::mutex> g(err_mu_);
    shutdown_links_locked();  // rings already formed: tell their neighbours at once
    if (!first_error_) first_error_ = std::make_unique<CommError>(err);
    throw;
  }
  formed_ = true;
  std::lock_guard<std::mutex> g(err_mu_);
  if (abort_.fired()) shutdown_links_locked();  // abort() raced with the end of form()
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
  return OpInfo{name, seq, tag, std::string(name) + " #" + std::to_string(seq) + " (" + describe + ")"};
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
    if (err.kind == ErrorKind::Aborted && !abort_reason_.empty())
      err = CommError(err.kind, std::string(err.what()) + " (" + abort_reason_ + ")", err.op, err.world_version,
                      err.rank, err.peer);
    if (!first_error_) first_error_ = std::make_unique<CommError>(err);
    throw err;
  }
}

void Communicator::allreduce(void* buf, size_t count, DType dtype, ReduceOp op) {
  guarded("allreduce", [&] {
    const int n = size();
    const size_t esize = dtype_size(dtype), bytes = count * esize;
    if (n == 1) {
      if (op == ReduceOp::Average) scale_down(buf, count, dtype, 1);
      return;
    }
    if (count == 0) return;
    uint32_t tag = fnv1a({1, uint64_t(dtype), uint64_t(op), count});
    std::string what = std::string(dtype_name(dtype)) + ", " + std::to_string(count) + " elements, " + op_name(op);
    if (algorithm_for(bytes)[0] == 'h') {
      OpInfo info = make_op("allreduce", fnv1a({tag, 5}), what + ", hierarchical");
      if ((dtype == DType::Float16 || dtype == DType::BFloat16) && (op == ReduceOp::Sum || op == ReduceOp::Average)) {
        // As on the ring: 16-bit sums travel and accumulate as float32, rounded once.
        std::vector<float> wide(count);
        widen_to_f32(wide.data(), buf, count, dtype);
        hierarchical_allreduce(reinterpret_cast<char*>(wide.data()), count, DType::Float32, op, info);
        narrow_from_f32(buf, wide.data(), count, dtype);
        return;
      }
      hierarchical_allreduce(static_cast<char*>(buf), count, dtype, op, info);
      return;
    }
    if (bytes <= cfg_.small_bytes) {
      // Small message: gather every rank's whole buffer (n-1 latency steps instead of
      // 2(n-1)) and reduce locally in rank order, which every rank does identically.
      OpInfo info = make_op("allreduce", tag, what);
      std::vector<char> all(bytes * n);
      std::memcpy(all.data() + bytes * rank_, buf, bytes);
      Blocks b;
      for (int c = 0; c < n; ++c) { b.off.push_back(bytes * c); b.len.push_back(bytes); }
      b.max_len = bytes;
      AllgatherPlan plan(all.data(), b, rank_, n, std::max(bytes, cfg_.segment_bytes));
      links_->run(plan, info);
      std::vector<const void*> srcs(n);
      for (int c = 0; c < n; ++c) srcs[c] = all.data() + bytes * c;
      reduce_many(buf, srcs.data(), n, count, dtype, op);
      return;
    }
    OpInfo info = make_op("allreduce", tag, what);
    if ((dtype == DType::Float16 || dtype == DType::BFloat16) && (op == ReduceOp::Sum || op == ReduceOp::Average)) {
      // Sums of 16-bit floats travel and accumulate as float32 and are rounded once at the
      // end, as the small path does: no overflow of partial sums, one rounding.
      std::vector<float> wide(count);
      widen_to_f32(wide.data(), buf, count, dtype);
      AllreducePlan plan(reinterpret_cast<char*>(wide.data()), count, DType::Float32, op, rank_, n,
                         cfg_.segment_bytes, scratch_);
      links_->run(plan, info);
      narrow_from_f32(buf, wide.data(), count, dtype);
      return;
    }
    AllreducePlan plan(static_cast<char*>(buf), count, dtype, op, rank_, n, cfg_.segment_bytes, scratch_);
    links_->run(plan, info);
  });
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

void Communicator::hierarchical_allreduce(char* buf, size_t count, DType dtype, ReduceOp op, const OpInfo& info) {
  const Hierarchy& h = hier_;
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
    p.tag = fnv1a({info.tag, k, c});  // a rank in another phase or chunk is a mismatch, not wrong numbers
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
    AllreducePlan plan(p, n, dtype, sum_op, h.local_rank, h.local_size, cfg_.segment_bytes, scratch_);
    Watching w(local_links_.get(), watch);
    local_links_->run(plan, phase(1, c, "phase 1: host-local allreduce"));
  };
  auto leaders = [&](size_t c, std::vector<char>& scratch, Links* watch) {
    auto [p, n] = chunk(c);
    AllreducePlan plan(p, n, dtype, sum_op, h.host, h.num_hosts, cfg_.segment_bytes, scratch);
    Watching w(leader_links_.get(), watch);
    leader_links_->run(plan, phase(2, c, "phase 2: leaders' allreduce"));
    if (op == ReduceOp::Average) scale_down(p, n, dtype, size());
  };
  auto local_bcast = [&](size_t c) {
    auto [p, n] = chunk(c);
    BroadcastPlan plan(p, n * esize, h.local_rank, h.local_size, 0, cfg_.segment_bytes);
    local_links_->run(plan, phase(3, c, "phase 3: host-local broadcast"));
  };

  if (!local_links_) {  // a host of one rank: only the leaders' phase
    for (size_t c = 0; c < chunks; ++c) leaders(c, scratch_, nullptr);
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
    local_reduce(0, leader_links_.get());
    leaders(0, scratch_, local_links_.get());
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
        leaders(c, leader_scratch_, nullptr);
        std::lock_guard<std::mutex> lk(mu);
        crossed = c + 1;
        cv.notify_all();
      }
    } catch (...) {
      {
        std::lock_guard<std::mutex> lk(mu);
        helper_error = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> g(err_mu_);
        shutdown_links_locked();
      }
      cv.notify_all();
    }
  });
  // Waiting for the helper, this thread still looks after the host-local ring: a host mate
  // that gives up or dies meanwhile fails this rank now, not when the leaders' phase ends.
  auto wait_crossed = [&](size_t c) {
    const OpInfo waiting = phase(3, c, "waiting for the leaders' phase");
    std::unique_lock<std::mutex> lk(mu);
    while (crossed <= c && !helper_error) {
      if (abort_.fired()) break;
      cv.wait_for(lk, std::chrono::milliseconds(2));
      if (crossed > c || helper_error) break;
      lk.unlock();
      local_links_->check_alive(waiting);
      lk.lock();
    }
    if (helper_error) std::rethrow_exception(helper_error);
    if (crossed <= c) throw CommError(ErrorKind::Aborted, info.describe + " failed at world version " +
                                                              std::to_string(world_version_) + " on rank " +
                                                              std::to_string(rank_) + ": communicator aborted",
                                      info.name, int64_t(world_version_), rank_, -1);
  };
  try {
    for (size_t c = 0; c < chunks; ++c) {
      // Watching the leaders' ring here too: while the helper waits for this chunk nobody
      // else looks at it, and a rank stuck on a live host mate must still hear of a failure.
      local_reduce(c, leader_links_.get());
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
    {
      std::lock_guard<std::mutex> g(err_mu_);
      shutdown_links_locked();  // wakes the helper if it waits in the leaders' ring
    }
    helper.join();
    if (first) std::rethrow_exception(first);
    throw;
  }
  helper.join();
}

void Communicator::broadcast(void* buf, size_t bytes, int root) {
  if (root < 0 || root >= size())
    throw CommError(ErrorKind::Invalid, "broadcast root rank " + std::to_string(root) + " is outside a world of size " +
                                            std::to_string(size()));
  guarded("broadcast", [&] {
    if (size() == 1 || bytes == 0) return;
    OpInfo info = make_op("broadcast", fnv1a({2, bytes, uint64_t(root)}),
                          std::to_string(bytes) + " bytes from rank " + std::to_string(root));
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
      b.off.push_back(at);
      b.len.push_back(bytes_per_rank[c]);
      b.max_len = std::max<size_t>(b.max_len, bytes_per_rank[c]);
      at += bytes_per_rank[c];
      h = fnv1a({h, bytes_per_rank[c]});
    }
    char* dst = static_cast<char*>(out) + b.off[rank_];
    if (dst != in && b.len[rank_]) std::memmove(dst, in, b.len[rank_]);
    if (n == 1) return;
    OpInfo info = make_op("allgather", h, std::to_string(at) + " bytes in all");
    AllgatherPlan plan(static_cast<char*>(out), b, rank_, n, cfg_.segment_bytes);
    links_->run(plan, info);
  });
}

void Communicator::barrier() {
  guarded("barrier", [&] {
    const int n = size();
    if (n == 1) return;
    // An allgather of empty blocks: after n-1 steps every rank has heard from every other.
    OpInfo info = make_op("barrier", fnv1a({4}), "barrier");
    Blocks b;
    b.off.assign(n, 0);
    b.len.assign(n, 0);
    AllgatherPlan plan(nullptr, b, rank_, n, cfg_.segment_bytes);
    links_->run(plan, info);
  });
}

}  // namespace ering
