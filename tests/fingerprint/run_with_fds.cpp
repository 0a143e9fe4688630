// Test helper standing in for the supervisor's file passing: opens each --open PATH as the
// calling user (no symlink followed), places the descriptors at 3, 4, ... in order, closes
// every other descriptor above 2, drops to --gid/--uid when given, and execs the command.
//
//   run_with_fds [--uid N] [--gid N] [--open PATH]... -- PROGRAM [ARGS...]
#include <fcntl.h>
#include <grp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "run_with_fds: %s: %s\n", what.c_str(), std::strerror(errno));
  std::exit(125);
}

}  // namespace

int main(int argc, char** argv) {
  long uid = -1, gid = -1;
  std::vector<std::string> paths;
  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "run_with_fds: %s needs a value\n", a.c_str());
      return 125;
    }
    if (a == "--uid")
      uid = std::stol(argv[++i]);
    else if (a == "--gid")
      gid = std::stol(argv[++i]);
    else if (a == "--open")
      paths.emplace_back(argv[++i]);
    else {
      std::fprintf(stderr, "run_with_fds: unknown option %s\n", a.c_str());
      return 125;
    }
  }
  if (i >= argc) {
    std::fprintf(stderr, "usage: run_with_fds [--uid N] [--gid N] [--open PATH]... -- CMD...\n");
    return 125;
  }
  // Opened first and parked high, so that placing them at 3.. never overwrites one of them.
  std::vector<int> parked;
  for (std::size_t k = 0; k < paths.size(); ++k) {
    int fd = ::open(paths[k].c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) die("open " + paths[k]);
    int high = ::fcntl(fd, F_DUPFD_CLOEXEC, 1000 + static_cast<int>(k));
    if (high < 0) die("park " + paths[k]);
    ::close(fd);
    parked.push_back(high);
  }
  for (std::size_t k = 0; k < parked.size(); ++k)
    if (::dup2(parked[k], 3 + static_cast<int>(k)) < 0) die("dup2 " + paths[k]);  // no CLOEXEC
  if (::syscall(SYS_close_range, 3 + parked.size(), ~0U, 0) != 0) die("close_range");
  if (gid >= 0) {
    if (::setgroups(0, nullptr) != 0) die("setgroups");
    if (::setgid(static_cast<gid_t>(gid)) != 0) die("setgid");
  }
  if (uid >= 0 && ::setuid(static_cast<uid_t>(uid)) != 0) die("setuid");
  ::execv(argv[i], argv + i);
  die(std::string("exec ") + argv[i]);
}
