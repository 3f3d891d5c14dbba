// TCP sockets for the ring: listener + handshake thread, connector, framed pipelined exchange.
#include "transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

namespace ering {
namespace {

constexpr size_t kMaxPending = 128;
constexpr size_t kMaxRefusalLog = 64;
// Refusal lines on stderr per second; a flood of strays then costs one summary line a second.
constexpr int kLogLines = 5;
constexpr auto kLogWindow = std::chrono::seconds(1);
// A parked HELLO waits this long for its world version before it is told NOT_READY
// and has to reconnect; long enough for any rendezvous to settle.
constexpr double kParkSeconds = 30.0;
// While a run() keeps making progress it still looks at its watched connections this often.
constexpr auto kWatchEvery = std::chrono::milliseconds(2);

std::string errno_text(int e) { return std::strerror(e); }

int poll_ms_until(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return int(std::min<long long>(left + 1, 1000 * 1000));
}

void tune_ring_socket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
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

// True when the other end of a connection closed or reset it (looked at without waiting).
bool connection_ended(int fd) {
  pollfd p = {fd, short(POLLRDHUP), 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

// Blocking-style I/O on a non-blocking socket for the connector's handshake, bounded
// by a deadline and the abort signal. Returns 0 on success, or an errno-like code:
// ETIMEDOUT, ECANCELED (abort), EPIPE (peer closed).
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

}  // namespace

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

namespace {

// Sleeps for a retry backoff, waking early on abort.
void backoff_sleep(int ms, const AbortSignal& abort) {
  pollfd p = {abort.fd(), POLLIN, 0};
  poll(&p, 1, ms);
}

}  // namespace

// ---------------------------------------------------------------- AbortSignal

AbortSignal::AbortSignal() : fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  if (fd_ < 0) throw std::runtime_error("eventfd failed: " + errno_text(errno));
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

// ---------------------------------------------------------------- Listener

struct Listener::Pending {
  int fd = -1;
  std::string peer;
  Clock::time_point deadline;
  // ReadHello -> (WaitActive ->) ReadProof -> (Parked ->) delivered or refused
  enum State { ReadHello, WaitActive, ReadProof, Parked } state = ReadHello;
  bool authenticated = false;
  std::vector<uint8_t> buf;
  size_t have = 0;
  bool header_done = false;
  MsgHeader header{};
  Hello hello;
  std::vector<uint8_t> hello_body;
  std::array<uint8_t, kNonceBytes> nonce{};
};

namespace {
Clock::time_point after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}
}  // namespace

Listener::Listener(const std::string& host, int port, double handshake_timeout_s)
    : host_(host), handshake_timeout_s_(handshake_timeout_s) {
  if (port < 0 || port > 65535) throw CommError(ErrorKind::Invalid, "invalid listen port " + std::to_string(port));
  if (!(handshake_timeout_s > 0)) throw CommError(ErrorKind::Invalid, "handshake timeout must be positive");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  std::string port_s = std::to_string(port);
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port_s.c_str(), &hints, &res);
  if (rc != 0) throw CommError(ErrorKind::Invalid, "cannot resolve listen host '" + host + "': " + gai_strerror(rc));
  std::string last_error = "no address";
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) { last_error = errno_text(errno); continue; }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) {
      listen_fd_ = fd;
      break;
    }
    last_error = errno_text(errno);
    ::close(fd);
  }
  freeaddrinfo(res);
  if (listen_fd_ < 0)
    throw CommError(ErrorKind::Invalid, "cannot listen on " + host + ":" + port_s + ": " + last_error);
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len);
  port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                         : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  ready_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  thread_ = std::thread([this] { loop(); });
}

Listener::~Listener() {
  stop_.store(true);
  wake();
  if (thread_.joinable()) thread_.join();
  for (int fd : slot_fd_)
    if (fd >= 0) ::close(fd);
  ::close(listen_fd_);
  ::close(wake_fd_);
  ::close(ready_fd_);
}

void Listener::wake() {
  uint64_t one = 1;
  ssize_t r = ::write(wake_fd_, &one, sizeof(one));
  (void)r;
}

std::string Listener::address() const {
  std::string h = host_.empty() ? "0.0.0.0" : host_;
  if (h.find(':') != std::string::npos) return "[" + h + "]:" + std::to_string(port_);
  return h + ":" + std::to_string(port_);
}

