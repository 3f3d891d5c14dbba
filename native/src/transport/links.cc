// The one loop that drives both directions of a ring, and what every end shares: the
// poison byte, failure messages, and watching the connections of another ring.
#include "transport/links.h"

#include <poll.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace ering {
namespace {

// After this long without progress a waiter on shared memory stops spinning and sleeps in
// poll() until a doorbell, EOF, abort or its deadline. Short, because with more ranks than
// cores the peer it waits for may need this core.
constexpr auto kSpin = std::chrono::microseconds(50);
// While a run() keeps making progress it still looks at its watched connections this often.
constexpr auto kWatchEvery = std::chrono::milliseconds(2);

[[noreturn]] void lost(const LinkContext& ctx, const OpInfo& op, bool propagated, int peer, const std::string& name,
                       const std::string& what) {
  if (propagated)
    link_failure(ctx, ErrorKind::Propagated, op, peer,
                 name + " gave up because of a failure elsewhere in the ring (it is alive; the failed rank is "
                        "further on)");
  link_failure(ctx, ErrorKind::PeerLost, op, peer, what);
}

// Fills pollfd entries for the watched connections (FIN/RST and the urgent poison byte only).
size_t add_watched(const std::vector<WatchFd>& w, pollfd* out) {
  size_t n = std::min(w.size(), kMaxWatch);
  for (size_t i = 0; i < n; ++i) out[i] = {w[i].fd, short(POLLRDHUP | POLLPRI), 0};
  return n;
}

// Throws the op's CommError if a watched connection ended or carries the poison byte:
// `polled` from a poll() over add_watched()'s entries, or null to poll them now without waiting.
void check_watched(const std::vector<WatchFd>& w, const pollfd* polled, const LinkContext& ctx, const OpInfo& op) {
  if (w.empty()) return;
  pollfd now[kMaxWatch];
  size_t n = std::min(w.size(), kMaxWatch);
  if (!polled) {
    add_watched(w, now);
    if (poll(now, nfds_t(n), 0) <= 0) return;
    polled = now;
  }
  for (size_t i = 0; i < n; ++i) {
    short ev = polled[i].revents;
    if (!ev) continue;
    if (ev & POLLNVAL) continue;  // not this ring's business (cannot happen while the links live)
    bool poisoned = (ev & POLLPRI) && take_poison(w[i].fd);
    if (!poisoned && !(ev & (POLLRDHUP | POLLHUP | POLLERR))) continue;
    lost(ctx, op, poisoned, w[i].peer, w[i].name,
         "connection to " + w[i].name + " (watched while this rank waits on another ring) closed "
             "(peer exited or failed)");
  }
}

}  // namespace

// ---------------------------------------------------------------- the poison byte

// One TCP urgent (out-of-band) byte sent before the FIN: it does not disturb the data
// stream, and it tells a neighbour that this rank is alive and gave up because of a
// failure elsewhere, so the neighbour does not blame it.
constexpr char kPoisonByte = 'P';

void send_poison(int fd) {
  if (::send(fd, &kPoisonByte, 1, MSG_OOB | MSG_DONTWAIT | MSG_NOSIGNAL) == 1 || errno != EAGAIN) return;
  // The send buffer is full of data the neighbour has not read yet: make room for one more
  // byte so the marker queues behind it (SO_SNDBUFFORCE needs CAP_NET_ADMIN; without it the
  // neighbour may report this live rank as lost: a wrong name, never a missed failure).
  int cur = 0;
  socklen_t len = sizeof(cur);
  if (getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &cur, &len) != 0) return;
  int want = cur / 2 + (64 << 10);  // the kernel doubles what it is given
  if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &want, sizeof(want)) != 0) return;
  ssize_t w = ::send(fd, &kPoisonByte, 1, MSG_OOB | MSG_DONTWAIT | MSG_NOSIGNAL);
  (void)w;
}

bool take_poison(int fd) {
  char b = 0;
  return ::recv(fd, &b, 1, MSG_OOB | MSG_DONTWAIT) == 1 && b == kPoisonByte;
}

bool take_poison_at_mark(int fd) {
  int at_mark = 0;
  if (ioctl(fd, SIOCATMARK, &at_mark) != 0 || !at_mark) return false;
  // Only the poison is ever sent urgent, so the mark alone says so, even while the byte
  // itself has not arrived yet (it would then be dropped by the read that passes it).
  take_poison(fd);
  return true;
}

// ---------------------------------------------------------------- failures

