// The connector: reaching a ring neighbour and completing the handshake, with retry. One
// attempt is the protocol of handshake.h in order: a TCP connection, HELLO -> ACK, PROOF ->
// RESULT; each step is a function below, and connect_ring_peer() retries the attempt while the
// neighbour may yet answer.
#include "transport/connect.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>

#include "transport/fork_guard.h"

namespace ering {
namespace {

bool is_wildcard(const std::string& host) { return host.empty() || host == "0.0.0.0" || host == "::"; }

// One connector's attempts to reach its neighbour and complete the handshake.
class Connector {
 public:
  Connector(const std::string& address, const Hello& hello, const std::string& secret, Clock::time_point deadline,
            Clock::duration unreachable_after, const AbortSignal& abort);
  // Attempts until one completes (the socket) or there is no point in another (throws).
  int connect();

 private:
  HostPort announced_address(const std::string& address) const;
  int open_connection();
  addrinfo* resolve();
  std::optional<std::vector<uint8_t>> hello_ack(int fd);
  bool proof_result(int fd, const std::vector<uint8_t>& acceptor_nonce);
  [[noreturn]] void refused(int fd, const std::vector<uint8_t>& body, const std::vector<uint8_t>& acceptor_nonce);
  bool exchange(int fd, const std::vector<uint8_t>& out, MsgType want, const char* after, const char* closed,
                MsgHeader* h, std::vector<uint8_t>* body);
  int read_answer(int fd, MsgType want, const char* after, MsgHeader* h, std::vector<uint8_t>* body);
  void retry_after(int fd, std::string problem);
  [[noreturn]] void give_up(Clock::time_point now) const;
  CommError fail(ErrorKind kind, const std::string& what) const {
    return form_error(kind, hello_.world_version, int(hello_.from_rank), int(hello_.to_rank), what);
  }
  // The answer at the neighbour's address is not a neighbour of this job: its failure.
  CommError bad_peer(int fd, const std::string& what) const {
    ::close(fd);
    return fail(ErrorKind::BadPeer, peer_ + " " + what);
  }

  const Hello& hello_;
  const std::string& secret_;
  const Clock::time_point deadline_;
  const Clock::duration unreachable_after_;
  const AbortSignal& abort_;
  const std::string shown_;  // the address as announced, made printable: the rendezvous passed it on from the peer
  const std::string peer_;   // "rank 3 at 10.0.0.2:4000 (leaders' ring)"
  const HostPort hp_;
  const std::vector<uint8_t> hello_body_, hello_msg_;
  const Clock::time_point started_ = Clock::now();
  bool reached_ = false;  // some attempt got a TCP connection: something listens there
  int backoff_ms_ = 2;
  std::string last_problem_ = "no attempt";
};

Connector::Connector(const std::string& address, const Hello& hello, const std::string& secret,
                     Clock::time_point deadline, Clock::duration unreachable_after, const AbortSignal& abort)
    : hello_(hello), secret_(secret), deadline_(deadline), unreachable_after_(unreachable_after), abort_(abort),
      shown_(printable(address, 300)),
      peer_("rank " + std::to_string(hello.to_rank) + " at " + shown_ +
            (hello.channel == kChannelFlat ? "" : std::string(" (") + channel_name(hello.channel) + ")")),
      hp_(announced_address(address)), hello_body_(encode_hello_body(hello)),
      hello_msg_(encode_message(MsgType::Hello, Status::Ok, hello_body_)) {}

int Connector::connect() {
  for (;;) {
    const int fd = open_connection();
    if (fd < 0) continue;
    auto acceptor_nonce = hello_ack(fd);
    if (!acceptor_nonce || !proof_result(fd, *acceptor_nonce)) continue;
    tune_ring_socket(fd);
    return fd;
  }
}

// The neighbour's announced address is its own doing: a bad one is its failure, not a bad argument.
HostPort Connector::announced_address(const std::string& address) const {
  HostPort hp;
  try {
    hp = parse_address(address);
  } catch (const CommError& e) {
    throw fail(ErrorKind::Unreachable,
               "rank " + std::to_string(hello_.to_rank) + " announced an unusable ring address: " + e.what());
  }
  if (is_wildcard(hp.host))
    throw fail(ErrorKind::Unreachable, "rank " + std::to_string(hello_.to_rank) + " announced the wildcard address " +
                                           shown_ + ", which nobody can connect to (it must announce an address "
                                           "the other workers reach, e.g. ELASTIC_RING_HOST)");
  return hp;
}

// A TCP connection to the neighbour, or -1 after a backoff when this attempt did not get one.
// Until one connection is reached the neighbour has `unreachable_after` to accept one.
int Connector::open_connection() {
  if (abort_.fired()) throw fail(ErrorKind::Aborted, "aborted while connecting to " + peer_);
  const auto now = Clock::now();
  const auto connect_deadline = reached_ ? deadline_ : std::min(deadline_, started_ + unreachable_after_);
  if (now >= connect_deadline) give_up(now);
  addrinfo* res = resolve();
  if (!res) return -1;
  int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    freeaddrinfo(res);
    retry_after(-1, std::string("socket() failed: ") + std::strerror(errno));  // out of descriptors, for now
    return -1;
  }
  guard_from_fork(fd);  // from the start: a fork during the handshake must not keep what becomes a link
  int e = 0;
  if (::connect(fd, res->ai_addr, res->ai_addrlen) != 0 && errno != EINPROGRESS) e = errno;
  freeaddrinfo(res);
  if (!e) e = wait_fd(fd, POLLOUT, connect_deadline, abort_);
  if (!e) {
    socklen_t len = sizeof(e);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &len);
  }
  if (e == ECANCELED) {
    ::close(fd);
    throw fail(ErrorKind::Aborted, "aborted while connecting to " + peer_);
  }
  if (e) {
    retry_after(fd, std::strerror(e));
    return -1;
  }
  reached_ = true;
  return fd;
}