void Listener::expect(const Expectation& e) {
  {
    std::lock_guard<std::mutex> g(mu_);
    expect_ = e;
    close_slots_locked(false, e.world_version);
  }
  wake();
}

void Listener::close_slots_locked(bool all, uint64_t keep_version) {
  for (size_t c = 0; c < kChannels; ++c) {
    if (slot_fd_[c] >= 0 && (all || slot_version_[c] != keep_version)) {
      ::close(slot_fd_[c]);
      slot_fd_[c] = -1;
    }
  }
}

void Listener::retire(uint64_t world_version) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!expect_.active || expect_.world_version != world_version) return;
    expect_.retired = true;
    close_slots_locked(true, 0);
  }
  wake();
}

int Listener::take(uint64_t world_version, Clock::time_point deadline, const AbortSignal& abort, int rank,
                   int prev_rank, uint8_t channel) {
  if (channel >= kChannels) throw CommError(ErrorKind::Invalid, "unknown ring channel " + std::to_string(channel));
  for (;;) {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (slot_fd_[channel] >= 0 && slot_version_[channel] == world_version) {
        int fd = slot_fd_[channel];
        slot_fd_[channel] = -1;
        expect_.connected[channel] = true;
        return fd;
      }
    }
    if (abort.fired())
      throw CommError(ErrorKind::Aborted, "forming world version " + std::to_string(world_version) + " aborted",
                      "form", int64_t(world_version), rank, prev_rank);
    int ms = poll_ms_until(deadline);
    if (ms == 0)
      throw CommError(ErrorKind::Timeout,
                      "form (world version " + std::to_string(world_version) + ", rank " + std::to_string(rank) +
                          "): " + channel_name(channel) + " predecessor rank " + std::to_string(prev_rank) +
                          " did not connect before the deadline",
                      "form", int64_t(world_version), rank, prev_rank);
    pollfd p[2] = {{ready_fd_, POLLIN, 0}, {abort.fd(), POLLIN, 0}};
    if (poll(p, 2, ms) > 0 && p[0].revents) {
      uint64_t v;
      ssize_t r = ::read(ready_fd_, &v, sizeof(v));
      (void)r;
    }
  }
}

std::vector<std::string> Listener::refusals() {
  std::lock_guard<std::mutex> g(mu_);
  return {refusals_.begin(), refusals_.end()};
}

void Listener::record_refusal(const std::string& peer, const std::string& reason) {
  // Every peer-supplied string in `reason` went through printable(), so the line is one line.
  std::string line = "refused ring connection from " + peer + ": " + reason;
  {
    std::lock_guard<std::mutex> g(mu_);
    refusals_.push_back(line);
    if (refusals_.size() > kMaxRefusalLog) refusals_.pop_front();
  }
  refusal_count_.fetch_add(1);
  log_line(line);
}

void Listener::log_line(const std::string& line) {
  // An operator sees strays and stale workers on stderr without enabling anything, and a
  // flood of them cannot fill the disk or bury everything else.
  auto now = Clock::now();
  if (now - log_window_ >= kLogWindow) {
    flush_suppressed();
    log_window_ = now;
    log_lines_ = 0;
  }
  if (log_lines_ >= kLogLines) {
    ++log_suppressed_;
    return;
  }
  ++log_lines_;
  std::string out = "elastic-ring: " + line + "\n";
  ssize_t r = ::write(2, out.data(), out.size());
  (void)r;
}

void Listener::flush_suppressed() {
  if (!log_suppressed_) return;
  std::string out = "elastic-ring: suppressed " + std::to_string(log_suppressed_) +
                    " more refused ring connections on " + address() + " (at most " + std::to_string(kLogLines) +
                    " lines a second; Listener.refusals() keeps the latest " + std::to_string(kMaxRefusalLog) + ")\n";
  ssize_t r = ::write(2, out.data(), out.size());
  (void)r;
  log_suppressed_ = 0;
}

void Listener::close_pending(Pending& p) {
  ::close(p.fd);
  p.fd = -1;
}

