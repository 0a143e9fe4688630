// The child runs between clone and execve in a copy of a possibly multi-threaded process, so
// it only makes raw system calls on memory prepared by the parent: no malloc, no locks, no
// glibc set*id (its all-threads broadcast would wait for threads that do not exist here).
#include "supervisor/contain/spawn.h"

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <deque>
#include <sstream>

#include <fcntl.h>
#include <linux/sched.h>
#include <net/if.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/error.h"

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

namespace assay::contain::detail {

namespace {

namespace fs = std::filesystem;
using common::UniqueFd;

enum Stage : int {
  kStageNamespaces = 0,  // not a failure: a NamespacesReport follows
  kStageUnshare,
  kStageSetsid,
  kStageMountPrivate,
  kStageMount,
  kStageMkdir,
  kStageLoopback,
  kStageStdio,
  kStageChdir,
  kStageRlimit,
  kStageSignals,
  kStageCloseRange,
  kStageSetgroups,
  kStageSetgid,
  kStageSetuid,
  kStageNoNewPrivs,
  kStageExec,
  kStageAttach,
  kStageAffinity,
};

const char* stage_name(int stage) {
  switch (stage) {
    case kStageNamespaces:
      return "namespaces";
    case kStageUnshare:
      return "unshare the network and mount namespaces";
    case kStageSetsid:
      return "setsid";
    case kStageMountPrivate:
      return "make / private in the mount namespace";
    case kStageMount:
      return "mount over a hidden path";
    case kStageMkdir:
      return "mkdir the workdir mount point";
    case kStageLoopback:
      return "bring up lo";
    case kStageStdio:
      return "set up stdin/stdout/stderr";
    case kStageChdir:
      return "chdir to the workdir";
    case kStageRlimit:
      return "setrlimit";
    case kStageSignals:
      return "reset signals";
    case kStageCloseRange:
      return "close_range";
    case kStageSetgroups:
      return "setgroups";
    case kStageSetgid:
      return "setresgid";
    case kStageSetuid:
      return "setresuid";
    case kStageNoNewPrivs:
      return "PR_SET_NO_NEW_PRIVS";
    case kStageExec:
      return "execve";
    case kStageAttach:
      return "move itself into the cgroup (write 0 to)";
    case kStageAffinity:
      return "sched_setaffinity";
  }
  return "unknown step";
}

struct ChildReport {
  int stage;
  int err;
  int op;  // index of the failed mount op or attach file, or -1
};

// The child's network namespace as the kernel shows it from inside, read by the child right
// after unshare (it is still assayd's code then), so that the parent need not hold the child
// while it reads /proc/<pid>: follows a ChildReport of stage kStageNamespaces, then
// `net_dev_bytes` of /proc/self/net/dev. One write, below PIPE_BUF.
struct NamespacesReport {
  std::uint64_t net_dev;
  std::uint64_t net_ino;
  std::uint32_t net_dev_bytes;
};
constexpr std::size_t kNetDevMax = 2048;

// What the parent sends through the gate: the control files the child writes "0" to, to move
// itself into its cgroups (v1 `tasks`), as `count` NUL-terminated paths in `bytes` bytes.
struct GateHeader {
  std::uint32_t count;
  std::uint32_t bytes;
};
constexpr std::size_t kGateMaxBytes = 4 * 4096;  // read onto the child's stack

struct MountOp {
  enum Kind { kMount, kMkdir } kind;
  const char* source;
  const char* target;
  const char* fstype;
  unsigned long flags;
  const char* data;
  int stage;
};

// Everything the child needs, as plain pointers into storage the parent keeps alive.
struct ChildPlan {
  int gate_read;
  int report_write;
  int stdin_fd;
  int stdout_fd;
  int stderr_fd;
  int workdir_fd;
  const char* workdir;
  const char* exe;
  char* const* argv;
  char* const* envp;
  const MountOp* ops;
  std::size_t op_count;
  rlim_t nofile;
  bool set_ids;
  uid_t uid;
  gid_t gid;
  const cpu_set_t* affinity;  // restored first thing (see prespawn), or null
};

[[noreturn]] void child_fail(const ChildPlan& p, int stage, int op = -1) {
  ChildReport r{stage, errno, op};
  ssize_t ignored = ::write(p.report_write, &r, sizeof r);
  (void)ignored;
  ::_exit(127);
}

// Moves the calling (single-threaded) child into one cgroup; false with errno set on failure.
bool write_zero(const char* file) {
  int fd = ::open(file, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  ssize_t n;
  do {
    n = ::write(fd, "0", 1);
  } while (n < 0 && errno == EINTR);
  int err = errno;
  ::close(fd);
  errno = err;
  return n == 1;
}

// Reads exactly `size` bytes; false on EOF or error (the parent gave up on this child).
bool read_full(int fd, void* buf, std::size_t size) {
  auto* at = static_cast<char*>(buf);
  while (size > 0) {
    ssize_t n = ::read(fd, at, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    at += n;
    size -= static_cast<std::size_t>(n);
  }
  return true;
}

// Everything between the namespaces and the gate: 0, or the failed stage with errno set and
// *op naming the mount op. The child keeps a failure to itself until it has read the gate, so
// that the parent's write to the gate never meets a closed pipe.
int child_setup(const ChildPlan& p, int* op) {
  // Own session and process group: the timeout's SIGTERM goes to the group.
  if (::setsid() < 0) return kStageSetsid;
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return kStageMountPrivate;
  // The parent's workdir fd points into the parent's mount namespace, and the kernel binds
  // only from mounts of our own: reopen it here, at the same number the plan refers to.
  int wfd = ::open(p.workdir, O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (wfd < 0) return kStageChdir;
  if (wfd != p.workdir_fd) {
    if (::dup3(wfd, p.workdir_fd, O_CLOEXEC) < 0) return kStageChdir;
    ::close(wfd);
  }
  for (std::size_t i = 0; i < p.op_count; ++i) {
    const MountOp& m = p.ops[i];
    *op = static_cast<int>(i);
    if (m.kind == MountOp::kMkdir) {
      if (::mkdir(m.target, 0755) != 0 && errno != EEXIST) return kStageMkdir;
    } else if (::mount(m.source, m.target, m.fstype, m.flags, m.data) != 0) {
      return m.stage;
    }
  }
  *op = -1;
  // A new network namespace has only lo, and it is down.
  int sock = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (sock < 0) return kStageLoopback;
  struct ifreq ifr {};
  std::memcpy(ifr.ifr_name, "lo", 3);
  if (::ioctl(sock, SIOCGIFFLAGS, &ifr) != 0) return kStageLoopback;
  ifr.ifr_flags = static_cast<short>(ifr.ifr_flags | IFF_UP | IFF_RUNNING);
  if (::ioctl(sock, SIOCSIFFLAGS, &ifr) != 0) return kStageLoopback;
  ::close(sock);

  if (::dup2(p.stdin_fd, 0) < 0 || ::dup2(p.stdout_fd, 1) < 0 || ::dup2(p.stderr_fd, 2) < 0) {
    return kStageStdio;
  }
  if (::chdir(p.workdir) != 0 && ::fchdir(p.workdir_fd) != 0) return kStageChdir;

  struct rlimit core {
    0, 0
  };
  struct rlimit nofile {
    p.nofile, p.nofile
  };
  if (::setrlimit(RLIMIT_CORE, &core) != 0 || ::setrlimit(RLIMIT_NOFILE, &nofile) != 0) {
    return kStageRlimit;
  }
  sigset_t none;
  sigemptyset(&none);
  if (::sigprocmask(SIG_SETMASK, &none, nullptr) != 0) return kStageSignals;
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig != SIGKILL && sig != SIGSTOP) ::sigaction(sig, &dfl, nullptr);  // some are reserved
  }
  // Nothing of the supervisor's leaks past exec (the report pipe is already close-on-exec).
  if (::syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC) != 0) {
    for (int fd = 3; fd < 65536; ++fd) {
      if (fd != p.report_write) ::fcntl(fd, F_SETFD, FD_CLOEXEC);
    }
  }
  return 0;
}

// Sends the NamespacesReport (see there); a namespace that cannot be read is reported as 0
// and no interfaces, which the parent records as such.
void report_namespaces(const ChildPlan& p) {
  char msg[sizeof(ChildReport) + sizeof(NamespacesReport) + kNetDevMax];
  ChildReport head{kStageNamespaces, 0, -1};
  NamespacesReport ns{};
  struct stat st {};
  if (::stat("/proc/self/ns/net", &st) == 0) {
    ns.net_dev = st.st_dev;
    ns.net_ino = st.st_ino;
  }
  char* text = msg + sizeof head + sizeof ns;
  int fd = ::open("/proc/self/net/dev", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    while (ns.net_dev_bytes < kNetDevMax) {
      ssize_t n = ::read(fd, text + ns.net_dev_bytes, kNetDevMax - ns.net_dev_bytes);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      ns.net_dev_bytes += static_cast<std::uint32_t>(n);
    }
    ::close(fd);
  }
  std::memcpy(msg, &head, sizeof head);
  std::memcpy(msg + sizeof head, &ns, sizeof ns);
  ssize_t ignored = ::write(p.report_write, msg, sizeof head + sizeof ns + ns.net_dev_bytes);
  (void)ignored;  // a parent that stopped listening closes the gate too
}

[[noreturn]] void child_main(const ChildPlan& p) {
  // The namespaces first: making a network namespace is most of a spawn's time, and the parent
  // makes the cgroup meanwhile (or has made it and cloned us into it). A failure is kept until
  // the gate was read, so that the parent's write to the gate never meets a closed pipe.
  int failed = 0, failed_errno = 0, op = -1;
  if (p.affinity && ::sched_setaffinity(0, sizeof *p.affinity, p.affinity) != 0) {
    failed = kStageAffinity;
    failed_errno = errno;
  } else if (::unshare(CLONE_NEWNET | CLONE_NEWNS) != 0) {
    failed = kStageUnshare;
    failed_errno = errno;
  } else {
    report_namespaces(p);
    failed = child_setup(p, &op);
    failed_errno = errno;
  }
  // Held here until the parent has made the cgroup.
  GateHeader gate{};
  char files[kGateMaxBytes];
  if (!read_full(p.gate_read, &gate, sizeof gate) || gate.bytes > sizeof files ||
      !read_full(p.gate_read, files, gate.bytes)) {
    ::_exit(127);
  }
  if (failed != 0) {
    errno = failed_errno;
    child_fail(p, failed, op);
  }
  // Into the worker's cgroups before anything of the command runs.
  const char* file = files;
  for (std::uint32_t i = 0; i < gate.count; ++i) {
    if (!write_zero(file)) child_fail(p, kStageAttach, static_cast<int>(i));
    file += std::strlen(file) + 1;
  }
  if (p.set_ids) {
    if (::syscall(SYS_setgroups, 0, nullptr) != 0) child_fail(p, kStageSetgroups);
    if (::syscall(SYS_setresgid, p.gid, p.gid, p.gid) != 0) child_fail(p, kStageSetgid);
    if (::syscall(SYS_setresuid, p.uid, p.uid, p.uid) != 0) child_fail(p, kStageSetuid);
  }
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) child_fail(p, kStageNoNewPrivs);
  ::execve(p.exe, p.argv, p.envp);
  child_fail(p, kStageExec);
}

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

// Interface names in /proc/net/dev text (two header lines, then "  name: counters...").
std::vector<std::string> interfaces_of(const std::string& net_dev) {
  std::vector<std::string> out;
  std::istringstream in(net_dev);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    if (++n <= 2) continue;  // two header lines
    auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = line.substr(0, colon);
    name.erase(0, name.find_first_not_of(' '));
    out.push_back(name);
  }
  return out;
}

