// assayd serve (`assayd contain` is declared in supervisor/contain/contain_cli.h); each parses its
// own arguments (argv[0] is the subcommand name).
#pragma once

namespace assay::supervisor {

int serve_main(int argc, char** argv);  // supervisor/serve.cpp
int node_main(int argc, char** argv);   // supervisor/pool_node.cpp: one node of a Slurm pool

}  // namespace assay::supervisor
