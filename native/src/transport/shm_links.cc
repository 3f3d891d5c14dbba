// Shared-memory ends: the memfd ring of chunks, and the ends that move a Plan's segments
// through it with doorbells. See shm_links.h for the design and native/README.md for the
// layout.
#include "transport/shm_links.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "transport/auth.h"

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

constexpr uint8_t kDoorbell = 'D';

size_t layout_bytes(size_t slots, size_t slot_bytes) { return kControlBytes + slots * (kChunkHeaderBytes + slot_bytes); }

template <class T>
void store(T& v, T x) { __atomic_store_n(&v, x, __ATOMIC_RELEASE); }
// Publishing a counter and then reading the other side's sleeping flag (and the reverse on
// the other side) must not be reordered: otherwise both could miss each other (lost wakeup).
template <class T>
void store_fenced(T& v, T x) { __atomic_store_n(&v, x, __ATOMIC_SEQ_CST); }
template <class T>
T load_fenced(const T& v) { return __atomic_load_n(&v, __ATOMIC_SEQ_CST); }

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

// ---------------------------------------------------------------- the ends

namespace {

void ring_doorbell(int fd) {
  // Non-blocking: if the socket is full, a doorbell is already pending and wakes the peer.
  ssize_t w = ::send(fd, &kDoorbell, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
  (void)w;
}

// Reads doorbell bytes; false when the connection has ended. The urgent poison byte is
// taken first: a normal read past it would discard it, and with it the news that the
// neighbour is alive and only passing a failure on.
bool drain(Neighbour& n) {
  char buf[64];
  for (;;) {
    if (take_poison(n.fd)) n.poisoned = true;
    ssize_t r = ::recv(n.fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (r > 0) continue;
    if (r == 0) return false;
    if (errno == EINTR) continue;
    return errno == EAGAIN || errno == EWOULDBLOCK;
  }
}

// An end over shared memory: the ring of chunks, and the wake-up protocol. A side that
// waits sets its "sleeping" flag, looks at the counters once more, and sleeps in poll() on
// the link's connection; a side that publishes (or frees) a chunk and finds the other's
// flag set clears it and rings one doorbell byte. Flag and counter are sequentially
// consistent on both sides, so a wake-up cannot be lost.
class ShmEnd : public End {
 public:
  ShmEnd(Direction d, Neighbour peer, std::unique_ptr<ShmRing> ring) : End(d, std::move(peer)), ring_(std::move(ring)) {}
  const char* kind() const override { return "shm"; }
  bool spins() const override { return true; }

  bool arm(const RunState& s) override {
    if (!waiting(s)) return false;
    armed_ = true;
    store_fenced(flag(dir_), 1u);
    return ready();
  }

  void disarm() override {
    if (armed_) store(flag(dir_), 0u);
    armed_ = false;
  }

  // Moves one chunk after another while this end has something to do and the other side
  // left room for it (or published it), waking the other side after each.
  bool move(RunState& s) override {
    bool progress = false;
    while (waiting(s) && ready()) {
      move_chunk(s);
      wake_other();
      progress = true;
    }
    return progress;
  }

 protected:
  // This end has something to do once the other side moves.
  virtual bool waiting(const RunState& s) const = 0;
  // The other side moved: a free slot (sending) or a published chunk (receiving).
  virtual bool ready() const = 0;
  // Publishes (sending) or consumes (receiving) one chunk, advancing the segment when done.
  virtual void move_chunk(RunState& s) = 0;
  // The sleeping flag of the side that moves in direction `d`.
  uint32_t& flag(Direction d) const {
    return d == Send ? ring_->control()->send_sleeping : ring_->control()->recv_sleeping;
  }
  // After publishing or freeing a chunk: rings the other side's doorbell if it sleeps.
  void wake_other() {
    uint32_t& other = flag(dir_ == Send ? Recv : Send);
    if (load_fenced(other) && __atomic_exchange_n(&other, 0u, __ATOMIC_SEQ_CST)) ring_doorbell(peer_.fd);
  }
  std::unique_ptr<ShmRing> ring_;
  bool armed_ = false;
};

// Copies each segment into free chunks and publishes them; the TCP connection carries
// doorbells both ways, the poison byte and EOF.
class ShmSend : public ShmEnd {
 public:
  ShmSend(Neighbour next, std::unique_ptr<ShmRing> ring) : ShmEnd(Send, std::move(next), std::move(ring)) {}

  short events(const RunState& s) const override { return more(s) ? short(POLLIN | POLLRDHUP) : 0; }

  void polled(short revents, RunState& s) override {
    if (!(revents & (POLLIN | POLLRDHUP | POLLHUP | POLLERR))) return;
    bool open = drain(peer_) && !(revents & (POLLHUP | POLLERR | POLLRDHUP));
    if (!open) peer_.closed(s);
  }

 private:
  bool waiting(const RunState& s) const override { return s.may_send(); }
  bool ready() const override { return head_ - load_fenced(ring_->control()->tail) < ring_->slots(); }
  void move_chunk(RunState& s) override {
    size_t n = std::min(ring_->slot_bytes(), span_.bytes - off_);
    *ring_->chunk(head_) = ShmRing::Chunk{s.op.seq, s.op.tag, s.sent, span_.bytes, off_, n};
    if (n) std::memcpy(ring_->payload(head_), span_.ptr + off_, n);
    off_ += n;
    store_fenced(ring_->control()->head, ++head_);
    if (off_ == span_.bytes) next_segment(s);
  }
  uint64_t head_ = 0;  // chunks published (this rank owns the counter); runs on across collectives
};

// Hands published chunks to the plan (which may reduce straight from them), then frees them.
class ShmRecv : public ShmEnd {
 public:
  ShmRecv(Neighbour prev, std::unique_ptr<ShmRing> ring) : ShmEnd(Recv, std::move(prev), std::move(ring)) {}

  bool move(RunState& s) override {
    bool progress = ShmEnd::move(s);
    // Chunks published before the neighbour's connection ended are still used; only when
    // more are needed does the operation fail.
    if (!progress && closed_ && more(s)) peer_.closed(s);
    return progress;
  }

  short events(const RunState& s) const override { return more(s) ? short(POLLIN) : 0; }

  void polled(short revents, RunState& s) override {
    if (revents && (!drain(peer_) || (revents & (POLLHUP | POLLERR)))) closed_ = true;
  }

 private:
  bool waiting(const RunState& s) const override { return more(s); }
  bool ready() const override { return tail_ != load_fenced(ring_->control()->head); }
  void move_chunk(RunState& s) override {
    ShmRing::Chunk ch = *ring_->chunk(tail_);  // a copy: checked values are the used values
    check(s, ch);
    if (ch.bytes) s.plan.deliver(s.received, off_, ring_->payload(tail_), ch.bytes);
    off_ += ch.bytes;
    store_fenced(ring_->control()->tail, ++tail_);
    if (off_ == span_.bytes) {
      s.plan.delivered(s.received);
      next_segment(s);
    }
  }
  // Fails the operation unless the chunk is the next piece of the segment expected.
  void check(const RunState& s, const ShmRing::Chunk& ch) const {
    std::string why = segment_mismatch(uint32_t(ch.seq), uint32_t(ch.tag), uint64_t(ch.index),
                                       uint64_t(ch.seg_bytes), s.op, s.received, span_.bytes, peer_.name);
    if (why.empty() && (ch.offset != off_ || ch.bytes > ring_->slot_bytes() || ch.bytes > span_.bytes - off_ ||
                        (ch.bytes == 0 && span_.bytes != 0)))
      why = peer_.name + " sent a malformed chunk of segment " + std::to_string(s.received) + " (offset " +
            std::to_string(ch.offset) + ", " + std::to_string(ch.bytes) + " bytes)";
    if (!why.empty()) link_failure(s.ctx, ErrorKind::Mismatch, s.op, peer_.rank, why);
  }

  uint64_t tail_ = 0;    // chunks consumed (this rank owns the counter); runs on across collectives
  bool closed_ = false;  // EOF on the connection: fail once the published chunks are used up
};

}  // namespace

std::unique_ptr<End> shm_send_end(int fd, std::unique_ptr<ShmRing> ring, const LinkContext& ctx) {
  return std::make_unique<ShmSend>(Neighbour(fd, ctx.next_rank, ctx.next_address), std::move(ring));
}

std::unique_ptr<End> shm_recv_end(int fd, std::unique_ptr<ShmRing> ring, const LinkContext& ctx) {
  return std::make_unique<ShmRecv>(Neighbour(fd, ctx.prev_rank, ctx.prev_address), std::move(ring));
}

}  // namespace ering
