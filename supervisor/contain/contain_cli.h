// `assayd contain`: runs one contained process and prints its evidence (contain_cli.cpp).
#pragma once

#include "supervisor/contain/contain.h"

namespace assay::supervisor {

// argv[0] is the subcommand name. Exit 0 when the process ran and was measured, whatever its own
// outcome; 1 when containment itself failed; 2 on a usage error.
int contain_main(int argc, char** argv);

// A spawn spec written on another host (the Slurm head), to run here: the environment values only
// this node knows (spec.node_env, e.g. the GPUs Slurm allocated) from this process's
// environment; with no uid named and this process root, this node's default worker identity,
// given the workspace. Throws common::Error("contain.usage").
void adopt_remote_spec(contain::SpawnSpec& spec);

}  // namespace assay::supervisor
