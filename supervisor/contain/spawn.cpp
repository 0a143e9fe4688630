// Starting one contained process (spawn.h); the child's side is child.cpp.
#include "supervisor/contain/spawn.h"

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <deque>
#include <sstream>

#include <fcntl.h>
#include <linux/sched.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/error.h"
#include "supervisor/contain/child.h"
#include "supervisor/contain/seccomp.h"
#include "supervisor/contain/spawn_report.h"

namespace assay::contain::detail {

namespace {

namespace fs = std::filesystem;
using common::UniqueFd;

struct CloneArgs {
  std::uint64_t flags = 0;
  std::uint64_t pidfd = 0;
  std::uint64_t child_tid = 0;
  std::uint64_t parent_tid = 0;
  std::uint64_t exit_signal = 0;
  std::uint64_t stack = 0;
  std::uint64_t stack_size = 0;
  std::uint64_t tls = 0;
  std::uint64_t set_tid = 0;
  std::uint64_t set_tid_size = 0;
  std::uint64_t cgroup = 0;
};

void make_pipe(UniqueFd& read_end, UniqueFd& write_end, const char* what) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) common::throw_errno("contain.spawn_failed", what, errno);
  read_end = UniqueFd(fds[0]);
  write_end = UniqueFd(fds[1]);
}

bool is_under(const fs::path& child, const fs::path& parent) {
  auto c = child.begin();
  for (auto p = parent.begin(); p != parent.end(); ++p, ++c) {
    if (c == child.end() || *c != *p) return false;
  }
  return true;
}

}  // namespace

struct Prespawned::State {
  std::string exe;
  std::deque<std::string> strings;  // the mount ops' paths (stable addresses)
  std::vector<MountOp> ops;
  std::vector<FdMove> moves;
  MountsEvidence mounts;
  std::string clone;  // "clone3" or "clone"
  bool into_cgroup = false;
  bool root_worker = false;
  bool affinity_narrowed = false;  // this thread runs on other CPUs until finish_spawn
  cpu_set_t affinity{};            // this thread's CPUs before prespawn
  pid_t pid = -1;
  UniqueFd pidfd, gate_w, report_r, status_r, out_r, err_r;
};

