// Connecting to a ring neighbour: the connector's side of the handshake (handshake.h),
// retried with backoff until the form deadline.
#pragma once

#include <string>

#include "base/common.h"
#include "transport/handshake.h"
#include "transport/io.h"

namespace ering {

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

// How long a neighbour may accept no connection at all before it is taken for unreachable:
// the collective timeout, at most this. A live worker's listener accepts at once, so this
// stays short even when the collective timeout is long enough for a busy peer (minutes).
constexpr double kUnreachableAfterMaxS = 30.0;

}  // namespace ering
