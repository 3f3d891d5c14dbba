// Checking and naming the communicator's settings.
#include "base/config.h"

#include <cmath>

#include "base/common.h"

namespace ering {
namespace {

[[noreturn]] void bad(const std::string& what) { throw CommError(ErrorKind::Invalid, "CommConfig." + what); }

}  // namespace

void check_config(const CommConfig& c) {
  if (!(c.timeout > 0) || !std::isfinite(c.timeout)) bad("timeout must be positive, got " + std::to_string(c.timeout));
  if (!(c.form_timeout > 0) || !std::isfinite(c.form_timeout))
    bad("form_timeout must be positive, got " + std::to_string(c.form_timeout));
  // Keepalive counts in whole seconds (a third idle, then 4 probes a sixth apart, each at least 1).
  if (!(c.dead_link_timeout >= 2 && c.dead_link_timeout <= 86400))
    bad("dead_link_timeout must be between 2 and 86400 seconds, got " + std::to_string(c.dead_link_timeout));
  if (c.segment_bytes < 64) bad("segment_bytes must be at least 64, got " + std::to_string(c.segment_bytes));
}

const char* transport_name(CommConfig::Transport t) { return t == CommConfig::Transport::Tcp ? "tcp" : "auto"; }

CommConfig::Transport parse_transport(const std::string& name) {
  if (name == "auto") return CommConfig::Transport::Auto;
  if (name == "tcp") return CommConfig::Transport::Tcp;
  bad("transport: unknown transport '" + printable(name) + "': expected 'auto' or 'tcp'");
}

const char* algorithm_setting_name(CommConfig::AlgorithmSetting a) {
  switch (a) {
    case CommConfig::AlgorithmSetting::Ring: return "ring";
    case CommConfig::AlgorithmSetting::Hierarchical: return "hierarchical";
    case CommConfig::AlgorithmSetting::Auto: break;
  }
  return "auto";
}

CommConfig::AlgorithmSetting parse_algorithm_setting(const std::string& name) {
  if (name == "auto") return CommConfig::AlgorithmSetting::Auto;
  if (name == "ring") return CommConfig::AlgorithmSetting::Ring;
  if (name == "hierarchical") return CommConfig::AlgorithmSetting::Hierarchical;
  bad("algorithm: unknown allreduce algorithm '" + printable(name) + "': expected 'auto', 'ring' or 'hierarchical'");
}

}  // namespace ering
