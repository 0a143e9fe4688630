// assayd-serve: the daemon. `assayd serve ARGS` execs `assayd-serve serve ARGS` (supervisor/
// main.cpp); started directly it behaves the same.
#include <cstring>

#include "supervisor/commands.h"

int main(int argc, char** argv) {
  // argv[1] is "serve" when assayd passed it on; serve_main expects the subcommand at argv[0].
  if (argc >= 2 && !std::strcmp(argv[1], "serve"))
    return assay::supervisor::serve_main(argc - 1, argv + 1);
  return assay::supervisor::serve_main(argc, argv);
}