namespace {

// argv[0] must be absolute and every passed descriptor open.
void check_exe_and_fds(const SpawnSpec& spec, const std::string& exe) {
  if (exe.empty() || exe.front() != '/') {
    throw common::Error("contain.spawn_failed", "argv[0] \"" + exe + "\" is not an absolute path");
  }
  for (int fd : spec.pass_fds) {
    if (fd < 0 || ::fcntl(fd, F_GETFD) < 0) {
      throw common::Error("contain.spawn_failed",
                          "pass_fds: descriptor " + std::to_string(fd) + " is not open");
    }
  }
}

// The worker's directory: absolute, normal, without a trailing '/' ("/" when unset).
fs::path normal_workdir(const SpawnSpec& spec) {
  fs::path workdir = spec.workdir.empty() ? fs::path("/") : fs::absolute(spec.workdir);
  workdir = workdir.lexically_normal();
  if (workdir.string().size() > 1 && workdir.string().back() == '/')
    workdir = workdir.parent_path();
  return workdir;
}

// argv and environment as the C arrays execve wants (the pointers point into the strings).
struct ExecArrays {
  std::vector<std::string> argv_store, env_store;
  std::vector<char*> argv_ptrs, env_ptrs;
};

void make_exec_arrays(const SpawnSpec& spec, ExecArrays& x) {
  x.argv_store = spec.argv;
  x.env_store = spec.env;
  for (auto& a : x.argv_store) x.argv_ptrs.push_back(a.data());
  x.argv_ptrs.push_back(nullptr);
  for (auto& e : x.env_store) {
    if (e.find('=') == std::string::npos) {
      throw common::Error("contain.spawn_failed", "environment entry \"" + e + "\" has no '='");
    }
    x.env_ptrs.push_back(e.data());
  }
  x.env_ptrs.push_back(nullptr);
}

// The child's descriptors: 0-2, the passed ones from 3, then its own (close-on-exec).
struct ChildSlots {
  int gate, report, status, parent, workdir, first_free;
};

ChildSlots child_slots(const SpawnSpec& spec) {
  const int own = 3 + static_cast<int>(spec.pass_fds.size());
  return {own, own + 1, own + 2, own + 3, own + 4, own + 5};
}

// What the child is told: its descriptors, the exec, the mounts, the identity and the filter.
void fill_plan(ChildPlan& plan, const SpawnSpec& spec, const ChildSlots& slot,
               bool have_parent_pidfd, const std::string& workdir_str, const ExecArrays& exec,
               Prespawned::State& st) {
  plan.moves = st.moves.data();
  plan.move_count = st.moves.size();
  plan.first_free = slot.first_free;
  plan.gate_read = slot.gate;
  plan.report_write = slot.report;
  plan.status_write = slot.status;
  plan.parent_pidfd = have_parent_pidfd ? slot.parent : -1;
  plan.workdir_fd = slot.workdir;
  plan.workdir = workdir_str.c_str();
  plan.exe = exec.argv_store.front().c_str();
  plan.argv = exec.argv_ptrs.data();
  plan.envp = exec.env_ptrs.data();
  plan.ops = st.ops.data();
  plan.op_count = st.ops.size();
  plan.nofile = spec.nofile;
  plan.set_ids = spec.uid.has_value() || spec.gid.has_value();
  plan.uid = spec.uid.value_or(::geteuid());
  plan.gid = spec.gid.value_or(::getegid());
  plan.root_worker = plan.uid == 0;
  plan.seccomp = &seccomp_policy().fprog;
  st.root_worker = plan.root_worker;
}

// Hidden paths: an empty read-only tmpfs over a directory, /dev/null over anything else. A
// workdir inside a hidden directory is bind-mounted back at its own path.
void plan_hidden_paths(const SpawnSpec& spec, const fs::path& workdir, int workdir_slot,
                       Prespawned::State& st) {
  std::vector<fs::path> hidden;
  for (const auto& h : spec.hidden_paths) hidden.push_back(fs::absolute(h).lexically_normal());
  std::sort(hidden.begin(), hidden.end());
  auto keep = [&](std::string s) { return st.strings.emplace_back(std::move(s)).c_str(); };
  std::vector<MountOp>& ops = st.ops;
  MountsEvidence& mounts = st.mounts;
  std::vector<fs::path> done;
  const char* workdir_proc = keep("/proc/self/fd/" + std::to_string(workdir_slot));
  for (const auto& h : hidden) {
    if (std::any_of(done.begin(), done.end(), [&](const fs::path& d) { return is_under(h, d); })) {
      continue;  // already covered by a hidden parent
    }
    struct stat st;
    if (::lstat(h.c_str(), &st) != 0) {
      mounts.absent.push_back(h.string());
      continue;
    }
    done.push_back(h);
    mounts.hidden.push_back(h.string());
    const char* target = keep(h.string());
    if (!S_ISDIR(st.st_mode)) {
      ops.push_back({MountOp::kMount, "/dev/null", target, nullptr, MS_BIND, nullptr, kStageMount});
      ops.push_back({MountOp::kMount, nullptr, target, nullptr, MS_REMOUNT | MS_BIND | MS_RDONLY,
                     nullptr, kStageMount});
      continue;
    }
    const unsigned long tmpfs_flags = MS_NOSUID | MS_NODEV | MS_NOEXEC;
    if (!is_under(workdir, h)) {
      ops.push_back({MountOp::kMount, "tmpfs", target, "tmpfs", tmpfs_flags | MS_RDONLY,
                     "size=4k,mode=0555", kStageMount});
      continue;
    }
    ops.push_back({MountOp::kMount, "tmpfs", target, "tmpfs", tmpfs_flags, "size=64k,mode=0755",
                   kStageMount});
    fs::path step = h;
    for (auto it = std::next(workdir.begin(), std::distance(h.begin(), h.end()));
         it != workdir.end(); ++it) {
      step /= *it;
      ops.push_back(
          {MountOp::kMkdir, nullptr, keep(step.string()), nullptr, 0, nullptr, kStageMkdir});
    }
    ops.push_back({MountOp::kMount, workdir_proc, keep(workdir.string()), nullptr, MS_BIND | MS_REC,
                   nullptr, kStageMount});
    ops.push_back({MountOp::kMount, "tmpfs", target, "tmpfs", MS_REMOUNT | tmpfs_flags | MS_RDONLY,
                   "size=64k,mode=0755", kStageMount});
  }
}

// Pins this thread to its current CPU while the child starts there (see prespawn); returns
// that CPU.
int narrow_affinity(Prespawned::State& st, ChildPlan& plan) {
  int here = ::sched_getcpu();
  cpu_set_t only_here;
  CPU_ZERO(&only_here);
  if (here >= 0 && ::sched_getaffinity(0, sizeof st.affinity, &st.affinity) == 0 &&
      CPU_ISSET(here, &st.affinity) && CPU_COUNT(&st.affinity) > 1) {
    CPU_SET(here, &only_here);
    if (::sched_setaffinity(0, sizeof only_here, &only_here) == 0) {
      st.affinity_narrowed = true;
      plan.affinity = &st.affinity;
    }
  }
  return here;
}

// Clones the child (clone3, into `clone_into` where the kernel allows; clone where clone3 is
// filtered); the child runs child_main(plan). Returns the pid (-1 with errno set on failure).
long clone_child(Prespawned::State& st, Cgroup* clone_into, const ChildPlan& plan, int& pidfd) {
  CloneArgs args;
  args.flags = CLONE_PIDFD | CLONE_NEWPID;
  args.pidfd = reinterpret_cast<std::uint64_t>(&pidfd);
  args.exit_signal = SIGCHLD;
  st.into_cgroup = clone_into && clone_into->clone_into_fd() >= 0;
  if (st.into_cgroup) {
    args.flags |= CLONE_INTO_CGROUP;
    args.cgroup = static_cast<std::uint64_t>(clone_into->clone_into_fd());
  }
  long pid = ::syscall(SYS_clone3, &args, sizeof args);
  if (pid < 0 && st.into_cgroup &&
      (errno == EPERM || errno == EBUSY || errno == EINVAL || errno == EACCES ||
       errno == EOPNOTSUPP)) {
    st.into_cgroup = false;  // e.g. a cgroup the kernel refuses to clone into: use the gate
    args.flags &= ~static_cast<std::uint64_t>(CLONE_INTO_CGROUP);
    args.cgroup = 0;
    pid = ::syscall(SYS_clone3, &args, sizeof args);
  }
  if (pid == 0) child_main(plan);
  st.clone = "clone3";
  if (pid < 0 && errno == ENOSYS) {
    // clone3 filtered (older seccomp profiles): clone with CLONE_PIDFD via parent_tid.
    st.into_cgroup = false;
    pid = ::syscall(SYS_clone, CLONE_PIDFD | CLONE_NEWPID | SIGCHLD, nullptr, &pidfd, nullptr,
                    nullptr);
    if (pid == 0) child_main(plan);
    st.clone = "clone";
  }
  return pid;
}

}  // namespace