// The neighbour's host resolved, or null after a backoff when the resolver is not answering
// now (it may later); a name that does not resolve is its failure.
addrinfo* Connector::resolve() {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(hp_.port);
  const int rc = getaddrinfo(hp_.host.c_str(), port.c_str(), &hints, &res);
  if (rc == EAI_AGAIN) {
    retry_after(-1, std::string("cannot resolve its host: ") + gai_strerror(rc));
    return nullptr;
  }
  if (rc != 0) throw fail(ErrorKind::Unreachable, "cannot resolve " + peer_ + ": " + gai_strerror(rc));
  return res;
}

// HELLO -> ACK: the acceptor's nonce, or nothing when the attempt must reconnect. This
// protocol refuses only after the PROOF, with a MAC: a refusal here proves nothing.
std::optional<std::vector<uint8_t>> Connector::hello_ack(int fd) {
  MsgHeader h{};
  std::vector<uint8_t> body;
  if (!exchange(fd, hello_msg_, MsgType::Ack, "HELLO", "it closed the connection before answering the HELLO", &h,
                &body))
    return std::nullopt;
  if (h.status == Status::Refused)
    throw bad_peer(fd, "refused the ring connection before any proof (unauthenticated, not acted on): '" +
                           printable(std::string(body.begin(), body.end()), 200) + "'");
  if (body.size() != kNonceBytes) throw bad_peer(fd, "sent a malformed handshake acknowledgement");
  return body;
}

// PROOF -> RESULT: true once the acceptor proved the secret back, false when the attempt must
// reconnect; a refusal throws.
bool Connector::proof_result(int fd, const std::vector<uint8_t>& acceptor_nonce) {
  Digest mine = handshake_mac(secret_, "connector", hello_body_, acceptor_nonce.data());
  auto proof = encode_message(MsgType::Proof, Status::Ok, std::vector<uint8_t>(mine.begin(), mine.end()));
  MsgHeader h{};
  std::vector<uint8_t> body;
  if (!exchange(fd, proof, MsgType::Result, "proof", "it closed the connection during the handshake, after the proof",
                &h, &body))
    return false;
  if (h.status == Status::Refused) refused(fd, body, acceptor_nonce);
  Digest want = handshake_mac(secret_, "acceptor", hello_body_, acceptor_nonce.data());
  if (body.size() != want.size() || !digest_equal(body.data(), want.data(), want.size()))
    throw bad_peer(fd, "failed to prove this job's secret (it holds another secret)");
  return true;
}

