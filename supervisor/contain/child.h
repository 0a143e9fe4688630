// The child side of a spawn (child.cpp): what runs between clone and execve, and the messages
// it sends the parent (spawn.cpp). The child runs in a copy of a possibly multi-threaded
// process, so it only makes raw system calls on memory prepared by the parent: no malloc, no
// locks, no glibc set*id (its all-threads broadcast would wait for threads that do not exist).
//
// Who is who: the cloned child is pid 1 of a new PID namespace. It keeps only its own
// descriptors, makes the network and mount namespaces, mounts /proc and /sys for them, waits
// at the gate and moves itself into the cgroup (v1). Then it starts the worker (pid 2,
// vfork-style: it shares the init's memory until execve), which drops every privilege,
// installs the seccomp filter, reports what it holds and executes. The child stays behind as
// the namespace's init: when the worker exits it kills what the worker left and reports the
// worker's exit status through a pipe of its own.
#pragma once

#include <cstddef>
#include <cstdint>

#include <linux/filter.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/types.h>

namespace assay::contain::detail {

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
  kStagePriority,
};

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

const char* stage_name(int stage);

// Runs in the cloned child; never returns.
[[noreturn]] void child_main(const ChildPlan& p);

// Reads exactly `size` bytes; false on EOF or error.
bool read_full(int fd, void* buf, std::size_t size);

}  // namespace assay::contain::detail
