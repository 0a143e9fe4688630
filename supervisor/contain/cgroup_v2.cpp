// cgroup v2 backend. Delegated (systemd Delegate=yes): assayd moves itself into
// <own>/supervisor and makes <own>/workers/<name>. Otherwise below a base cgroup that holds no
// processes: <base>/assayd-<pid>-<start>/<name>. Never writes outside that subtree.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <sstream>
#include <thread>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "common/fs.h"
#include "supervisor/contain/cgroup.h"

namespace assay::contain::detail {

namespace {

namespace fs = std::filesystem;
using common::Json;

const CgroupMount* v2_mount(const std::vector<CgroupMount>& mounts) {
  for (const auto& m : mounts) {
    if (m.v2) return &m;
  }
  return nullptr;
}

std::string own_v2_path(const std::vector<CgroupMembership>& membership) {
  for (const auto& m : membership) {
    if (m.id == 0 && m.controllers.empty()) return m.path;
  }
  return {};
}

std::vector<std::string> words(const std::optional<std::string>& text) {
  std::vector<std::string> out;
  if (!text) return out;
  std::istringstream in(*text);
  std::string w;
  while (in >> w) out.push_back(w);
  return out;
}

bool has_word(const std::vector<std::string>& list, const std::string& w) {
  return std::find(list.begin(), list.end(), w) != list.end();
}

// Enables memory and pids (and cpu where offered) for the children of `dir`.
std::vector<std::string> enable_controllers(const fs::path& dir) {
  auto offered = words(read_cgroup_file(dir / "cgroup.controllers"));
  auto enabled = words(read_cgroup_file(dir / "cgroup.subtree_control"));
  std::vector<std::string> want{"memory", "pids"};
  if (has_word(offered, "cpu")) want.push_back("cpu");
  for (const auto& c : want) {
    if (has_word(enabled, c)) continue;
    if (!has_word(offered, c)) {
      throw common::Error("contain.unavailable", "cgroup v2 controller \"" + c +
                                                     "\" is not offered in " +
                                                     (dir / "cgroup.controllers").string());
    }
    try {
      write_cgroup_file(dir / "cgroup.subtree_control", "+" + c);
    } catch (const common::Error& e) {
      throw common::Error("contain.unavailable",
                          std::string(e.what()) +
                              " (a cgroup v2 parent must hold no processes: run assayd under "
                              "systemd with Delegate=yes or pass a base cgroup without processes)");
    }
  }
  return want;
}

class V2Cgroup : public Cgroup {
 public:
  V2Cgroup(std::string name, std::string path, fs::path dir, bool remove_parent)
      : name_(std::move(name)),
        path_(std::move(path)),
        dir_(std::move(dir)),
        remove_parent_(remove_parent) {
    int fd = ::open(dir_.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) common::throw_errno("contain.cgroup_io", "open " + dir_.string(), errno);
    fd_ = common::UniqueFd(fd);
  }

  const std::string& name() const override { return name_; }
  std::string path() const override { return path_; }
  std::map<std::string, std::string> hierarchies() const override {
    return {{"unified", dir_.string()}};
  }
  int clone_into_fd() const override { return fd_.get(); }

  void attach(pid_t pid) override { write_cgroup_file(dir_ / "cgroup.procs", std::to_string(pid)); }

  void set_limits(const Limits& limits) override {
    if (limits.memory_max) {
      write_cgroup_file(dir_ / "memory.max", std::to_string(*limits.memory_max));
    }
    if (limits.memory_high) {
      write_cgroup_file(dir_ / "memory.high", std::to_string(*limits.memory_high));
    }
    if (limits.swap_max) {
      if (!fs::exists(dir_ / "memory.swap.max")) {
        throw common::Error("contain.unsupported_limit",
                            "swap_max=" + std::to_string(*limits.swap_max) +
                                ": swap accounting is off (no memory.swap.max in " + dir_.string() +
                                ")");
      }
      write_cgroup_file(dir_ / "memory.swap.max", std::to_string(*limits.swap_max));
    }
    if (limits.pids_max) write_cgroup_file(dir_ / "pids.max", std::to_string(*limits.pids_max));
    // One worker is one unit: an OOM kill takes the whole cgroup, not one random process.
    if (fs::exists(dir_ / "memory.oom.group")) write_cgroup_file(dir_ / "memory.oom.group", "1");
  }