void Listener::refuse(Pending& p, Refusal code, const std::string& told, const std::string& logged) {
  // Recorded before answering, so the refusal is on record once the peer hears of it.
  record_refusal(p.peer, logged.empty() ? told : logged);
  if (!told.empty()) {
    // Only after a PROOF (checked or not) is there a transcript to sign; the MAC proves the
    // secret only to a connector that proved it first.
    std::string secret;
    if (p.authenticated) {
      std::lock_guard<std::mutex> g(mu_);
      secret = expect_.secret;
    }
    auto body = encode_refusal(p.authenticated ? &secret : nullptr, p.hello_body, p.nonce.data(), code, told);
    auto msg = encode_message(MsgType::Result, Status::Refused, body);
    ssize_t w = ::send(p.fd, msg.data(), msg.size(), MSG_NOSIGNAL);
    (void)w;
  }
  close_pending(p);
}

void Listener::send_ack(Pending& p) {
  random_bytes(p.nonce.data(), p.nonce.size());
  auto msg = encode_message(MsgType::Ack, Status::Ok, std::vector<uint8_t>(p.nonce.begin(), p.nonce.end()));
  if (::send(p.fd, msg.data(), msg.size(), MSG_NOSIGNAL) != ssize_t(msg.size())) {
    close_pending(p);
    return;
  }
  p.state = Pending::ReadProof;
  p.buf.assign(kHeaderBytes, 0);
  p.have = 0;
  p.header_done = false;
  p.deadline = after(handshake_timeout_s_);
}

// Called once the peer is authenticated, and again for parked peers when the expectation moves.
void Listener::decide(Pending& p) {
  std::unique_lock<std::mutex> g(mu_);
  Expectation e = expect_;
  std::string reason;
  Refusal code = Refusal::NotAuthenticated;
  Verdict v = judge_hello(p.hello, e, &code, &reason);
  if (v == Verdict::Park) {
    g.unlock();
    if (p.state != Pending::Parked) {
      p.state = Pending::Parked;
      p.deadline = after(kParkSeconds);
    }
    return;
  }
  const uint8_t ch = p.hello.channel;  // judge_hello accepted it: < kChannels
  if (v == Verdict::Accept && slot_fd_[ch] >= 0 && slot_version_[ch] == e.world_version &&
      connection_ended(slot_fd_[ch])) {
    // The predecessor's earlier connection died after its handshake (its RESULT lost on
    // the way, say) and it came back: the new one replaces it.
    ::close(slot_fd_[ch]);
    slot_fd_[ch] = -1;
  }
  if (v == Verdict::Accept && (slot_fd_[ch] >= 0 || e.connected[ch])) {
    v = Verdict::Refuse;
    code = Refusal::Duplicate;
    reason = "duplicate connection from rank " + std::to_string(p.hello.from_rank) + ": the " + channel_name(ch) +
             " of world version " + std::to_string(p.hello.world_version) + " is already connected";
  }
  if (v == Verdict::Refuse) {
    g.unlock();
    refuse(p, code, reason, "");
    return;
  }
  Digest mine = handshake_mac(e.secret, "acceptor", p.hello_body, p.nonce.data());
  auto msg = encode_message(MsgType::Result, Status::Ok, std::vector<uint8_t>(mine.begin(), mine.end()));
  if (::send(p.fd, msg.data(), msg.size(), MSG_NOSIGNAL) != ssize_t(msg.size())) {
    g.unlock();
    close_pending(p);
    return;
  }
  slot_fd_[ch] = p.fd;
  slot_version_[ch] = e.world_version;
  p.fd = -1;
  g.unlock();
  uint64_t one = 1;
  ssize_t w = ::write(ready_fd_, &one, sizeof(one));
  (void)w;
}

