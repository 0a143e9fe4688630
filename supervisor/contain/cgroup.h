// cgroup backends with the same verbs (create, attach, limit, kill, read counters, remove),
// one implementation per kernel interface: cgroup_v2.cpp and cgroup_v1.cpp.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <sys/types.h>

#include "common/json.h"
#include "supervisor/contain/contain.h"
#include "supervisor/contain/evidence.h"

namespace assay::contain::detail {

// One worker's leaf cgroup (in every hierarchy the backend uses).
class Cgroup {
 public:
  virtual ~Cgroup() = default;
  virtual const std::string& name() const = 0;
  // Path relative to the hierarchy root (the memory hierarchy's for v1), for the evidence.
  virtual std::string path() const = 0;
  virtual std::map<std::string, std::string> hierarchies() const = 0;  // controller -> directory
  // An O_PATH directory fd for clone3(CLONE_INTO_CGROUP), or -1 where the backend has none.
  virtual int clone_into_fd() const = 0;
  virtual void attach(pid_t pid) = 0;
  // Control files a freshly cloned, still single-threaded child writes "0" to, first thing,
  // to move itself in (v1 `tasks`): a task moving itself skips the kernel's global
  // threadgroup lock, whose write side waits for an RCU grace period (~10 ms) when the parent
  // writes the child's pid to cgroup.procs instead. Empty: the parent calls attach().
  virtual std::vector<std::string> self_attach_files() const { return {}; }
  virtual void set_limits(const Limits& limits) = 0;
  // Kills every process in the cgroup (v2 cgroup.kill, v1 freeze + SIGKILL + thaw); returns
  // how many processes it signalled (v2: how many were listed before the kill).
  virtual int kill_all() = 0;
  virtual std::vector<pid_t> pids() const = 0;
  // Counters keyed by kernel file name; a file the kernel does not offer is null.
  virtual Counters counters() const = 0;
  // Writes 0 to the counters this interface lets be reset and returns their file names (v1:
  // memory.max_usage_in_bytes, memory.failcnt, memsw twins where offered; v2: none, since a
  // write to memory.peak resets only the writer's own descriptor's view, kernel 6.12 on).
  virtual std::vector<std::string> reset_peaks() { return {}; }
  // Removes the directories; throws naming the directory and errno if rmdir fails.
  virtual void remove() = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;  // "cgroup-v2" or "cgroup-v1"
  virtual common::Json describe() const = 0;
  virtual bool supports_clone_into_cgroup() const = 0;
  virtual std::unique_ptr<Cgroup> create(const std::string& name) = 0;
  // Worker cgroups left behind by a supervisor that is gone.
  virtual std::vector<std::unique_ptr<Cgroup>> orphans() = 0;
  // Removes this process's (empty) owner directory, if the backend made one (v2).
  virtual void release() = 0;
};

// One line of /proc/self/cgroup: hierarchy id, controllers ("" for v2), path.
struct CgroupMembership {
  int id = 0;
  std::vector<std::string> controllers;
  std::string path;
};
// One cgroup mount from /proc/self/mountinfo.
struct CgroupMount {
  std::string root;  // the hierarchy path mounted there
  std::filesystem::path mountpoint;
  bool v2 = false;
  std::vector<std::string> controllers;  // v1 super options that name controllers
};

std::vector<CgroupMembership> parse_proc_cgroup(const std::string& text);
std::vector<CgroupMount> parse_mountinfo_cgroups(const std::string& text);
// Directory of hierarchy path `path` below `mount`; throws contain.unavailable when the mount
// does not cover that path (a container that mounted only a sub-tree).
std::filesystem::path cgroup_dir(const CgroupMount& mount, const std::string& path);

// Small cgroupfs file helpers: each error names the file and the errno.
std::optional<std::string> read_cgroup_file(const std::filesystem::path& file);
void write_cgroup_file(const std::filesystem::path& file, const std::string& value);
std::optional<std::uint64_t> read_u64(const std::filesystem::path& file);  // "max" -> nullopt
std::vector<pid_t> read_pids(const std::filesystem::path& procs_file);
// rmdir that waits (up to ~2 s) while just-killed processes leave the cgroup; ENOENT is success.
void rmdir_retrying(const std::filesystem::path& dir);
// "key value" lines (memory.events, cpu.stat, memory.oom_control) -> {key: value}; null when
// the file is absent; each requested key missing from the file is null.
Counter read_flat_keyed(const std::filesystem::path& file, const std::vector<std::string>& keys);
// The keyed counter's parse: the requested keys of "key value" lines, a key without an unsigned
// value null.
std::map<std::string, std::optional<std::uint64_t>> parse_flat_keyed(
    std::string_view text, const std::vector<std::string>& keys);
// A single-number counter file; null when absent.
Counter read_counter(const std::filesystem::path& file);

// Owner name of this process, "assayd-<pid>-<start time in ticks>": the v2 owner directory,
// the prefix of v1 leaf names.
std::string owner_dir_name();
// True when `owner` is an owner name whose process is gone (or was replaced).
bool owner_is_gone(const std::string& owner);

std::unique_ptr<Backend> make_v2_backend(const RuntimeOptions& options,
                                         const std::vector<CgroupMembership>& membership,
                                         const std::vector<CgroupMount>& mounts);
std::unique_ptr<Backend> make_v1_backend(const RuntimeOptions& options,
                                         const std::vector<CgroupMembership>& membership,
                                         const std::vector<CgroupMount>& mounts);
// True when the v2 hierarchy offers the memory controller at the cgroup workers would use.
bool v2_has_memory(const RuntimeOptions& options, const std::vector<CgroupMembership>& membership,
                   const std::vector<CgroupMount>& mounts);

}  // namespace assay::contain::detail