void link_failure(const LinkContext& ctx, ErrorKind kind, const OpInfo& op, int peer, const std::string& what) {
  std::string msg = op.describe + " failed at world version " + std::to_string(ctx.world_version) + " on rank " +
                    std::to_string(ctx.rank) + ": " + what;
  throw CommError(kind, msg, op.name, int64_t(ctx.world_version), ctx.rank, peer);
}

std::string segment_mismatch(uint32_t seq, uint32_t tag, uint64_t index, uint64_t bytes, const OpInfo& op,
                             size_t want_index, size_t want_bytes, const std::string& sender) {
  const uint32_t want_tag = op.recv_tag >= 0 ? uint32_t(op.recv_tag) : op.tag;
  if (seq != op.seq || (tag != want_tag && op.recv_tag < 0))
    return sender + " is in a different collective (its operation #" + std::to_string(seq) +
           "; ranks must call the same collectives in the same order with the same dtype, op and size)";
  if (tag != want_tag)
    return sender + " sends another number of bytes than this rank receives in " + op.name + " #" +
           std::to_string(seq) + " (a receiver must expect exactly what its sender sends)";
  if (index != want_index || bytes != want_bytes)
    return sender + " sent segment " + std::to_string(index) + " of " + std::to_string(bytes) +
           " bytes, expected segment " + std::to_string(want_index) + " of " + std::to_string(want_bytes) +
           " bytes (buffer sizes differ between ranks?)";
  return "";
}

std::string rank_name(int rank, const std::string& address) {
  return "rank " + std::to_string(rank) + " (" + address + ")";
}

Neighbour::Neighbour(int fd, int rank, const std::string& address)
    : fd(fd), rank(rank), name(rank_name(rank, address)) {}

void Neighbour::closed(const RunState& s) {
  // An ended connection with a pending error (reset, or the kernel gave up on it) says why.
  int err = 0;
  socklen_t len = sizeof(err);
  if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err != 0) broke(s, err);
  lost(s.ctx, s.op, poisoned || take_poison(fd), rank, name, "connection to " + name + " closed (peer exited or failed)");
}

void Neighbour::broke(const RunState& s, int err) {
  std::string why = std::strerror(err);
  if (err == ETIMEDOUT) {
    char took[32];
    std::snprintf(took, sizeof(took), "%g", s.ctx.dead_link_timeout_s);
    why += std::string(" (nothing sent on it was acknowledged for ") + took +
           " s, CommConfig.dead_link_timeout: the link between the two is down)";
  }
  lost(s.ctx, s.op, poisoned || take_poison(fd), rank, name, "connection to " + name + " lost: " + why);
}

End::~End() {
  if (peer_.fd >= 0) ::close(peer_.fd);
}

void End::start(RunState& s) {
  off_ = 0;
  if (dir_ == Send && s.nsend) span_ = s.plan.send_span(0);
  if (dir_ == Recv && s.nrecv) span_ = s.plan.recv_span(0);
}

void End::next_segment(RunState& s) {
  off_ = 0;
  if (dir_ == Send && ++s.sent < s.nsend) span_ = s.plan.send_span(s.sent);
  if (dir_ == Recv && ++s.received < s.nrecv) span_ = s.plan.recv_span(s.received);
}

// ---------------------------------------------------------------- Links

Links::Links(std::unique_ptr<End> send, std::unique_ptr<End> recv, LinkContext ctx, const AbortSignal* abort)
    : send_(std::move(send)), recv_(std::move(recv)), ctx_(std::move(ctx)), abort_(abort) {}

void Links::shutdown() {
  const int next_fd = send_->peer().fd, prev_fd = recv_->peer().fd;
  if (!poisoned_.exchange(true)) {
    send_poison(next_fd);
    send_poison(prev_fd);
  }
  // shutdown(), not close(): safe while another thread is inside poll() on these fds,
  // and it sends FIN at once so both neighbours see EOF.
  ::shutdown(next_fd, SHUT_RDWR);
  ::shutdown(prev_fd, SHUT_RDWR);
}

std::vector<WatchFd> Links::connections() const {
  return {{send_->peer().fd, send_->peer().rank, send_->peer().name},
          {recv_->peer().fd, recv_->peer().rank, recv_->peer().name}};
}

void Links::check_alive(const OpInfo& op) {
  try {
    check_watched(connections(), nullptr, ctx_, op);
  } catch (CommError& e) {
    if (e.kind != ErrorKind::Aborted && e.kind != ErrorKind::Invalid && abort_->fired())
      link_failure(ctx_, ErrorKind::Aborted, op, -1, "communicator aborted");
    throw;
  }
}

