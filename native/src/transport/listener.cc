// The listener: accepting ring connections and running their handshakes on one thread.
#include "transport/listener.h"

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

#include "transport/fork_guard.h"

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

}  // namespace

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
Clock::time_point after(double s) { return Clock::now() + seconds(s); }
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
    if (fd < 0) { last_error = std::strerror(errno); continue; }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 1024) == 0) {
      listen_fd_ = fd;
      guard_from_fork(fd);  // a child must not accept the next world's connections for a dead worker
      break;
    }
    last_error = std::strerror(errno);
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
    const std::string predecessor = std::string(channel_name(channel)) + " predecessor rank " + std::to_string(prev_rank);
    if (abort.fired())
      throw form_error(ErrorKind::Aborted, world_version, rank, prev_rank, "aborted while waiting for the " + predecessor);
    int ms = poll_ms_until(deadline);
    if (ms == 0)
      throw form_error(ErrorKind::Timeout, world_version, rank, prev_rank, predecessor + " did not connect before the deadline");
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
      record_refusal("(listener)", std::string("poll failed: ") + std::strerror(errno));
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
        guard_from_fork(fd);  // from the start: a fork during the handshake must not keep what becomes a link
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

}  // namespace ering