bool write_all(int fd, const char* data, std::size_t size) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return false;
    data += n;
    size -= static_cast<std::size_t>(n);
  }
  return true;
}

}  // namespace

struct Prespawned::State {
  std::string exe;
  std::deque<std::string> strings;  // the mount ops' paths (stable addresses)
  std::vector<MountOp> ops;
  MountsEvidence mounts;
  std::string clone;  // "clone3" or "clone"
  bool into_cgroup = false;
  bool affinity_narrowed = false;  // this thread runs on other CPUs until finish_spawn
  cpu_set_t affinity{};            // this thread's CPUs before prespawn
  pid_t pid = -1;
  UniqueFd pidfd, gate_w, report_r, out_r, err_r;
};

std::unique_ptr<Prespawned> prespawn(const SpawnSpec& spec, Cgroup* clone_into) {
  if (spec.argv.empty()) throw common::Error("contain.spawn_failed", "empty argv");
  auto child = std::make_unique<Prespawned>();
  Prespawned::State& st = *child->state_;
  st.exe = spec.argv.front();
  const std::string& exe = st.exe;
  if (exe.empty() || exe.front() != '/') {
    throw common::Error("contain.spawn_failed", "argv[0] \"" + exe + "\" is not an absolute path");
  }
  fs::path workdir = spec.workdir.empty() ? fs::path("/") : fs::absolute(spec.workdir);
  workdir = workdir.lexically_normal();
  if (workdir.string().size() > 1 && workdir.string().back() == '/')
    workdir = workdir.parent_path();

  // argv and environment as the C arrays execve wants.
  std::vector<std::string> argv_store = spec.argv;
  std::vector<std::string> env_store = spec.env;
  std::vector<char*> argv_ptrs, env_ptrs;
  for (auto& a : argv_store) argv_ptrs.push_back(a.data());
  argv_ptrs.push_back(nullptr);
  for (auto& e : env_store) {
    if (e.find('=') == std::string::npos) {
      throw common::Error("contain.spawn_failed", "environment entry \"" + e + "\" has no '='");
    }
    env_ptrs.push_back(e.data());
  }
  env_ptrs.push_back(nullptr);

  int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devnull < 0) common::throw_errno("contain.spawn_failed", "open /dev/null", errno);
  UniqueFd devnull_fd(devnull);
  int wfd = ::open(workdir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (wfd < 0)
    common::throw_errno("contain.spawn_failed", "open workdir " + workdir.string(), errno);
  UniqueFd workdir_fd(wfd);

  // Hidden paths: an empty read-only tmpfs over a directory, /dev/null over anything else. A
  // workdir inside a hidden directory is bind-mounted back at its own path.
  std::vector<fs::path> hidden;
  for (const auto& h : spec.hidden_paths) hidden.push_back(fs::absolute(h).lexically_normal());
  std::sort(hidden.begin(), hidden.end());
  auto keep = [&](std::string s) { return st.strings.emplace_back(std::move(s)).c_str(); };
  std::vector<MountOp>& ops = st.ops;
  MountsEvidence& mounts = st.mounts;
  std::vector<fs::path> done;
  const char* workdir_proc = keep("/proc/self/fd/" + std::to_string(wfd));
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

  UniqueFd gate_r, report_w, out_w, err_w;
  make_pipe(gate_r, st.gate_w, "pipe (gate)");
  make_pipe(st.report_r, report_w, "pipe (report)");
  make_pipe(st.out_r, out_w, "pipe (stdout)");
  make_pipe(st.err_r, err_w, "pipe (stderr)");

  ChildPlan plan{};
  plan.gate_read = gate_r.get();
  plan.report_write = report_w.get();
  plan.stdin_fd = devnull_fd.get();
  plan.stdout_fd = out_w.get();
  plan.stderr_fd = err_w.get();
  plan.workdir_fd = workdir_fd.get();
  std::string workdir_str = workdir.string();
  plan.workdir = workdir_str.c_str();
  plan.exe = argv_store.front().c_str();
  plan.argv = argv_ptrs.data();
  plan.envp = env_ptrs.data();
  plan.ops = ops.data();
  plan.op_count = ops.size();
  plan.nofile = spec.nofile;
  plan.set_ids = spec.uid.has_value() || spec.gid.has_value();
  plan.uid = spec.uid.value_or(::getuid());
  plan.gid = spec.gid.value_or(::getgid());

  // The child starts on this CPU, which is awake, and this thread moves to the others for its
  // share (detection, the cgroup) until finish_spawn: the child's path (namespaces, exec) is
  // the longer one, and on a VM a new task sent to an idle vCPU waited ~0.5 ms for it to wake.
  // The child restores the CPUs it inherits before anything else.
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

  int pidfd = -1;
  CloneArgs args;
  args.flags = CLONE_PIDFD;
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
    pid = ::syscall(SYS_clone, CLONE_PIDFD | SIGCHLD, nullptr, &pidfd, nullptr, nullptr);
    if (pid == 0) child_main(plan);
    st.clone = "clone";
  }
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
// killed; either way it is reaped here.
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
    std::string what = stage_name(report.stage);
    if (report.stage == kStageExec) what += " " + st.exe;
    if (report.stage == kStageAttach) {
      if (report.op >= 0 && static_cast<std::size_t>(report.op) < attach_files.size()) {
        what += " " + attach_files[static_cast<std::size_t>(report.op)];
      }
    } else if (report.op >= 0 && static_cast<std::size_t>(report.op) < st.ops.size()) {
      what += std::string(" ") + st.ops[static_cast<std::size_t>(report.op)].target;
    }
    child.reset();  // reaps it (and `st` with it)
    common::throw_errno("contain.spawn_failed", what, report.err);
  };

  Spawned s;
  if (cgroup && !st.into_cgroup) attach_files = cgroup->self_attach_files();
  if (st.into_cgroup) {
    s.method = st.clone + "-into-cgroup";
  } else if (!attach_files.empty()) {
    s.method = st.clone + "-self-attach";
  } else {
    s.method = st.clone + "-pipe-gate";
    if (cgroup) {
      try {
        cgroup->attach(st.pid);
      } catch (const common::Error& e) {
        throw common::Error("contain.spawn_failed", std::string("attach to cgroup: ") + e.what());
      }
    }
  }
  std::string gate;
  for (const auto& f : attach_files) gate.append(f).push_back('\0');
  if (gate.size() > kGateMaxBytes) {
    throw common::Error("contain.spawn_failed",
                        "cgroup paths too long for the gate (" + std::to_string(gate.size()) +
                            " bytes, at most " + std::to_string(kGateMaxBytes) + ")");
  }
  GateHeader header{static_cast<std::uint32_t>(attach_files.size()),
                    static_cast<std::uint32_t>(gate.size())};
  gate.insert(0, reinterpret_cast<const char*>(&header), sizeof header);
  if (!write_all(st.gate_w.get(), gate.data(), gate.size())) {
    common::throw_errno("contain.spawn_failed", "write to the gate pipe", errno);
  }
  st.gate_w = UniqueFd();

  // The child's network namespace, as it reported it, against ours.
  ChildReport report{};
  ssize_t n = read_report(report);
  if (n == static_cast<ssize_t>(sizeof report) && report.stage != kStageNamespaces) failed(report);
  NamespacesReport ns{};
  std::string net_dev(kNetDevMax, '\0');
  if (n != static_cast<ssize_t>(sizeof report) || !read_full(st.report_r.get(), &ns, sizeof ns) ||
      ns.net_dev_bytes > kNetDevMax ||
      !read_full(st.report_r.get(), net_dev.data(), ns.net_dev_bytes)) {
    throw common::Error("contain.spawn_failed", "the child exited before reporting its namespaces");
  }
  net_dev.resize(ns.net_dev_bytes);
  struct stat mine {};
  bool private_net = ::stat("/proc/self/ns/net", &mine) == 0 && ns.net_ino != 0 &&
                     (ns.net_ino != mine.st_ino || ns.net_dev != mine.st_dev);
  s.network = NetworkEvidence{private_net, interfaces_of(net_dev)};
  s.mounts = st.mounts;

  n = read_report(report);
  if (n > 0) failed(report);  // else EOF: the exec closed the report pipe
  s.pid = st.pid;
  s.pidfd = std::move(st.pidfd);
  s.stdout_read = std::move(st.out_r);
  s.stderr_read = std::move(st.err_r);
  st.pid = -1;  // released: the caller awaits it through the pidfd
  return s;
}

}  // namespace assay::contain::detail
