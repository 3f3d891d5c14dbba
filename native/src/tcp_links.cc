// The TCP data plane: frames on non-blocking sockets, pipelined in both directions.
#include "tcp_links.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace ering {
namespace {

// While a run() keeps making progress it still looks at its watched connections this often.
constexpr auto kWatchEvery = std::chrono::milliseconds(2);

}  // namespace

namespace {
// The unsent (or unreceived) rest of a frame: the header's remainder, then the payload's.
int frame_rest(FrameHeader& hdr, Span payload, size_t done, iovec iov[2]) {
  int n = 0;
  if (done < sizeof(hdr)) iov[n++] = {reinterpret_cast<char*>(&hdr) + done, sizeof(hdr) - done};
  size_t pdone = done > sizeof(hdr) ? done - sizeof(hdr) : 0;
  if (payload.bytes > pdone) iov[n++] = {payload.ptr + pdone, payload.bytes - pdone};
  return n;
}
}  // namespace

ssize_t send_frame_part(int fd, const FrameHeader& hdr, Span payload, size_t done) {
  FrameHeader h = hdr;  // sendmsg only reads it
  iovec iov[2];
  msghdr mh{};
  mh.msg_iov = iov;
  mh.msg_iovlen = frame_rest(h, payload, done, iov);
  return ::sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
}

ssize_t recv_frame_part(int fd, FrameHeader& hdr, Span payload, size_t done, bool* poisoned) {
  iovec iov[2];
  msghdr mh{};
  mh.msg_iov = iov;
  mh.msg_iovlen = frame_rest(hdr, payload, done, iov);
  size_t want = 0;
  for (size_t k = 0; k < mh.msg_iovlen; ++k) want += iov[k].iov_len;
  ssize_t r = ::recvmsg(fd, &mh, MSG_DONTWAIT);
  if (r > 0 && size_t(r) < want && take_poison_at_mark(fd)) *poisoned = true;
  return r;
}

std::string frame_mismatch(const FrameHeader& h, const OpInfo& op, size_t index, size_t bytes,
                           const std::string& sender) {
  if (h.seq != op.seq || h.tag != op.tag)
    return sender + " is in a different collective (its operation #" + std::to_string(h.seq) +
           "; ranks must call the same collectives in the same order with the same dtype, op and size)";
  if (h.index != index || h.bytes != bytes)
    return sender + " sent segment " + std::to_string(h.index) + " of " + std::to_string(h.bytes) +
           " bytes, expected segment " + std::to_string(index) + " of " + std::to_string(bytes) +
           " bytes (buffer sizes differ between ranks?)";
  return "";
}

TcpLinks::TcpLinks(int next_fd, int prev_fd, LinkContext ctx, const AbortSignal* abort, double timeout_s)
    : next_fd_(next_fd), prev_fd_(prev_fd), ctx_(std::move(ctx)), abort_(abort), timeout_s_(timeout_s) {}

TcpLinks::~TcpLinks() {
  if (next_fd_ >= 0) ::close(next_fd_);
  if (prev_fd_ >= 0) ::close(prev_fd_);
}

void TcpLinks::shutdown() { give_up(poisoned_, next_fd_, prev_fd_); }

std::vector<WatchFd> TcpLinks::connections() const {
  return {{next_fd_, ctx_.next_rank, "rank " + std::to_string(ctx_.next_rank) + " (" + ctx_.next_address + ")"},
          {prev_fd_, ctx_.prev_rank, "rank " + std::to_string(ctx_.prev_rank) + " (" + ctx_.prev_address + ")"}};
}

void TcpLinks::lost(const OpInfo& op, int fd, int peer, const std::string& name, const std::string& what) {
  link_lost(ctx_, op, take_poison(fd) || (fd == prev_fd_ && prev_poisoned_), peer, name, what);
}

void TcpLinks::fail(ErrorKind kind, const OpInfo& op, int peer, const std::string& what) {
  link_failure(ctx_, kind, op, peer, what);
}