bool Listener::advance(Pending& p) {
  for (;;) {
    ssize_t r = ::recv(p.fd, p.buf.data() + p.have, p.buf.size() - p.have, 0);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      // A connector that gives up (its own deadline, or a probe) just goes away.
      close_pending(p);
      return false;
    }
    if (r < 0) return true;
    p.have += size_t(r);
    if (p.have < p.buf.size()) continue;
    if (!p.header_done) {
      std::string why;
      if (!decode_header(p.buf.data(), &p.header, &why)) {
        refuse(p, Refusal::NotAuthenticated, "", why);  // garbage: no answer
        return false;
      }
      MsgType want = p.state == Pending::ReadProof ? MsgType::Proof : MsgType::Hello;
      if (p.header.type != want) {
        refuse(p, Refusal::NotAuthenticated, "", "unexpected handshake message type");
        return false;
      }
      p.header_done = true;
      p.buf.assign(p.header.body_len, 0);
      p.have = 0;
      if (p.header.body_len > 0) continue;
    }
    if (p.state == Pending::ReadHello) {
      std::string why;
      if (!decode_hello_body(p.buf.data(), p.buf.size(), &p.hello, &why)) {
        refuse(p, Refusal::NotAuthenticated, "", why);
        return false;
      }
      p.hello_body = p.buf;
      bool active;
      {
        std::lock_guard<std::mutex> g(mu_);
        active = expect_.active;
      }
      if (active) {
        send_ack(p);
      } else {
        // No communicator has started forming yet, so there is no secret to check against:
        // hold the connection (unauthenticated, so only for the short handshake timeout).
        p.state = Pending::WaitActive;
        p.deadline = after(handshake_timeout_s_);
      }
      return p.fd >= 0;
    }
    // PROOF: the connector must hold this job's secret before it learns anything.
    std::string secret;
    {
      std::lock_guard<std::mutex> g(mu_);
      secret = expect_.secret;
    }
    Digest want = handshake_mac(secret, "connector", p.hello_body, p.nonce.data());
    if (p.buf.size() != want.size() || !digest_equal(p.buf.data(), want.data(), want.size())) {
      refuse(p, Refusal::NotAuthenticated,
             "authentication failed: the peer does not hold this job's secret (or belongs to another job)",
             "authentication failed: the peer, claiming job '" + printable(p.hello.job_id) + "' world version " +
                 std::to_string(p.hello.world_version) + " rank " + std::to_string(p.hello.from_rank) +
                 ", does not hold this job's secret");
      return false;
    }
    p.authenticated = true;
    decide(p);
    return false;  // decided: delivered, refused or parked (a parked entry is kept by the caller)
  }
}