void check_identity(const SpawnSpec& spec) {
  uid_t uid = spec.uid.value_or(::geteuid());
  gid_t gid = spec.gid.value_or(::getegid());
  if (spec.allow_root || (uid != 0 && gid != 0)) return;
  throw common::Error("contain.root_worker",
                      "worker \"" + spec.name + "\" would run as uid " + std::to_string(uid) +
                          " gid " + std::to_string(gid) +
                          ": give it an unprivileged uid and gid (default_worker_identity()), "
                          "or allow_root for development");
}

std::unique_ptr<Prespawned> prespawn(const SpawnSpec& spec, Cgroup* clone_into) {
  if (spec.argv.empty()) throw common::Error("contain.spawn_failed", "empty argv");
  check_identity(spec);
  auto child = std::make_unique<Prespawned>();
  Prespawned::State& st = *child->state_;
  st.exe = spec.argv.front();
  const std::string& exe = st.exe;
  check_exe_and_fds(spec, exe);
  const fs::path workdir = normal_workdir(spec);

  ExecArrays exec;
  make_exec_arrays(spec, exec);

  int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devnull < 0) common::throw_errno("contain.spawn_failed", "open /dev/null", errno);
  UniqueFd devnull_fd(devnull);
  int wfd = ::open(workdir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (wfd < 0)
    common::throw_errno("contain.spawn_failed", "open workdir " + workdir.string(), errno);
  UniqueFd workdir_fd(wfd);
  // Without pidfd_open (before 5.3) the child cannot tell that its parent died before it
  // armed PDEATHSIG; the gate's EOF still ends it.
  UniqueFd parent_pidfd(static_cast<int>(::syscall(SYS_pidfd_open, ::getpid(), 0)));

  const ChildSlots slot = child_slots(spec);

  plan_hidden_paths(spec, workdir, slot.workdir, st);

  UniqueFd gate_r, report_w, status_w, out_w, err_w;
  make_pipe(gate_r, st.gate_w, "pipe (gate)");
  make_pipe(st.report_r, report_w, "pipe (report)");
  make_pipe(st.status_r, status_w, "pipe (init status)");
  make_pipe(st.out_r, out_w, "pipe (stdout)");
  make_pipe(st.err_r, err_w, "pipe (stderr)");
  // The init's report is read once it exited, never waited for.
  ::fcntl(st.status_r.get(), F_SETFL, O_NONBLOCK);

  std::vector<FdMove>& moves = st.moves;
  moves = {
      {devnull_fd.get(), 0, false, -1}, {out_w.get(), 1, false, -1}, {err_w.get(), 2, false, -1}};
  for (std::size_t i = 0; i < spec.pass_fds.size(); ++i) {
    moves.push_back({spec.pass_fds[i], 3 + static_cast<int>(i), false, -1});
  }
  moves.push_back({gate_r.get(), slot.gate, true, -1});
  moves.push_back({report_w.get(), slot.report, true, -1});
  moves.push_back({status_w.get(), slot.status, true, -1});
  if (parent_pidfd) moves.push_back({parent_pidfd.get(), slot.parent, true, -1});
  moves.push_back({workdir_fd.get(), slot.workdir, true, -1});

  ChildPlan plan{};
  std::string workdir_str = workdir.string();
  fill_plan(plan, spec, slot, bool(parent_pidfd), workdir_str, exec, st);

  // The child starts on this CPU, which is awake, and this thread moves to the others for its
  // share (detection, the cgroup) until finish_spawn: the child's path (namespaces, exec) is
  // the longer one, and on a VM a new task sent to an idle vCPU waited ~0.5 ms for it to wake.
  // The child restores the CPUs it inherits before anything else.
  const int here = narrow_affinity(st, plan);

  int pidfd = -1;
  const long pid = clone_child(st, clone_into, plan, pidfd);
  if (st.affinity_narrowed) {
    cpu_set_t elsewhere = st.affinity;
    CPU_CLR(here, &elsewhere);
    if (pid < 0 || ::sched_setaffinity(0, sizeof elsewhere, &elsewhere) != 0) {
      child->restore_affinity();
    }
  }
  if (pid < 0) common::throw_errno("contain.spawn_failed", "clone3 " + exe, errno);
  st.pid = static_cast<pid_t>(pid);
  st.pidfd = UniqueFd(pidfd);
  return child;
}

