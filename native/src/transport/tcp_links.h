// The TCP ends of a ring direction: every segment travels as a 24-byte frame header and
// its payload on the connection of its direction (rank r -> r+1), and the receiver checks
// the header, so ranks that call different collectives fail instead of mixing data.
#pragma once

#include <memory>

#include "transport/links.h"

namespace ering {

// The header of every frame on a TCP direction (native byte order: both ends are the same
// job's build).
struct FrameHeader {
  uint32_t seq;
  uint32_t tag;
  uint64_t index;
  uint64_t bytes;
};
static_assert(sizeof(FrameHeader) == 24, "frame header is 24 bytes on the wire");

// Sends frames to the next rank, which never sends on this connection: anything readable
// on it (data, FIN, RST, the poison byte) means it closed.
std::unique_ptr<End> tcp_send_end(int fd, const LinkContext& ctx);
// Receives frames from the previous rank into the plan's recv_span().
std::unique_ptr<End> tcp_recv_end(int fd, const LinkContext& ctx);

}  // namespace ering
