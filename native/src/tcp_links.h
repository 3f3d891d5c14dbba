// The TCP data plane: every segment travels as a 24-byte frame header and its payload on
// the connection of its direction (rank r -> r+1), checked by the receiver.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <string>

#include "links.h"

namespace ering {

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

// Empty when `h` is the header of receive `index` (`bytes` long) of `op`; else why not.
std::string frame_mismatch(const FrameHeader& h, const OpInfo& op, size_t index, size_t bytes,
                           const std::string& sender);

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