Prespawned::Prespawned() : state_(std::make_unique<State>()) {}

// A child never finished (given up on, or failed) reads EOF at the gate and exits, or is
// killed (and its PID namespace with it); either way it is reaped here.
Prespawned::~Prespawned() {
  restore_affinity();
  if (state_->pid <= 0) return;
  state_->gate_w = UniqueFd();
  ::kill(state_->pid, SIGKILL);
  siginfo_t info;
  while (::waitid(P_PID, static_cast<id_t>(state_->pid), &info, WEXITED) < 0 && errno == EINTR) {
  }
}

pid_t Prespawned::pid() const {
  return state_->pid;
}

void Prespawned::restore_affinity() {
  if (!state_->affinity_narrowed) return;
  state_->affinity_narrowed = false;
  ::sched_setaffinity(0, sizeof state_->affinity, &state_->affinity);
}

namespace {

// The step a child reported failing, with the object it failed on.
std::string failed_step(const ChildReport& report, const Prespawned::State& st,
                        const std::vector<std::string>& attach_files) {
  std::string what = stage_name(report.stage);
  if (report.stage == kStageExec) what += " " + st.exe;
  if (report.stage == kStageAttach) {
    if (report.op >= 0 && static_cast<std::size_t>(report.op) < attach_files.size()) {
      what += " " + attach_files[static_cast<std::size_t>(report.op)];
    }
  } else if (report.stage == kStageBounding) {
    what += " (capability " + std::to_string(report.op) + ")";
  } else if (report.op >= 0 && static_cast<std::size_t>(report.op) < st.ops.size()) {
    what += std::string(" ") + st.ops[static_cast<std::size_t>(report.op)].target;
  }
  return what;
}

// How the child gets into its cgroup; with neither clone-into nor self-attach, the parent
// attaches it now.
std::string spawn_method(const Prespawned::State& st, Cgroup* cgroup,
                         const std::vector<std::string>& attach_files) {
  if (st.into_cgroup) {
    return st.clone + "-into-cgroup";
  } else if (!attach_files.empty()) {
    return st.clone + "-self-attach";
  } else {
    if (cgroup) {
      try {
        cgroup->attach(st.pid);
      } catch (const common::Error& e) {
        throw common::Error("contain.spawn_failed", std::string("attach to cgroup: ") + e.what());
      }
    }
    return st.clone + "-pipe-gate";
  }
}

}  // namespace

