// The child runs between clone and execve in a copy of a possibly multi-threaded process, so
// it only makes raw system calls on memory prepared by the parent: no malloc, no locks, no
// glibc set*id (its all-threads broadcast would wait for threads that do not exist here).
//
// Who is who: the cloned child is pid 1 of a new PID namespace. It makes the network and mount
// namespaces, mounts /proc and /sys for them, waits at the gate and moves itself into the cgroup
// (v1). Then it starts the worker (pid 2, vfork-style: it shares the init's memory until
// execve), which drops every privilege, installs the seccomp filter, reports what it holds and
// executes. The init stays behind as a small reaper: when the worker exits it kills what the
// worker left and reports the worker's exit status through a pipe of its own.
#include "supervisor/contain/spawn.h"

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <deque>
#include <sstream>

#include <fcntl.h>
#include <linux/capability.h>
#include <linux/sched.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <poll.h>
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
#include "supervisor/contain/seccomp.h"

#ifndef SECCOMP_FILTER_FLAG_SPEC_ALLOW
#define SECCOMP_FILTER_FLAG_SPEC_ALLOW (1UL << 2)
#endif

namespace assay::contain::detail {

namespace {

namespace fs = std::filesystem;
using common::UniqueFd;

enum Stage : int {
  kStageNamespaces = 0,  // not a failure: a NamespacesReport follows
  kStagePrivileges,      // not a failure: a PrivilegesReport follows
  kStageUnshare,
  kStageSetsid,
  kStageMountPrivate,
  kStageProc,
  kStageSys,
  kStageMount,
  kStageMkdir,
  kStageLoopback,
  kStageChdir,
  kStageRlimit,
  kStageSignals,
  kStageFork,
  kStageBounding,
  kStageSetgroups,
  kStageSetgid,
  kStageSetuid,
  kStageCapabilities,
  kStageNoNewPrivs,
  kStageDumpable,
  kStageSeccomp,
  kStageExec,
  kStageAttach,
  kStageAffinity,
};

const char* stage_name(int stage) {
  switch (stage) {
    case kStageNamespaces:
    case kStagePrivileges:
      return "report";
    case kStageUnshare:
      return "unshare the network and mount namespaces";
    case kStageSetsid:
      return "setsid";
    case kStageMountPrivate:
      return "make / private in the mount namespace";
    case kStageProc:
      return "mount /proc of the PID namespace";
    case kStageSys:
      return "mount /sys of the network namespace";
    case kStageMount:
      return "mount over a hidden path";
    case kStageMkdir:
      return "mkdir the workdir mount point";
    case kStageLoopback:
      return "bring up lo";
    case kStageChdir:
      return "chdir to the workdir";
    case kStageRlimit:
      return "setrlimit";
    case kStageSignals:
      return "reset signals";
    case kStageFork:
      return "start the worker under the PID namespace's init";
    case kStageBounding:
      return "drop the capability bounding set (PR_CAPBSET_DROP)";
    case kStageSetgroups:
      return "setgroups";
    case kStageSetgid:
      return "setresgid";
    case kStageSetuid:
      return "setresuid";
    case kStageCapabilities:
      return "capset (clear every capability)";
    case kStageNoNewPrivs:
      return "PR_SET_NO_NEW_PRIVS";
    case kStageDumpable:
      return "PR_SET_DUMPABLE";
    case kStageSeccomp:
      return "install the seccomp filter";
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

// The child's namespaces as the kernel shows them from inside, read by the child right after
// unshare (it is still assayd's code then), so that the parent need not hold the child while
// it reads /proc/<pid>: follows a ChildReport of stage kStageNamespaces, then `net_dev_bytes`
// of /proc/self/net/dev. One write, below PIPE_BUF.
struct NamespacesReport {
  std::uint64_t net_dev;
  std::uint64_t net_ino;
  std::uint64_t pid_dev;
  std::uint64_t pid_ino;
  std::uint32_t net_dev_bytes;
};
constexpr std::size_t kNetDevMax = 2048;

// What the worker's process holds right before execve, read back from the kernel: follows a
// ChildReport of stage kStagePrivileges.
struct PrivilegesReport {
  std::uint64_t inheritable, permitted, effective, bounding, ambient;
  std::uint32_t uid[3], gid[3];  // real, effective, saved
  std::int32_t no_new_privs, dumpable, seccomp;
};

// The init's last word, through the status pipe: how the worker (pid 2) ended and how many
// processes it left that the init killed.
struct InitReport {
  std::int32_t code;    // -1 unless it exited
  std::int32_t signal;  // 0 unless killed by a signal
  std::int32_t core_dumped;
  std::int32_t leftover;
};

// What the parent sends through the gate: the control files the child writes "0" to, to move
// itself into its cgroups (v1 `tasks`), as `count` NUL-terminated paths in `bytes` bytes.
struct GateHeader {
  std::uint32_t count;
  std::uint32_t bytes;
};
constexpr std::size_t kGateMaxBytes = 4 * 4096;  // read onto the child's stack
constexpr std::size_t kWorkerStack = 64 * 1024;  // the worker's stack until execve (the init's)

struct MountOp {
  enum Kind { kMount, kMkdir } kind;
  const char* source;
  const char* target;
  const char* fstype;
  unsigned long flags;
  const char* data;
  int stage;
};

// A descriptor the child keeps: moved from `from` (the parent's number) to `to`.
struct FdMove {
  int from;
  int to;
  bool cloexec;
  int temp;  // written by the child (its own copy of this array)
};

// Everything the child needs, as plain pointers into storage the parent keeps alive. The fd
// fields are the numbers the child moved them to.
struct ChildPlan {
  FdMove* moves;
  std::size_t move_count;
  int first_free;  // every descriptor from here up is closed before anything else
  int gate_read;
  int report_write;
  int status_write;
  int parent_pidfd;  // -1 without pidfd_open
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
  bool root_worker;  // uid 0 (allow_root): the bounding set must go, or execve regains it all
  const sock_fprog* seccomp;
  const cpu_set_t* affinity;  // restored first thing (see prespawn), or null
};

[[noreturn]] void child_fail(const ChildPlan& p, int stage, int op = -1) {
  ChildReport r{stage, errno, op};
  ssize_t ignored = ::write(p.report_write, &r, sizeof r);
  (void)ignored;
  ::_exit(127);
}

// Closes [first, last]; close_range where the kernel has it (5.9), else one by one up to the
// descriptor limit.
void close_fds(unsigned first, unsigned last) {
  if (first > last || ::syscall(SYS_close_range, first, last, 0U) == 0) return;
  struct rlimit lim {};
  ::getrlimit(RLIMIT_NOFILE, &lim);
  unsigned top = lim.rlim_cur == RLIM_INFINITY ? 65536U : static_cast<unsigned>(lim.rlim_cur);
  for (unsigned fd = first; fd <= last && fd < top; ++fd) ::close(static_cast<int>(fd));
}

// Moves the kept descriptors to their numbers and closes every other one: nothing of assayd's
// (its listening socket, other children's gates) stays open here for a moment longer. Each is
// first copied above the final numbers, so that no move overwrites one still to be made.
bool place_fds(const ChildPlan& p) {
  for (std::size_t i = 0; i < p.move_count; ++i) {
    p.moves[i].temp = ::fcntl(p.moves[i].from, F_DUPFD_CLOEXEC, p.first_free);
    if (p.moves[i].temp < 0) return false;
  }
  for (std::size_t i = 0; i < p.move_count; ++i) {
    const FdMove& m = p.moves[i];
    if (::dup3(m.temp, m.to, m.cloexec ? O_CLOEXEC : 0) < 0) return false;
  }
  close_fds(static_cast<unsigned>(p.first_free), ~0U);
  return true;
}

// Moves the calling (single-threaded) child into one cgroup; false with errno set on failure.
// A file below /sys is opened through `old_sys`, the /sys that the fresh one now covers.
bool write_zero(int old_sys, const char* file) {
  int fd = old_sys >= 0 && std::strncmp(file, "/sys/", 5) == 0
               ? ::openat(old_sys, file + 5, O_WRONLY | O_CLOEXEC)
               : ::open(file, O_WRONLY | O_CLOEXEC);
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
// that the parent's write to the gate never meets a closed pipe. *old_sys: the host's /sys,
// where the v1 cgroups the child moves itself into after the gate are.
int child_setup(const ChildPlan& p, int* op, int* old_sys) {
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
  // A /proc that shows this PID namespace only (no /proc/<assayd>), and a /sys whose
  // class/net is this network namespace's.
  const unsigned long quiet = MS_NOSUID | MS_NODEV | MS_NOEXEC;
  if (::mount("proc", "/proc", "proc", quiet, nullptr) != 0) return kStageProc;
  *old_sys = ::open("/sys", O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (::mount("sysfs", "/sys", "sysfs", quiet | MS_RDONLY, nullptr) != 0) return kStageSys;
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
  if (::stat("/proc/self/ns/pid", &st) == 0) {
    ns.pid_dev = st.st_dev;
    ns.pid_ino = st.st_ino;
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

// What the worker's process holds now, as the kernel answers.
PrivilegesReport read_privileges() {
  PrivilegesReport r{};
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2] = {};
  if (::syscall(SYS_capget, &header, data) == 0) {
    auto both = [](std::uint32_t lo, std::uint32_t hi) { return std::uint64_t(hi) << 32 | lo; };
    r.effective = both(data[0].effective, data[1].effective);
    r.permitted = both(data[0].permitted, data[1].permitted);
    r.inheritable = both(data[0].inheritable, data[1].inheritable);
  } else {
    r.effective = r.permitted = r.inheritable = ~0ULL;  // unknown: the parent refuses it
  }
  for (int cap = 0; cap < 64; ++cap) {
    int in = ::prctl(PR_CAPBSET_READ, cap, 0, 0, 0);
    if (in < 0) break;  // past the last capability
    if (in > 0) r.bounding |= 1ULL << cap;
  }
  // Ambient is a subset of permitted and inheritable (a kernel invariant): ask about those.
  for (int cap = 0; cap < 64; ++cap) {
    if (((r.permitted & r.inheritable) >> cap & 1) &&
        ::prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_IS_SET, cap, 0, 0) > 0) {
      r.ambient |= 1ULL << cap;
    }
  }
  ::syscall(SYS_getresuid, &r.uid[0], &r.uid[1], &r.uid[2]);
  ::syscall(SYS_getresgid, &r.gid[0], &r.gid[1], &r.gid[2]);
  r.no_new_privs = ::prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0);
  r.dumpable = ::prctl(PR_GET_DUMPABLE, 0, 0, 0, 0);
  r.seccomp = ::prctl(PR_GET_SECCOMP, 0, 0, 0, 0);
  return r;
}

// The worker's process (pid 2), sharing the init's memory until execve: gives up every
// privilege, installs the filter, reports what it holds and executes.
int worker_main(void* arg) {
  const ChildPlan& p = *static_cast<const ChildPlan*>(arg);
  // The bounding set first: dropping it needs CAP_SETPCAP, which setresuid takes away.
  for (int cap = 0; cap < 64; ++cap) {
    int in = ::prctl(PR_CAPBSET_READ, cap, 0, 0, 0);
    if (in < 0) break;
    if (in == 0 || ::prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0) continue;
    // Without CAP_SETPCAP (a service that does not grant it) a non-root worker keeps the set,
    // which it cannot use (no_new_privs, no file capabilities); the evidence shows it.
    if (errno == EPERM && !p.root_worker) break;
    child_fail(p, kStageBounding, cap);
  }
  ::prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);  // EINVAL before 4.3: none
  if (p.set_ids) {
    if (::syscall(SYS_setgroups, 0, nullptr) != 0) child_fail(p, kStageSetgroups);
    if (::syscall(SYS_setresgid, p.gid, p.gid, p.gid) != 0) child_fail(p, kStageSetgid);
    if (::syscall(SYS_setresuid, p.uid, p.uid, p.uid) != 0) child_fail(p, kStageSetuid);
  }
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct none[2] = {};
  if (::syscall(SYS_capset, &header, none) != 0) child_fail(p, kStageCapabilities);
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) child_fail(p, kStageNoNewPrivs);
  if (::prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) child_fail(p, kStageDumpable);
  // SPEC_ALLOW: a filter would otherwise also switch on the speculative store bypass
  // mitigation (kernels before 5.16), which slows a CPU forward pass and guards nothing here.
  if (::syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_SPEC_ALLOW, p.seccomp) !=
          0 &&
      (errno != EINVAL || ::syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, p.seccomp) != 0)) {
    child_fail(p, kStageSeccomp);
  }
  char msg[sizeof(ChildReport) + sizeof(PrivilegesReport)];
  ChildReport head{kStagePrivileges, 0, -1};
  PrivilegesReport held = read_privileges();
  std::memcpy(msg, &head, sizeof head);
  std::memcpy(msg + sizeof head, &held, sizeof held);
  ssize_t ignored = ::write(p.report_write, msg, sizeof msg);
  (void)ignored;
  ::execve(p.exe, p.argv, p.envp);
  child_fail(p, kStageExec);
}

// The init (pid 1 of the worker's PID namespace) once the worker runs: reaps whatever exits;
// when the worker exits, kills everything else in the namespace, reaps it, and reports.
[[noreturn]] void run_init(const ChildPlan& p, pid_t worker) {
  close_fds(0, static_cast<unsigned>(p.status_write) - 1);  // stdio, passed fds, the report pipe
  close_fds(static_cast<unsigned>(p.status_write) + 1, ~0U);
  InitReport r{-1, 0, 0, 0};
  bool worker_done = false;
  for (;;) {
    siginfo_t info{};
    if (::syscall(SYS_waitid, P_ALL, 0, &info, WEXITED, nullptr) != 0) {
      if (errno == EINTR) continue;
      break;  // ECHILD: nothing is left
    }
    if (!worker_done && info.si_pid == worker) {
      worker_done = true;
      if (info.si_code == CLD_EXITED) {
        r.code = info.si_status;
      } else {
        r.signal = info.si_status;
        r.core_dumped = info.si_code == CLD_DUMPED;
      }
      ::kill(-1, SIGKILL);  // everyone in this namespace but the init
    } else if (worker_done && info.si_code == CLD_KILLED && info.si_status == SIGKILL) {
      ++r.leftover;
    }
  }
  ssize_t ignored = ::write(p.status_write, &r, sizeof r);
  (void)ignored;
  ::_exit(r.signal ? 128 + r.signal : r.code & 0xff);
}

[[noreturn]] void child_main(const ChildPlan& p) {
  // Dies with the thread that cloned it until the gate has opened; then the worker is its own
  // (a restarted assayd finds its cgroup), as a worker past exec always was.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
  int failed = 0, failed_errno = 0, op = -1, old_sys = -1;
  if (p.affinity && ::sched_setaffinity(0, sizeof *p.affinity, p.affinity) != 0) {
    failed = kStageAffinity;
    failed_errno = errno;
  }
  if (!place_fds(p)) ::_exit(127);  // the parent reads EOF (and its gate write gets EPIPE)
  if (p.parent_pidfd >= 0) {
    // The parent may have died before PDEATHSIG was armed (getppid() says 0 in a new PID
    // namespace whether it lives or not, so ask its pidfd).
    struct pollfd gone {
      p.parent_pidfd, POLLIN, 0
    };
    if (::poll(&gone, 1, 0) == 1) ::_exit(127);
    ::close(p.parent_pidfd);
  }
  // The namespaces next: making a network namespace is most of a spawn's time, and the parent
  // makes the cgroup meanwhile (or has made it and cloned us into it). A failure is kept until
  // the gate was read, so that the parent's write to the gate never meets a closed pipe.
  if (failed == 0) {
    if (::unshare(CLONE_NEWNET | CLONE_NEWNS) != 0) {
      failed = kStageUnshare;
      failed_errno = errno;
    } else {
      report_namespaces(p);
      failed = child_setup(p, &op, &old_sys);
      failed_errno = errno;
    }
  }
  // Held here until the parent has made the cgroup.
  GateHeader gate{};
  char files[kGateMaxBytes];
  if (!read_full(p.gate_read, &gate, sizeof gate) || gate.bytes > sizeof files ||
      !read_full(p.gate_read, files, gate.bytes)) {
    ::_exit(127);
  }
  ::close(p.gate_read);
  if (failed != 0) {
    errno = failed_errno;
    child_fail(p, failed, op);
  }
  // Into the worker's cgroups before anything of the command runs.
  const char* file = files;
  for (std::uint32_t i = 0; i < gate.count; ++i) {
    if (!write_zero(old_sys, file)) child_fail(p, kStageAttach, static_cast<int>(i));
    file += std::strlen(file) + 1;
  }
  if (old_sys >= 0) ::close(old_sys);
  ::prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0);
  // The init is root and pid 1 where the worker can see it: its /proc entries stay root's.
  if (::prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) child_fail(p, kStageDumpable);
  alignas(16) char stack[kWorkerStack];
  pid_t worker = ::clone(worker_main, stack + sizeof stack, CLONE_VM | CLONE_VFORK | SIGCHLD,
                         const_cast<ChildPlan*>(&p));
  if (worker < 0) child_fail(p, kStageFork);
  run_init(p, worker);
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
  if (exe.empty() || exe.front() != '/') {
    throw common::Error("contain.spawn_failed", "argv[0] \"" + exe + "\" is not an absolute path");
  }
  for (int fd : spec.pass_fds) {
    if (fd < 0 || ::fcntl(fd, F_GETFD) < 0) {
      throw common::Error("contain.spawn_failed",
                          "pass_fds: descriptor " + std::to_string(fd) + " is not open");
    }
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
  // Without pidfd_open (before 5.3) the child cannot tell that its parent died before it
  // armed PDEATHSIG; the gate's EOF still ends it.
  UniqueFd parent_pidfd(static_cast<int>(::syscall(SYS_pidfd_open, ::getpid(), 0)));

  // The child's descriptors: 0-2, the passed ones from 3, then its own (close-on-exec).
  const int own = 3 + static_cast<int>(spec.pass_fds.size());
  const int gate_slot = own, report_slot = own + 1, status_slot = own + 2, parent_slot = own + 3,
            workdir_slot = own + 4, first_free = own + 5;

  // Hidden paths: an empty read-only tmpfs over a directory, /dev/null over anything else. A
  // workdir inside a hidden directory is bind-mounted back at its own path.
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
  moves.push_back({gate_r.get(), gate_slot, true, -1});
  moves.push_back({report_w.get(), report_slot, true, -1});
  moves.push_back({status_w.get(), status_slot, true, -1});
  if (parent_pidfd) moves.push_back({parent_pidfd.get(), parent_slot, true, -1});
  moves.push_back({workdir_fd.get(), workdir_slot, true, -1});

  ChildPlan plan{};
  plan.moves = moves.data();
  plan.move_count = moves.size();
  plan.first_free = first_free;
  plan.gate_read = gate_slot;
  plan.report_write = report_slot;
  plan.status_write = status_slot;
  plan.parent_pidfd = parent_pidfd ? parent_slot : -1;
  plan.workdir_fd = workdir_slot;
  std::string workdir_str = workdir.string();
  plan.workdir = workdir_str.c_str();
  plan.exe = argv_store.front().c_str();
  plan.argv = argv_ptrs.data();
  plan.envp = env_ptrs.data();
  plan.ops = ops.data();
  plan.op_count = ops.size();
  plan.nofile = spec.nofile;
  plan.set_ids = spec.uid.has_value() || spec.gid.has_value();
  plan.uid = spec.uid.value_or(::geteuid());
  plan.gid = spec.gid.value_or(::getegid());
  plan.root_worker = plan.uid == 0;
  plan.seccomp = &seccomp_policy().fprog;
  st.root_worker = plan.root_worker;

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

bool same_namespace(const char* mine_path, std::uint64_t dev, std::uint64_t ino) {
  struct stat mine {};
  return ino == 0 || (::stat(mine_path, &mine) == 0 && ino == mine.st_ino && dev == mine.st_dev);
}

std::string hex(std::uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
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
    child.reset();  // reaps it (and `st` with it)
    common::throw_errno("contain.spawn_failed", what, report.err);
  };
  auto gone = [&](const char* before) {
    child.reset();
    throw common::Error("contain.spawn_failed", std::string("the child exited before ") + before);
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
  // A child that died before the gate (it never does on its own before reading it) must not
  // take this process with it through SIGPIPE.
  sigset_t pipe_only, old;
  sigemptyset(&pipe_only);
  sigaddset(&pipe_only, SIGPIPE);
  ::pthread_sigmask(SIG_BLOCK, &pipe_only, &old);
  bool written = write_all(st.gate_w.get(), gate.data(), gate.size());
  int write_errno = errno;
  if (!written && write_errno == EPIPE && !sigismember(&old, SIGPIPE)) {
    struct timespec now {};
    ::sigtimedwait(&pipe_only, nullptr, &now);  // consume ours, not a real one's
  }
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
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
  std::string kept;
  if (held.effective || held.permitted || held.inheritable || held.ambient) kept += " capabilities";
  if (held.bounding && st.root_worker) kept += " bounding set " + hex(held.bounding);
  if (held.no_new_privs != 1) kept += " no_new_privs " + std::to_string(held.no_new_privs);
  if (held.seccomp != 2) kept += " seccomp mode " + std::to_string(held.seccomp);
  if (held.uid[0] != held.uid[1] || held.uid[1] != held.uid[2] || held.gid[0] != held.gid[1] ||
      held.gid[1] != held.gid[2]) {
    kept += " mixed ids";
  }
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

std::optional<InitOutcome> read_init_report(int status_read) {
  InitReport r{};
  ssize_t n;
  do {
    n = ::read(status_read, &r, sizeof r);
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(sizeof r)) return std::nullopt;
  InitOutcome out;
  if (r.signal != 0) {
    out.exit.signal = r.signal;
    out.exit.core_dumped = r.core_dumped != 0;
  } else {
    out.exit.code = r.code;
  }
  out.leftover_killed = r.leftover;
  return out;
}

}  // namespace assay::contain::detail
