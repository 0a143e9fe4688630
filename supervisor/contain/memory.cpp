// The supervisor's own memory room, from /proc/meminfo and its cgroup's control files. The
// cgroup is found with the same /proc/self/cgroup and mountinfo parsing the runtime uses.
#include "supervisor/contain/memory.h"

#include <algorithm>
#include <charconv>
#include <filesystem>

#include "common/error.h"
#include "supervisor/contain/cgroup.h"

namespace assay::contain {

namespace {

namespace fs = std::filesystem;

// v1 reports "no limit" as a huge page-aligned number.
constexpr std::uint64_t kV1NoLimit = 1ULL << 60;

std::string read_proc(const char* path) {
  auto text = detail::read_cgroup_file(path);
  if (!text) throw common::Error("contain.memory_view", std::string("cannot read ") + path);
  return *text;
}

bool has(const std::vector<std::string>& list, const std::string& want) {
  return std::find(list.begin(), list.end(), want) != list.end();
}

// The tightest limit from `dir` up to the mount point: the cgroup with the smallest limit.
void tightest_limit(MemoryView& v, const detail::CgroupMount& mount, const std::string& path,
                    const char* limit_file, const char* usage_file) {
  if (mount.root != "/" && path != mount.root && !path.starts_with(mount.root + "/")) {
    return;  // our cgroup is not visible in this mount (a container that mounted a sub-tree)
  }
  for (fs::path dir = detail::cgroup_dir(mount, path);; dir = dir.parent_path()) {
    auto limit = detail::read_u64(dir / limit_file);  // v2 "max": nullopt
    if (limit && *limit < kV1NoLimit && (!v.cgroup_limit || *limit < *v.cgroup_limit)) {
      v.cgroup_limit = limit;
      v.cgroup_usage = detail::read_u64(dir / usage_file);
    }
    if (dir == mount.mountpoint || dir.parent_path() == dir) break;
  }
}

}  // namespace

std::uint64_t MemoryView::available() const {
  std::uint64_t a = mem_available;
  if (cgroup_limit) {
    std::uint64_t used = cgroup_usage.value_or(0);
    std::uint64_t room = *cgroup_limit > used ? *cgroup_limit - used : 0;
    a = std::min(a, room);
  }
  return a;
}

std::uint64_t MemoryView::capacity() const {
  return cgroup_limit ? std::min(mem_total, *cgroup_limit) : mem_total;
}

MemoryView read_memory_view() {
  return detail::memory_view_from(read_proc("/proc/self/cgroup"), read_proc("/proc/self/mountinfo"),
                                  read_proc("/proc/meminfo"));
}

namespace detail {

std::uint64_t parse_meminfo(std::string_view meminfo, std::string_view key) {
  const std::string kKey = std::string(key) + ":";
  std::size_t at = 0;
  while (at < meminfo.size() && !meminfo.substr(at).starts_with(kKey)) {
    at = meminfo.find('\n', at);
    if (at == std::string_view::npos) break;
    ++at;
  }
  if (at >= meminfo.size()) {
    throw common::Error("contain.memory_view",
                        "/proc/meminfo has no " + std::string(key) + " line");
  }
  std::string_view line = meminfo.substr(at + kKey.size());
  line = line.substr(0, line.find('\n'));
  std::string_view rest = line.substr(std::min(line.find_first_not_of(' '), line.size()));
  std::uint64_t kb = 0;
  auto [end, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), kb);
  if (ec != std::errc() || std::string_view(end, rest.data() + rest.size()) != " kB" ||
      kb > UINT64_MAX / 1024) {
    throw common::Error("contain.memory_view",
                        "malformed /proc/meminfo line \"" + kKey + std::string(line) + "\"");
  }
  return kb * 1024;
}

MemoryView memory_view_from(const std::string& proc_cgroup, const std::string& mountinfo,
                            std::string_view meminfo) {
  MemoryView v;
  v.mem_available = parse_mem_available(meminfo);
  v.mem_total = parse_meminfo(meminfo, "MemTotal");
  auto membership = parse_proc_cgroup(proc_cgroup);
  auto mounts = parse_mountinfo_cgroups(mountinfo);
  // v1's memory hierarchy where one is mounted (hybrid hosts have v2 without memory), else v2.
  for (const auto& m : mounts) {
    if (m.v2 || !has(m.controllers, "memory")) continue;
    for (const auto& c : membership) {
      if (has(c.controllers, "memory")) {
        tightest_limit(v, m, c.path, "memory.limit_in_bytes", "memory.usage_in_bytes");
        return v;
      }
    }
  }
  for (const auto& m : mounts) {
    if (!m.v2) continue;
    for (const auto& c : membership) {
      if (c.id == 0 && c.controllers.empty()) {
        tightest_limit(v, m, c.path, "memory.max", "memory.current");
        return v;
      }
    }
  }
  return v;
}

}  // namespace detail

}  // namespace assay::contain