void Listener::loop() {
  std::vector<std::unique_ptr<Pending>> pending;
  std::vector<pollfd> fds;
  bool accept_paused = false;  // out of file descriptors: stop polling the listening socket briefly
  auto accept_resume = Clock::now();
  while (!stop_.load()) {
    fds.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    if (accept_paused && Clock::now() >= accept_resume) accept_paused = false;
    fds.push_back({listen_fd_, short(accept_paused ? 0 : POLLIN), 0});
    auto next_deadline = Clock::now() + std::chrono::seconds(60);
    if (accept_paused) next_deadline = std::min(next_deadline, accept_resume);
    if (log_suppressed_) next_deadline = std::min(next_deadline, log_window_ + kLogWindow);
    for (auto& p : pending) {
      // Waiting connections are only watched for hang-up, not read.
      bool waiting = p->state == Pending::Parked || p->state == Pending::WaitActive;
      fds.push_back({p->fd, short(waiting ? POLLRDHUP : POLLIN), 0});
      next_deadline = std::min(next_deadline, p->deadline);
    }
    int r = poll(fds.data(), fds.size(), poll_ms_until(next_deadline));
    if (r < 0 && errno != EINTR) {
      record_refusal("(listener)", std::string("poll failed: ") + errno_text(errno));
      continue;
    }
    bool rejudge = false;
    if (fds[0].revents) {
      uint64_t v;
      ssize_t n = ::read(wake_fd_, &v, sizeof(v));
      (void)n;
      rejudge = true;
    }
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& p = *pending[i];
      if (!fds[i + 2].revents || p.fd < 0) continue;
      if (p.state == Pending::Parked || p.state == Pending::WaitActive) {
        close_pending(p);
      } else {
        advance(p);
      }
    }
    auto now = Clock::now();
    if (log_suppressed_ && now - log_window_ >= kLogWindow) flush_suppressed();
    for (auto& p : pending) {
      if (p->fd < 0) continue;
      if (rejudge && p->state == Pending::WaitActive) {
        bool active;
        {
          std::lock_guard<std::mutex> g(mu_);
          active = expect_.active;
        }
        if (active) send_ack(*p);
      } else if (rejudge && p->state == Pending::Parked) {
        decide(*p);
      }
      if (p->fd >= 0 && now >= p->deadline) {
        if (p->state == Pending::Parked || p->state == Pending::WaitActive) {
          // Tell the connector to come back later rather than leave it guessing.
          auto msg = encode_message(p->state == Pending::Parked ? MsgType::Result : MsgType::Ack, Status::NotReady, {});
          ssize_t w = ::send(p->fd, msg.data(), msg.size(), MSG_NOSIGNAL);
          (void)w;
          close_pending(*p);
        } else {
          refuse(*p, Refusal::NotAuthenticated, "",
                 "handshake not completed within " + std::to_string(handshake_timeout_s_) + " s");
        }
      }
    }
    pending.erase(std::remove_if(pending.begin(), pending.end(), [](auto& p) { return p->fd < 0; }), pending.end());
    if (fds[1].revents) {
      for (;;) {
        int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
          if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            accept_paused = true;  // the socket stays readable: don't spin on it
            accept_resume = Clock::now() + std::chrono::milliseconds(50);
          }
          break;
        }
        if (pending.size() >= kMaxPending) {
          // Full: drop the newest connection that has sent nothing yet, else the newest that
          // has not authenticated; never one that proved the secret. Under a burst the real
          // neighbour is among the older ones, or halfway through its handshake, while the
          // newest is most likely another stray; a real neighbour that is dropped reconnects.
          auto silent = [](auto& p) { return !p->authenticated && p->state == Pending::ReadHello && !p->header_done && p->have == 0; };
          auto victim = std::find_if(pending.rbegin(), pending.rend(), silent);
          if (victim == pending.rend())
            victim = std::find_if(pending.rbegin(), pending.rend(), [](auto& p) { return !p->authenticated; });
          if (victim == pending.rend()) {
            record_refusal(peer_name(fd), "too many handshakes in progress");
            ::close(fd);
            continue;
          }
          refuse(**victim, Refusal::NotAuthenticated, "", "dropped: too many handshakes in progress");
          pending.erase(std::next(victim).base());
        }
        auto p = std::make_unique<Pending>();
        p->fd = fd;
        p->peer = peer_name(fd);
        p->buf.assign(kHeaderBytes, 0);
        p->deadline = after(handshake_timeout_s_);
        tune_ring_socket(fd);
        // Data may already be waiting; advancing now saves a poll round trip.
        advance(*p);
        if (p->fd >= 0) pending.push_back(std::move(p));
      }
    }
  }
  for (auto& p : pending)
    if (p->fd >= 0) ::close(p->fd);
}

// ---------------------------------------------------------------- connector

namespace {

bool is_wildcard(const std::string& host) { return host.empty() || host == "0.0.0.0" || host == "::"; }

}  // namespace