  int kill_all() override {
    int listed = static_cast<int>(pids().size());
    if (fs::exists(dir_ / "cgroup.kill")) {
      write_cgroup_file(dir_ / "cgroup.kill", "1");
      return listed;
    }
    // Kernels before 5.14: freeze, SIGKILL every process, thaw.
    write_cgroup_file(dir_ / "cgroup.freeze", "1");
    for (int i = 0; i < 500; ++i) {
      auto events = read_flat_keyed(dir_ / "cgroup.events", {"frozen"});
      if (!events.keys || events.keys->at("frozen") == 1u) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    int signalled = 0;
    for (pid_t p : pids()) {
      if (::kill(p, SIGKILL) == 0) ++signalled;
    }
    write_cgroup_file(dir_ / "cgroup.freeze", "0");
    return signalled;
  }

  std::vector<pid_t> pids() const override { return read_pids(dir_ / "cgroup.procs"); }

  Counters counters() const override {
    Counters c;
    c["memory.events"] = read_flat_keyed(
        dir_ / "memory.events", {"low", "high", "max", "oom", "oom_kill", "oom_group_kill"});
    c["memory.peak"] = read_counter(dir_ / "memory.peak");
    c["memory.swap.current"] = read_counter(dir_ / "memory.swap.current");
    c["memory.swap.peak"] = read_counter(dir_ / "memory.swap.peak");
    c["memory.swap.events"] = read_flat_keyed(dir_ / "memory.swap.events", {"high", "max", "fail"});
    c["pids.peak"] = read_counter(dir_ / "pids.peak");
    c["pids.events"] = read_flat_keyed(dir_ / "pids.events", {"max"});
    c["cpu.stat"] = read_flat_keyed(dir_ / "cpu.stat", {"usage_usec", "user_usec", "system_usec"});
    return c;
  }

  void remove() override {
    fd_ = common::UniqueFd();
    rmdir_retrying(dir_);
    if (remove_parent_) ::rmdir(dir_.parent_path().c_str());
  }

 private:
  std::string name_;
  std::string path_;
  fs::path dir_;
  bool remove_parent_;
  common::UniqueFd fd_;
};

class V2Backend : public Backend {
 public:
  V2Backend(fs::path workers_dir, std::string workers_path, bool delegated,
            std::vector<std::string> controllers)
      : workers_dir_(std::move(workers_dir)),
        workers_path_(std::move(workers_path)),
        delegated_(delegated),
        controllers_(std::move(controllers)) {}

  std::string name() const override { return "cgroup-v2"; }
  bool supports_clone_into_cgroup() const override { return true; }

  Json describe() const override {
    return Json{{"backend", name()},
                {"workers_cgroup", workers_path_},
                {"workers_dir", workers_dir_.string()},
                {"delegated", delegated_},
                {"controllers", controllers_}};
  }

  std::unique_ptr<Cgroup> create(const std::string& name) override {
    fs::path leaf = workers_dir_ / name;
    if (::mkdir(leaf.c_str(), 0755) != 0) {
      common::throw_errno("contain.cgroup_io", "mkdir " + leaf.string(), errno);
    }
    return std::make_unique<V2Cgroup>(name, workers_path_ + "/" + name, leaf, false);
  }

  std::vector<std::unique_ptr<Cgroup>> orphans() override {
    std::vector<std::unique_ptr<Cgroup>> out;
    std::error_code ec;
    if (delegated_) {
      // One assayd per delegated unit: everything under workers/ at start-up is an orphan.
      for (const auto& leaf : fs::directory_iterator(workers_dir_, ec)) {
        if (!leaf.is_directory()) continue;
        std::string n = leaf.path().filename();
        out.push_back(std::make_unique<V2Cgroup>(n, workers_path_ + "/" + n, leaf.path(), false));
      }
      return out;
    }
    fs::path base = workers_dir_.parent_path();
    std::string base_path = workers_path_.substr(0, workers_path_.rfind('/'));
    for (const auto& owner : fs::directory_iterator(base, ec)) {
      std::string owner_name = owner.path().filename();
      if (!owner.is_directory() || !owner_is_gone(owner_name)) continue;
      bool any = false;
      for (const auto& leaf : fs::directory_iterator(owner.path(), ec)) {
        if (!leaf.is_directory()) continue;
        any = true;
        std::string n = leaf.path().filename();
        out.push_back(std::make_unique<V2Cgroup>(n, base_path + "/" + owner_name + "/" + n,
                                                 leaf.path(), true));
      }
      if (!any) ::rmdir(owner.path().c_str());
    }
    return out;
  }

