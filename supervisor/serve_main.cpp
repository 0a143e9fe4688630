// assayd-serve: the daemon. `assayd serve ARGS` execs `assayd-serve serve ARGS` (supervisor/
// main.cpp); started directly it behaves the same. `assayd node ARGS` execs `assayd-serve node
// ARGS` (supervisor/pool_node.cpp).
#include <cstring>

#include "supervisor/commands.h"

int main(int argc, char** argv) {
  // `assayd node ARGS` execs `assayd-serve node ARGS`: a node of a Slurm worker pool.
  // assayd execs it with argv[0] "node"; started directly, argv[1] is.
  if (argc >= 1 && !std::strcmp(argv[0], "node")) return assay::supervisor::node_main(argc, argv);
  if (argc >= 2 && !std::strcmp(argv[1], "node"))
    return assay::supervisor::node_main(argc - 1, argv + 1);
  // argv[1] is "serve" when assayd passed it on; serve_main expects the subcommand at argv[0].
  if (argc >= 2 && !std::strcmp(argv[1], "serve"))
    return assay::supervisor::serve_main(argc - 1, argv + 1);
  return assay::supervisor::serve_main(argc, argv);
}
