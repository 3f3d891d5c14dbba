// Socket primitives of the transport: the abort signal every wait includes, poll deadlines,
// whole-buffer I/O on non-blocking sockets, and ring addresses.
//
// Everything here waits in poll() on the socket and the abort eventfd, bounded by a
// deadline, so no caller can block past it or miss an abort.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "base/common.h"

namespace ering {

// An eventfd that stays readable once fired, so every poll() that includes it wakes
// at once and every later poll() returns at once: abort is sticky.
class AbortSignal {
 public:
  AbortSignal();
  ~AbortSignal();
  AbortSignal(const AbortSignal&) = delete;
  AbortSignal& operator=(const AbortSignal&) = delete;
  void fire();
  bool fired() const { return fired_.load(std::memory_order_acquire); }
  int fd() const { return fd_; }

 private:
  int fd_;
  std::atomic<bool> fired_{false};
};

struct HostPort {
  std::string host;
  int port;
};
// Parses "host:port" or "[v6]:port"; throws CommError(Invalid) naming the bad address.
HostPort parse_address(const std::string& address);

// The poll() timeout that ends at `deadline`: 0 once it has passed (callers treat 0 as
// "the deadline passed"), else the milliseconds left, rounded up, at most 1000 s.
int poll_ms_until(Clock::time_point deadline);

// Waits until `fd` has one of `events`. Returns 0, or ETIMEDOUT, ECANCELED (abort fired)
// or the errno of a failed poll().
int wait_fd(int fd, short events, Clock::time_point deadline, const AbortSignal& abort);

// Moves exactly n bytes on a non-blocking socket within the deadline. Returns 0, or
// ETIMEDOUT, ECANCELED (abort fired) or EPIPE (the peer closed or reset).
int write_full(int fd, const uint8_t* buf, size_t n, Clock::time_point deadline, const AbortSignal& abort);
int read_full(int fd, uint8_t* buf, size_t n, Clock::time_point deadline, const AbortSignal& abort);

// TCP_NODELAY: ring frames and handshake messages go out at once; the default dead-link
// timeout below. Also guards the socket from forked children (fork_guard.h).
void tune_ring_socket(int fd);
// TCP_USER_TIMEOUT and keepalive: a ring connection on which nothing is acknowledged for about
// `seconds` (CommConfig::dead_link_timeout, checked) fails (ETIMEDOUT), whether data is in
// flight or the side waits idle. The communicator sets its own once a connection is its ring's.
void set_dead_link_timeout(int fd, double seconds);
// "host:port" (or "[v6]:port") of a connected socket's other end, "?" if unknown.
std::string peer_name(int fd);
// True when the other end of a connection closed or reset it (looked at without waiting).
bool connection_ended(int fd);

}  // namespace ering
