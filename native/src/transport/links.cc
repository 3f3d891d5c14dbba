// The one loop that drives the ends of a collective's rings (run_steps), and what every end
// shares: the poison byte, failure messages, and watching the connections of a blocked ring.
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
#include <optional>
#include <stdexcept>

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

// The poll() events that tell a watched connection ended or carries the poison byte.
constexpr short kWatchEvents = POLLRDHUP | POLLPRI;

// Throws the op's CommError if one of a ring's connections, watched while the ring waits,
// ended or carries the poison byte: `polled` holds their revents from a poll(), or is null to
// look now without waiting.
void check_watched(const std::vector<WatchFd>& w, const short* polled, const LinkContext& ctx, const OpInfo& op) {
  short now[2] = {0, 0};
  if (!polled) {
    pollfd p[2];
    for (size_t i = 0; i < w.size() && i < 2; ++i) p[i] = {w[i].fd, kWatchEvents, 0};
    if (poll(p, nfds_t(std::min<size_t>(w.size(), 2)), 0) <= 0) return;
    for (size_t i = 0; i < w.size() && i < 2; ++i) now[i] = p[i].revents;
    polled = now;
  }
  for (size_t i = 0; i < w.size() && i < 2; ++i) {
    short ev = polled[i];
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
  CommError err(kind, msg, op.name, int64_t(ctx.world_version), ctx.rank, peer);
  err.call_seq = int64_t(op.seq);
  err.call_tag = op.call_tag;
  err.call = op.describe;
  throw err;
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

void Links::run(Plan& plan, const OpInfo& op) { run_steps({Step{this, &plan, op}}); }

size_t Schedule::add(Links* ring, std::unique_ptr<Plan> plan, OpInfo op, ptrdiff_t after) {
  plans.push_back(std::move(plan));
  steps.push_back(Step{ring, plans.back().get(), std::move(op), after});
  return steps.size() - 1;
}

// ---------------------------------------------------------------- run_steps

// The loop of run_steps(): one lane per ring, each with its steps in order and the one in
// flight. Everything that waits sleeps in one poll().
class StepRunner {
 public:
  explicit StepRunner(const std::vector<Step>& steps);
  void run();

 private:
  struct Lane {
    Links* ring;
    std::vector<size_t> steps;    // indices into the schedule, in the order they run
    size_t next = 0;              // steps[next] is in flight, or the next to start
    std::optional<RunState> run;  // the step in flight
    bool pending() const { return run || next < steps.size(); }
    const OpInfo& op(const std::vector<Step>& all) const { return all[steps[std::min(next, steps.size() - 1)]].op; }
  };
  void loop();
  // Its next step waits for a step of another ring that has not finished.
  bool blocked(const Lane& l) const {
    if (l.run || l.next == l.steps.size()) return false;
    const ptrdiff_t after = steps_[l.steps[l.next]].after;
    return after >= 0 && !done_[size_t(after)];
  }
  bool start_steps();
  bool move_lanes();
  bool spins() const;
  void sleep();
  void check_blocked(const short* polled);
  [[noreturn]] void fail(ErrorKind kind, const Lane& lane, int peer, const std::string& what) const {
    link_failure(lane.ring->ctx_, kind, lane.op(steps_), peer, what);
  }
  [[noreturn]] void timed_out() const;
  const std::vector<Step>& steps_;
  std::vector<Lane> lanes_;
  std::vector<bool> done_;
  const AbortSignal* abort_;
  Clock::time_point deadline_;
  const Lane* at_ = nullptr;  // the lane a failure belongs to, for run()'s Aborted
  std::vector<pollfd> fds_;
  std::vector<short> watched_;  // revents of a blocked lane's two connections
};

StepRunner::StepRunner(const std::vector<Step>& steps) : steps_(steps), done_(steps.size(), false) {
  deadline_ = Clock::time_point::max();
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& s = steps[i];
    // Waiting only on an earlier step keeps every order of the steps free of cycles.
    if (s.after >= ptrdiff_t(i)) throw std::logic_error("run_steps: a step may only wait for an earlier one");
    auto lane = std::find_if(lanes_.begin(), lanes_.end(), [&](const Lane& l) { return l.ring == s.ring; });
    if (lane == lanes_.end()) {
      lanes_.push_back(Lane{s.ring, {}, 0, std::nullopt});
      lane = lanes_.end() - 1;
    }
    lane->steps.push_back(i);
    // Not moved by progress: a byte a neighbour sends says nothing about the rank that is
    // missing further round the ring, so a "no progress" deadline would fire at different
    // times on different ranks, paths and world sizes. The collective's own deadline does not.
    deadline_ = std::min(deadline_, s.op.deadline);
    if (s.ring->abort_ != steps[0].ring->abort_) throw std::logic_error("run_steps: rings of two communicators");
  }
  abort_ = steps.empty() ? nullptr : steps[0].ring->abort_;
  at_ = lanes_.empty() ? nullptr : &lanes_[0];
  fds_.resize(1 + 2 * lanes_.size());
}

void StepRunner::run() {
  try {
    loop();
  } catch (CommError& e) {
    if (e.kind != ErrorKind::Aborted && e.kind != ErrorKind::Invalid && abort_->fired())
      fail(ErrorKind::Aborted, *at_, -1, "communicator aborted");
    throw;
  }
}

void StepRunner::loop() {
  auto idle_since = Clock::time_point{};
  auto watched_at = Clock::now();
  for (;;) {
    if (abort_->fired()) fail(ErrorKind::Aborted, *at_, -1, "communicator aborted");
    bool progress = start_steps();
    progress = move_lanes() || progress;
    if (std::none_of(lanes_.begin(), lanes_.end(), [](const Lane& l) { return l.pending(); })) return;
    if (progress) {
      auto now = Clock::now();
      idle_since = Clock::time_point{};
      if (now - watched_at > kWatchEvery) {
        watched_at = now;
        check_blocked(nullptr);
      }
      continue;
    }
    if (spins()) {
      auto now = Clock::now();
      if (idle_since == Clock::time_point{}) idle_since = now;
      if (now - idle_since < kSpin) {
        sched_yield();
        continue;
      }
    }
    // Every end in flight arms, then looks once more: a peer that publishes in between
    // either sees the flag (and rings) or is seen here.
    bool ready = false;
    for (Lane& l : lanes_) {
      if (!l.run) continue;
      ready = l.ring->send_->arm(*l.run) || ready;
      ready = l.ring->recv_->arm(*l.run) || ready;
    }
    if (!ready) sleep();
    for (Lane& l : lanes_) {
      l.ring->send_->disarm();
      l.ring->recv_->disarm();
    }
    idle_since = Clock::time_point{};  // spin again briefly after every wake-up
  }
}

// Starts the next step of every ring that is free, once the step it waits for has finished.
bool StepRunner::start_steps() {
  bool started = false;
  for (Lane& l : lanes_) {
    if (l.run || l.next == l.steps.size() || blocked(l)) continue;
    const Step& s = steps_[l.steps[l.next]];
    at_ = &l;
    l.run.emplace(*s.plan, s.op, l.ring->ctx_);
    l.ring->send_->start(*l.run);
    l.ring->recv_->start(*l.run);
    started = true;
  }
  return started;
}

// Moves what every step in flight can move without blocking; a step whose segments all
// moved is done, and its ring free for the next.
bool StepRunner::move_lanes() {
  bool progress = false;
  for (Lane& l : lanes_) {
    if (!l.run) continue;
    at_ = &l;
    RunState& s = *l.run;
    progress = l.ring->send_->move(s) || progress;
    if (s.received < s.nrecv) progress = l.ring->recv_->move(s) || progress;
    if (s.sent == s.nsend && s.received == s.nrecv) {
      done_[l.steps[l.next++]] = true;
      l.run.reset();
      progress = true;
    }
  }
  return progress;
}

// Shared memory moves without a system call to wake the waiter: spin briefly before sleeping.
bool StepRunner::spins() const {
  return std::any_of(lanes_.begin(), lanes_.end(),
                     [](const Lane& l) { return l.run && (l.ring->send_->spins() || l.ring->recv_->spins()); });
}

// A blocked ring's connections, looked at (polled: their revents; null: now, without waiting).
// Its neighbours cannot finish the step it waits to start, so an ending connection is a failure.
void StepRunner::check_blocked(const short* polled) {
  for (size_t i = 0; i < lanes_.size(); ++i) {
    const Lane& l = lanes_[i];
    if (!blocked(l)) continue;
    const short* mine = polled ? polled + 2 * i : nullptr;
    if (mine && !mine[0] && !mine[1]) continue;
    at_ = &l;
    check_watched(l.ring->connections(), mine, l.ring->ctx_, l.op(steps_));
  }
}

void StepRunner::timed_out() const {
  const Lane* waited = at_;
  for (const Lane& l : lanes_)
    if (l.run) {
      waited = &l;
      break;
    }
  const Neighbour& peer = waited->run && waited->run->received < waited->run->nrecv ? waited->ring->recv_->peer()
                                                                                   : waited->ring->send_->peer();
  char secs[32];
  std::snprintf(secs, sizeof(secs), "%g", waited->op(steps_).timeout_s);
  fail(ErrorKind::Timeout, *waited, peer.rank,
       std::string("not finished ") + secs + " s after this rank entered it (the collective timeout, "
           "ELASTIC_COLLECTIVE_TIMEOUT): waiting on " + peer.name +
           " (not in this collective: busy elsewhere, or hung, stopped or partitioned)");
}

// Nothing moved and nothing is left to spin for: sleeps in poll() on abort, the connections of
// every step in flight and those of every blocked ring, until one is ready or the deadline.
void StepRunner::sleep() {
  int ms = poll_ms_until(deadline_);
  if (ms == 0) timed_out();
  fds_[0] = {abort_->fd(), POLLIN, 0};
  for (size_t i = 0; i < lanes_.size(); ++i) {
    const Lane& l = lanes_[i];
    pollfd* f = &fds_[1 + 2 * i];
    const int send_fd = l.ring->send_->peer().fd, recv_fd = l.ring->recv_->peer().fd;
    if (l.run) {
      // An end with nothing more to move in this step is left out (a negative fd): poll()
      // reports POLLHUP and POLLERR even for no events, and a neighbour that finished its
      // part and closed (reset by a doorbell it never read) is no failure of a step that
      // needs nothing more from it. Were it gone too early, the end that still waits says so.
      const short send_events = l.ring->send_->events(*l.run), recv_events = l.ring->recv_->events(*l.run);
      f[0] = {send_events ? send_fd : -1, send_events, 0};
      f[1] = {recv_events ? recv_fd : -1, recv_events, 0};
    } else if (blocked(l)) {
      f[0] = {send_fd, kWatchEvents, 0};
      f[1] = {recv_fd, kWatchEvents, 0};
    } else {
      f[0] = f[1] = {-1, 0, 0};  // done: a neighbour may finish and close
    }
  }
  int r = poll(fds_.data(), nfds_t(fds_.size()), ms);
  if (r < 0 && errno != EINTR)
    fail(ErrorKind::PeerLost, *at_, -1, std::string("poll failed: ") + std::strerror(errno));
  if (fds_[0].revents) fail(ErrorKind::Aborted, *at_, -1, "communicator aborted");
  if (r <= 0) return;
  watched_.assign(2 * lanes_.size(), 0);
  for (size_t i = 0; i < lanes_.size(); ++i)
    if (blocked(lanes_[i])) {
      watched_[2 * i] = fds_[1 + 2 * i].revents;
      watched_[2 * i + 1] = fds_[2 + 2 * i].revents;
    }
  check_blocked(watched_.data());
  for (size_t i = 0; i < lanes_.size(); ++i) {
    Lane& l = lanes_[i];
    if (!l.run) continue;
    at_ = &l;
    // The receiving end first: it only takes note (a poison byte that must be read before
    // the stream's end is seen), while the sending end may fail the step.
    if (fds_[2 + 2 * i].fd >= 0) l.ring->recv_->polled(fds_[2 + 2 * i].revents, *l.run);
    if (fds_[1 + 2 * i].fd >= 0) l.ring->send_->polled(fds_[1 + 2 * i].revents, *l.run);
  }
}

void run_steps(const std::vector<Step>& steps) {
  if (steps.empty()) return;
  StepRunner(steps).run();
}

}  // namespace ering
