// Shared-memory links: the memfd ring of chunks, its set-up over the authenticated TCP
// connection, and a Links that moves a Plan's segments through it with doorbells,
// deadlines and abort. See shm.h for the design and native/README.md for the wire format.
#include "shm.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "auth.h"
#include "handshake.h"

namespace ering {

struct ShmRing::Control {
  char magic[8];  // "ERNGSHM1"
  uint64_t world_version;
  uint32_t from_rank, to_rank;
  uint32_t slots, slot_bytes;
  uint8_t token[16];
  // Each side's counter on its own cache line. Counters run on across collectives.
  alignas(64) uint64_t head;   // chunks published; written by the sender only
  uint32_t recv_sleeping;      // the receiver is (about to be) asleep in poll(): ring its doorbell
  alignas(64) uint64_t tail;   // chunks consumed; written by the receiver only
  uint32_t send_sleeping;      // the sender waits for a free chunk
};

// What a chunk carries besides its payload: the same checks as a TCP frame header.
struct ShmRing::Chunk {
  uint32_t seq, tag;
  uint64_t index;      // segment index within the collective
  uint64_t seg_bytes;  // the whole segment's size
  uint64_t offset;     // where this chunk's payload starts within the segment
  uint64_t bytes;      // payload bytes in this chunk (0 for an empty segment)
};

namespace {

constexpr char kShmMagic[8] = {'E', 'R', 'N', 'G', 'S', 'H', 'M', '1'};
constexpr size_t kControlBytes = 256;
constexpr size_t kChunkHeaderBytes = 64;
constexpr uint64_t kMaxShmBytes = uint64_t(1) << 30;
static_assert(sizeof(ShmRing::Control) <= kControlBytes, "control block fits its reserved space");
static_assert(sizeof(ShmRing::Chunk) <= kChunkHeaderBytes, "chunk header fits its reserved space");

// After this long without progress a waiter stops spinning and sleeps in poll() until a
// doorbell, EOF, abort or its deadline. Short, because with more ranks than cores the
// peer it waits for may need this core.
constexpr auto kSpin = std::chrono::microseconds(50);
constexpr uint8_t kDoorbell = 'D';
// While a run() keeps making progress it still looks at its watched connections this often.
constexpr auto kWatchEvery = std::chrono::milliseconds(2);

size_t layout_bytes(size_t slots, size_t slot_bytes) { return kControlBytes + slots * (kChunkHeaderBytes + slot_bytes); }

template <class T>
T load(const T& v) { return __atomic_load_n(&v, __ATOMIC_ACQUIRE); }
template <class T>
void store(T& v, T x) { __atomic_store_n(&v, x, __ATOMIC_RELEASE); }
// Publishing a counter and then reading the other side's sleeping flag (and the reverse on
// the other side) must not be reordered: otherwise both could miss each other (lost wakeup).
template <class T>
void store_fenced(T& v, T x) { __atomic_store_n(&v, x, __ATOMIC_SEQ_CST); }
template <class T>
T load_fenced(const T& v) { return __atomic_load_n(&v, __ATOMIC_SEQ_CST); }

void put_u32(std::vector<uint8_t>& b, uint32_t v) { for (int i = 3; i >= 0; --i) b.push_back(uint8_t(v >> (8 * i))); }
void put_u64(std::vector<uint8_t>& b, uint64_t v) { for (int i = 7; i >= 0; --i) b.push_back(uint8_t(v >> (8 * i))); }
uint32_t get_u32(const uint8_t* p) { return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3]; }
uint64_t get_u64(const uint8_t* p) { return uint64_t(get_u32(p)) << 32 | get_u32(p + 4); }

constexpr uint8_t kModeTcp = 0, kModeShm = 1;
constexpr size_t kOfferBody = 1 + 4 + 4 + 8 + 16;

CommError form_error(ErrorKind kind, const LinkContext& ctx, int peer, const std::string& what) {
  return CommError(kind,
                   "form (world version " + std::to_string(ctx.world_version) + ", rank " + std::to_string(ctx.rank) +
                       "): " + what,
                   "form", int64_t(ctx.world_version), ctx.rank, peer);
}

[[noreturn]] void io_failed(int e, const LinkContext& ctx, int peer, const std::string& name) {
  if (e == ECANCELED) throw form_error(ErrorKind::Aborted, ctx, peer, "aborted while setting up the link with " + name);
  if (e == ETIMEDOUT) throw form_error(ErrorKind::Timeout, ctx, peer, "no link set-up from " + name + " before the deadline");
  throw form_error(ErrorKind::PeerLost, ctx, peer, name + " closed the connection while setting up the link");
}

// Reads one handshake-framed message of the given type.
std::vector<uint8_t> read_msg(int fd, MsgType want, const LinkContext& ctx, int peer, const std::string& name,
                              Clock::time_point deadline, const AbortSignal& abort) {
  uint8_t hdr[kHeaderBytes];
  if (int e = read_full(fd, hdr, sizeof(hdr), deadline, abort)) io_failed(e, ctx, peer, name);
  MsgHeader h{};
  std::string why;
  if (!decode_header(hdr, &h, &why) || h.type != want)
    throw form_error(ErrorKind::Refused, ctx, peer, name + " sent a malformed link set-up" + (why.empty() ? "" : ": " + why));
  std::vector<uint8_t> body(h.body_len);
  if (int e = read_full(fd, body.data(), body.size(), deadline, abort)) io_failed(e, ctx, peer, name);
  return body;
}

void write_msg(int fd, MsgType type, const std::vector<uint8_t>& body, const LinkContext& ctx, int peer,
               const std::string& name, Clock::time_point deadline, const AbortSignal& abort) {
  auto msg = encode_message(type, Status::Ok, body);
  if (int e = write_full(fd, msg.data(), msg.size(), deadline, abort)) io_failed(e, ctx, peer, name);
}

std::string rank_name(int rank, const std::string& address) {
  return "rank " + std::to_string(rank) + " (" + address + ")";
}

}  // namespace

