// The LINK exchange after an accepted handshake: how a link's data travels (TCP frames,
// or shared memory when both ends are on one host and the receiver can map the memory).
#include "transport/link_setup.h"

#include <unistd.h>

#include <cerrno>

#include "transport/handshake.h"
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

}  // namespace

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

}  // namespace ering
