// cgroup v1 backend: a leaf per worker in the memory hierarchy, plus pids, freezer and cpuacct
// where they are mounted and writable, all below the cgroup this process already belongs to
// (or a configured base): <base>/assayd-<pid>-<start>.<name>. The owner is in the leaf's name
// rather than a directory above it (v1 has no subtree_control to set on one): a directory per
// assayd process was a mkdir and an rmdir in every hierarchy, about a tenth of a one-shot
// `assayd contain`. Leaves of the earlier layout, <base>/assayd-<pid>-<start>/<name>, are
// still found as orphans.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <thread>

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "supervisor/contain/cgroup.h"

namespace assay::contain::detail {

namespace {

namespace fs = std::filesystem;
using common::Json;

// cpu.shares of a worker's leaf (1024 is the default, the supervisor's).
constexpr int kWorkerCpuShares = 64;

struct Hierarchy {
  std::string controller;  // "memory", "pids", "freezer", "cpuacct", "cpu"
  fs::path base;           // directory of the base cgroup in this hierarchy
};

class V1Cgroup : public Cgroup {
 public:
  V1Cgroup(std::string name, std::string path, std::vector<Hierarchy> dirs, bool remove_parent)
      : name_(std::move(name)),
        path_(std::move(path)),
        dirs_(std::move(dirs)),
        remove_parent_(remove_parent) {}

  const std::string& name() const override { return name_; }
  std::string path() const override { return path_; }
  std::map<std::string, std::string> hierarchies() const override {
    std::map<std::string, std::string> out;
    for (const auto& h : dirs_) out[h.controller] = h.base.string();
    return out;
  }
  int clone_into_fd() const override { return -1; }

  void attach(pid_t pid) override {
    for (const auto& h : dirs_) write_cgroup_file(h.base / "cgroup.procs", std::to_string(pid));
  }
  std::vector<std::string> self_attach_files() const override {
    std::vector<std::string> out;
    for (const auto& h : dirs_) out.push_back(h.base / "tasks");
    return out;
  }

  void set_limits(const Limits& limits) override {
    if (limits.memory_high) {
      throw common::Error("contain.unsupported_limit",
                          "memory_high=" + std::to_string(*limits.memory_high) +
                              ": cgroup v1 has no memory.high equivalent");
    }
    const fs::path& mem = dir("memory");
    if (limits.memory_max) {
      write_cgroup_file(mem / "memory.limit_in_bytes", std::to_string(*limits.memory_max));
    }
    if (limits.swap_max) {
      if (!limits.memory_max) {
        throw common::Error("contain.unsupported_limit",
                            "swap_max=" + std::to_string(*limits.swap_max) +
                                " needs memory_max on cgroup v1 (memory.memsw.limit_in_bytes is "
                                "memory plus swap)");
      }
      if (!fs::exists(mem / "memory.memsw.limit_in_bytes")) {
        throw common::Error("contain.unsupported_limit",
                            "swap_max=" + std::to_string(*limits.swap_max) +
                                ": swap accounting is off (no memory.memsw.limit_in_bytes in " +
                                mem.string() + ")");
      }
      write_cgroup_file(mem / "memory.memsw.limit_in_bytes",
                        std::to_string(*limits.memory_max + *limits.swap_max));
    }
    if (limits.pids_max) {
      const fs::path* pids = find("pids");
      if (!pids) {
        throw common::Error(
            "contain.unsupported_limit",
            "pids_max=" + std::to_string(*limits.pids_max) + ": no writable pids hierarchy");
      }
      write_cgroup_file(*pids / "pids.max", std::to_string(*limits.pids_max));
    }
  }