// ---------------------------------------------------------------- ShmRing

ShmRing::~ShmRing() {
  close_fd();
  if (base_) munmap(base_, bytes_);
}

void ShmRing::close_fd() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

const uint8_t* ShmRing::token() const { return ctl_->token; }

ShmRing::Chunk* ShmRing::chunk(uint64_t n) const {
  return reinterpret_cast<Chunk*>(static_cast<char*>(base_) + kControlBytes +
                                  (n % slots_) * (kChunkHeaderBytes + slot_bytes_));
}

char* ShmRing::payload(uint64_t n) const { return reinterpret_cast<char*>(chunk(n)) + kChunkHeaderBytes; }

std::unique_ptr<ShmRing> ShmRing::create(uint64_t world_version, uint32_t from_rank, uint32_t to_rank, size_t slots,
                                         size_t slot_bytes) {
  std::unique_ptr<ShmRing> r(new ShmRing());
  r->slots_ = slots;
  r->slot_bytes_ = slot_bytes;
  r->bytes_ = layout_bytes(slots, slot_bytes);
  r->fd_ = memfd_create("elastic-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (r->fd_ < 0) return nullptr;
  // Sealed against shrinking: the receiver can never be made to fault on a truncated mapping.
  if (ftruncate(r->fd_, off_t(r->bytes_)) != 0 ||
      fcntl(r->fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    return nullptr;
  void* p = mmap(nullptr, r->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd_, 0);
  if (p == MAP_FAILED) return nullptr;
  r->base_ = p;
  r->ctl_ = static_cast<Control*>(p);
  Control* c = r->ctl_;
  std::memcpy(c->magic, kShmMagic, sizeof(kShmMagic));
  c->world_version = world_version;
  c->from_rank = from_rank;
  c->to_rank = to_rank;
  c->slots = uint32_t(slots);
  c->slot_bytes = uint32_t(slot_bytes);
  random_bytes(c->token, sizeof(c->token));
  return r;
}

std::unique_ptr<ShmRing> ShmRing::open(uint32_t pid, uint32_t fd, uint64_t bytes, const uint8_t* token,
                                       uint64_t world_version, uint32_t from_rank, uint32_t to_rank,
                                       std::string* why) {
  if (bytes < kControlBytes || bytes > kMaxShmBytes) {
    *why = "announced shared memory of " + std::to_string(bytes) + " bytes";
    return nullptr;
  }
  std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  std::unique_ptr<ShmRing> r(new ShmRing());
  r->fd_ = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (r->fd_ < 0) {
    *why = "cannot open " + path + ": " + std::strerror(errno) + " (another host, container or pid namespace?)";
    return nullptr;
  }
  struct stat st{};
  int seals = fcntl(r->fd_, F_GET_SEALS);
  if (fstat(r->fd_, &st) != 0 || !S_ISREG(st.st_mode) || uint64_t(st.st_size) != bytes || seals < 0 ||
      !(seals & F_SEAL_SHRINK)) {
    *why = path + " is not the sealed shared memory the peer announced";
    return nullptr;
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd_, 0);
  if (p == MAP_FAILED) {
    *why = std::string("mmap failed: ") + std::strerror(errno);
    return nullptr;
  }
  r->base_ = p;
  r->bytes_ = bytes;
  r->ctl_ = static_cast<Control*>(p);
  r->close_fd();  // the mapping keeps the memory; no name or descriptor is left to find it by
  const Control* c = r->ctl_;
  // The token arrived over the authenticated connection: a recycled pid or descriptor
  // number cannot pass for the peer's memory.
  if (std::memcmp(c->magic, kShmMagic, sizeof(kShmMagic)) != 0 || !digest_equal(c->token, token, sizeof(c->token)) ||
      c->world_version != world_version || c->from_rank != from_rank || c->to_rank != to_rank) {
    *why = path + " does not hold the token the peer announced (another process?)";
    return nullptr;
  }
  size_t slots = c->slots, slot_bytes = c->slot_bytes;
  if (slots < 1 || slots > 4096 || slot_bytes < 64 || slot_bytes % 64 != 0 || layout_bytes(slots, slot_bytes) != bytes) {
    *why = path + " has an inconsistent layout";
    return nullptr;
  }
  r->slots_ = slots;
  r->slot_bytes_ = slot_bytes;
  return r;
}

// ---------------------------------------------------------------- link set-up

std::unique_ptr<ShmRing> offer_link(int fd, const LinkSettings& s, const LinkContext& ctx, Clock::time_point deadline,
                                    const AbortSignal& abort) {
  std::unique_ptr<ShmRing> ring;
  if (s.want_shm)
    ring = ShmRing::create(ctx.world_version, uint32_t(ctx.rank), uint32_t(ctx.next_rank), s.slots, s.slot_bytes);
  std::vector<uint8_t> body;
  if (ring) {
    body.push_back(kModeShm);
    put_u32(body, uint32_t(getpid()));
    put_u32(body, uint32_t(ring->fd()));
    put_u64(body, ring->bytes());
    body.insert(body.end(), ring->token(), ring->token() + 16);
  } else {
    body.push_back(kModeTcp);
  }
  write_msg(fd, MsgType::Link, body, ctx, ctx.next_rank, rank_name(ctx.next_rank, ctx.next_address), deadline, abort);
  return ring;
}

std::unique_ptr<ShmRing> finish_link(int fd, std::unique_ptr<ShmRing> offered, const LinkContext& ctx,
                                     Clock::time_point deadline, const AbortSignal& abort) {
  std::string name = rank_name(ctx.next_rank, ctx.next_address);
  auto body = read_msg(fd, MsgType::LinkAck, ctx, ctx.next_rank, name, deadline, abort);
  if (body.size() != 1 || body[0] > kModeShm || (body[0] == kModeShm && !offered))
    throw form_error(ErrorKind::Refused, ctx, ctx.next_rank, name + " sent a malformed link acknowledgement");
  if (body[0] != kModeShm) return nullptr;
  offered->close_fd();  // the receiver holds its own mapping now
  return offered;
}

std::unique_ptr<ShmRing> accept_link(int fd, const LinkSettings& s, const LinkContext& ctx, Clock::time_point deadline,
                                     const AbortSignal& abort) {
  std::string name = rank_name(ctx.prev_rank, ctx.prev_address);
  auto body = read_msg(fd, MsgType::Link, ctx, ctx.prev_rank, name, deadline, abort);
  if (body.empty() || body[0] > kModeShm || (body[0] == kModeShm && body.size() != kOfferBody) ||
      (body[0] == kModeTcp && body.size() != 1))
    throw form_error(ErrorKind::Refused, ctx, ctx.prev_rank, name + " sent a malformed link set-up");
  std::unique_ptr<ShmRing> ring;
  if (body[0] == kModeShm && s.want_shm) {
    std::string why;
    ring = ShmRing::open(get_u32(&body[1]), get_u32(&body[5]), get_u64(&body[9]), &body[17], ctx.world_version,
                         uint32_t(ctx.prev_rank), uint32_t(ctx.rank), &why);
    if (!ring) {
      // Same host name but no shared memory (e.g. another container): TCP still works.
      std::string line = "elastic-ring: rank " + std::to_string(ctx.rank) + ": no shared memory with " + name + " (" +
                         why + "); this link uses TCP\n";
      ssize_t w = ::write(2, line.data(), line.size());
      (void)w;
    }
  }
  write_msg(fd, MsgType::LinkAck, {ring ? kModeShm : kModeTcp}, ctx, ctx.prev_rank, name, deadline, abort);
  return ring;
}

// ---------------------------------------------------------------- ShmLinks

namespace {

void ring_doorbell(int fd) {
  // Non-blocking: if the socket is full, a doorbell is already pending and wakes the peer.
  ssize_t w = ::send(fd, &kDoorbell, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
  (void)w;
}
}  // namespace

ShmLinks::ShmLinks(int next_fd, int prev_fd, std::unique_ptr<ShmRing> send, std::unique_ptr<ShmRing> recv,
                   LinkContext ctx, const AbortSignal* abort, double timeout_s)
    : next_fd_(next_fd), prev_fd_(prev_fd), send_(std::move(send)), recv_(std::move(recv)), ctx_(std::move(ctx)),
      abort_(abort), timeout_s_(timeout_s) {}

ShmLinks::~ShmLinks() {
  if (next_fd_ >= 0) ::close(next_fd_);
  if (prev_fd_ >= 0) ::close(prev_fd_);
}

std::vector<WatchFd> ShmLinks::connections() const {
  return {{next_fd_, ctx_.next_rank, rank_name(ctx_.next_rank, ctx_.next_address)},
          {prev_fd_, ctx_.prev_rank, rank_name(ctx_.prev_rank, ctx_.prev_address)}};
}

void ShmLinks::shutdown() {
  // The shared memory stays mapped until the destructor: another thread may be in run().
  give_up(poisoned_, next_fd_, prev_fd_);
}

void ShmLinks::lost(const OpInfo& op, int fd, int peer, const std::string& name, const std::string& what) {
  link_lost(ctx_, op, take_poison(fd), peer, name, what);
}

void ShmLinks::fail(ErrorKind kind, const OpInfo& op, int peer, const std::string& what) {
  link_failure(ctx_, kind, op, peer, what);
}

void ShmLinks::run(Plan& plan, const OpInfo& op) {
  const size_t nsend = plan.num_sends(), nrecv = plan.num_recvs();
  size_t si = 0, ri = 0;
  // Progress within the current segment: shm counts payload bytes, TCP counts frame bytes.
  size_t soff = 0, roff = 0;
  Span sspan{nullptr, 0}, rspan{nullptr, 0};
  FrameHeader shdr{}, rhdr{};
  if (nsend) { sspan = plan.send_span(0); shdr = {op.seq, op.tag, 0, sspan.bytes}; }
  if (nrecv) rspan = plan.recv_span(0);
  bool prev_closed = false;  // EOF on a shm receive link: fail once its published chunks are used up
  // A neighbour's poison byte, taken as soon as it is seen and used only if its stream ends early.
  bool next_poisoned = false, prev_poisoned = false;
  const auto timeout = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s_));
  auto deadline = Clock::now() + timeout;
  auto idle_since = Clock::now();
  auto watched_at = Clock::now();
  const std::string next_name = rank_name(ctx_.next_rank, ctx_.next_address);
  const std::string prev_name = rank_name(ctx_.prev_rank, ctx_.prev_address);
  auto closed = [&](int fd, int peer, const std::string& name, bool poisoned) {
    if (poisoned)
      fail(ErrorKind::Propagated, op, peer,
           name + " gave up because of a failure elsewhere in the ring (it is alive; the failed rank is further on)");
    lost(op, fd, peer, name, "connection to " + name + " closed (peer exited or failed)");
  };
  auto can_send = [&] { return si < nsend && (plan.send_after(si) < 0 || size_t(plan.send_after(si)) < ri); };

  // Copies as many chunks as there are free slots, publishing each at once.
  auto shm_send = [&]() -> bool {
    bool progress = false;
    ShmRing::Control* c = send_->control();
    while (can_send()) {
      if (head_ - load(c->tail) >= send_->slots()) break;
      ShmRing::Chunk* ch = send_->chunk(head_);
      size_t n = std::min(send_->slot_bytes(), sspan.bytes - soff);
      *ch = ShmRing::Chunk{op.seq, op.tag, si, sspan.bytes, soff, n};
      if (n) std::memcpy(send_->payload(head_), sspan.ptr + soff, n);
      soff += n;
      store_fenced(c->head, ++head_);
      if (load_fenced(c->recv_sleeping) && __atomic_exchange_n(&c->recv_sleeping, 0u, __ATOMIC_SEQ_CST))
        ring_doorbell(next_fd_);
      progress = true;
      if (soff == sspan.bytes) {
        ++si;
        soff = 0;
        if (si < nsend) sspan = plan.send_span(si);
      }
    }
    return progress;
  };

  // Hands published chunks to the plan (which may reduce straight from them), then frees them.
  auto shm_recv = [&]() -> bool {
    bool progress = false;
    ShmRing::Control* c = recv_->control();
    while (ri < nrecv && tail_ != load(c->head)) {
      ShmRing::Chunk ch = *recv_->chunk(tail_);  // a copy: checked values are the used values
      std::string why = frame_mismatch(FrameHeader{uint32_t(ch.seq), uint32_t(ch.tag), uint64_t(ch.index),
                                                   uint64_t(ch.seg_bytes)},
                                       op, ri, rspan.bytes, prev_name);
      if (why.empty() && (ch.offset != roff || ch.bytes > recv_->slot_bytes() || ch.bytes > rspan.bytes - roff ||
                          (ch.bytes == 0 && rspan.bytes != 0)))
        why = prev_name + " sent a malformed chunk of segment " + std::to_string(ri) + " (offset " +
              std::to_string(ch.offset) + ", " + std::to_string(ch.bytes) + " bytes)";
      if (!why.empty()) fail(ErrorKind::Mismatch, op, ctx_.prev_rank, why);
      if (ch.bytes) plan.deliver(ri, roff, recv_->payload(tail_), ch.bytes);
      roff += ch.bytes;
      store_fenced(c->tail, ++tail_);
      if (load_fenced(c->send_sleeping) && __atomic_exchange_n(&c->send_sleeping, 0u, __ATOMIC_SEQ_CST))
        ring_doorbell(prev_fd_);
      progress = true;
      if (roff == rspan.bytes) {
        plan.delivered(ri);
        ++ri;
        roff = 0;
        if (ri < nrecv) rspan = plan.recv_span(ri);
      }
    }
    return progress;
  };

  auto tcp_send = [&]() -> bool {
    if (!can_send()) return false;
    ssize_t w = send_frame_part(next_fd_, shdr, sspan, soff);
    if (w > 0) {
      soff += size_t(w);
      if (soff == sizeof(shdr) + sspan.bytes) {
        ++si;
        soff = 0;
        if (si < nsend) { sspan = plan.send_span(si); shdr = {op.seq, op.tag, si, sspan.bytes}; }
      }
      return true;
    }
    if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      lost(op, next_fd_, ctx_.next_rank, next_name, "connection to " + next_name + " lost: " + std::strerror(errno));
    return false;
  };

  auto tcp_recv = [&]() -> bool {
    if (ri >= nrecv) return false;
    ssize_t r = recv_frame_part(prev_fd_, rhdr, rspan, roff, &prev_poisoned);
    if (r == 0) closed(prev_fd_, ctx_.prev_rank, prev_name, prev_poisoned);
    if (r < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
        lost(op, prev_fd_, ctx_.prev_rank, prev_name, "connection to " + prev_name + " lost: " + std::strerror(errno));
      return false;
    }
    size_t before = roff;
    roff += size_t(r);
    if (before < sizeof(rhdr) && roff >= sizeof(rhdr)) {
      std::string why = frame_mismatch(rhdr, op, ri, rspan.bytes, prev_name);
      if (!why.empty()) fail(ErrorKind::Mismatch, op, ctx_.prev_rank, why);
    }
    if (roff == sizeof(rhdr) + rspan.bytes) {
      plan.received(ri);
      ++ri;
      roff = 0;
      if (ri < nrecv) rspan = plan.recv_span(ri);
    }
    return true;
  };

  // Reads doorbell bytes; false when the connection has ended. The urgent poison byte is
  // taken first: a normal read past it would discard it, and with it the news that the
  // neighbour is alive and only passing a failure on.
  auto drain = [](int fd, bool* poisoned) -> bool {
    char buf[64];
    for (;;) {
      if (take_poison(fd)) *poisoned = true;
      ssize_t r = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (r > 0) continue;
      if (r == 0) return false;
      if (errno == EINTR) continue;
      return errno == EAGAIN || errno == EWOULDBLOCK;
    }
  };
  while (si < nsend || ri < nrecv) {
    if (abort_->fired()) fail(ErrorKind::Aborted, op, -1, "communicator aborted");
    bool progress = send_ ? shm_send() : tcp_send();
    if (ri < nrecv) progress |= recv_ ? shm_recv() : tcp_recv();
    if (progress) {
      auto now = Clock::now();
      deadline = now + timeout;
      idle_since = Clock::time_point{};
      if (!watch_.empty() && now - watched_at > kWatchEvery) {
        watched_at = now;
        check_watched(watch_, nullptr, ctx_, op);
      }
      continue;
    }
    if (recv_ && prev_closed && ri < nrecv) closed(prev_fd_, ctx_.prev_rank, prev_name, prev_poisoned);
    auto now = Clock::now();
    if (idle_since == Clock::time_point{}) idle_since = now;
    if (now - idle_since < kSpin) {
      sched_yield();
      continue;
    }
    // Going to sleep: say so in the shared memory, then look once more, so a peer that
    // publishes in between either sees the flag (and rings) or is seen here.
    bool waiting_recv = recv_ && ri < nrecv;
    bool waiting_send = send_ && can_send();
    if (waiting_recv) store_fenced(recv_->control()->recv_sleeping, 1u);
    if (waiting_send) store_fenced(send_->control()->send_sleeping, 1u);
    bool ready = (waiting_recv && tail_ != load_fenced(recv_->control()->head)) ||
                 (waiting_send && head_ - load_fenced(send_->control()->tail) < send_->slots());
    if (!ready) {
      bool tcp_can_send = !send_ && can_send();
      pollfd fds[3 + kMaxWatch];
      fds[0] = {abort_->fd(), POLLIN, 0};
      // shm: doorbells and EOF arrive here; TCP: the next rank never sends, so readable means closed.
      fds[1] = {next_fd_, short(si < nsend ? ((tcp_can_send ? POLLOUT : 0) | POLLIN | POLLRDHUP) : 0), 0};
      fds[2] = {prev_fd_, short(ri < nrecv ? (POLLIN | (recv_ ? 0 : POLLPRI)) : 0), 0};
      int ms = poll_ms_until(deadline);
      if (ms == 0) {
        bool waiting_on_prev = ri < nrecv;
        fail(ErrorKind::Timeout, op, waiting_on_prev ? ctx_.prev_rank : ctx_.next_rank,
             "no progress for " + std::to_string(timeout_s_) + " s waiting on " +
                 (waiting_on_prev ? prev_name : next_name) + " (hung, stopped or partitioned?)");
      }
      size_t nw = add_watched(watch_, fds + 3);
      int r = poll(fds, nfds_t(3 + nw), ms);
      if (r < 0 && errno != EINTR) fail(ErrorKind::PeerLost, op, -1, std::string("poll failed: ") + std::strerror(errno));
      if (fds[0].revents) fail(ErrorKind::Aborted, op, -1, "communicator aborted");
      if (r > 0 && nw) check_watched(watch_, fds + 3, ctx_, op);
      const short ended = POLLIN | POLLRDHUP | POLLHUP | POLLERR;
      if (fds[1].revents & ended) {
        if (!send_)  // TCP: the next rank never sends on this connection, so readable means closed
          lost(op, next_fd_, ctx_.next_rank, next_name, "connection to " + next_name + " closed (peer exited or failed)");
        bool open = drain(next_fd_, &next_poisoned) && !(fds[1].revents & (POLLHUP | POLLERR | POLLRDHUP));
        if (!open) closed(next_fd_, ctx_.next_rank, next_name, next_poisoned);
      }
      if (!recv_ && (fds[2].revents & POLLPRI) && take_poison(prev_fd_)) prev_poisoned = true;
      if (recv_ && fds[2].revents) {
        if (!drain(prev_fd_, &prev_poisoned) || (fds[2].revents & (POLLHUP | POLLERR))) prev_closed = true;
      }
    }
    if (waiting_recv) store(recv_->control()->recv_sleeping, 0u);
    if (waiting_send) store(send_->control()->send_sleeping, 0u);
    idle_since = Clock::time_point{};  // spin again briefly after every wake-up
  }
}

}  // namespace ering