// RESULT REFUSED: acted on only when its MAC proves the acceptor holds the secret too.
void Connector::refused(int fd, const std::vector<uint8_t>& body, const std::vector<uint8_t>& acceptor_nonce) {
  Refusal code{};
  std::string reason;
  bool authenticated = false;
  if (!decode_refusal(body, secret_, hello_body_, acceptor_nonce.data(), &code, &reason, &authenticated))
    throw bad_peer(fd, "sent a malformed refusal");
  if (!authenticated || code == Refusal::NotAuthenticated)
    throw bad_peer(fd, "refused the ring connection without proving this job's secret (not acted on): '" +
                           printable(reason, 200) + "'");
  ::close(fd);
  throw fail(code == Refusal::NoSuchRing ? ErrorKind::SettingsMismatch : ErrorKind::Refused,
             peer_ + " refused the ring connection: " + printable(reason, 600));
}

// Sends `out` and reads the answer, which must be a `want` message. False when the attempt
// must reconnect (after a backoff, here): the connection was closed or reset first (`closed`
// says when), or the neighbour has not reached this world version. Throws on abort, at the
// deadline, and on an answer that is not this protocol.
bool Connector::exchange(int fd, const std::vector<uint8_t>& out, MsgType want, const char* after, const char* closed,
                         MsgHeader* h, std::vector<uint8_t>* body) {
  int e = write_full(fd, out.data(), out.size(), deadline_, abort_);
  if (!e) e = read_answer(fd, want, after, h, body);
  if (e == ECANCELED || e == ETIMEDOUT) {
    ::close(fd);
    if (e == ECANCELED) throw fail(ErrorKind::Aborted, "aborted while connecting to " + peer_);
    throw fail(ErrorKind::Timeout, "no handshake with " + peer_ + " before the deadline (no answer to the " + after +
                                       "; it accepted the connection)");
  }
  if (e) {
    retry_after(fd, closed);
    return false;
  }
  if (h->status == Status::NotReady) {
    retry_after(fd, peer_ + " has not reached world version " + std::to_string(hello_.world_version));
    return false;
  }
  return true;
}

// Reads one handshake message, which must be a `want` message: 0, or the read's error.
int Connector::read_answer(int fd, MsgType want, const char* after, MsgHeader* h, std::vector<uint8_t>* body) {
  uint8_t hdr[kHeaderBytes];
  if (int e = read_full(fd, hdr, kHeaderBytes, deadline_, abort_)) return e;
  std::string why;
  if (!decode_header(hdr, h, &why))
    throw bad_peer(fd, std::string("answered the ") + after + " with something that is not an elastic-ring "
                                                              "handshake: " + why);
  if (h->type != want) throw bad_peer(fd, std::string("sent an unexpected handshake message in answer to the ") + after);
  body->assign(h->body_len, 0);
  return read_full(fd, body->data(), body->size(), deadline_, abort_);
}

// Closes this attempt's connection (if any) and sleeps for the backoff, waking early on abort.
void Connector::retry_after(int fd, std::string problem) {
  if (fd >= 0) ::close(fd);
  last_problem_ = std::move(problem);
  pollfd p = {abort_.fd(), POLLIN, 0};
  poll(&p, 1, backoff_ms_);
  backoff_ms_ = std::min(backoff_ms_ * 2, 100);
}

// No attempt completed in time: a neighbour that accepted no connection at all is
// unreachable, one that did but never completed the handshake timed out.
void Connector::give_up(Clock::time_point now) const {
  if (reached_)
    throw fail(ErrorKind::Timeout, "could not connect to " + peer_ + " before the deadline (" + last_problem_ + ")");
  throw fail(ErrorKind::Unreachable,
             peer_ + " accepted no connection for " +
                 std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now - started_).count()) + " s (" +
                 last_problem_ + "): nothing listens at its announced address");
}

}  // namespace

int connect_ring_peer(const std::string& address, const Hello& hello, const std::string& secret,
                      Clock::time_point deadline, Clock::duration unreachable_after, const AbortSignal& abort) {
  return Connector(address, hello, secret, deadline, unreachable_after, abort).connect();
}

}  // namespace ering