void Links::run(Plan& plan, const OpInfo& op) {
  try {
    run_plan(plan, op);
  } catch (CommError& e) {
    if (e.kind != ErrorKind::Aborted && e.kind != ErrorKind::Invalid && abort_->fired())
      link_failure(ctx_, ErrorKind::Aborted, op, -1, "communicator aborted");
    throw;
  }
}

void Links::run_plan(Plan& plan, const OpInfo& op) {
  RunState s{plan, op, ctx_, plan.num_sends(), plan.num_recvs()};
  send_->start(s);
  recv_->start(s);
  const bool spin = send_->spins() || recv_->spins();
  // Not moved by progress: a byte a neighbour sends says nothing about the rank that is
  // missing further round the ring, so a "no progress" deadline would fire at different
  // times on different ranks, paths and world sizes. The collective's own deadline does not.
  const auto deadline = op.deadline;
  auto idle_since = Clock::time_point{};
  auto watched_at = Clock::now();
  while (s.sent < s.nsend || s.received < s.nrecv) {
    if (abort_->fired()) link_failure(ctx_, ErrorKind::Aborted, op, -1, "communicator aborted");
    bool progress = send_->move(s);
    if (s.received < s.nrecv) progress |= recv_->move(s);
    if (progress) {
      auto now = Clock::now();
      idle_since = Clock::time_point{};
      if (!watch_.empty() && now - watched_at > kWatchEvery) {
        watched_at = now;
        check_watched(watch_, nullptr, ctx_, op);
      }
      continue;
    }
    if (spin) {
      auto now = Clock::now();
      if (idle_since == Clock::time_point{}) idle_since = now;
      if (now - idle_since < kSpin) {
        sched_yield();
        continue;
      }
    }
    // Both ends arm, then look once more: a peer that publishes in between either sees the
    // flag (and rings) or is seen here.
    bool ready = send_->arm(s);
    ready = recv_->arm(s) || ready;
    if (!ready) sleep(s, deadline);
    send_->disarm();
    recv_->disarm();
    idle_since = Clock::time_point{};  // spin again briefly after every wake-up
  }
}

void Links::sleep(RunState& s, Clock::time_point deadline) {
  pollfd fds[3 + kMaxWatch];
  // An end with nothing more to move in this operation is left out (a negative fd): poll()
  // reports POLLHUP and POLLERR even for no events, and a neighbour that finished its part
  // and closed (reset by a doorbell it never read) is no failure of an operation that needs
  // nothing more from it. Were it gone too early, the end that still waits on it says so.
  const short send_events = send_->events(s), recv_events = recv_->events(s);
  fds[0] = {abort_->fd(), POLLIN, 0};
  fds[1] = {send_events ? send_->peer().fd : -1, send_events, 0};
  fds[2] = {recv_events ? recv_->peer().fd : -1, recv_events, 0};
  int ms = poll_ms_until(deadline);
  if (ms == 0) {
    const Neighbour& waited = s.received < s.nrecv ? recv_->peer() : send_->peer();
    char secs[32];
    std::snprintf(secs, sizeof(secs), "%g", s.op.timeout_s);
    link_failure(ctx_, ErrorKind::Timeout, s.op, waited.rank,
                 std::string("not finished ") + secs + " s after this rank entered it (the collective timeout, "
                     "ELASTIC_COLLECTIVE_TIMEOUT): waiting on " + waited.name +
                     " (not in this collective: busy elsewhere, or hung, stopped or partitioned)");
  }
  size_t nw = add_watched(watch_, fds + 3);
  int r = poll(fds, nfds_t(3 + nw), ms);
  if (r < 0 && errno != EINTR)
    link_failure(ctx_, ErrorKind::PeerLost, s.op, -1, std::string("poll failed: ") + std::strerror(errno));
  if (fds[0].revents) link_failure(ctx_, ErrorKind::Aborted, s.op, -1, "communicator aborted");
  if (r > 0 && nw) check_watched(watch_, fds + 3, ctx_, s.op);
  // The receiving end first: it only takes note (a poison byte that must be read before the
  // stream's end is seen), while the sending end may fail the operation.
  if (recv_events) recv_->polled(fds[2].revents, s);
  if (send_events) send_->polled(fds[1].revents, s);
}

}  // namespace ering
