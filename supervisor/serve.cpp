// Placeholder until the supervisor daemon lands (issue: supervisor daemon and client CLI).
#include <cstdio>

#include "supervisor/commands.h"

namespace assay::supervisor {

int serve_main(int, char**) {
  std::fputs("assayd serve: not built in this revision\n", stderr);
  return 2;
}

}  // namespace assay::supervisor
