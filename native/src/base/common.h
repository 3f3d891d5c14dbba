// Shared vocabulary of the core: dtypes, reduce ops, clocks, the one error type, and
// printable() for strings a peer supplied.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace ering {

enum class DType : int { Float16 = 0, BFloat16, Float32, Float64, Int32, Int64, UInt8 };
enum class ReduceOp : int { Sum = 0, Average, Min, Max };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
const char* op_name(ReduceOp op);

// A peer-supplied string made safe for a log line or an error message: bytes outside
// printable ASCII (escape codes, newlines, NUL) become \xNN, a backslash \\, and it is cut at
// max_bytes (noting the full length), so no peer can forge lines or drive a terminal.
std::string printable(const std::string& s, size_t max_bytes = 64);

using Clock = std::chrono::steady_clock;

// A time in seconds (as configured, a double) as the clock's duration.
inline Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

// Why a communicator operation failed. Everything except Invalid poisons the
// communicator: the caller must discard it and form a new one. One list, so the binding
// exports exactly these names and values (elastic.ring._native.ErrorKind) and Python never
// mirrors the numbers.
#define ERING_ERROR_KINDS(X)                                                                                   \
  X(PeerLost, 0, "a ring neighbour closed or reset its connection")                                           \
  X(Timeout, 1, "not finished within the collective timeout (a peer not in the collective, or hung)")          \
  X(Aborted, 2, "abort() was called, locally or by a neighbour's failure")                                    \
  X(Refused, 3, "a neighbour that proved the job's secret refused the handshake (another world version, "     \
                "world size, rank or job, or a duplicate)")                                                   \
  X(Invalid, 4, "bad arguments; the communicator is still usable")                                            \
  X(Mismatch, 5, "ranks called different collectives (a program bug)")                                        \
  X(Propagated, 6, "a neighbour failed or aborted because of a failure elsewhere in the ring")                \
  X(SettingsMismatch, 7, "ranks of one world have different ring settings, as a neighbour that proved the "   \
                         "job's secret says; no later world fixes that")                                      \
  X(Unreachable, 8, "a neighbour's announced address cannot be used: not HOST:PORT, a wildcard, a name that " \
                    "does not resolve, or nothing accepts connections there")                                 \
  X(BadPeer, 9, "what answers at a neighbour's address does not prove the job's secret or does not speak "    \
                "the ring protocol (an unauthenticated refusal, garbage)")

enum class ErrorKind : int {
#define ERING_KIND_VALUE(name, number, doc) name = number,
  ERING_ERROR_KINDS(ERING_KIND_VALUE)
#undef ERING_KIND_VALUE
};

class CommError : public std::runtime_error {
 public:
  CommError(ErrorKind kind, const std::string& msg, std::string op = "", int64_t world_version = -1,
            int rank = -1, int peer = -1)
      : std::runtime_error(msg),
        kind(kind), op(std::move(op)), world_version(world_version), rank(rank), peer(peer) {}
  ErrorKind kind;
  std::string op;
  int64_t world_version;
  int rank;
  int peer;
  // The collective that failed, when the failure came from one: its sequence number on this
  // communicator, what it is (OpInfo::call_tag) and its description; call_seq -1: none.
  int64_t call_seq = -1;
  uint32_t call_tag = 0;
  std::string call;
};

// The error of a failed form() of world version `world_version` on `rank`, blaming `peer`
// (-1: nobody): "form (world version V, rank R): what". Every step of forming builds it here.
inline CommError form_error(ErrorKind kind, uint64_t world_version, int rank, int peer, const std::string& what) {
  return CommError(kind, "form (world version " + std::to_string(world_version) + ", rank " + std::to_string(rank) +
                             "): " + what,
                   "form", int64_t(world_version), rank, peer);
}

}  // namespace ering
