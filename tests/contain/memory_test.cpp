// contain::read_memory_view: MemAvailable capped by the tightest cgroup limit on the way up,
// against fake cgroup trees, malformed /proc text and this machine's real cgroup.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "common/error.h"
#include "supervisor/contain/cgroup.h"
#include "supervisor/contain/memory.h"
#include "tests/contain/test_util.h"

namespace {

namespace fs = std::filesystem;
using namespace assay::contain;
using assay::contain::test::slurp;
using assay::contain::test::TempDir;

constexpr std::uint64_t kMiB = 1024 * 1024;
constexpr const char* kMeminfo =
    "MemTotal:       32768000 kB\nMemFree:         1000000 kB\nMemAvailable:    2097152 kB\n"
    "Buffers:           1000 kB\n";

void put(const fs::path& file, const std::string& text) {
  fs::create_directories(file.parent_path());
  std::ofstream(file) << text;
}

std::string mount_line(const fs::path& at, bool v2) {
  return v2 ? "41 31 0:38 / " + at.string() + " rw,relatime - cgroup2 cgroup2 rw\n"
            : "35 31 0:32 / " + at.string() + " rw,relatime - cgroup cgroup rw,memory\n";
}

}  // namespace

TEST_CASE("memory view on v2: the limited ancestor caps MemAvailable; max means no limit") {
  TempDir root;
  put(root.path / "memory.current", "9999999999\n");  // the root has no memory.max
  put(root.path / "svc/memory.max", std::to_string(1024 * kMiB) + "\n");
  put(root.path / "svc/memory.current", std::to_string(300 * kMiB) + "\n");
  put(root.path / "svc/supervisor/memory.max", "max\n");
  put(root.path / "svc/supervisor/memory.current", std::to_string(100 * kMiB) + "\n");
  auto v = detail::memory_view_from("0::/svc/supervisor\n", mount_line(root.path, true), kMeminfo);
  CHECK(v.mem_available == 2048 * kMiB);
  CHECK(v.cgroup_limit == 1024 * kMiB);
  CHECK(v.cgroup_usage == 300 * kMiB);
  CHECK(v.available() == 724 * kMiB);
  CHECK(v.capacity() == 1024 * kMiB);  // the limit, below MemTotal
  // Plenty of room in the cgroup: MemAvailable is the bound.
  put(root.path / "svc/memory.max", std::to_string(64 * 1024 * kMiB) + "\n");
  v = detail::memory_view_from("0::/svc/supervisor\n", mount_line(root.path, true), kMeminfo);
  CHECK(v.available() == 2048 * kMiB);
  // No limit anywhere.
  put(root.path / "svc/memory.max", "max\n");
  v = detail::memory_view_from("0::/svc/supervisor\n", mount_line(root.path, true), kMeminfo);
  CHECK_FALSE(v.cgroup_limit);
  CHECK(v.available() == 2048 * kMiB);
  CHECK(v.mem_total == 32768000ull * 1024);
  CHECK(v.capacity() == 32768000ull * 1024);  // MemTotal when no cgroup limits it
}

TEST_CASE("memory view on v1: the smallest limit below 2^60 wins, and its usage") {
  TempDir root;
  const std::string none = "9223372036854771712\n";  // v1's "no limit"
  put(root.path / "memory.limit_in_bytes", none);
  put(root.path / "a/memory.limit_in_bytes", std::to_string(256 * kMiB) + "\n");
  put(root.path / "a/memory.usage_in_bytes", std::to_string(200 * kMiB) + "\n");
  put(root.path / "a/b/memory.limit_in_bytes", std::to_string(512 * kMiB) + "\n");
  put(root.path / "a/b/memory.usage_in_bytes", std::to_string(10 * kMiB) + "\n");
  put(root.path / "a/b/c/memory.limit_in_bytes", none);
  put(root.path / "a/b/c/memory.usage_in_bytes", std::to_string(5 * kMiB) + "\n");
  // A hybrid host: v2 is mounted too, without the memory controller; v1's memory counts.
  std::string mounts = mount_line(root.path / "unified", true) + mount_line(root.path, false);
  auto v = detail::memory_view_from("4:memory:/a/b/c\n0::/\n", mounts, kMeminfo);
  CHECK(v.cgroup_limit == 256 * kMiB);
  CHECK(v.cgroup_usage == 200 * kMiB);
  CHECK(v.available() == 56 * kMiB);
  // Over the limit: no room, not a wrapped-around number.
  put(root.path / "a/memory.usage_in_bytes", std::to_string(300 * kMiB) + "\n");
  v = detail::memory_view_from("4:memory:/a/b/c\n0::/\n", mounts, kMeminfo);
  CHECK(v.available() == 0);
}

