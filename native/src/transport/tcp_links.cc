// The TCP ends: frames on non-blocking sockets, moved with sendmsg/recvmsg a piece at a time.
#include "transport/tcp_links.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>

namespace ering {
namespace {

bool would_block(int e) { return e == EAGAIN || e == EWOULDBLOCK || e == EINTR; }

// The unmoved rest of a frame, `done` bytes of which moved: the header's remainder, then
// the payload's.
msghdr frame_rest(FrameHeader& hdr, Span payload, size_t done, iovec iov[2]) {
  msghdr mh{};
  mh.msg_iov = iov;
  if (done < sizeof(hdr)) iov[mh.msg_iovlen++] = {reinterpret_cast<char*>(&hdr) + done, sizeof(hdr) - done};
  size_t pdone = done > sizeof(hdr) ? done - sizeof(hdr) : 0;
  if (payload.bytes > pdone) iov[mh.msg_iovlen++] = {payload.ptr + pdone, payload.bytes - pdone};
  return mh;
}

// Frames to the next rank, which never sends on this connection: anything readable on it
// (data, FIN, RST, the poison byte) means it closed.
class TcpSend : public End {
 public:
  explicit TcpSend(Neighbour next) : End(Send, std::move(next)) {}
  const char* kind() const override { return "tcp"; }

  bool move(RunState& s) override {
    if (!s.may_send()) return false;
    if (off_ == 0) hdr_ = {s.op.seq, s.op.tag, s.sent, span_.bytes};
    iovec iov[2];
    msghdr mh = frame_rest(hdr_, span_, off_, iov);
    ssize_t w = ::sendmsg(peer_.fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0 && !would_block(errno)) peer_.broke(s, errno);
    if (w <= 0) return false;
    off_ += size_t(w);
    if (off_ == sizeof(hdr_) + span_.bytes) next_segment(s);
    return true;
  }

  short events(const RunState& s) const override {
    return more(s) ? short((s.may_send() ? POLLOUT : 0) | POLLIN | POLLRDHUP | POLLPRI) : 0;
  }

  void polled(short revents, RunState& s) override {
    if (revents & (POLLIN | POLLRDHUP | POLLHUP | POLLERR | POLLPRI)) peer_.closed(s);
  }

 private:
  FrameHeader hdr_{};
};

// Frames from the previous rank, landing in the plan's recv_span().
class TcpRecv : public End {
 public:
  explicit TcpRecv(Neighbour prev) : End(Recv, std::move(prev)) {}
  const char* kind() const override { return "tcp"; }

  bool move(RunState& s) override {
    iovec iov[2];
    msghdr mh = frame_rest(hdr_, span_, off_, iov);
    size_t want = 0;
    for (size_t k = 0; k < mh.msg_iovlen; ++k) want += iov[k].iov_len;
    ssize_t r = ::recvmsg(peer_.fd, &mh, MSG_DONTWAIT);
    if (r == 0) peer_.closed(s);
    if (r < 0) {
      if (!would_block(errno)) peer_.broke(s, errno);
      return false;
    }
    // Linux stops a read at the urgent mark and drops the urgent byte on the next read past
    // it: when this read stopped there, the poison byte is taken now.
    if (size_t(r) < want && take_poison_at_mark(peer_.fd)) peer_.poisoned = true;
    size_t before = off_;
    off_ += size_t(r);
    if (before < sizeof(hdr_) && off_ >= sizeof(hdr_)) {
      std::string why = segment_mismatch(hdr_.seq, hdr_.tag, hdr_.index, hdr_.bytes, s.op, s.received, span_.bytes,
                                         peer_.name);
      if (!why.empty()) link_failure(s.ctx, ErrorKind::Mismatch, s.op, peer_.rank, why);
    }
    if (off_ == sizeof(hdr_) + span_.bytes) {
      s.plan.received(s.received);
      next_segment(s);
    }
    return true;
  }

  // A neighbour that finished and closed may leave its marker ahead of data still to be
  // read: it is taken when seen but only consulted if the stream ends early.
  short events(const RunState& s) const override { return more(s) ? short(POLLIN | POLLPRI) : 0; }

  void polled(short revents, RunState& s) override {
    if ((revents & POLLPRI) && take_poison(peer_.fd)) peer_.poisoned = true;
  }

 private:
  FrameHeader hdr_{};
};

}  // namespace

std::unique_ptr<End> tcp_send_end(int fd, const LinkContext& ctx) {
  return std::make_unique<TcpSend>(Neighbour(fd, ctx.next_rank, ctx.next_address));
}

std::unique_ptr<End> tcp_recv_end(int fd, const LinkContext& ctx) {
  return std::make_unique<TcpRecv>(Neighbour(fd, ctx.prev_rank, ctx.prev_address));
}

}  // namespace ering
