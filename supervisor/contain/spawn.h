// Starting one contained process: clone3 (into the cgroup where the kernel allows it) of a child
// that is pid 1 of a new PID namespace; it keeps only its own descriptors, makes its network
// and mount namespaces, reports them as the kernel shows them from inside (inodes and
// /proc/self/net/dev, read before anything but assayd's code ran there), sets up (/proc, /sys,
// private mounts, lo, rlimits, signals) and waits at a pipe gate until its cgroup exists; on v1
// it then moves itself into its cgroups (else the parent attached it). It then starts the worker
// as pid 2, which drops every privilege, installs the seccomp filter, reports what it holds and
// executes; the child stays as the namespace's init and reports the worker's exit.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <sys/types.h>

#include "common/fs.h"
#include "supervisor/contain/cgroup.h"
#include "supervisor/contain/contain.h"
#include "supervisor/contain/evidence.h"

namespace assay::contain::detail {

struct Spawned {
  pid_t pid = -1;
  common::UniqueFd pidfd;
  common::UniqueFd stdout_read;
  common::UniqueFd stderr_read;
  // "clone3-into-cgroup"; "clone3-self-attach"/"clone-self-attach" (v1: the gated child moved
  // itself in); "clone3-pipe-gate"/"clone-pipe-gate" (the parent attached the gated child).
  std::string method;
  // The child's network namespace inode against assayd's, and the interfaces the kernel lists
  // in it.
  NetworkEvidence network;
  bool pid_namespace_private = false;
  MountsEvidence mounts;
  uid_t uid = 0;  // as the worker read them back before execve
  gid_t gid = 0;
  Capabilities capabilities;
  // The init's report of the worker's exit (read_init_report).
  common::UniqueFd status_read;
};

// How the worker (pid 2) ended, as its init reported it.
struct InitOutcome {
  ExitStatus exit;
  int leftover_killed = 0;  // processes the worker left that the init killed
};
// Reads the init's report once it exited; nullopt when it wrote none (it was killed first, as
// on a timeout's or cancel's cgroup kill: its own status is the worker's then).
std::optional<InitOutcome> read_init_report(int status_read);

// Refuses (common::Error("contain.root_worker")) a spec whose worker would run as uid 0 or
// gid 0 unless it says allow_root.
void check_identity(const SpawnSpec& spec);

// A cloned child that is making its namespaces and will wait at the gate (an EarlyChild when
// started before the Runtime exists). Destroying it before finish_spawn kills and reaps it.
class Prespawned : public EarlyChild {
 public:
  Prespawned();
  ~Prespawned() override;
  pid_t pid() const;
  // Gives the calling thread back the CPUs it had before prespawn (see there).
  void restore_affinity();

  struct State;
  std::unique_ptr<State> state_;
};

// Clones the child for `spec` (into `clone_into` where the kernel allows it; null: not into a
// cgroup). The child starts making its namespaces at once.
std::unique_ptr<Prespawned> prespawn(const SpawnSpec& spec, Cgroup* clone_into);
// Waits for the child's namespaces, records them, moves the child into `cgroup` (null: no
// cgroup, mode "none"; itself on v1, unless it was cloned there) and lets it exec. Throws
// common::Error("contain.spawn_failed") naming the step and errno when the child could not
// be started or could not exec; the child is reaped then.
Spawned finish_spawn(std::unique_ptr<Prespawned> child, Cgroup* cgroup);

}  // namespace assay::contain::detail