int connect_ring_peer(const std::string& address, const Hello& hello, const std::string& secret,
                      Clock::time_point deadline, Clock::duration unreachable_after, const AbortSignal& abort) {
  auto fail = [&](ErrorKind kind, const std::string& what) -> CommError {
    return CommError(kind,
                     "form (world version " + std::to_string(hello.world_version) + ", rank " +
                         std::to_string(hello.from_rank) + "): " + what,
                     "form", int64_t(hello.world_version), int(hello.from_rank), int(hello.to_rank));
  };
  const std::string shown = printable(address, 300);  // the rendezvous passed it on from the peer
  std::string peer = "rank " + std::to_string(hello.to_rank) + " at " + shown +
                     (hello.channel == kChannelFlat ? "" : std::string(" (") + channel_name(hello.channel) + ")");
  // The neighbour's announced address is its own doing: a bad one is its failure, not a bad argument.
  HostPort hp;
  try {
    hp = parse_address(address);
  } catch (const CommError& e) {
    throw fail(ErrorKind::Unreachable,
               "rank " + std::to_string(hello.to_rank) + " announced an unusable ring address: " + e.what());
  }
  if (is_wildcard(hp.host))
    throw fail(ErrorKind::Unreachable, "rank " + std::to_string(hello.to_rank) + " announced the wildcard address " +
                                           shown + ", which nobody can connect to (it must announce an address "
                                           "the other workers reach, e.g. ELASTIC_RING_HOST)");

  std::vector<uint8_t> hello_body = encode_hello_body(hello);
  std::vector<uint8_t> hello_msg = encode_message(MsgType::Hello, Status::Ok, hello_body);
  const auto started = Clock::now();
  bool reached = false;  // some attempt got a TCP connection: something listens there
  int backoff_ms = 2;
  std::string last_problem = "no attempt";
  auto retry_after = [&](int fd, std::string problem) {
    if (fd >= 0) ::close(fd);
    last_problem = std::move(problem);
    backoff_sleep(backoff_ms, abort);
    backoff_ms = std::min(backoff_ms * 2, 100);
  };
  // The answer at the neighbour's address is not a neighbour of this job: its failure.
  auto bad_peer = [&](int fd, const std::string& what) -> CommError {
    ::close(fd);
    return fail(ErrorKind::BadPeer, peer + " " + what);
  };
  // Sends `out` and reads the answer, which must be a `want` message. False: the connection
  // was closed or reset first (the caller retries). Throws on abort, at the deadline, and
  // on an answer that is not this protocol.
  auto exchange = [&](int fd, const std::vector<uint8_t>& out, MsgType want, const char* after, MsgHeader* h,
                      std::vector<uint8_t>* body) {
    uint8_t hdr[kHeaderBytes];
    std::string why;
    int e = write_full(fd, out.data(), out.size(), deadline, abort);
    if (!e) e = read_full(fd, hdr, kHeaderBytes, deadline, abort);
    if (!e) {
      if (!decode_header(hdr, h, &why))
        throw bad_peer(fd, std::string("answered the ") + after + " with something that is not an elastic-ring "
                                                                  "handshake: " + why);
      if (h->type != want) throw bad_peer(fd, std::string("sent an unexpected handshake message in answer to the ") + after);
      body->assign(h->body_len, 0);
      e = read_full(fd, body->data(), body->size(), deadline, abort);
    }
    if (e == ECANCELED || e == ETIMEDOUT) {
      ::close(fd);
      if (e == ECANCELED) throw fail(ErrorKind::Aborted, "aborted while connecting to " + peer);
      throw fail(ErrorKind::Timeout, "no handshake with " + peer + " before the deadline (no answer to the " + after +
                                         "; it accepted the connection)");
    }
    return e == 0;
  };
  for (;;) {
    if (abort.fired()) throw fail(ErrorKind::Aborted, "aborted while connecting to " + peer);
    auto now = Clock::now();
    auto connect_deadline = reached ? deadline : std::min(deadline, started + unreachable_after);
    if (now >= connect_deadline) {
      if (reached)
        throw fail(ErrorKind::Timeout, "could not connect to " + peer + " before the deadline (" + last_problem + ")");
      throw fail(ErrorKind::Unreachable,
                 peer + " accepted no connection for " +
                     std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now - started).count()) +
                     " s (" + last_problem + "): nothing listens at its announced address");
    }
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* res = nullptr;
    std::string port_s = std::to_string(hp.port);
    int rc = getaddrinfo(hp.host.c_str(), port_s.c_str(), &hints, &res);
    if (rc == EAI_AGAIN) {  // the resolver is not answering now; it may later
      retry_after(-1, std::string("cannot resolve its host: ") + gai_strerror(rc));
      continue;
    }
    if (rc != 0)
      throw fail(ErrorKind::Unreachable, "cannot resolve " + peer + ": " + gai_strerror(rc));
    int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      freeaddrinfo(res);
      retry_after(-1, std::string("socket() failed: ") + errno_text(errno));  // out of descriptors, for now
      continue;
    }
    int e = 0;
    if (::connect(fd, res->ai_addr, res->ai_addrlen) != 0 && errno != EINPROGRESS) e = errno;
    freeaddrinfo(res);
    if (!e) e = wait_fd(fd, POLLOUT, connect_deadline, abort);
    if (!e) {
      socklen_t len = sizeof(e);
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &len);
    }
    if (e == ECANCELED) {
      ::close(fd);
      throw fail(ErrorKind::Aborted, "aborted while connecting to " + peer);
    }
    if (e) {
      retry_after(fd, errno_text(e));
      continue;
    }
    reached = true;

    // HELLO -> ACK. A connection closed or reset before the RESULT is retried: a flooded
    // listener drops connections that have not proved the secret yet.
    MsgHeader h{};
    std::vector<uint8_t> body;
    if (!exchange(fd, hello_msg, MsgType::Ack, "HELLO", &h, &body)) {
      retry_after(fd, "it closed the connection before answering the HELLO");
      continue;
    }
    if (h.status == Status::NotReady) {
      retry_after(fd, peer + " has not reached world version " + std::to_string(hello.world_version));
      continue;
    }
    if (h.status == Status::Refused)  // this protocol refuses only after the PROOF, with a MAC
      throw bad_peer(fd, "refused the ring connection before any proof (unauthenticated, not acted on): '" +
                             printable(std::string(body.begin(), body.end()), 200) + "'");
    if (body.size() != kNonceBytes) throw bad_peer(fd, "sent a malformed handshake acknowledgement");

    // PROOF -> RESULT.
    std::vector<uint8_t> acceptor_nonce = body;
    Digest mine = handshake_mac(secret, "connector", hello_body, acceptor_nonce.data());
    auto proof = encode_message(MsgType::Proof, Status::Ok, std::vector<uint8_t>(mine.begin(), mine.end()));
    if (!exchange(fd, proof, MsgType::Result, "proof", &h, &body)) {
      retry_after(fd, "it closed the connection during the handshake, after the proof");
      continue;
    }
    if (h.status == Status::NotReady) {
      retry_after(fd, peer + " has not reached world version " + std::to_string(hello.world_version));
      continue;
    }
    if (h.status == Status::Refused) {
      Refusal code{};
      std::string reason;
      bool authenticated = false;
      if (!decode_refusal(body, secret, hello_body, acceptor_nonce.data(), &code, &reason, &authenticated))
        throw bad_peer(fd, "sent a malformed refusal");
      if (!authenticated || code == Refusal::NotAuthenticated)
        throw bad_peer(fd, "refused the ring connection without proving this job's secret (not acted on): '" +
                               printable(reason, 200) + "'");
      ::close(fd);
      throw fail(code == Refusal::NoSuchRing ? ErrorKind::SettingsMismatch : ErrorKind::Refused,
                 peer + " refused the ring connection: " + printable(reason, 600));
    }
    Digest want = handshake_mac(secret, "acceptor", hello_body, acceptor_nonce.data());
    if (body.size() != want.size() || !digest_equal(body.data(), want.data(), want.size()))
      throw bad_peer(fd, "failed to prove this job's secret (it holds another secret)");
    tune_ring_socket(fd);
    return fd;
  }
}

