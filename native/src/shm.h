// Shared-memory transport for ring neighbours on the same host.
//
// Bulk bytes of a link (rank r -> r+1) travel through a ring of chunks in a memfd that the
// sender creates and the receiver maps; the authenticated TCP connection of the link stays
// open as the control channel: it carries the set-up (LINK / LINK_ACK), a one-byte doorbell
// whenever the other side has gone to sleep, the poison byte, and EOF/RST when a process
// dies. Every wait is a poll() on that socket and the abort eventfd, after a short spin.
//
// The memfd is reachable only during forming (the receiver opens /proc/<pid>/fd/<n>, told
// over the authenticated connection, and checks a random token inside it); both sides
// close the fd once it is mapped, so no name is left anywhere and the memory goes away
// with the last mapping, also when a process is killed.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "tcp_links.h"

namespace ering {

// One direction's shared memory: a control block and `slots` chunks of `slot_bytes`.
class ShmRing {
 public:
  struct Control;
  struct Chunk;
  ~ShmRing();
  ShmRing(const ShmRing&) = delete;
  ShmRing& operator=(const ShmRing&) = delete;

  // Sender side: a new sealed memfd, mapped. *fd is open until close_fd().
  static std::unique_ptr<ShmRing> create(uint64_t world_version, uint32_t from_rank, uint32_t to_rank,
                                         size_t slots, size_t slot_bytes);
  // Receiver side: maps the sender's memfd through /proc; null with *why when that fails
  // or the memory is not what the sender announced (then the link stays on TCP).
  static std::unique_ptr<ShmRing> open(uint32_t pid, uint32_t fd, uint64_t bytes, const uint8_t* token,
                                       uint64_t world_version, uint32_t from_rank, uint32_t to_rank,
                                       std::string* why);

  int fd() const { return fd_; }
  void close_fd();
  uint64_t bytes() const { return bytes_; }
  const uint8_t* token() const;
  size_t slots() const { return slots_; }
  size_t slot_bytes() const { return slot_bytes_; }
  Control* control() const { return ctl_; }
  Chunk* chunk(uint64_t n) const;
  char* payload(uint64_t n) const;

 private:
  ShmRing() = default;
  int fd_ = -1;
  void* base_ = nullptr;
  uint64_t bytes_ = 0;
  size_t slots_ = 0, slot_bytes_ = 0;
  Control* ctl_ = nullptr;
};

struct LinkSettings {
  bool want_shm = false;  // both ends on one host and the transport allows it
  size_t slots = 8;
  size_t slot_bytes = 256 << 10;
};

// The LINK exchange after the handshake, on the link's connection. The sender (connector)
// calls offer_link() then, after accept_link() of its own predecessor, finish_link();
// the receiver (acceptor) calls accept_link(). Each returns the shared memory of the
// link, or null when it runs over TCP. Errors throw CommError for op "form".
std::unique_ptr<ShmRing> offer_link(int fd, const LinkSettings& s, const LinkContext& ctx,
                                    Clock::time_point deadline, const AbortSignal& abort);
std::unique_ptr<ShmRing> finish_link(int fd, std::unique_ptr<ShmRing> offered, const LinkContext& ctx,
                                     Clock::time_point deadline, const AbortSignal& abort);
std::unique_ptr<ShmRing> accept_link(int fd, const LinkSettings& s, const LinkContext& ctx,
                                     Clock::time_point deadline, const AbortSignal& abort);

// Links where at least one direction runs through shared memory; a direction whose
// neighbour is on another host keeps TCP framing (a mixed world).
class ShmLinks : public Links {
 public:
  ShmLinks(int next_fd, int prev_fd, std::unique_ptr<ShmRing> send, std::unique_ptr<ShmRing> recv, LinkContext ctx,
           const AbortSignal* abort, double timeout_s);
  ~ShmLinks() override;
  void run(Plan& plan, const OpInfo& op) override;
  void shutdown() override;
  const char* send_kind() const override { return send_ ? "shm" : "tcp"; }
  const char* recv_kind() const override { return recv_ ? "shm" : "tcp"; }
  std::vector<WatchFd> connections() const override;
  const LinkContext& context() const override { return ctx_; }

 private:
  [[noreturn]] void fail(ErrorKind kind, const OpInfo& op, int peer, const std::string& what);
  [[noreturn]] void lost(const OpInfo& op, int fd, int peer, const std::string& name, const std::string& what);
  int next_fd_, prev_fd_;
  std::unique_ptr<ShmRing> send_, recv_;
  uint64_t head_ = 0;  // chunks this rank published to send_ (it owns the counter)
  uint64_t tail_ = 0;  // chunks this rank consumed from recv_
  std::atomic<bool> poisoned_{false};
  LinkContext ctx_;
  const AbortSignal* abort_;
  double timeout_s_;
};

}  // namespace ering
