// The settings of a communicator and their defaults.
#pragma once

#include <cstddef>

namespace ering {

struct CommConfig {
  double timeout_s = 30.0;       // longest a collective may go without moving a byte
  double form_timeout_s = 30.0;  // longest form() waits for both neighbours
  size_t segment_bytes = 1 << 20;
  size_t small_bytes = 32 << 10;  // allreduce at or below this size takes the small-message path
  // Auto: a neighbour on the same host (same entry in `hosts`) gets shared memory; Tcp: never.
  enum class Transport { Auto, Tcp } transport = Transport::Auto;
  // Allreduce algorithm. Ring: the flat ring always. Hierarchical: the hierarchical
  // schedule whenever the world allows it (see Hierarchy), else the ring. Auto: the
  // hierarchical schedule when the world allows it and the buffer is larger than
  // hierarchical_bytes, else the ring. The choice depends only on world shape, size and
  // config, so every rank makes the same one (the config must be the same on every rank).
  enum class Algorithm { Auto, Ring, Hierarchical } algorithm = Algorithm::Auto;
  size_t hierarchical_bytes = 4 << 20;
};

}  // namespace ering
