// Starting one contained process: clone3 (into the cgroup where the kernel allows it, else a
// pipe gate that holds the child until it was attached: by itself on v1, where it moves into
// its cgroups as its first act, by the parent otherwise), private network and mount
// namespaces, cleared environment, rlimits, optional privilege drop, pidfd.
#pragma once

#include <string>
#include <vector>

#include <sys/types.h>

#include "common/fs.h"
#include "common/json.h"
#include "supervisor/contain/cgroup.h"
#include "supervisor/contain/contain.h"

namespace assay::contain::detail {

struct Spawned {
  pid_t pid = -1;
  common::UniqueFd pidfd;
  common::UniqueFd stdout_read;
  common::UniqueFd stderr_read;
  // "clone3-into-cgroup"; "clone3-self-attach"/"clone-self-attach" (v1: the gated child moved
  // itself in); "clone3-pipe-gate"/"clone-pipe-gate" (the parent attached the gated child).
  std::string method;
  common::Json network;  // {"namespace": "private", "interfaces": [...]} as the kernel lists them
  common::Json mounts;   // {"namespace": "private", "hidden": [...], "absent": [...]}
};

// Starts spec.argv in `cgroup` (null: no cgroup, mode "none"). Throws
// common::Error("contain.spawn_failed") naming the step and errno when the child could not be
// started or could not exec; nothing is left running then.
Spawned spawn_contained(const SpawnSpec& spec, Cgroup* cgroup);

}  // namespace assay::contain::detail
