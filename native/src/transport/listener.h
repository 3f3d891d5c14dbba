// The listening socket for ring connections and its handshake thread: accepts, runs many
// handshakes at once (each with a deadline), parks neighbours of a newer world version,
// evicts strays when full, and hands each authenticated predecessor to take().
//
// The protocol is in handshake.h; this file holds the sockets and the state machine of
// one pending connection (ReadHello -> (WaitActive ->) ReadProof -> (Parked ->) taken or
// refused). See native/README.md, "Wire format".
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/common.h"
#include "transport/handshake.h"
#include "transport/io.h"

namespace ering {

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
  std::array<int, kChannels> slot_fd_{{-1, -1, -1, -1}};
  std::array<uint64_t, kChannels> slot_version_{{0, 0, 0, 0}};
  void close_slots_locked(bool all, uint64_t keep_version);
  std::deque<std::string> refusals_;  // guarded by mu_
  std::atomic<uint64_t> refusal_count_{0};
  // The stderr rate limit; the listener thread only.
  Clock::time_point log_window_{};
  int log_lines_ = 0;
  uint64_t log_suppressed_ = 0;
  std::thread thread_;
};

}  // namespace ering
