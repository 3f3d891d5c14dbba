// The data plane of a communicator's rings: a Plan (what a collective sends and receives,
// as numbered segments), the Links that move it between this rank and its two neighbours on
// one ring, and the loop that runs the steps of a collective over one or more rings
// (run_steps) with one deadline, abort, and the poison byte that tells a neighbour a failure
// was passed on.
//
// The links know connections and segments only; which bytes go where is the Plan's
// business (plans.h), and which ring runs what when is the Steps' (hierarchical.h). Each
// direction is an end: TCP frames (tcp_links.h) or shared memory (shm_links.h); one loop
// here drives them all, whatever they are.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "base/common.h"
#include "transport/io.h"

namespace ering {

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

struct OpInfo {
  const char* name;      // "allreduce", "broadcast", ...
  uint32_t seq;          // per-communicator operation counter, identical on every rank
  uint32_t tag;          // hash of what the op is (kind, dtype, op, size): catches mismatched calls
  std::string describe;  // for errors: "allreduce #7 (float32, 1000 elements, sum)"
  // The collective timeout: when this rank entered the collective plus the timeout. Every
  // step of the collective (each phase of the hierarchical path) ends by it, so the timeout
  // means one thing on every path and world size: the longest a rank stays in one
  // collective, however far its neighbours got.
  Clock::time_point deadline;
  double timeout_s;
  // The tag segments from the previous rank must carry, when it differs from what this rank
  // sends (a shift names each link's size in its tags, so a receiver expecting another size
  // fails at the first segment instead of taking a prefix); -1: `tag`.
  int64_t recv_tag = -1;
  // What the collective is, the same on every rank that called the same one: `tag` of the
  // call, before a phase or a link's size changes it (a shift's sizes differ by rank). A rank
  // reports it when the collective failed, so the world can tell who called another one.
  uint32_t call_tag = 0;
};

struct LinkContext {
  int rank;
  int size;
  uint64_t world_version;
  int next_rank, prev_rank;
  std::string next_address, prev_address;  // as printed in messages (printable())
  double dead_link_timeout_s = 0;          // CommConfig::dead_link_timeout, for messages
};

// A connection of a ring that is watched while it carries nothing for this rank: a ring
// whose next step waits for a step of another ring (run_steps), or the flat ring while the
// reverse ring forms. A rank blocked on one ring must still learn at once that a neighbour it
// needs on another gave up or died (FIN, RST or the poison byte; data and doorbells on it
// are left alone).
struct WatchFd {
  int fd;
  int peer;
  std::string name;
};

// Where one step on a ring stands: the collective in flight there and how far each
// direction has got. The ends advance their own counter; the loop reads both.
struct RunState {
  RunState(Plan& p, const OpInfo& o, const LinkContext& c)
      : plan(p), op(o), ctx(c), nsend(p.num_sends()), nrecv(p.num_recvs()) {}
  Plan& plan;
  const OpInfo& op;
  const LinkContext& ctx;
  const size_t nsend, nrecv;
  size_t sent = 0, received = 0;  // segments wholly sent / received so far
  // The next send segment may start: it exists, and the receive it waits for has completed.
  bool may_send() const {
    return sent < nsend && (plan.send_after(sent) < 0 || size_t(plan.send_after(sent)) < received);
  }
};

// How errors name a neighbour: "rank 3 (10.0.0.2:4000)".
std::string rank_name(int rank, const std::string& address);

// One neighbour's connection, as an end of a link sees it.
struct Neighbour {
  Neighbour(int fd, int rank, const std::string& address);
  int fd;
  int rank;
  std::string name;       // "rank 3 (10.0.0.2:4000)"
  bool poisoned = false;  // its poison byte, taken (a read past it would drop it) before its stream ended
  // Its connection ended: "propagated" if its poison byte came first, else the peer is lost.
  [[noreturn]] void closed(const RunState& s);
  // A send or receive on its connection failed with `err`.
  [[noreturn]] void broke(const RunState& s, int err);
};

// One end of a ring direction: the sending end (this rank -> the next) or the receiving
// end (the previous rank -> this one), over TCP frames or shared memory. It owns the
// connection to that neighbour. run_steps() drives the two ends of every ring in one loop.
class End {
 public:
  enum Direction { Send, Recv };
  End(Direction d, Neighbour peer) : dir_(d), peer_(std::move(peer)) {}
  virtual ~End();
  End(const End&) = delete;
  End& operator=(const End&) = delete;
  virtual const char* kind() const = 0;  // "tcp" or "shm"
  // Waits spin briefly before sleeping in poll() (memory the peer writes, not a socket).
  virtual bool spins() const { return false; }
  // A new step begins: the first segment of this end's direction.
  void start(RunState& s);
  // Moves what it can without blocking, advancing s.sent (a sending end, while
  // s.may_send()) or s.received (handing each segment to the plan); true if anything moved.
  // Throws when it cannot go on (the neighbour's connection ended, a segment that does not
  // match).
  virtual bool move(RunState& s) = 0;
  // About to sleep: arms the peer's wake-up (shared memory's sleeping flag); true when,
  // looking once more, there is something to do after all. disarm() after the sleep.
  virtual bool arm(const RunState& s) { return false; }
  virtual void disarm() {}
  // The poll() events to sleep on for the neighbour's connection, and what they mean. A
  // receiving end only takes note (a poison byte, EOF), for its next move() to act on.
  virtual short events(const RunState& s) const = 0;
  virtual void polled(short revents, RunState& s) = 0;
  const Neighbour& peer() const { return peer_; }