TEST_CASE("memory view: a cgroup outside the mounted sub-tree has no visible limit") {
  TempDir root;
  put(root.path / "memory.max", "1048576\n");
  std::string mounts = "41 31 0:38 /other " + root.path.string() + " rw - cgroup2 cgroup2 rw\n";
  auto v = detail::memory_view_from("0::/mine\n", mounts, kMeminfo);
  CHECK_FALSE(v.cgroup_limit);
  CHECK(v.available() == 2048 * kMiB);
  CHECK(v.mem_total == 32768000ull * 1024);
  CHECK(v.capacity() == 32768000ull * 1024);  // MemTotal when no cgroup limits it
}

TEST_CASE("memory view: malformed /proc text and control files are errors naming them") {
  CHECK(detail::parse_mem_available("MemAvailable:        12 kB") == 12 * 1024);
  for (const char* bad :
       {"MemTotal: 1 kB\n", "", "MemAvailable: lots kB\n", "MemAvailable: 12 MB\n",
        "MemAvailable:\n", "MemAvailable: -3 kB\n", "MemAvailable: 99999999999999999999 kB\n"}) {
    CAPTURE(bad);
    try {
      detail::parse_mem_available(bad);
      FAIL("accepted");
    } catch (const assay::common::Error& e) {
      CHECK(e.code() == "contain.memory_view");
      CHECK(std::string(e.what()).find("MemAvailable") != std::string::npos);
    }
  }
  TempDir root;
  put(root.path / "a/memory.max", "lots\n");
  try {
    detail::memory_view_from("0::/a\n", mount_line(root.path, true), kMeminfo);
    FAIL("accepted a memory.max of \"lots\"");
  } catch (const assay::common::Error& e) {
    CHECK(e.code() == "contain.cgroup_io");
    CHECK(std::string(e.what()).find((root.path / "a/memory.max").string()) != std::string::npos);
  }
  CHECK_THROWS_WITH(detail::memory_view_from("memory\n", mount_line(root.path, true), kMeminfo),
                    doctest::Contains("malformed /proc/self/cgroup"));
}

// This machine's own cgroup, read here by hand: the memory hierarchy's line of
// /proc/self/cgroup (v1), else the unified one, with its directories up to the mount point.
TEST_CASE("memory view of this process matches /proc/meminfo and its own cgroup's files") {
  auto mounts = detail::parse_mountinfo_cgroups(slurp("/proc/self/mountinfo"));
  auto membership = detail::parse_proc_cgroup(slurp("/proc/self/cgroup"));
  std::optional<std::uint64_t> want_limit, want_usage;
  bool found = false;
  for (bool v2 : {false, true}) {
    for (const auto& m : mounts) {
      bool memory =
          std::find(m.controllers.begin(), m.controllers.end(), "memory") != m.controllers.end();
      if (found || m.v2 != v2 || (!v2 && !memory) || m.root != "/") continue;
      for (const auto& c : membership) {
        bool mine = v2 ? c.controllers.empty()
                       : std::find(c.controllers.begin(), c.controllers.end(), "memory") !=
                             c.controllers.end();
        if (!mine) continue;
        found = true;
        const char* limit_file = v2 ? "memory.max" : "memory.limit_in_bytes";
        const char* usage_file = v2 ? "memory.current" : "memory.usage_in_bytes";
        for (fs::path d = m.mountpoint / fs::path(c.path).relative_path();; d = d.parent_path()) {
          std::string text = slurp(d / limit_file);
          if (!text.empty() && text != "max\n") {
            std::uint64_t limit = std::stoull(text);
            if (limit < (1ULL << 60) && (!want_limit || limit < *want_limit)) {
              want_limit = limit;
              want_usage = std::stoull(slurp(d / usage_file));
            }
          }
          if (d == m.mountpoint) break;
        }
      }
    }
  }
  std::string meminfo = slurp("/proc/meminfo");
  auto at = meminfo.find("MemAvailable:");
  REQUIRE(at != std::string::npos);
  std::uint64_t want_available = std::stoull(meminfo.substr(at + 13)) * 1024;

  MemoryView v = read_memory_view();
  MESSAGE("MemAvailable " << v.mem_available << ", cgroup limit "
                          << (v.cgroup_limit ? std::to_string(*v.cgroup_limit) : "none"));
  CHECK(v.mem_available > 0);
  // Both change while the test runs; within 256 MiB of each other.
  auto near = [](std::uint64_t a, std::uint64_t b) { return (a > b ? a - b : b - a) < 256 * kMiB; };
  CHECK(near(v.mem_available, want_available));
  CHECK(v.cgroup_limit == want_limit);
  if (want_usage) {
    REQUIRE(v.cgroup_usage);
    CHECK(near(*v.cgroup_usage, *want_usage));
  }
}

