// Shared vocabulary of the core: dtypes, reduce ops, clocks and the one error type.
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

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Why a communicator operation failed. Everything except Invalid poisons the
// communicator: the caller must discard it and form a new one.
enum class ErrorKind : int {
  PeerLost = 0,   // a ring neighbour closed or reset its connection
  Timeout = 1,    // no progress before the deadline (hung or partitioned peer)
  Aborted = 2,    // abort() was called, locally or by a neighbour's failure
  Refused = 3,    // a handshake was refused (wrong job, secret or world version)
  Invalid = 4,    // bad arguments; the communicator is still usable
  Mismatch = 5,   // ranks called different collectives (a program bug)
  Propagated = 6, // a neighbour failed or aborted because of a failure elsewhere in the ring
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
};

}  // namespace ering
