// What a contained run's evidence says, summed up: the normalised memory counters and whether
// the worker succeeded (and why not). Derived from the typed Evidence, never from JSON.
#include <algorithm>
#include <string>

#include "supervisor/contain/evidence.h"

namespace assay::contain {

std::vector<std::string> Evidence::memory_pressure() const {
  NormalisedEvidence n = normalised();
  std::vector<std::string> seen;
  for (auto [field, value] : {std::pair{"memory_high_events", n.memory_high_events},
                              std::pair{"memory_max_events", n.memory_max_events},
                              std::pair{"memory_oom_events", n.memory_oom_events},
                              std::pair{"memory_oom_kill_events", n.memory_oom_kill_events}})
    if (value.value_or(0) > 0) seen.push_back(n.sources[field] + " = " + std::to_string(*value));
  if (n.memory_swap_bytes.value_or(0) > 0)
    seen.push_back("swap " + std::to_string(*n.memory_swap_bytes) + " bytes (" +
                   n.sources["memory_swap_bytes"] + ")");
  return seen;
}

namespace {

// A resident job's counters as per-job figures: each cumulative counter minus its value at the
// job's start (never below 0), a counter reset at the start as read, and the lifetime peaks the
// kernel cannot reset (memory.peak, memory.swap.peak, pids.peak) left out. Current values
// (usage_in_bytes, swap.current) stay as read.
Counters per_job(const Counters& end, const ResidentEvidence& r) {
  static const std::vector<std::string> kLifetime = {"memory.peak", "memory.swap.peak", "pids.peak",
                                                     "memory.max_usage_in_bytes",
                                                     "memory.memsw.max_usage_in_bytes"};
  static const std::vector<std::string> kCurrent = {
      "memory.usage_in_bytes", "memory.memsw.usage_in_bytes", "memory.swap.current"};
  auto listed = [](const std::vector<std::string>& v, const std::string& f) {
    return std::find(v.begin(), v.end(), f) != v.end();
  };
  auto minus = [](std::optional<std::uint64_t> a, std::optional<std::uint64_t> b) {
    if (!a || !b) return std::optional<std::uint64_t>();
    return std::optional<std::uint64_t>(*a > *b ? *a - *b : 0);
  };
  Counters out;
  for (const auto& [file, c] : end) {
    if (listed(r.reset, file) || listed(kCurrent, file)) {
      out[file] = c;
      continue;
    }
    if (listed(kLifetime, file)) continue;
    const Counter* start = nullptr;
    if (r.counters_at_start)
      if (auto it = r.counters_at_start->find(file); it != r.counters_at_start->end())
        start = &it->second;
    Counter d;
    if (start && c.value) d.value = minus(c.value, start->value);
    if (start && c.keys && start->keys) {
      d.keys.emplace();
      for (const auto& [k, v] : *c.keys) {
        auto s = start->keys->find(k);
        (*d.keys)[k] = s == start->keys->end() ? std::nullopt : minus(v, s->second);
      }
    }
    out[file] = d;
  }
  return out;
}

}  // namespace

std::optional<Counters> Evidence::job_counters() const {
  if (!counters) return std::nullopt;
  if (!resident) return counters;
  return per_job(*counters, *resident);
}

NormalisedEvidence Evidence::normalised() const {
  NormalisedEvidence n;
  const std::optional<Counters> job = job_counters();
  auto find = [&](const std::string& file) -> const Counter* {
    if (!job) return nullptr;
    auto it = job->find(file);
    return it == job->end() ? nullptr : &it->second;
  };
  // Sets `field` from a single-number file, recording the source when the kernel offered it.
  auto from_value = [&](std::optional<std::uint64_t>& field, const char* name,
                        const std::string& file) {
    const Counter* c = find(file);
    if (field || !c || !c->value) return;
    field = c->value;
    n.sources[name] = file;
  };
  auto from_key = [&](std::optional<std::uint64_t>& field, const char* name,
                      const std::string& file, const std::string& key) {
    const Counter* c = find(file);
    if (field || !c || !c->keys) return;
    auto it = c->keys->find(key);
    if (it == c->keys->end() || !it->second) return;
    field = it->second;
    n.sources[name] = file + ":" + key;
  };
  // cgroup v2
  from_key(n.memory_high_events, "memory_high_events", "memory.events", "high");
  from_key(n.memory_max_events, "memory_max_events", "memory.events", "max");
  from_key(n.memory_oom_events, "memory_oom_events", "memory.events", "oom");
  from_key(n.memory_oom_kill_events, "memory_oom_kill_events", "memory.events", "oom_kill");
  from_value(n.memory_peak_bytes, "memory_peak_bytes", "memory.peak");
  from_value(n.memory_swap_bytes, "memory_swap_bytes", "memory.swap.peak");
  from_value(n.memory_swap_bytes, "memory_swap_bytes", "memory.swap.current");
  // cgroup v1: no memory.high and no count of OOM invocations (oom_control has under_oom, a
  // state); failcnt counts the charges that hit the limit; swap is memory+swap minus memory.
  from_value(n.memory_max_events, "memory_max_events", "memory.failcnt");
  from_key(n.memory_oom_kill_events, "memory_oom_kill_events", "memory.oom_control", "oom_kill");
  from_value(n.memory_peak_bytes, "memory_peak_bytes", "memory.max_usage_in_bytes");
  const Counter* memsw = find("memory.memsw.usage_in_bytes");
  const Counter* usage = find("memory.usage_in_bytes");
  if (!n.memory_swap_bytes && memsw && memsw->value && usage && usage->value) {
    // Two reads, not one snapshot: never below 0.
    n.memory_swap_bytes = *memsw->value > *usage->value ? *memsw->value - *usage->value : 0;
    n.sources["memory_swap_bytes"] = "memory.memsw.usage_in_bytes-memory.usage_in_bytes";
  }
  if (wall_usec) {
    n.elapsed_seconds = static_cast<double>(*wall_usec) / 1e6;
    n.sources["elapsed_seconds"] = "wall_usec";
  }
  if (limits) {
    n.timeout_seconds = static_cast<double>(limits->timeout.count()) / 1e3;
    n.sources["timeout_seconds"] = "limits.timeout_ms";
  }
  if (exit && exit->code) {
    n.exit_code = exit->code;
    n.sources["exit_code"] = "exit.code";
  }
  return n;
}

bool Evidence::succeeded() const {
  if (resident) return !exit && !timed_out && !cancelled && oom_killed != true;
  return exit && exit->code == 0 && !timed_out && oom_killed != true;
}

std::string Evidence::failure_reason() const {
  if (timed_out) return "timed out and was killed";
  if (oom_killed == true) return "was OOM-killed (memory limit reached)";
  if (exit && exit->signal) {
    return "was killed by signal " + exit->signal_name.value_or(std::to_string(*exit->signal));
  }
  if (resident && !exit) return cancelled ? "was stopped" : "";
  if (exit && exit->code == 0) return "";
  if (exit && exit->code) return "exited with code " + std::to_string(*exit->code);
  std::string reason = "left no exit status in its evidence";
  for (std::size_t i = 0; i < errors.size(); ++i) reason += (i ? "; " : ": ") + errors[i];
  return reason;
}

}  // namespace assay::contain
