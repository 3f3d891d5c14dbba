// What every Links shares: the poison byte, giving up, failure messages, and watching
// the connections of another ring.
#include "links.h"

#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

namespace ering {

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

void give_up(std::atomic<bool>& poisoned, int next_fd, int prev_fd) {
  if (!poisoned.exchange(true)) {
    for (int fd : {next_fd, prev_fd})
      if (fd >= 0) send_poison(fd);
  }
  // shutdown(), not close(): safe while another thread is inside poll() on these fds,
  // and it sends FIN at once so both neighbours see EOF.
  if (next_fd >= 0) ::shutdown(next_fd, SHUT_RDWR);
  if (prev_fd >= 0) ::shutdown(prev_fd, SHUT_RDWR);
}

void link_failure(const LinkContext& ctx, ErrorKind kind, const OpInfo& op, int peer, const std::string& what) {
  std::string msg = op.describe + " failed at world version " + std::to_string(ctx.world_version) + " on rank " +
                    std::to_string(ctx.rank) + ": " + what;
  throw CommError(kind, msg, op.name, int64_t(ctx.world_version), ctx.rank, peer);
}

void link_lost(const LinkContext& ctx, const OpInfo& op, bool propagated, int peer, const std::string& name,
               const std::string& what) {
  if (propagated)
    link_failure(ctx, ErrorKind::Propagated, op, peer,
                 name + " gave up because of a failure elsewhere in the ring (it is alive; the failed rank is "
                        "further on)");
  link_failure(ctx, ErrorKind::PeerLost, op, peer, what);
}

void Links::check_alive(const OpInfo& op) { check_watched(connections(), nullptr, context(), op); }

size_t add_watched(const std::vector<WatchFd>& w, pollfd* out) {
  size_t n = std::min(w.size(), kMaxWatch);
  for (size_t i = 0; i < n; ++i) out[i] = {w[i].fd, short(POLLRDHUP | POLLPRI), 0};
  return n;
}

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
    link_lost(ctx, op, poisoned, w[i].peer, w[i].name,
              "connection to " + w[i].name + " (watched while this rank waits on another ring) closed "
                  "(peer exited or failed)");
  }
}

}  // namespace ering
