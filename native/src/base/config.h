// The settings of a communicator: the one place each is defined and given its default.
//
// Python's elastic.CommConfig takes its defaults from here (the binding exposes this struct
// as elastic.ring._native.CommConfig) and fills one by field name, so no default is written twice.
// Every rank of a world must use the same settings (Communicator.connect() checks).
#pragma once

#include <cstddef>
#include <string>

namespace ering {

struct CommConfig {
  // Seconds a rank may stay in one collective (from entering it) before it fails with Timeout.
  // Long, like torch's gloo default (30 min): hung, stopped or partitioned processes are fenced
  // by the rendezvous heartbeat within seconds and their collectives aborted, so this only has
  // to catch a live process that never enters the collective, and must not fire on one busy
  // for a while elsewhere (evaluation, a checkpoint write) or on a long transfer.
  double timeout = 1800.0;
  double form_timeout = 30.0;      // seconds form() waits for both ring neighbours
  // Seconds a ring connection may go without the peer's kernel acknowledging anything before
  // the kernel fails it (TCP_USER_TIMEOUT for data in flight, keepalive probes for an idle
  // side): a link that silently drops everything (a cable pulled, a firewall) ends the ring
  // in this long, whatever `timeout`. A live peer's kernel acknowledges even while its process
  // is busy, so a short value evicts nobody busy; too short for a lossy link's retransmissions
  // would cut a link that is only slow.
  double dead_link_timeout = 30.0;
  size_t segment_bytes = 1 << 20;  // pipeline segment: ~1 MiB keeps both directions busy
  size_t small_bytes = 32 << 10;   // allreduce up to this size takes the small-message path (measured)
  size_t fusion_bytes = 64 << 20;  // async allreduces are fused into buckets up to this size
  // Auto: a neighbour on the same host (same entry in `hosts`) gets shared memory; Tcp: never.
  enum class Transport { Auto, Tcp } transport = Transport::Auto;
  // Which allreduce algorithms may run (the choice itself: algorithm.h). Ring: the flat ring
  // always. Hierarchical: the hierarchical schedule whenever the world allows it (see
  // Hierarchy), else the ring. Auto: the hierarchical schedule when the world allows it and
  // the buffer is larger than hierarchical_bytes, else the ring.
  enum class AlgorithmSetting { Auto, Ring, Hierarchical } algorithm = AlgorithmSetting::Auto;
  size_t hierarchical_bytes = 4 << 20;  // "auto" goes hierarchical above this size (measured)
};

// Throws CommError(Invalid) naming the first setting that is out of range.
void check_config(const CommConfig& c);

// The settings' names as Python and the environment spell them ("auto", "tcp", ...);
// parse_* throw CommError(Invalid) naming the choices.
const char* transport_name(CommConfig::Transport t);
CommConfig::Transport parse_transport(const std::string& name);
const char* algorithm_setting_name(CommConfig::AlgorithmSetting a);
CommConfig::AlgorithmSetting parse_algorithm_setting(const std::string& name);

}  // namespace ering
