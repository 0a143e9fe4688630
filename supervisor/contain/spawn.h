// Starting one contained process: clone3 (into the cgroup where the kernel allows it); the
// child makes its own network and mount namespaces, reports the network namespace as the
// kernel shows it from inside (its inode and /proc/self/net/dev, read before anything but
// assayd's code ran there), sets up (private mounts, lo, stdio, rlimits, signals) and waits at
// a pipe gate until its cgroup exists; on v1 it then moves itself into its cgroups (else the
// parent attached it) before it executes. Cleared environment, optional privilege drop, pidfd.
#pragma once

#include <memory>
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
  MountsEvidence mounts;
};

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