// ---------------------------------------------------------------- data plane

namespace {


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

void TcpLinks::shutdown() { give_up(poisoned_, next_fd_, prev_fd_); }

std::vector<WatchFd> TcpLinks::connections() const {
  return {{next_fd_, ctx_.next_rank, "rank " + std::to_string(ctx_.next_rank) + " (" + ctx_.next_address + ")"},
          {prev_fd_, ctx_.prev_rank, "rank " + std::to_string(ctx_.prev_rank) + " (" + ctx_.prev_address + ")"}};
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
        lost(op, next_fd_, ctx_.next_rank, next_name, "connection to " + next_name + " lost: " + errno_text(errno));
      }
    }
    if (ri < nrecv) {
      ssize_t r = recv_frame_part(prev_fd_, rhdr, rspan, roff, &prev_poisoned_);
      if (r == 0) {
        lost(op, prev_fd_, ctx_.prev_rank, prev_name, "connection to " + prev_name + " closed (peer exited or failed)");
      } else if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        lost(op, prev_fd_, ctx_.prev_rank, prev_name, "connection to " + prev_name + " lost: " + errno_text(errno));
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
      fail(ErrorKind::PeerLost, op, -1, std::string("poll failed: ") + errno_text(errno));
    if (fds[0].revents) fail(ErrorKind::Aborted, op, -1, "communicator aborted");
    if (r > 0 && nw) check_watched(watch_, fds + 3, ctx_, op);
    if ((fds[2].revents & POLLPRI) && take_poison(prev_fd_)) prev_poisoned_ = true;
    if (fds[1].revents & (POLLIN | POLLRDHUP | POLLHUP | POLLERR | POLLPRI))
      lost(op, next_fd_, ctx_.next_rank, next_name, "connection to " + next_name + " closed (peer exited or failed)");
  }
}

}  // namespace ering
