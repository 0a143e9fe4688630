// assayd: the supervisor. `serve` runs the daemon; `contain` runs one contained process.
#include <cstdio>
#include <cstring>

#include "supervisor/commands.h"

namespace {

constexpr const char* kUsage =
    "usage: assayd <command> [options]\n"
    "\n"
    "commands:\n"
    "  serve     run the supervisor daemon (HTTP/1.1 over a unix socket)\n"
    "  contain   run one command in a fresh contained cgroup and print the evidence JSON\n"
    "\n"
    "Run `assayd <command> --help` for the options of a command.\n";

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (!std::strcmp(argv[1], "--version")) {
    std::puts("assayd " ASSAY_VERSION);
    return 0;
  }
  if (!std::strcmp(argv[1], "serve")) return assay::supervisor::serve_main(argc - 1, argv + 1);
  if (!std::strcmp(argv[1], "contain")) return assay::supervisor::contain_main(argc - 1, argv + 1);
  std::fprintf(stderr, "assayd: unknown command \"%s\"\n%s", argv[1], kUsage);
  return 2;
}
