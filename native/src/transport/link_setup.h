// The LINK exchange right after a successful handshake, on the link's connection: the
// sender (connector) offers shared memory or TCP, the receiver (acceptor) answers which one
// the link uses. Both messages use the handshake header (handshake.h); see native/README.md,
// "Link set-up".
#pragma once

#include <memory>

#include "transport/io.h"
#include "transport/links.h"
#include "transport/shm_links.h"

namespace ering {

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

}  // namespace ering
