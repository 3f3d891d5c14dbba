// The shared-memory ends of a ring direction, for neighbours on the same host.
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

#include "transport/links.h"

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

// Sends to the next rank through `ring` (which this rank created and the next one mapped).
std::unique_ptr<End> shm_send_end(int fd, std::unique_ptr<ShmRing> ring, const LinkContext& ctx);
// Receives from the previous rank through `ring` (the previous rank's memory, mapped here).
std::unique_ptr<End> shm_recv_end(int fd, std::unique_ptr<ShmRing> ring, const LinkContext& ctx);

}  // namespace ering
