// What /metrics reports, counted where it happens; rendered by the API.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <string>

namespace assay::supervisor {

// The last kWindow durations of one phase: a quantile over recent work, in bounded memory.
struct Durations {
  static constexpr std::size_t kWindow = 1024;
  std::deque<double> recent;
  double sum = 0;           // over all, like a Prometheus summary's _sum
  std::uint64_t count = 0;  // over all
  void add(double seconds);
  double median() const;
};

struct Metrics {
  std::uint64_t submissions = 0, duplicates = 0, rejected = 0, queue_full = 0;
  std::uint64_t preflight_refusals = 0, preflight_waits = 0, oom_kills = 0, timeouts = 0;
  std::uint64_t connections_refused = 0, store_write_failures = 0, internal_errors = 0;
  std::map<std::string, Durations> durations;  // "job", "fingerprint", "oracle", ...
  // The Slurm executor: steps submitted, and each followed step's last Slurm state by name.
  std::uint64_t slurm_submitted = 0;
  std::map<std::string, std::string> slurm_steps;
  // Slurm worker pools: nodes by state (connected and free, busy, launching: submitted and not
  // yet dialled in), and nodes lost (channel closed or silent) over the daemon's life.
  std::map<std::string, std::uint64_t> pool_nodes;
  std::uint64_t pool_nodes_lost = 0;
};

}  // namespace assay::supervisor
