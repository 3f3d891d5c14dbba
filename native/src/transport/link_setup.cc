// Forming rings: the handshakes, the LINK exchange after each (how a link's data travels:
// TCP frames, or shared memory when both ends are on one host and the receiver can map the
// memory), and the ends and Links built on them.
#include "transport/link_setup.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <deque>

#include "transport/connect.h"
#include "transport/shm_links.h"
#include "transport/tcp_links.h"
#include "transport/wire.h"

namespace ering {
namespace {

constexpr uint8_t kModeTcp = 0, kModeShm = 1;
constexpr size_t kOfferBody = 1 + 4 + 4 + 8 + 16;

// The neighbour at the other end of a link's connection, as forming errors name it.
struct Peer {
  const LinkContext& ctx;
  int rank;
  std::string name;
  CommError error(ErrorKind kind, const std::string& what) const {
    return form_error(kind, ctx.world_version, ctx.rank, rank, what);
  }
  [[noreturn]] void io_failed(int e) const {
    if (e == ECANCELED) throw error(ErrorKind::Aborted, "aborted while setting up the link with " + name);
    if (e == ETIMEDOUT) throw error(ErrorKind::Timeout, "no link set-up from " + name + " before the deadline");
    throw error(ErrorKind::PeerLost, name + " closed the connection while setting up the link");
  }
};

Peer next_peer(const LinkContext& ctx) { return {ctx, ctx.next_rank, rank_name(ctx.next_rank, ctx.next_address)}; }
Peer prev_peer(const LinkContext& ctx) { return {ctx, ctx.prev_rank, rank_name(ctx.prev_rank, ctx.prev_address)}; }

// Reads one handshake-framed message of the given type.
std::vector<uint8_t> read_msg(int fd, MsgType want, const Peer& peer, Clock::time_point deadline,
                              const AbortSignal& abort) {
  uint8_t hdr[kHeaderBytes];
  if (int e = read_full(fd, hdr, sizeof(hdr), deadline, abort)) peer.io_failed(e);
  MsgHeader h{};
  std::string why;
  if (!decode_header(hdr, &h, &why) || h.type != want)
    throw peer.error(ErrorKind::Refused, peer.name + " sent a malformed link set-up" + (why.empty() ? "" : ": " + why));
  std::vector<uint8_t> body(h.body_len);
  if (int e = read_full(fd, body.data(), body.size(), deadline, abort)) peer.io_failed(e);
  return body;
}

void write_msg(int fd, MsgType type, const std::vector<uint8_t>& body, const Peer& peer, Clock::time_point deadline,
               const AbortSignal& abort) {
  auto msg = encode_message(type, Status::Ok, body);
  if (int e = write_full(fd, msg.data(), msg.size(), deadline, abort)) peer.io_failed(e);
}

// The sender's (connector's) side of LINK, sent right after its handshake: shared memory
// (a sealed memfd, created here) or TCP. Returns the offered memory, or null.
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
  write_msg(fd, MsgType::Link, body, next_peer(ctx), deadline, abort);
  return ring;
}

// The sender's LINK_ACK, awaited after it answered its own predecessor's LINK: the offered
// memory if the receiver mapped it, null for TCP.
std::unique_ptr<ShmRing> finish_link(int fd, std::unique_ptr<ShmRing> offered, const LinkContext& ctx,
                                     Clock::time_point deadline, const AbortSignal& abort) {
  const Peer next = next_peer(ctx);
  auto body = read_msg(fd, MsgType::LinkAck, next, deadline, abort);
  if (body.size() != 1 || body[0] > kModeShm || (body[0] == kModeShm && !offered))
    throw next.error(ErrorKind::Refused, next.name + " sent a malformed link acknowledgement");
  if (body[0] != kModeShm) return nullptr;
  offered->close_fd();  // the receiver holds its own mapping now
  return offered;
}

// The receiver's (acceptor's) side: reads LINK, maps the sender's memory if offered and
// wanted, answers LINK_ACK. Returns the mapped memory, or null for TCP.
std::unique_ptr<ShmRing> accept_link(int fd, const LinkSettings& s, const LinkContext& ctx, Clock::time_point deadline,
                                     const AbortSignal& abort) {
  const Peer prev = prev_peer(ctx);
  auto body = read_msg(fd, MsgType::Link, prev, deadline, abort);
  if (body.empty() || body[0] > kModeShm || (body[0] == kModeShm && body.size() != kOfferBody) ||
      (body[0] == kModeTcp && body.size() != 1))
    throw prev.error(ErrorKind::Refused, prev.name + " sent a malformed link set-up");
  std::unique_ptr<ShmRing> ring;
  if (body[0] == kModeShm && s.want_shm) {
    std::string why;
    ring = ShmRing::open(get_u32(&body[1]), get_u32(&body[5]), get_u64(&body[9]), &body[17], ctx.world_version,
                         uint32_t(ctx.prev_rank), uint32_t(ctx.rank), &why);
    if (!ring) {
      // Same host name but no shared memory (e.g. another container): TCP still works.
      std::string line = "elastic-ring: rank " + std::to_string(ctx.rank) + ": no shared memory with " + prev.name + " (" +
                         why + "); this link uses TCP\n";
      ssize_t w = ::write(2, line.data(), line.size());
      (void)w;
    }
  }
  write_msg(fd, MsgType::LinkAck, {ring ? kModeShm : kModeTcp}, prev, deadline, abort);
  return ring;
}

// One ring while it forms: its connections, and the shared memory of each direction.
struct Pending {
  explicit Pending(const RingToForm& r) : ring(r) {}
  Pending(const Pending&) = delete;
  Pending& operator=(const Pending&) = delete;
  const RingToForm& ring;
  int next_fd = -1, prev_fd = -1;
  std::unique_ptr<ShmRing> offered, send_memory, recv_memory;
  ~Pending() {
    if (next_fd >= 0) ::close(next_fd);
    if (prev_fd >= 0) ::close(prev_fd);
  }
};

// This rank's HELLO on the ring's channel, with a fresh nonce.
Hello hello_for(const RingToForm& ring, const Forming& how) {
  Hello h;
  h.job_id = how.job_id;
  h.world_version = how.world_version;
  h.from_rank = uint32_t(how.rank);
  h.to_rank = uint32_t(ring.ctx.next_rank);
  h.world_size = uint32_t(how.world_size);
  h.world_digest = how.world_digest;
  h.channel = ring.channel;
  random_bytes(h.nonce.data(), h.nonce.size());
  return h;
}

// Each direction runs over shared memory if its LINK settled on it, else over TCP; the ends
// own the connections from here on.
std::unique_ptr<Links> links_of(Pending& p, const Forming& how) {
  const LinkContext& ctx = p.ring.ctx;
  auto send = p.send_memory ? shm_send_end(p.next_fd, std::move(p.send_memory), ctx) : tcp_send_end(p.next_fd, ctx);
  p.next_fd = -1;
  auto recv = p.recv_memory ? shm_recv_end(p.prev_fd, std::move(p.recv_memory), ctx) : tcp_recv_end(p.prev_fd, ctx);
  p.prev_fd = -1;
  return std::make_unique<Links>(std::move(send), std::move(recv), ctx, how.abort);
}

}  // namespace

