// Socket primitives: the abort eventfd, poll deadlines, whole-buffer I/O, ring addresses.
#include "transport/io.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "base/config.h"
#include "transport/fork_guard.h"

namespace ering {

// ---------------------------------------------------------------- AbortSignal

AbortSignal::AbortSignal() : fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  if (fd_ < 0) throw std::runtime_error(std::string("eventfd failed: ") + std::strerror(errno));
}
AbortSignal::~AbortSignal() { ::close(fd_); }
void AbortSignal::fire() {
  fired_.store(true, std::memory_order_release);
  uint64_t one = 1;
  // The counter is never read, so the fd stays readable for every later poll().
  ssize_t r = ::write(fd_, &one, sizeof(one));
  (void)r;
}

// ---------------------------------------------------------------- addresses

HostPort parse_address(const std::string& address) {
  std::string host, port;
  if (!address.empty() && address[0] == '[') {
    auto close = address.find(']');
    if (close == std::string::npos || close + 1 >= address.size() || address[close + 1] != ':')
      throw CommError(ErrorKind::Invalid, "invalid ring address '" + printable(address, 300) + "': expected [IPv6]:PORT");
    host = address.substr(1, close - 1);
    port = address.substr(close + 2);
  } else {
    auto colon = address.rfind(':');
    if (colon == std::string::npos || colon == 0)
      throw CommError(ErrorKind::Invalid, "invalid ring address '" + printable(address, 300) + "': expected HOST:PORT");
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
  }
  char* end = nullptr;
  long p = std::strtol(port.c_str(), &end, 10);
  if (port.empty() || *end != '\0' || p <= 0 || p > 65535)
    throw CommError(ErrorKind::Invalid, "invalid port in ring address '" + printable(address, 300) + "'");
  return {host, int(p)};
}

std::string peer_name(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
    return std::string("[") + host + "]:" + std::to_string(port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

// ---------------------------------------------------------------- waiting and I/O

int poll_ms_until(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return int(std::min<long long>(left + 1, 1000 * 1000));
}

void tune_ring_socket(int fd) {
  guard_from_fork(fd);  // every ring connection passes here, connected or accepted
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  // The default until a communicator takes the connection and sets its own: an accepted
  // connection parked or slotted for a ring not yet formed is still found dead by the kernel
  // (the listener replaces a slotted connection that ended).
  set_dead_link_timeout(fd, CommConfig().dead_link_timeout);
}

void set_dead_link_timeout(int fd, double seconds) {
  // A link that acknowledges nothing for this long is dead (a cable pulled, a firewall dropping
  // everything): the kernel fails the connection with ETIMEDOUT, so the ring fails in seconds
  // however long the collective timeout. Data in flight is bounded by TCP_USER_TIMEOUT; an idle
  // side (waiting to receive, its own data acknowledged) by keepalive probes: a third of the
  // time idle, then 4 probes a sixth apart. A live peer's kernel acknowledges both even while
  // its process is busy elsewhere.
  unsigned int ms = unsigned(seconds * 1000);
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof(ms));
  int one = 1, idle = std::max(1, int(seconds / 3)), interval = std::max(1, int(seconds / 6)), probes = 4;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
}

bool connection_ended(int fd) {
  pollfd p = {fd, short(POLLRDHUP), 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

int wait_fd(int fd, short events, Clock::time_point deadline, const AbortSignal& abort) {
  for (;;) {
    if (abort.fired()) return ECANCELED;
    pollfd p[2] = {{fd, events, 0}, {abort.fd(), POLLIN, 0}};
    int ms = poll_ms_until(deadline);
    if (ms == 0) return ETIMEDOUT;
    int r = poll(p, 2, ms);
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (p[1].revents) return ECANCELED;
    if (p[0].revents) return 0;
  }
}

int write_full(int fd, const uint8_t* buf, size_t n, Clock::time_point deadline, const AbortSignal& abort) {
  size_t done = 0;
  while (done < n) {
    ssize_t w = ::send(fd, buf + done, n - done, MSG_NOSIGNAL);
    if (w > 0) { done += size_t(w); continue; }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (int e = wait_fd(fd, POLLOUT, deadline, abort)) return e;
      continue;
    }
    return EPIPE;
  }
  return 0;
}

int read_full(int fd, uint8_t* buf, size_t n, Clock::time_point deadline, const AbortSignal& abort) {
  size_t done = 0;
  while (done < n) {
    ssize_t r = ::recv(fd, buf + done, n - done, 0);
    if (r > 0) { done += size_t(r); continue; }
    if (r == 0) return EPIPE;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (int e = wait_fd(fd, POLLIN, deadline, abort)) return e;
      continue;
    }
    return EPIPE;
  }
  return 0;
}

}  // namespace ering
