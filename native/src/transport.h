// TCP transport: the listening socket and its handshake thread, connecting to a ring
// neighbour, and moving a Plan's segments with deadlines and abort.
//
// The transport knows sockets and framing only; which bytes go where is the Plan's
// business (ring.cc). The shared-memory transport for neighbours on the same host
// (shm.h) implements Links too and keeps these TCP connections for liveness.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <poll.h>
#include <sys/types.h>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common.h"
#include "handshake.h"

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

// Listens for ring connections and runs their handshakes on one background thread,
// many at a time, so a silent or garbage connection never delays the real neighbour.
class Listener {
 public:
  Listener(const std::string& host, int port, double handshake_timeout_s);
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  std::string address() const;
  int port() const { return port_; }

  // Starts expecting the predecessor of a new world. Connections held for an older
  // world are dropped; connections from a newer one stay parked until it is expected.
  void expect(const Expectation& e);
  // The communicator of this version is gone: late neighbours are refused, not parked.
  void retire(uint64_t world_version);
  // Waits for the authenticated connection from the expected predecessor on `channel`
  // (which ring of the world version) and takes it.
  int take(uint64_t world_version, Clock::time_point deadline, const AbortSignal& abort, int rank, int prev_rank,
           uint8_t channel = kChannelFlat);

  std::vector<std::string> refusals();  // recent refusal messages, oldest first
  uint64_t refusal_count() const { return refusal_count_.load(); }

 private:
  struct Pending;
  void loop();
  void wake();
  // Answers `told` with `code` in a RESULT REFUSED (empty: no answer; authenticated only
  // if the peer is) and logs `logged` (empty: the same), then closes.
  void refuse(Pending& p, Refusal code, const std::string& told, const std::string& logged);
  void record_refusal(const std::string& peer, const std::string& reason);
  // stderr gets at most kLogLines refusal lines a second, then one line counting the rest;
  // the count is written at the latest when the second is over (loop() wakes for it).
  void log_line(const std::string& line);
  void flush_suppressed();
  void close_pending(Pending& p);
  void send_ack(Pending& p);
  void decide(Pending& p);
  bool advance(Pending& p);

  int listen_fd_ = -1;
  int wake_fd_ = -1;    // eventfd: wakes the loop on expect() and on shutdown
  int ready_fd_ = -1;   // eventfd: wakes take() when the slot is filled
  std::string host_;
  int port_ = 0;
  double handshake_timeout_s_;
  std::atomic<bool> stop_{false};

  std::mutex mu_;
  Expectation expect_;        // guarded by mu_
  // guarded by mu_: per channel, the authenticated predecessor not yet taken, and its version
  std::array<int, kChannels> slot_fd_{{-1, -1, -1}};
  std::array<uint64_t, kChannels> slot_version_{{0, 0, 0}};
  void close_slots_locked(bool all, uint64_t keep_version);
  std::deque<std::string> refusals_;  // guarded by mu_
  std::atomic<uint64_t> refusal_count_{0};
  // The stderr rate limit; the listener thread only.
  Clock::time_point log_window_{};
  int log_lines_ = 0;
  uint64_t log_suppressed_ = 0;
  std::thread thread_;
};

// Connects to a ring neighbour and completes the handshake. Returns the socket.
// Retried with backoff until the deadline: a connection closed or reset before the
// handshake completed (a flooded listener drops unauthenticated connections), a neighbour
// not yet at this world version, a name that does not resolve for now. A neighbour that
// accepts no connection at all (refused, no route) is given up after `unreachable_after`
// (or the deadline, if sooner) as Unreachable. Fails at once, naming the neighbour: an
// address that is not HOST:PORT or a wildcard (Unreachable), an answer that is not the
// protocol or a refusal without the secret's proof (BadPeer), an authenticated refusal
// (Refused, or SettingsMismatch when the neighbour forms no such ring).
int connect_ring_peer(const std::string& address, const Hello& hello, const std::string& secret,
                      Clock::time_point deadline, Clock::duration unreachable_after, const AbortSignal& abort);

// Moves exactly n bytes on a non-blocking socket within the deadline. Returns 0, or
// ETIMEDOUT, ECANCELED (abort fired) or EPIPE (the peer closed or reset).
int write_full(int fd, const uint8_t* buf, size_t n, Clock::time_point deadline, const AbortSignal& abort);
int read_full(int fd, uint8_t* buf, size_t n, Clock::time_point deadline, const AbortSignal& abort);

// The poison byte: one TCP urgent byte a rank sends before shutting a connection down when
// it gives up, so a neighbour reports "propagated" instead of blaming a live rank.
void send_poison(int fd);
struct LinkContext;
struct OpInfo;
// What every Links does on giving up: the poison byte once on both connections, then
// shutdown() (not close(): safe while another thread polls them; FIN reaches both at once).
void give_up(std::atomic<bool>& poisoned, int next_fd, int prev_fd);
// Throws the CommError of a failed operation on this rank, naming op, version, rank and peer.
[[noreturn]] void link_failure(const LinkContext& ctx, ErrorKind kind, const OpInfo& op, int peer,
                               const std::string& what);
// A connection ended: "propagated" if the neighbour's poison byte came first, else the peer is lost.
[[noreturn]] void link_lost(const LinkContext& ctx, const OpInfo& op, bool propagated, int peer,
                            const std::string& name, const std::string& what);
// Reads a pending poison byte; true if there was one.
bool take_poison(int fd);
// After a short read: reads the poison byte if the read stopped at the urgent mark (the
// next read past it would discard it).
bool take_poison_at_mark(int fd);

struct Span {
  char* ptr;
  size_t bytes;
};

