// How much memory the supervisor may still use: the host's MemAvailable, capped by the room its
// own cgroup (or the tightest of its ancestors) has left. For the preflight.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace assay::contain {

struct MemoryView {
  std::uint64_t mem_available = 0;  // /proc/meminfo MemAvailable, bytes
  std::uint64_t mem_total = 0;      // /proc/meminfo MemTotal, bytes
  // The smallest memory limit on this process's cgroup and its ancestors (v2 memory.max, v1
  // memory.limit_in_bytes below 2^60), and that cgroup's usage (memory.current,
  // memory.usage_in_bytes); nullopt when none is limited.
  std::optional<std::uint64_t> cgroup_limit, cgroup_usage;
  // mem_available, or the cgroup's room (limit - usage) when that is less.
  std::uint64_t available() const;
  // The most available() can ever be: MemTotal, or the cgroup limit when that is less. Swap is
  // not counted, as MemAvailable never counts it: a job needing more would wait forever.
  std::uint64_t capacity() const;
};

// Throws common::Error("contain.memory_view", ...) when /proc/meminfo has no MemAvailable,
// contain.unavailable when /proc/self/cgroup is malformed, contain.cgroup_io naming the file
// when a control file cannot be read or holds something else than a number.
MemoryView read_memory_view();

namespace detail {
// The same from the texts of /proc/self/cgroup, /proc/self/mountinfo and /proc/meminfo; the
// control files are read below the mount points mountinfo names.
MemoryView memory_view_from(const std::string& proc_cgroup, const std::string& mountinfo,
                            std::string_view meminfo);
// The line `key` ("MemAvailable", "MemTotal") in bytes; throws contain.memory_view when it is
// missing or not "<n> kB".
std::uint64_t parse_meminfo(std::string_view meminfo, std::string_view key);
inline std::uint64_t parse_mem_available(std::string_view meminfo) {
  return parse_meminfo(meminfo, "MemAvailable");
}
}  // namespace detail

}  // namespace assay::contain