void form_rings(const std::vector<RingToForm>& rings, const Forming& how, const AbortSignal& stop,
                const AbortSignal& linking_stop, const std::function<void(size_t, std::unique_ptr<Links>)>& formed) {
  std::deque<Pending> pending;  // closes what it still holds if forming fails
  for (auto& r : rings) pending.emplace_back(r);
  // A neighbour that accepts no connection for the collective timeout (at most
  // kUnreachableAfterMaxS) is not coming: give up on it then, even if the deadline is later.
  const auto unreachable_after = seconds(std::min(how.collective_timeout, kUnreachableAfterMaxS));
  for (auto& p : pending) {
    p.next_fd = connect_ring_peer(p.ring.next_address, hello_for(p.ring, how), how.secret, how.deadline,
                                  unreachable_after, stop);
    set_dead_link_timeout(p.next_fd, how.dead_link_timeout);
    p.offered = offer_link(p.next_fd, p.ring.send, p.ring.ctx, how.deadline, stop);
  }
  for (auto& p : pending) {
    p.prev_fd = how.listener->take(how.world_version, how.deadline, stop, how.rank, p.ring.ctx.prev_rank,
                                   p.ring.channel);
    set_dead_link_timeout(p.prev_fd, how.dead_link_timeout);
    p.recv_memory = accept_link(p.prev_fd, p.ring.recv, p.ring.ctx, how.deadline, linking_stop);
  }
  for (size_t i = 0; i < pending.size(); ++i) {
    Pending& p = pending[i];
    p.send_memory = finish_link(p.next_fd, std::move(p.offered), p.ring.ctx, how.deadline, linking_stop);
    formed(i, links_of(p, how));
  }
}

// ---------------------------------------------------------------- WatchWhileForming

WatchWhileForming::WatchWhileForming(std::vector<WatchFd> fds, int sender_side_fd, const AbortSignal& outer)
    : thread_([this, fds = std::move(fds), sender_side_fd, &outer]() mutable {
        watch(std::move(fds), sender_side_fd, outer);
      }) {}

WatchWhileForming::~WatchWhileForming() {
  done_.fire();
  thread_.join();
}

void WatchWhileForming::watch(std::vector<WatchFd> fds, int sender_side_fd, const AbortSignal& outer) {
  std::vector<pollfd> p = {{done_.fd(), POLLIN, 0}, {outer.fd(), POLLIN, 0}};
  for (auto& w : fds) p.push_back({w.fd, short(POLLRDHUP | POLLPRI), 0});
  // No deadline of its own: the forming it guards has one, and its end (done_) ends this.
  for (;;) {
    if (poll(p.data(), nfds_t(p.size()), -1) < 0) {
      if (errno == EINTR) continue;
      any.fire();  // cannot watch: stop the waits (the caller names the cause if there is one)
      sender_side.fire();
      return;
    }
    if (p[0].revents) return;
    if (p[1].revents) {
      any.fire();
      sender_side.fire();
      return;
    }
    for (size_t i = 2; i < p.size(); ++i) {
      if (!p[i].revents) continue;
      any.fire();
      if (p[i].fd == sender_side_fd) {
        sender_side.fire();
        return;
      }
      p[i].fd = -1;  // told once (poll() skips it now); keep watching the other
    }
  }
}

}  // namespace ering