 protected:
  // Segments of this end's direction still to move in this run.
  bool more(const RunState& s) const { return dir_ == Send ? s.sent < s.nsend : s.received < s.nrecv; }
  // The current segment wholly moved (a receiving end has told the plan): count it and take
  // the next one.
  void next_segment(RunState& s);
  const Direction dir_;
  Neighbour peer_;
  Span span_{nullptr, 0};  // the segment in flight
  size_t off_ = 0;         // how much of it moved (TCP: of its frame, header included)
};

// One ring of a communicator: a sending end to the next rank and a receiving end from the
// previous one, whichever each is (TCP, or shared memory for a neighbour on the same host).
// run_steps() drives them, so the deadline, abort, watching and failure rules are written
// once for every transport and every ring.
class Links {
 public:
  // `send` is a sending end to ctx.next_rank, `recv` a receiving end from ctx.prev_rank.
  Links(std::unique_ptr<End> send, std::unique_ptr<End> recv, LinkContext ctx, const AbortSignal* abort);
  // Runs one plan on this ring to the end: run_steps() with one step.
  void run(Plan& plan, const OpInfo& op);
  // Shuts the connections down so neighbours fail fast: how one failure reaches every rank.
  // The poison byte once on both, then shutdown() (not close(): safe while another thread
  // polls them; FIN reaches both at once). Ends keep their memory until destroyed.
  void shutdown();
  // How this rank sends to the next rank and receives from the previous one: "tcp" or "shm".
  const char* send_kind() const { return send_->kind(); }
  const char* recv_kind() const { return recv_->kind(); }
  // This ring's two connections, {to the next rank, from the previous rank}, for watching.
  std::vector<WatchFd> connections() const;
  // Outside a run: throws op's CommError if a neighbour on this ring gave up or died (Aborted
  // after this rank's own abort(), as a run).
  void check_alive(const OpInfo& op);

 private:
  friend class StepRunner;  // links.cc: the loop of run_steps()
  std::unique_ptr<End> send_, recv_;
  LinkContext ctx_;
  const AbortSignal* abort_;
  std::atomic<bool> poisoned_{false};
};

// One collective on one ring, as a step of a collective over several rings.
struct Step {
  Links* ring;
  Plan* plan;
  OpInfo op;             // its own tag and description; the deadline is the collective's
  ptrdiff_t after = -1;  // an earlier step (of another ring) that must finish before this one starts, or -1
};

// A collective over several rings as data: its plans, and the steps that run them.
struct Schedule {
  std::vector<std::unique_ptr<Plan>> plans;
  std::vector<Step> steps;
  // Adds a step running `plan` on `ring` after `after` (-1: its ring's previous step only);
  // returns its index.
  size_t add(Links* ring, std::unique_ptr<Plan> plan, OpInfo op, ptrdiff_t after = -1);
};

// Runs `steps` to the end in one loop on the calling thread: each ring takes its steps in the
// order given, and a step starts once its ring's previous step and its `after` step have
// finished, so rings overlap where the steps allow. The rings (of one communicator: they
// share its abort signal) wait together in one poll(): on abort, on their connections, and
// on the connections of a ring whose next step still waits (see WatchFd), until the earliest
// step deadline. Fails (CommError) when the deadline passes first (Timeout), on abort, when
// a neighbour's connection ends or a segment does not match. After this rank's own abort()
// every failure is reported as Aborted: abort() shuts the sockets down, and a send or
// receive that meets that end first would blame a neighbour.
void run_steps(const std::vector<Step>& steps);

// The poison byte: one TCP urgent byte a rank sends before shutting a connection down when
// it gives up, so a neighbour reports "propagated" instead of blaming a live rank.
void send_poison(int fd);
// Reads a pending poison byte; true if there was one.
bool take_poison(int fd);
// After a short read: reads the poison byte if the read stopped at the urgent mark (the
// next read past it would discard it).
bool take_poison_at_mark(int fd);
// Throws the CommError of a failed operation on this rank, naming op, version, rank and peer.
[[noreturn]] void link_failure(const LinkContext& ctx, ErrorKind kind, const OpInfo& op, int peer,
                               const std::string& what);
// Empty when a segment's header (what a TCP frame or a shared-memory chunk says it is) is
// receive `index` of `op`, `bytes` long; else why not, naming the sender.
std::string segment_mismatch(uint32_t seq, uint32_t tag, uint64_t index, uint64_t bytes, const OpInfo& op,
                             size_t want_index, size_t want_bytes, const std::string& sender);

}  // namespace ering
