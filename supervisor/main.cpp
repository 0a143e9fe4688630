// assayd: the supervisor's command line. `contain` runs one contained process here; `serve`
// replaces this process (same pid, so systemd's socket activation and notifications still
// address it) with assayd-serve, the daemon, which lives in its own executable so that this
// one links neither the HTTP server nor libcrypto (and can be static): it starts as fast as
// /bin/true (bench/contain_overhead.md).
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

#include "supervisor/contain/contain_cli.h"

#ifndef ASSAY_LIBEXEC_DIR
#define ASSAY_LIBEXEC_DIR "/usr/libexec/assay"
#endif

namespace {

constexpr const char* kUsage =
    "usage: assayd <command> [options]\n"
    "\n"
    "commands:\n"
    "  serve     run the supervisor daemon (HTTP/1.1 over a unix socket)\n"
    "  contain   run one command in a fresh contained cgroup and print the evidence JSON\n"
    "  node      one node of a Slurm worker pool (run by the pool's batch script)\n"
    "\n"
    "Run `assayd <command> --help` for the options of a command.\n";

// assayd-serve beside this executable (the build tree; an override for tests), else in the
// installed libexec directory.
std::vector<std::filesystem::path> serve_candidates() {
  std::vector<std::filesystem::path> out;
  std::error_code ec;
  auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) out.push_back(self.parent_path() / "assayd-serve");
  out.emplace_back(std::filesystem::path(ASSAY_LIBEXEC_DIR) / "assayd-serve");
  return out;
}

int exec_serve(int argc, char** argv) {
  std::vector<char*> args(argv + 1, argv + argc);  // "serve" or "node", options...
  args.push_back(nullptr);
  std::string tried;
  int err = ENOENT;
  for (const auto& candidate : serve_candidates()) {
    if (::access(candidate.c_str(), X_OK) != 0) {
      tried += (tried.empty() ? "" : ", ") + candidate.string();
      continue;
    }
    ::execv(candidate.c_str(), args.data());
    err = errno;
    tried += (tried.empty() ? "" : ", ") + candidate.string();
  }
  std::fprintf(stderr, "assayd: cannot run the daemon executable assayd-serve (tried %s): %s\n",
               tried.c_str(), std::strerror(err));
  return 1;
}

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
  if (!std::strcmp(argv[1], "serve") || !std::strcmp(argv[1], "node"))
    return exec_serve(argc, argv);
  if (!std::strcmp(argv[1], "contain")) return assay::supervisor::contain_main(argc - 1, argv + 1);
  std::fprintf(stderr, "assayd: unknown command \"%s\"\n%s", argv[1], kUsage);
  return 2;
}
