// Small helpers shared by the contain tests.
#pragma once

#include <doctest/doctest.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "common/json.h"
#include "supervisor/contain/contain.h"
#include "supervisor/contain/contain_cli.h"

namespace assay::contain::test {

inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A scratch directory removed at the end of the test.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "contain-test-XXXXXX").string();
    path = ::mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

// Validates a document against schemas/process-containment.schema.json with python3-jsonschema.
inline void check_schema(const common::Json& evidence, const std::filesystem::path& dir) {
  std::filesystem::path doc = dir / "evidence.json";
  std::ofstream(doc) << evidence.dump();
  std::string cmd = std::string(ASSAY_PYTHON3) +
                    " -c 'import json,sys,jsonschema; "
                    "s=json.load(open(sys.argv[1])); d=json.load(open(sys.argv[2])); "
                    "jsonschema.Draft202012Validator(s).validate(d)' " ASSAY_SCHEMA_DIR
                    "/process-containment.schema.json " +
                    doc.string();
  CHECK_MESSAGE(std::system(cmd.c_str()) == 0, "schema validation failed for " << evidence.dump());
}

namespace fs = std::filesystem;

// Workers run as the default worker identity (never root): the test's directory (mkdtemp's
// 0700) is opened to them, as the daemon hands a job's workspace to its worker.
inline SpawnSpec make_spec(const std::string& name, std::vector<std::string> argv,
                           const fs::path& dir) {
  fs::permissions(dir, fs::perms::all);
  WorkerIdentity who = default_worker_identity();
  SpawnSpec s;
  s.uid = who.uid;
  s.gid = who.gid;
  s.name = name + "-" + std::to_string(::getpid());
  s.argv = std::move(argv);
  s.workdir = dir;
  s.env = {"PATH=/usr/bin:/bin", "LANG=C.UTF-8"};
  s.stdout_path = dir / (name + ".out");
  s.stderr_path = dir / (name + ".err");
  s.limits.timeout = std::chrono::seconds(60);
  return s;
}

// Default: below this process's own cgroup. ASSAY_TEST_BASE_CGROUP names another (cgroup v2
// hosts, where the test's own cgroup holds processes and cannot enable controllers).
inline RuntimeOptions test_options() {
  RuntimeOptions o;
  if (const char* base = std::getenv("ASSAY_TEST_BASE_CGROUP")) o.base_cgroup = base;
  return o;
}
inline std::unique_ptr<Runtime> runtime() {
  return Runtime::create(test_options());
}

// A process on the host whose command line contains `needle` (pids inside a worker's PID
// namespace mean nothing out here).
inline bool process_with(const std::string& needle) {
  for (const auto& e : fs::directory_iterator("/proc")) {
    std::string pid = e.path().filename();
    if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string cmdline = slurp(e.path() / "cmdline");
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    if (cmdline.find(needle) != std::string::npos) return true;
  }
  return false;
}

inline bool process_gone(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!stat || !std::getline(stat, line)) return true;
  auto close = line.rfind(')');
  return close != std::string::npos && line.size() > close + 2 && line[close + 2] == 'Z';
}

// `assayd contain`, run in a child process as main() would dispatch it.
struct CliResult {
  int status;
  std::string out, err;
};
inline CliResult run_cli(std::vector<std::string> args, const fs::path& stdout_to = {}) {
  TempDir dir;
  fs::path out = stdout_to.empty() ? dir.path / "out" : stdout_to, err = dir.path / "err";
  std::fflush(nullptr);  // or the child flushes the test runner's buffered output too
  pid_t pid = ::fork();
  if (pid == 0) {
    int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ::dup2(o, 1);
    ::dup2(e, 2);
    if (const char* base = std::getenv("ASSAY_TEST_BASE_CGROUP")) {
      args.insert(args.begin(), {"--base-cgroup", base});
    }
    args.insert(args.begin(), "contain");
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    int rc = assay::supervisor::contain_main(static_cast<int>(args.size()), argv.data());
    std::fflush(stdout);
    ::_exit(rc);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status),
          stdout_to.empty() ? slurp(out) : "", slurp(err)};
}

// Worker cgroups this process owns right now, in every hierarchy the runtime uses: v1 leaves
// named <leaf_prefix><worker> in each hierarchy's base, v2 leaves in the workers directory.
inline std::vector<fs::path> my_cgroups(const Runtime& rt) {
  std::vector<fs::path> out;
  common::Json d = rt.describe();
  std::string prefix = d.value("leaf_prefix", "");
  std::vector<fs::path> roots;
  if (d.contains("hierarchies")) {
    for (auto& [k, v] : d["hierarchies"].items()) roots.push_back(v.get<std::string>());
  }
  if (d.contains("workers_dir")) roots.push_back(d["workers_dir"].get<std::string>());
  for (const auto& r : roots) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(r, ec)) {
      if (e.is_directory() && e.path().filename().string().starts_with(prefix)) {
        out.push_back(e.path());
      }
    }
  }
  return out;
}

}  // namespace assay::contain::test
