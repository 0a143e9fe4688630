// The child side of a spawn: see child.h.
#include "supervisor/contain/child.h"

#include <cerrno>
#include <csignal>
#include <cstring>
#include <initializer_list>

#include <fcntl.h>
#include <linux/capability.h>
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

#ifndef SECCOMP_FILTER_FLAG_SPEC_ALLOW
#define SECCOMP_FILTER_FLAG_SPEC_ALLOW (1UL << 2)
#endif

namespace assay::contain::detail {

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
    case kStagePriority:
      return "sched_setscheduler/setpriority";
  }
  return "unknown step";
}

namespace {

// Workers run at this nice value (weight ~110 against the supervisor's 1024).
constexpr int kWorkerNice = 10;

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
  // A worker yields the CPU to the supervisor, which must keep answering while it computes: a
  // batch-class, niced process (lowering one's own priority needs no privilege and cannot fail
  // for a valid value; the cgroup backends add their own lower weight where they can). The last
  // step before the exec: set-up done at a lower priority waits behind every busy process of a
  // loaded machine (a 32 ms stall was traced in the capability checks).
  struct sched_param batch {};
  batch.sched_priority = 0;
  if (::sched_setscheduler(0, SCHED_BATCH, &batch) != 0) child_fail(p, kStagePriority);
  if (::setpriority(PRIO_PROCESS, 0, kWorkerNice) != 0) child_fail(p, kStagePriority);
  ::execve(p.exe, p.argv, p.envp);
  child_fail(p, kStageExec);
}

pid_t g_init_worker = 0;  // the init's worker, for forward_signal

// A signal sent to the init from outside (a batch system signals every process of its job) is
// the worker's: a pid-namespace init would otherwise die of it and take the worker down with a
// SIGKILL that the evidence would then report instead of what was sent.
void forward_signal(int sig) {
  ::kill(g_init_worker, sig);
}

// The init (pid 1 of the worker's PID namespace) once the worker runs: reaps whatever exits;
// when the worker exits, kills everything else in the namespace, reaps it, and reports.
[[noreturn]] void run_init(const ChildPlan& p, pid_t worker) {
  g_init_worker = worker;
  struct sigaction fwd {};
  fwd.sa_handler = forward_signal;
  ::sigemptyset(&fwd.sa_mask);
  for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2})
    ::sigaction(sig, &fwd, nullptr);
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

}  // namespace

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

}  // namespace assay::contain::detail
