// The allreduce algorithm's choice and its names.
#include "algorithm.h"

namespace ering {
namespace {

// Each algorithm and the name Python reports for it: the one place the strings come from.
// The small-message path runs on the flat ring and has always been reported as the ring.
struct Named {
  Algorithm algorithm;
  const char* name;
};
constexpr Named kNames[] = {
    {Algorithm::Ring, "ring"},
    {Algorithm::SmallMessage, "ring"},
    {Algorithm::Hierarchical, "hierarchical"},
};

}  // namespace

Algorithm choose_allreduce(size_t bytes, const CommConfig& cfg, const Hierarchy& h) {
  if (h.applies && (cfg.algorithm == CommConfig::AlgorithmSetting::Hierarchical || bytes > cfg.hierarchical_bytes))
    return Algorithm::Hierarchical;
  return bytes <= cfg.small_bytes ? Algorithm::SmallMessage : Algorithm::Ring;
}

const char* algorithm_name(Algorithm a) {
  for (const Named& n : kNames)
    if (n.algorithm == a) return n.name;
  return "?";
}

}  // namespace ering
