// The parent's side of the child's pipes: the gate message it writes, the reports it reads.
#include "supervisor/contain/spawn_report.h"

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <sstream>

#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "supervisor/contain/spawn.h"

namespace assay::contain::detail {

namespace {

bool write_all(int fd, const char* data, std::size_t size) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return false;
    data += n;
    size -= static_cast<std::size_t>(n);
  }
  return true;
}

std::string hex(std::uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

// Interface names in /proc/net/dev text (two header lines, then "  name: counters...").
std::vector<std::string> interfaces_of(const std::string& net_dev) {
  std::vector<std::string> out;
  std::istringstream in(net_dev);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    if (++n <= 2) continue;  // two header lines
    auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = line.substr(0, colon);
    name.erase(0, name.find_first_not_of(' '));
    out.push_back(name);
  }
  return out;
}

bool same_namespace(const char* mine_path, std::uint64_t dev, std::uint64_t ino) {
  struct stat mine {};
  return ino == 0 || (::stat(mine_path, &mine) == 0 && ino == mine.st_ino && dev == mine.st_dev);
}

// What the gate pipe carries: a header, then the files the child writes `0` to.
std::string gate_message(const std::vector<std::string>& attach_files) {
  std::string gate;
  for (const auto& f : attach_files) gate.append(f).push_back('\0');
  if (gate.size() > kGateMaxBytes) {
    throw common::Error("contain.spawn_failed",
                        "cgroup paths too long for the gate (" + std::to_string(gate.size()) +
                            " bytes, at most " + std::to_string(kGateMaxBytes) + ")");
  }
  GateHeader header{static_cast<std::uint32_t>(attach_files.size()),
                    static_cast<std::uint32_t>(gate.size())};
  gate.insert(0, reinterpret_cast<const char*>(&header), sizeof header);
  return gate;
}

// Writes the gate message; false (and `write_errno`) when the child is gone.
bool write_gate(int fd, const std::string& gate, int& write_errno) {
  // A child that died before the gate (it never does on its own before reading it) must not
  // take this process with it through SIGPIPE.
  sigset_t pipe_only, old;
  sigemptyset(&pipe_only);
  sigaddset(&pipe_only, SIGPIPE);
  ::pthread_sigmask(SIG_BLOCK, &pipe_only, &old);
  bool written = write_all(fd, gate.data(), gate.size());
  write_errno = errno;
  if (!written && write_errno == EPIPE && !sigismember(&old, SIGPIPE)) {
    struct timespec now {};
    ::sigtimedwait(&pipe_only, nullptr, &now);  // consume ours, not a real one's
  }
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  return written;
}

// What the worker holds that it must not (empty: nothing).
std::string kept_privileges(const PrivilegesReport& held, bool root_worker) {
  std::string kept;
  if (held.effective || held.permitted || held.inheritable || held.ambient) kept += " capabilities";
  if (held.bounding && root_worker) kept += " bounding set " + hex(held.bounding);
  if (held.no_new_privs != 1) kept += " no_new_privs " + std::to_string(held.no_new_privs);
  if (held.seccomp != 2) kept += " seccomp mode " + std::to_string(held.seccomp);
  if (held.uid[0] != held.uid[1] || held.uid[1] != held.uid[2] || held.gid[0] != held.gid[1] ||
      held.gid[1] != held.gid[2]) {
    kept += " mixed ids";
  }
  return kept;
}

std::optional<InitOutcome> read_init_report(int status_read) {
  InitReport r{};
  ssize_t n;
  do {
    n = ::read(status_read, &r, sizeof r);
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(sizeof r)) return std::nullopt;
  InitOutcome out;
  if (r.signal != 0) {
    out.exit.signal = r.signal;
    out.exit.core_dumped = r.core_dumped != 0;
  } else {
    out.exit.code = r.code;
  }
  out.leftover_killed = r.leftover;
  return out;
}

}  // namespace assay::contain::detail