// What one collective sends to the next rank and receives from the previous one,
// as numbered segments. Sends and receives each go in index order.
class Plan {
 public:
  virtual ~Plan() = default;
  virtual size_t num_sends() const = 0;
  virtual size_t num_recvs() const = 0;
  virtual Span send_span(size_t i) = 0;
  // Where segment i lands when a transport receives it into memory of the plan's choosing.
  virtual Span recv_span(size_t i) = 0;
  // Called once segment i has fully landed in recv_span(i) (e.g. to reduce it).
  virtual void received(size_t i) {}
  // For a transport whose bytes already sit in memory the plan can read (shared memory):
  // hands over bytes [offset, offset + n) of segment i. The default copies them to
  // recv_span(i); a plan may consume them in place instead (reduce straight from them).
  virtual void deliver(size_t i, size_t offset, const char* src, size_t n) {
    std::memcpy(recv_span(i).ptr + offset, src, n);
  }
  // Called once every byte of segment i went through deliver().
  virtual void delivered(size_t i) { received(i); }
  // The receive that must complete before send i may start, or -1 for none.
  virtual ptrdiff_t send_after(size_t i) const = 0;
};

// Every segment on a TCP direction travels as this 24-byte header + payload. The header
// lets the receiver check that both ranks are in the same collective with the same shape.
struct FrameHeader {
  uint32_t seq;
  uint32_t tag;
  uint64_t index;
  uint64_t bytes;
};
static_assert(sizeof(FrameHeader) == 24, "frame header is 24 bytes on the wire");

// One non-blocking sendmsg of what is left of a frame (`hdr`, then `payload`), `done` bytes of
// which are out already: what sendmsg returned (errno set when negative).
ssize_t send_frame_part(int fd, const FrameHeader& hdr, Span payload, size_t done);
// One non-blocking recvmsg into the rest of a frame, `done` bytes of which arrived: what
// recvmsg returned. Linux stops a read at the urgent mark and drops the urgent byte on the
// next read past it, so when this read stopped there the poison byte is taken now and
// *poisoned set.
ssize_t recv_frame_part(int fd, FrameHeader& hdr, Span payload, size_t done, bool* poisoned);

struct OpInfo;
// Empty when `h` is the header of receive `index` (`bytes` long) of `op`; else why not.
std::string frame_mismatch(const FrameHeader& h, const OpInfo& op, size_t index, size_t bytes,
                           const std::string& sender);

struct OpInfo {
  const char* name;      // "allreduce", "broadcast", ...
  uint32_t seq;          // per-communicator operation counter, identical on every rank
  uint32_t tag;          // hash of what the op is (kind, dtype, op, size): catches mismatched calls
  std::string describe;  // for errors: "allreduce #7 (float32, 1000 elements, sum)"
};

struct LinkContext {
  int rank;
  int size;
  uint64_t world_version;
  int next_rank, prev_rank;
  std::string next_address, prev_address;  // as printed in messages (printable())
};

// A connection of another ring of the same communicator that a run() must watch while it
// waits: the hierarchical allreduce runs its phases on different rings, and a rank blocked
// in one phase must still learn at once that a neighbour it needs in a later phase gave up
// or died (FIN, RST or the poison byte; data and doorbells on it are left alone).
struct WatchFd {
  int fd;
  int peer;
  std::string name;
};
constexpr size_t kMaxWatch = 2;

// The data plane of one ring.
class Links {
 public:
  virtual ~Links() = default;
  virtual void run(Plan& plan, const OpInfo& op) = 0;
  // Shuts the connections down so neighbours fail fast: how one failure reaches every rank.
  virtual void shutdown() = 0;
  // How this rank sends to the next rank and receives from the previous one: "tcp" or "shm".
  virtual const char* send_kind() const { return "tcp"; }
  virtual const char* recv_kind() const { return "tcp"; }
  // This ring's two connections, for another ring's run() to watch.
  virtual std::vector<WatchFd> connections() const = 0;
  // What the next run() watches besides its own connections (at most kMaxWatch); cleared by the caller.
  void watch(std::vector<WatchFd> w) { watch_ = std::move(w); }
  virtual const LinkContext& context() const = 0;
  // Outside run(): throws op's CommError if a neighbour on this ring gave up or died.
  void check_alive(const OpInfo& op);

 protected:
  std::vector<WatchFd> watch_;
};

// Fills pollfd entries for the watched connections (FIN/RST and the urgent poison byte only).
size_t add_watched(const std::vector<WatchFd>& w, pollfd* out);
// Throws the op's CommError if a watched connection ended or carries the poison byte:
// `revents` from a poll() over add_watched()'s entries, or null to poll them now without waiting.
void check_watched(const std::vector<WatchFd>& w, const pollfd* polled, const LinkContext& ctx, const OpInfo& op);

class TcpLinks : public Links {
 public:
  TcpLinks(int next_fd, int prev_fd, LinkContext ctx, const AbortSignal* abort, double timeout_s);
  ~TcpLinks() override;
  void run(Plan& plan, const OpInfo& op) override;
  void shutdown() override;
  std::vector<WatchFd> connections() const override;
  const LinkContext& context() const override { return ctx_; }

 private:
  [[noreturn]] void fail(ErrorKind kind, const OpInfo& op, int peer, const std::string& what);
  [[noreturn]] void lost(const OpInfo& op, int fd, int peer, const std::string& name, const std::string& what);
  int next_fd_, prev_fd_;
  std::atomic<bool> poisoned_{false};
  bool prev_poisoned_ = false;  // the predecessor's poison byte, taken before its stream ended
  LinkContext ctx_;
  const AbortSignal* abort_;
  double timeout_s_;
};

}  // namespace ering
