// The connector: reaching a ring neighbour and completing the handshake, with retry.
#include "transport/connect.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "transport/fork_guard.h"

namespace ering {
namespace {

// Sleeps for a retry backoff, waking early on abort.
void backoff_sleep(int ms, const AbortSignal& abort) {
  pollfd p = {abort.fd(), POLLIN, 0};
  poll(&p, 1, ms);
}

bool is_wildcard(const std::string& host) { return host.empty() || host == "0.0.0.0" || host == "::"; }

}  // namespace

int connect_ring_peer(const std::string& address, const Hello& hello, const std::string& secret,
                      Clock::time_point deadline, Clock::duration unreachable_after, const AbortSignal& abort) {
  auto fail = [&](ErrorKind kind, const std::string& what) {
    return form_error(kind, hello.world_version, int(hello.from_rank), int(hello.to_rank), what);
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
  // Sends `out` and reads the answer, which must be a `want` message. False when the caller
  // must reconnect (after a backoff, here): the connection was closed or reset first
  // (`closed` says when), or the neighbour has not reached this world version. Throws on
  // abort, at the deadline, and on an answer that is not this protocol.
  auto exchange = [&](int fd, const std::vector<uint8_t>& out, MsgType want, const char* after, const char* closed,
                      MsgHeader* h, std::vector<uint8_t>* body) {
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
    if (e) {
      retry_after(fd, closed);
      return false;
    }
    if (h->status == Status::NotReady) {
      retry_after(fd, peer + " has not reached world version " + std::to_string(hello.world_version));
      return false;
    }
    return true;
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
      retry_after(-1, std::string("socket() failed: ") + std::strerror(errno));  // out of descriptors, for now
      continue;
    }
    guard_from_fork(fd);  // from the start: a fork during the handshake must not keep what becomes a link
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
      retry_after(fd, std::strerror(e));
      continue;
    }
    reached = true;

    // HELLO -> ACK. A connection closed or reset before the RESULT is retried: a flooded
    // listener drops connections that have not proved the secret yet.
    MsgHeader h{};
    std::vector<uint8_t> body;
    if (!exchange(fd, hello_msg, MsgType::Ack, "HELLO", "it closed the connection before answering the HELLO", &h,
                  &body))
      continue;
    if (h.status == Status::Refused)  // this protocol refuses only after the PROOF, with a MAC
      throw bad_peer(fd, "refused the ring connection before any proof (unauthenticated, not acted on): '" +
                             printable(std::string(body.begin(), body.end()), 200) + "'");
    if (body.size() != kNonceBytes) throw bad_peer(fd, "sent a malformed handshake acknowledgement");

    // PROOF -> RESULT.
    std::vector<uint8_t> acceptor_nonce = body;
    Digest mine = handshake_mac(secret, "connector", hello_body, acceptor_nonce.data());
    auto proof = encode_message(MsgType::Proof, Status::Ok, std::vector<uint8_t>(mine.begin(), mine.end()));
    if (!exchange(fd, proof, MsgType::Result, "proof", "it closed the connection during the handshake, after the proof",
                  &h, &body))
      continue;
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

}  // namespace ering