void TcpLinks::run(Plan& plan, const OpInfo& op) {
  const size_t nsend = plan.num_sends(), nrecv = plan.num_recvs();
  size_t si = 0, ri = 0;
  FrameHeader shdr{}, rhdr{};
  size_t soff = 0, roff = 0;  // bytes of the current frame (header + payload) already moved
  Span sspan{nullptr, 0}, rspan{nullptr, 0};
  if (nsend) { sspan = plan.send_span(0); shdr = {op.seq, op.tag, 0, sspan.bytes}; }
  if (nrecv) rspan = plan.recv_span(0);
  const auto timeout = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s_));
  auto deadline = Clock::now() + timeout;
  auto watched_at = Clock::now();
  const std::string next_name = "rank " + std::to_string(ctx_.next_rank) + " (" + ctx_.next_address + ")";
  const std::string prev_name = "rank " + std::to_string(ctx_.prev_rank) + " (" + ctx_.prev_address + ")";

  while (si < nsend || ri < nrecv) {
    if (abort_->fired()) fail(ErrorKind::Aborted, op, -1, "communicator aborted");
    bool progress = false;
    bool can_send = si < nsend && (plan.send_after(si) < 0 || size_t(plan.send_after(si)) < ri);
    if (can_send) {
      ssize_t w = send_frame_part(next_fd_, shdr, sspan, soff);
      if (w > 0) {
        soff += size_t(w);
        progress = true;
        if (soff == sizeof(shdr) + sspan.bytes) {
          ++si;
          soff = 0;
          if (si < nsend) { sspan = plan.send_span(si); shdr = {op.seq, op.tag, si, sspan.bytes}; }
        }
      } else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        lost(op, next_fd_, ctx_.next_rank, next_name, "connection to " + next_name + " lost: " + std::strerror(errno));
      }
    }
    if (ri < nrecv) {
      ssize_t r = recv_frame_part(prev_fd_, rhdr, rspan, roff, &prev_poisoned_);
      if (r == 0) {
        lost(op, prev_fd_, ctx_.prev_rank, prev_name, "connection to " + prev_name + " closed (peer exited or failed)");
      } else if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        lost(op, prev_fd_, ctx_.prev_rank, prev_name, "connection to " + prev_name + " lost: " + std::strerror(errno));
      } else if (r > 0) {
        size_t before = roff;
        roff += size_t(r);
        progress = true;
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
      }
    }
    if (progress) {
      auto now = Clock::now();
      deadline = now + timeout;
      if (!watch_.empty() && now - watched_at > kWatchEvery) {
        watched_at = now;
        check_watched(watch_, nullptr, ctx_, op);
      }
      continue;
    }
    // Nothing moved: sleep in poll() until a socket is ready, abort fires or the deadline passes.
    can_send = si < nsend && (plan.send_after(si) < 0 || size_t(plan.send_after(si)) < ri);
    pollfd fds[3 + kMaxWatch];
    fds[0] = {abort_->fd(), POLLIN, 0};
    // The next rank never sends on this connection, so readable means it closed.
    fds[1] = {next_fd_, short(si < nsend ? ((can_send ? POLLOUT : 0) | POLLIN | POLLRDHUP | POLLPRI) : 0), 0};
    // A neighbour that finished and closed may leave its marker ahead of data we still have
    // to read: it is taken when seen but only consulted if the stream ends early.
    fds[2] = {prev_fd_, short(ri < nrecv ? POLLIN | POLLPRI : 0), 0};
    int ms = poll_ms_until(deadline);
    if (ms == 0) {
      bool waiting_on_prev = ri < nrecv;
      fail(ErrorKind::Timeout, op, waiting_on_prev ? ctx_.prev_rank : ctx_.next_rank,
           "no progress for " + std::to_string(timeout_s_) + " s waiting on " +
               (waiting_on_prev ? prev_name : next_name) + " (hung, stopped or partitioned?)");
    }
    size_t nw = add_watched(watch_, fds + 3);
    int r = poll(fds, nfds_t(3 + nw), ms);
    if (r < 0 && errno != EINTR)
      fail(ErrorKind::PeerLost, op, -1, std::string("poll failed: ") + std::strerror(errno));
    if (fds[0].revents) fail(ErrorKind::Aborted, op, -1, "communicator aborted");
    if (r > 0 && nw) check_watched(watch_, fds + 3, ctx_, op);
    if ((fds[2].revents & POLLPRI) && take_poison(prev_fd_)) prev_poisoned_ = true;
    if (fds[1].revents & (POLLIN | POLLRDHUP | POLLHUP | POLLERR | POLLPRI))
      lost(op, next_fd_, ctx_.next_rank, next_name, "connection to " + next_name + " closed (peer exited or failed)");
  }
}

}  // namespace ering
