// Which algorithm an allreduce runs: a typed choice, made once per call by a pure function
// of the buffer's size, the settings and the world's shape. Every rank of a world has the
// same settings (Python's Communicator.connect() checks) and the same hosts, so every rank
// makes the same choice without a word exchanged.
#pragma once

#include <cstddef>

#include "base/config.h"
#include "hierarchical.h"

namespace ering {

enum class Algorithm {
  Ring,          // reduce-scatter then allgather round the flat ring, pipelined by segments
  SmallMessage,  // the whole buffers gathered round the flat ring, then reduced by every rank in rank order
  Hierarchical,  // host-local allreduce, leaders' allreduce, host-local broadcast, pipelined by chunks
};

// The algorithm for an allreduce of `bytes` (more than zero, in a world of two or more):
// hierarchical where the world's shape allows it (`h.applies`) and either the setting asks
// for it or the buffer is larger than cfg.hierarchical_bytes; else the flat ring, whose
// small-message path takes buffers of at most cfg.small_bytes.
Algorithm choose_allreduce(size_t bytes, const CommConfig& cfg, const Hierarchy& h);

// What Python's Communicator.algorithm_for() reports: "ring" or "hierarchical".
const char* algorithm_name(Algorithm a);

}  // namespace ering