  int kill_all() override {
    const fs::path* freezer = find("freezer");
    int signalled = 0;
    if (freezer) {
      // Frozen tasks cannot fork, so one pass over cgroup.procs catches them all.
      write_cgroup_file(*freezer / "freezer.state", "FROZEN");
      for (int i = 0; i < 500; ++i) {
        auto state = read_cgroup_file(*freezer / "freezer.state");
        if (!state || state->starts_with("FROZEN")) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    }
    for (int round = 0; round < 100; ++round) {
      auto list = pids();
      if (list.empty()) break;
      for (pid_t p : list) {
        if (::kill(p, SIGKILL) == 0) ++signalled;
      }
      if (freezer) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    if (freezer) write_cgroup_file(*freezer / "freezer.state", "THAWED");
    return signalled;
  }

  std::vector<pid_t> pids() const override { return read_pids(dir("memory") / "cgroup.procs"); }

  Counters counters() const override {
    const fs::path& mem = dir("memory");
    Counters c;
    c["memory.max_usage_in_bytes"] = read_counter(mem / "memory.max_usage_in_bytes");
    c["memory.usage_in_bytes"] = read_counter(mem / "memory.usage_in_bytes");
    c["memory.failcnt"] = read_counter(mem / "memory.failcnt");
    c["memory.oom_control"] =
        read_flat_keyed(mem / "memory.oom_control", {"oom_kill", "under_oom"});
    c["memory.memsw.max_usage_in_bytes"] = read_counter(mem / "memory.memsw.max_usage_in_bytes");
    c["memory.memsw.failcnt"] = read_counter(mem / "memory.memsw.failcnt");
    // Swap accounting on: swap charged now = memory+swap minus memory (v1 has no swap file).
    c["memory.memsw.usage_in_bytes"] = read_counter(mem / "memory.memsw.usage_in_bytes");
    const fs::path* pids = find("pids");
    c["pids.peak"] = pids ? read_counter(*pids / "pids.peak") : Counter{};
    c["pids.events"] = pids ? read_flat_keyed(*pids / "pids.events", {"max"}) : Counter{};
    const fs::path* cpu = find("cpuacct");
    c["cpuacct.usage"] = cpu ? read_counter(*cpu / "cpuacct.usage") : Counter{};
    c["cpuacct.usage_user"] = cpu ? read_counter(*cpu / "cpuacct.usage_user") : Counter{};
    c["cpuacct.usage_sys"] = cpu ? read_counter(*cpu / "cpuacct.usage_sys") : Counter{};
    return c;
  }

  std::vector<std::string> reset_peaks() override {
    std::vector<std::string> reset;
    const fs::path& mem = dir("memory");
    for (const char* file : {"memory.max_usage_in_bytes", "memory.failcnt",
                             "memory.memsw.max_usage_in_bytes", "memory.memsw.failcnt"}) {
      if (!fs::exists(mem / file)) continue;
      write_cgroup_file(mem / file, "0");
      reset.push_back(file);
    }
    return reset;
  }

  void remove() override {
    for (const auto& h : dirs_) {
      rmdir_retrying(h.base);
      if (remove_parent_) ::rmdir(h.base.parent_path().c_str());  // earlier layout's owner dir
    }
  }

 private:
  const fs::path* find(const std::string& controller) const {
    for (const auto& h : dirs_) {
      if (h.controller == controller) return &h.base;
    }
    return nullptr;
  }
  const fs::path& dir(const std::string& controller) const { return *find(controller); }

  std::string name_;
  std::string path_;
  std::vector<Hierarchy> dirs_;
  bool remove_parent_;
};

class V1Backend : public Backend {
 public:
  V1Backend(std::vector<Hierarchy> bases, std::string memory_path)
      : bases_(std::move(bases)), memory_path_(std::move(memory_path)), owner_(owner_dir_name()) {}

  std::string name() const override { return "cgroup-v1"; }
  bool supports_clone_into_cgroup() const override { return false; }

  Json describe() const override {
    Json h = Json::object();
    for (const auto& b : bases_) h[b.controller] = b.base.string();
    return Json{{"backend", name()},
                {"base_cgroup", memory_path_},
                {"hierarchies", h},
                {"leaf_prefix", owner_ + "."}};
  }

  std::unique_ptr<Cgroup> create(const std::string& name) override {
    const std::string leaf_name = owner_ + "." + name;
    std::vector<Hierarchy> dirs;
    for (const auto& b : bases_) {
      fs::path leaf = b.base / leaf_name;
      if (::mkdir(leaf.c_str(), 0755) != 0) {
        int err = errno;
        bool optional_refused =
            b.controller != "memory" && (err == EACCES || err == EPERM || err == EROFS);
        if (optional_refused) continue;  // an optional hierarchy this process may not write to
        for (const auto& made : dirs) ::rmdir(made.base.c_str());
        common::throw_errno("contain.cgroup_io", "mkdir " + leaf.string(), err);
      }
      dirs.push_back({b.controller, leaf});
      // A worker's CPU weight is a sixteenth of the supervisor's, which must keep answering
      // while workers compute (the cpu hierarchy, where assayd may write to it).
      std::error_code ec;
      if (fs::exists(leaf / "cpu.shares", ec)) {
        try {
          write_cgroup_file(leaf / "cpu.shares", std::to_string(kWorkerCpuShares));
        } catch (const common::Error&) {
          // An optional weight: the worker is still niced (child.cpp).
        }
      }
    }
    return std::make_unique<V1Cgroup>(name, memory_path_ + "/" + leaf_name, std::move(dirs), false);
  }

  std::vector<std::unique_ptr<Cgroup>> orphans() override {
    std::vector<std::unique_ptr<Cgroup>> out;
    std::error_code ec;
    const fs::path& mem_base = bases_.front().base;
    std::vector<std::string> entries;
    for (const auto& e : fs::directory_iterator(mem_base, ec)) {
      if (e.is_directory()) entries.push_back(e.path().filename());
    }
    // One leaf, by its name relative to each hierarchy's base.
    auto orphan = [&](const std::string& worker, const std::string& relative, bool in_owner_dir) {
      std::vector<Hierarchy> dirs;
      for (const auto& b : bases_) {
        fs::path d = b.base / relative;
        if (fs::is_directory(d)) dirs.push_back({b.controller, d});
      }
      out.push_back(std::make_unique<V1Cgroup>(worker, memory_path_ + "/" + relative,
                                               std::move(dirs), in_owner_dir));
    };
    for (const auto& entry : entries) {
      auto dot = entry.find('.');
      if (dot != std::string::npos) {  // <owner>.<worker>
        if (owner_is_gone(entry.substr(0, dot))) orphan(entry.substr(dot + 1), entry, false);
        continue;
      }
      if (!owner_is_gone(entry)) continue;  // not an owner directory, or its assayd still runs
      std::vector<std::string> leaves;      // the earlier layout: <owner>/<worker>
      for (const auto& leaf : fs::directory_iterator(mem_base / entry, ec)) {
        if (leaf.is_directory()) leaves.push_back(leaf.path().filename());
      }
      for (const auto& leaf : leaves) orphan(leaf, entry + "/" + leaf, true);
      if (leaves.empty()) {
        for (const auto& b : bases_) ::rmdir((b.base / entry).c_str());
      }
    }
    return out;
  }

  void release() override {}  // no directory of its own: the leaves carry the owner's name

 private:
  std::vector<Hierarchy> bases_;  // memory first
  std::string memory_path_;
  std::string owner_;
};

}  // namespace

std::unique_ptr<Backend> make_v1_backend(const RuntimeOptions& options,
                                         const std::vector<CgroupMembership>& membership,
                                         const std::vector<CgroupMount>& mounts) {
  std::vector<Hierarchy> bases;
  std::string memory_path;
  for (const char* controller : {"memory", "pids", "freezer", "cpuacct", "cpu"}) {
    const CgroupMount* mount = nullptr;
    for (const auto& m : mounts) {
      if (!m.v2 && std::find(m.controllers.begin(), m.controllers.end(), controller) !=
                       m.controllers.end()) {
        mount = &m;
        break;
      }
    }
    const CgroupMembership* member = nullptr;
    for (const auto& m : membership) {
      if (std::find(m.controllers.begin(), m.controllers.end(), controller) !=
          m.controllers.end()) {
        member = &m;
      }
    }
    std::string path = !options.base_cgroup.empty() ? options.base_cgroup
                       : member                     ? member->path
                                                    : std::string();
    bool required = std::string(controller) == "memory";
    if (!mount || path.empty()) {
      if (required) {
        throw common::Error("contain.unavailable",
                            "no cgroup v1 memory hierarchy is mounted (see /proc/self/mountinfo)");
      }
      continue;
    }
    fs::path dir;
    try {
      dir = cgroup_dir(*mount, path);
    } catch (const common::Error&) {
      if (required) throw;
      continue;
    }
    if (::access(dir.c_str(), W_OK) != 0 || !fs::is_directory(dir)) {
      if (required) {
        throw common::Error("contain.unavailable", "cgroup v1 memory cgroup " + dir.string() +
                                                       " is not writable: " + std::strerror(errno));
      }
      continue;
    }
    if (required) memory_path = path == "/" ? std::string() : path;
    // "cpu,cpuacct" is often one hierarchy: one leaf in it, not two.
    if (std::any_of(bases.begin(), bases.end(), [&](const Hierarchy& b) { return b.base == dir; }))
      continue;
    bases.push_back({controller, dir});
  }
  return std::make_unique<V1Backend>(std::move(bases), memory_path);
}

}  // namespace assay::contain::detail