  void release() override {
    if (!delegated_) ::rmdir(workers_dir_.c_str());
  }

 private:
  fs::path workers_dir_;
  std::string workers_path_;
  bool delegated_;
  std::vector<std::string> controllers_;
};

}  // namespace

bool v2_has_memory(const RuntimeOptions& options, const std::vector<CgroupMembership>& membership,
                   const std::vector<CgroupMount>& mounts) {
  const CgroupMount* mount = v2_mount(mounts);
  if (!mount) return false;
  std::string path = options.base_cgroup.empty() ? own_v2_path(membership) : options.base_cgroup;
  if (path.empty()) return false;
  try {
    auto controllers = words(read_cgroup_file(cgroup_dir(*mount, path) / "cgroup.controllers"));
    return has_word(controllers, "memory");
  } catch (const common::Error&) {
    return false;
  }
}

namespace {

// All workers together weigh a tenth of a sibling at the default 100 (the supervisor's cgroup
// when delegated), which must keep answering while they compute. Where the cpu controller is
// not enabled there is no cpu.weight; the workers are still niced (child.cpp).
void lower_cpu_weight(const fs::path& workers) {
  std::error_code ec;
  if (!fs::exists(workers / "cpu.weight", ec)) return;
  try {
    write_cgroup_file(workers / "cpu.weight", "10");
  } catch (const common::Error&) {
    // Optional, as above.
  }
}

}  // namespace

std::unique_ptr<Backend> make_v2_backend(const RuntimeOptions& options,
                                         const std::vector<CgroupMembership>& membership,
                                         const std::vector<CgroupMount>& mounts) {
  const CgroupMount* mount = v2_mount(mounts);
  if (!mount) throw common::Error("contain.unavailable", "no cgroup2 hierarchy is mounted");
  std::string own = own_v2_path(membership);
  std::string base = options.base_cgroup.empty() ? own : options.base_cgroup;
  if (base.empty()) {
    throw common::Error("contain.unavailable", "no cgroup v2 entry (0::) in /proc/self/cgroup");
  }
  fs::path base_dir = cgroup_dir(*mount, base);
  if (base == "/") base.clear();
  if (options.delegated) {
    // No-internal-process rule: the supervisor leaves its own cgroup before enabling controllers.
    fs::path sup = base_dir / "supervisor";
    if (::mkdir(sup.c_str(), 0755) != 0 && errno != EEXIST) {
      common::throw_errno("contain.unavailable", "mkdir " + sup.string(), errno);
    }
    write_cgroup_file(sup / "cgroup.procs", "0");
    enable_controllers(base_dir);
    fs::path workers = base_dir / "workers";
    if (::mkdir(workers.c_str(), 0755) != 0 && errno != EEXIST) {
      common::throw_errno("contain.unavailable", "mkdir " + workers.string(), errno);
    }
    auto controllers = enable_controllers(workers);
    lower_cpu_weight(workers);
    return std::make_unique<V2Backend>(workers, base + "/workers", true, controllers);
  }
  enable_controllers(base_dir);
  std::string owner = owner_dir_name();
  fs::path owner_dir = base_dir / owner;
  if (::mkdir(owner_dir.c_str(), 0755) != 0 && errno != EEXIST) {
    common::throw_errno("contain.unavailable", "mkdir " + owner_dir.string(), errno);
  }
  std::vector<std::string> controllers;
  try {
    controllers = enable_controllers(owner_dir);
  } catch (...) {
    ::rmdir(owner_dir.c_str());
    throw;
  }
  lower_cpu_weight(owner_dir);
  return std::make_unique<V2Backend>(owner_dir, base + "/" + owner, false, controllers);
}

}  // namespace assay::contain::detail