// A real limit: a child process moves itself into <own>/memview-<pid>/inner, whose parent has
// a 256 MiB memory.limit_in_bytes (cgroup v1, the build machine's), and reads its view there.
TEST_CASE("memory view inside a limited v1 cgroup finds the parent's limit") {
  auto mounts = detail::parse_mountinfo_cgroups(slurp("/proc/self/mountinfo"));
  auto membership = detail::parse_proc_cgroup(slurp("/proc/self/cgroup"));
  fs::path own;
  for (const auto& m : mounts) {
    if (m.v2 ||
        std::find(m.controllers.begin(), m.controllers.end(), "memory") == m.controllers.end())
      continue;
    for (const auto& c : membership) {
      if (std::find(c.controllers.begin(), c.controllers.end(), "memory") != c.controllers.end())
        own = detail::cgroup_dir(m, c.path);
    }
  }
  if (own.empty()) return;  // no cgroup v1 memory hierarchy here
  fs::path outer = own / ("memview-" + std::to_string(::getpid())), inner = outer / "inner";
  std::error_code ec;
  if (!fs::create_directories(inner, ec)) {
    MESSAGE("cannot make " << inner << ": " << ec.message());
    return;
  }
  detail::write_cgroup_file(outer / "memory.limit_in_bytes", std::to_string(256 * kMiB));
  int pipe_fds[2];
  REQUIRE(::pipe(pipe_fds) == 0);
  std::fflush(nullptr);
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(pipe_fds[0]);
    std::string report;
    try {
      detail::write_cgroup_file(inner / "tasks", "0");
      MemoryView v = read_memory_view();
      report = std::to_string(v.cgroup_limit.value_or(0)) + " " +
               std::to_string(v.cgroup_usage.value_or(0)) + " " + std::to_string(v.available());
    } catch (const std::exception& e) {
      report = std::string("error ") + e.what();
    }
    (void)!::write(pipe_fds[1], report.data(), report.size());
    ::_exit(0);
  }
  ::close(pipe_fds[1]);
  std::string report;
  char buf[256];
  for (ssize_t n; (n = ::read(pipe_fds[0], buf, sizeof buf)) > 0;) report.append(buf, n);
  ::close(pipe_fds[0]);
  ::waitpid(child, nullptr, 0);
  fs::remove(inner, ec);
  fs::remove(outer, ec);
  INFO(report);
  REQUIRE(report.find("error") == std::string::npos);
  std::uint64_t limit = 0, usage = 0, available = 0;
  REQUIRE(std::sscanf(report.c_str(), "%lu %lu %lu", &limit, &usage, &available) == 3);
  CHECK(limit == 256 * kMiB);
  CHECK(usage > 0);
  CHECK(usage < 256 * kMiB);
  CHECK(available == 256 * kMiB - usage);
  CHECK_FALSE(fs::exists(outer));
}