Spawned finish_spawn(std::unique_ptr<Prespawned> child, Cgroup* cgroup) {
  child->restore_affinity();
  Prespawned::State& st = *child->state_;
  auto read_report = [&](ChildReport& report) {
    ssize_t n;
    do {
      n = ::read(st.report_r.get(), &report, sizeof report);
    } while (n < 0 && errno == EINTR);
    return n;
  };
  std::vector<std::string> attach_files;
  // The child reported a failed step: it exits; the error names the step, errno and object.
  auto failed = [&](const ChildReport& report) {
    std::string what = failed_step(report, st, attach_files);
    child.reset();  // reaps it (and `st` with it)
    common::throw_errno("contain.spawn_failed", what, report.err);
  };
  auto gone = [&](const char* before) {
    child.reset();
    throw common::Error("contain.spawn_failed", std::string("the child exited before ") + before);
  };

  Spawned s;
  if (cgroup && !st.into_cgroup) attach_files = cgroup->self_attach_files();
  s.method = spawn_method(st, cgroup, attach_files);
  const std::string gate = gate_message(attach_files);
  int write_errno = 0;
  const bool written = write_gate(st.gate_w.get(), gate, write_errno);
  if (!written) {
    child.reset();
    common::throw_errno("contain.spawn_failed", "write to the gate pipe", write_errno);
  }
  st.gate_w = UniqueFd();

  // The child's namespaces, as it reported them, against ours.
  ChildReport report{};
  ssize_t n = read_report(report);
  if (n == static_cast<ssize_t>(sizeof report) && report.stage != kStageNamespaces) failed(report);
  NamespacesReport ns{};
  std::string net_dev(kNetDevMax, '\0');
  if (n != static_cast<ssize_t>(sizeof report) || !read_full(st.report_r.get(), &ns, sizeof ns) ||
      ns.net_dev_bytes > kNetDevMax ||
      !read_full(st.report_r.get(), net_dev.data(), ns.net_dev_bytes)) {
    gone("reporting its namespaces");
  }
  net_dev.resize(ns.net_dev_bytes);
  s.network = NetworkEvidence{!same_namespace("/proc/self/ns/net", ns.net_dev, ns.net_ino),
                              interfaces_of(net_dev)};
  s.pid_namespace_private = !same_namespace("/proc/self/ns/pid", ns.pid_dev, ns.pid_ino);
  s.mounts = st.mounts;

  // What the worker holds right before execve.
  n = read_report(report);
  if (n == static_cast<ssize_t>(sizeof report) && report.stage != kStagePrivileges) failed(report);
  PrivilegesReport held{};
  if (n != static_cast<ssize_t>(sizeof report) ||
      !read_full(st.report_r.get(), &held, sizeof held)) {
    gone("reporting its privileges");
  }
  const std::string kept = kept_privileges(held, st.root_worker);
  if (!kept.empty()) {
    child.reset();
    throw common::Error("contain.spawn_failed", "the worker kept privileges:" + kept);
  }
  s.uid = held.uid[0];
  s.gid = held.gid[0];
  s.capabilities =
      Capabilities{held.inheritable, held.permitted, held.effective, held.bounding, held.ambient};

  n = read_report(report);
  if (n > 0) failed(report);  // else EOF: the exec closed the report pipe
  s.pid = st.pid;
  s.pidfd = std::move(st.pidfd);
  s.stdout_read = std::move(st.out_r);
  s.stderr_read = std::move(st.err_r);
  s.status_read = std::move(st.status_r);
  st.pid = -1;  // released: the caller awaits it through the pidfd
  return s;
}

}  // namespace assay::contain::detail