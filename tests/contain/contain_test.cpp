// The containment runtime against the real kernel: cgroups are made below this test process's
// own cgroup (the runtime's default) and every test checks that none is left behind.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "common/error.h"
#include "supervisor/contain/cgroup.h"
#include "supervisor/contain/contain.h"
#include "supervisor/contain/contain_cli.h"
#include "supervisor/contain/spawn.h"
#include "tests/contain/test_util.h"

namespace {

namespace fs = std::filesystem;
using assay::common::Json;
using namespace assay::contain;
using namespace assay::contain::test;

constexpr const char* kPython = ASSAY_PYTHON3;
constexpr std::uint64_t kMiB = 1024 * 1024;

}  // namespace

TEST_CASE("auto-detection picks a cgroup backend with a memory controller on this host") {
  auto rt = runtime();
  CHECK((rt->backend() == "cgroup-v1" || rt->backend() == "cgroup-v2"));
  CHECK(rt->describe()["backend"] == rt->backend());
}

TEST_CASE("a normal run exits 0, is measured, validates against the schema and leaves no cgroup") {
  TempDir dir;
  auto rt = runtime();
  auto spec = make_spec("normal", {"/bin/sh", "-c", "echo hello; echo oops >&2; exit 0"}, dir.path);
  Evidence e = rt->run(spec);
  CHECK(e.mode == rt->backend());
  REQUIRE(e.exit);
  CHECK(e.exit->code == 0);
  CHECK_FALSE(e.exit->signal);
  CHECK(e.succeeded());
  CHECK(e.failure_reason() == "");
  CHECK_FALSE(e.timed_out);
  CHECK(e.oom_killed == false);
  REQUIRE(e.cgroup);
  CHECK(e.cgroup->removed);
  CHECK(e.errors.empty());
  CHECK(e.memory_peak_bytes.value_or(0) > 0);
  REQUIRE(e.output);
  CHECK(e.output->out.bytes == 6);
  CHECK(e.output->err.bytes == 5);
  CHECK(e.output->out.path == spec.stdout_path.string());
  CHECK(slurp(spec.stdout_path) == "hello\n");
  CHECK(slurp(spec.stderr_path) == "oops\n");
  REQUIRE(e.spawn);
  CHECK(e.spawn->environment_keys == std::vector<std::string>{"PATH", "LANG"});
  CHECK(e.limits == spec.limits);
  Json doc = e.to_json();
  CHECK(doc["schema"] == "assay.process-containment.v1");
  CHECK(doc["exit"]["code"] == 0);
  CHECK(doc["memory"]["peak_bytes"] == *e.memory_peak_bytes);
  // The Kiln-v2 view, measured on this kernel: every counter it has is there.
  const Json& n = doc["normalised"];
  CHECK(n["memory_peak_bytes"] == *e.memory_peak_bytes);
  CHECK(n["memory_oom_kill_events"] == 0);
  CHECK(n["memory_max_events"] == 0);
  CHECK(n["exit_code"] == 0);
  CHECK(n["timeout_seconds"] == static_cast<double>(spec.limits.timeout.count()) / 1e3);
  CHECK(n["elapsed_seconds"].get<double>() > 0);
  if (e.mode == "cgroup-v1") {
    CHECK(n["memory_high_events"].is_null());
    CHECK(n["sources"]["memory_max_events"] == "memory.failcnt");
    // With swap accounting on (memory.memsw.* present) the swap charge is measured, not null.
    bool memsw = std::filesystem::exists(
        std::filesystem::path(e.cgroup->hierarchies.at("memory")).parent_path() /
        "memory.memsw.usage_in_bytes");
    CHECK(n["memory_swap_bytes"].is_null() == !memsw);
    CHECK(doc["memory"]["swap_current_bytes"].is_null() == !memsw);
  } else {
    CHECK(n["memory_high_events"] == 0);
    CHECK(n["memory_oom_events"] == 0);
    CHECK(n["sources"]["memory_peak_bytes"] == "memory.peak");
  }
  check_schema(doc, dir.path);
  CHECK(Evidence::from_json(doc) == e);
  CHECK(my_cgroups(*rt).empty());
}

TEST_CASE("the exit code and the killing signal of the worker are reported") {
  TempDir dir;
  auto rt = runtime();
  Evidence code = rt->run(make_spec("code", {"/bin/sh", "-c", "exit 7"}, dir.path));
  REQUIRE(code.exit);
  CHECK(code.exit->code == 7);
  CHECK(code.failure_reason() == "exited with code 7");
  Evidence sig = rt->run(make_spec("sig", {"/bin/sh", "-c", "kill -SEGV $$"}, dir.path));
  REQUIRE(sig.exit);
  CHECK_FALSE(sig.exit->code);
  CHECK(sig.exit->signal == SIGSEGV);
  CHECK(sig.exit->signal_name == "SIGSEGV");
  CHECK_FALSE(sig.exit->core_dumped);  // RLIMIT_CORE is 0
  CHECK(sig.failure_reason() == "was killed by signal SIGSEGV");
  Json doc = sig.to_json();
  CHECK(doc["exit"]["code"].is_null());
  CHECK(doc["exit"]["signal_name"] == "SIGSEGV");
}

TEST_CASE("a 200 MB allocation under a 64 MB limit is OOM-killed and the evidence says so") {
  TempDir dir;
  auto rt = runtime();
  auto spec = make_spec("oom", {kPython, "-c", "x = b'\\x01' * (200 << 20)"}, dir.path);
  spec.limits.memory_max = 64 * kMiB;
  Evidence e = rt->run(spec);
  REQUIRE(e.exit);
  CHECK(e.exit->signal == SIGKILL);
  CHECK(e.oom_killed == true);
  CHECK_FALSE(e.succeeded());
  CHECK(e.failure_reason() == "was OOM-killed (memory limit reached)");
  REQUIRE(e.memory_peak_bytes);
  CHECK(*e.memory_peak_bytes > 56 * kMiB);
  CHECK(*e.memory_peak_bytes <= 64 * kMiB);
  REQUIRE(e.limits);
  CHECK(e.limits->memory_max == 64 * kMiB);
  Json doc = e.to_json();
  CHECK(doc["oom_killed"] == true);
  CHECK(doc["limits"]["memory_max"] == 64 * kMiB);
  CHECK(doc["normalised"]["memory_oom_kill_events"].get<std::uint64_t>() >= 1);
  CHECK(doc["normalised"]["memory_max_events"].get<std::uint64_t>() >= 1);
  CHECK(doc["normalised"]["exit_code"].is_null());  // SIGKILL
  check_schema(doc, dir.path);
  CHECK(my_cgroups(*rt).empty());
}

TEST_CASE("a normal run reports a peak within 20% of what it allocated") {
  TempDir dir;
  auto rt = runtime();
  auto spec = make_spec("peak", {kPython, "-c", "x = b'\\x01' * (128 << 20)"}, dir.path);
  spec.limits.memory_max = 512 * kMiB;
  Evidence e = rt->run(spec);
  REQUIRE(e.succeeded());
  CHECK(e.oom_killed == false);
  auto peak = static_cast<double>(e.memory_peak_bytes.value_or(0));
  CHECK(peak >= 128.0 * kMiB);
  CHECK(peak <= 1.2 * 128 * kMiB);
}

// A grandchild in a session of its own (gc.pid is written only after setsid), started before
// the main process goes on: on a slow machine the timeout must not catch it half-way. Its
// sleep's argument is unique to this test process, so that the host can look for it.
std::string grandchild() {
  return "setsid sh -c 'echo $$ > gc.tmp; mv gc.tmp gc.pid; exec sleep 60." +
         std::to_string(::getpid()) + "' & while [ ! -e gc.pid ]; do sleep 0.01; done; ";
}
std::string grandchild_marker() {
  return "sleep 60." + std::to_string(::getpid());
}

TEST_CASE("a timeout kills the worker in about a second, its setsid grandchild too") {
  TempDir dir;
  auto rt = runtime();
  auto spec = make_spec("timeout", {"/bin/sh", "-c", grandchild() + "exec sleep 60"}, dir.path);
  spec.limits.timeout = std::chrono::seconds(1);
  spec.limits.kill_grace = std::chrono::milliseconds(500);
  auto t0 = std::chrono::steady_clock::now();
  Evidence e = rt->run(spec);
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(took < 3.0);
  CHECK(e.timed_out);
  CHECK(e.sigterm_sent);
  REQUIRE(e.exit);
  CHECK(e.exit->signal == SIGTERM);
  CHECK(e.failure_reason() == "timed out and was killed");
  CHECK(e.leftover_processes_killed >= 1);
  CHECK(slurp(dir.path / "gc.pid") != "");
  CHECK_FALSE(process_with(grandchild_marker()));
  CHECK(e.wall_usec.value_or(0) >= 1'000'000);
  CHECK(my_cgroups(*rt).empty());
}

TEST_CASE("a worker that ignores SIGTERM is killed with the whole cgroup after the grace period") {
  TempDir dir;
  auto rt = runtime();
  auto spec = make_spec("stubborn", {"/bin/sh", "-c", "trap '' TERM; " + grandchild() + "sleep 60"},
                        dir.path);
  spec.limits.timeout = std::chrono::milliseconds(500);
  spec.limits.kill_grace = std::chrono::milliseconds(500);
  auto t0 = std::chrono::steady_clock::now();
  Evidence e = rt->run(spec);
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(took < 3.0);
  CHECK(e.timed_out);
  CHECK(e.cgroup_killed);
  REQUIRE(e.exit);
  CHECK(e.exit->signal == SIGKILL);
  CHECK(slurp(dir.path / "gc.pid") != "");
  CHECK_FALSE(process_with(grandchild_marker()));
  CHECK(my_cgroups(*rt).empty());
}

TEST_CASE(
    "a contained process cannot reach a TCP listener on the host's 127.0.0.1 and sees only lo") {
  TempDir dir;
  int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(listener >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  socklen_t len = sizeof addr;
  REQUIRE(::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  REQUIRE(::listen(listener, 4) == 0);
  int port = ntohs(addr.sin_port);
  // Inside: connect to the host's port, then prove lo is up with a listener of its own.
  std::string script =
      "import socket\n"
      "s = socket.socket(); s.settimeout(3)\n"
      "try:\n"
      "    s.connect(('127.0.0.1', " +
      std::to_string(port) +
      ")); print('connected')\n"
      "except OSError as e:\n"
      "    print('refused' if isinstance(e, ConnectionRefusedError) else 'error ' + str(e))\n"
      "l = socket.socket(); l.bind(('127.0.0.1', 0)); l.listen()\n"
      "c = socket.create_connection(l.getsockname(), timeout=3); print('lo-up')\n"
      "print(','.join(n for _, n in socket.if_nameindex()))\n";
  auto rt = runtime();
  auto spec = make_spec("net", {kPython, "-c", script}, dir.path);
  Evidence e = rt->run(spec);
  ::close(listener);
  CHECK(e.succeeded());
  CHECK(slurp(spec.stdout_path) == "refused\nlo-up\nlo\n");
  REQUIRE(e.network);
  CHECK(e.network->private_namespace);
  CHECK(e.network->interfaces == std::vector<std::string>{"lo"});
  CHECK(e.network->to_json() == Json{{"namespace", "private"}, {"interfaces", {"lo"}}});
}

TEST_CASE("8 concurrent contained processes each get their own cgroup and evidence") {
  TempDir dir;
  auto rt = runtime();
  boost::asio::io_context io;
  std::vector<Evidence> results;
  std::vector<std::shared_ptr<Running>> running;
  for (int i = 0; i < 8; ++i) {
    auto spec = make_spec(
        "par" + std::to_string(i),
        {kPython, "-c",
         "import time; x = b'\\x01' * (" + std::to_string(8 + 4 * i) + " << 20); time.sleep(0.3)"},
        dir.path);
    spec.limits.memory_max = 256 * kMiB;
    running.push_back(rt->start(io, spec, [&](Evidence e) { results.push_back(std::move(e)); }));
  }
  CHECK(my_cgroups(*rt).size() >= 8);  // memory (+pids, freezer...) leaves, all alive at once
  io.run();
  REQUIRE(results.size() == 8);
  std::set<std::string> paths;
  for (const auto& e : results) {
    CHECK(e.succeeded());
    REQUIRE(e.cgroup);
    CHECK(e.cgroup->removed);
    paths.insert(e.cgroup->path);
    int i = std::stoi(e.name.substr(3));
    CHECK(e.memory_peak_bytes.value_or(0) >= (8 + 4 * static_cast<std::uint64_t>(i)) * kMiB);
  }
  CHECK(paths.size() == 8);
  CHECK(my_cgroups(*rt).empty());
}

TEST_CASE("cancelling a running worker kills it and still delivers the evidence") {
  TempDir dir;
  auto rt = runtime();
  boost::asio::io_context io;
  std::optional<Evidence> result;
  auto r = rt->start(io, make_spec("cancel", {"/bin/sleep", "60"}, dir.path),
                     [&](Evidence e) { result = std::move(e); });
  boost::asio::steady_timer t(io, std::chrono::milliseconds(200));
  t.async_wait([&](boost::system::error_code) { r->kill(); });
  io.run();
  REQUIRE(result);
  CHECK(result->cancelled);
  REQUIRE(result->exit);
  CHECK(result->exit->signal == SIGKILL);
  CHECK(result->failure_reason() == "was killed by signal SIGKILL");
  CHECK(my_cgroups(*rt).empty());
}

TEST_CASE("the worker gets exactly its environment, rlimits, no_new_privs and the given user") {
  TempDir dir;
  fs::permissions(dir.path, fs::perms::all);  // the dropped user must be able to enter it
  auto rt = runtime();
  auto env = make_spec("env", {"/usr/bin/env"}, dir.path);
  rt->run(env);
  CHECK(slurp(env.stdout_path) == "PATH=/usr/bin:/bin\nLANG=C.UTF-8\n");
  auto who =
      make_spec("who",
                {"/bin/sh", "-c",
                 "id -u; id -g; id -G; ulimit -c; ulimit -n; grep NoNewPrivs /proc/self/status"},
                dir.path);
  who.uid = 65534;
  who.gid = 65534;
  who.nofile = 256;
  Evidence e = rt->run(who);
  CHECK(e.succeeded());
  CHECK(slurp(who.stdout_path) == "65534\n65534\n65534\n0\n256\nNoNewPrivs:\t1\n");
  REQUIRE(e.spawn);
  CHECK(e.spawn->uid == 65534u);
  CHECK(e.spawn->gid == 65534u);
  CHECK(e.spawn->rlimit_nofile == 256);
  CHECK(e.to_json()["spawn"]["rlimits"] == Json{{"core", 0}, {"nofile", 256}});
}

TEST_CASE("output beyond the cap is counted and dropped") {
  TempDir dir;
  auto rt = runtime();
  auto spec = make_spec("cap", {"/bin/sh", "-c", "head -c 100000 /dev/zero"}, dir.path);
  spec.output_cap_bytes = 1000;
  Evidence e = rt->run(spec);
  REQUIRE(e.output);
  CHECK(e.output->out.bytes == 1000);
  CHECK(e.output->out.dropped_bytes == 99000);
  CHECK(e.output->cap_bytes == 1000);
  CHECK(fs::file_size(spec.stdout_path) == 1000);
}

TEST_CASE("hidden paths are unreachable inside, the workdir below them stays usable") {
  TempDir dir;
  fs::path state = dir.path / "state";
  fs::create_directories(state / "jobs" / "j1" / "oracle");
  std::ofstream(state / "secret.key") << "private";
  std::ofstream(state / "jobs" / "j1" / "oracle" / "input.json") << "{}";
  std::ofstream(dir.path / "token") << "t0ken";
  fs::permissions(state / "jobs" / "j1" / "oracle", fs::perms::all);
  auto rt = runtime();
  auto spec = make_spec("hide",
                        {"/bin/sh", "-c",
                         "cat input.json; echo; cat " + (state / "secret.key").string() +
                             " 2>/dev/null || echo no-secret; cat " +
                             (dir.path / "token").string() + "; echo; echo out > output.json"},
                        state / "jobs" / "j1" / "oracle");
  spec.stdout_path = dir.path / "hide.out";
  spec.stderr_path = dir.path / "hide.err";
  spec.hidden_paths = {state, dir.path / "token", dir.path / "missing"};
  Evidence e = rt->run(spec);
  CHECK(e.succeeded());
  CHECK(slurp(dir.path / "hide.out") == "{}\nno-secret\n\n");
  CHECK(slurp(state / "jobs" / "j1" / "oracle" / "output.json") == "out\n");
  REQUIRE(e.mounts);
  CHECK(e.mounts->hidden ==
        std::vector<std::string>{state.string(), (dir.path / "token").string()});
  CHECK(e.mounts->absent == std::vector<std::string>{(dir.path / "missing").string()});
  CHECK(slurp(state / "secret.key") == "private");  // the host's view is untouched
}

TEST_CASE("a runtime leaves no directory of its own behind: no owner cgroup on v2, no leaf on v1") {
  TempDir dir;
  std::vector<fs::path> bases;
  std::string prefix;
  {
    auto rt = runtime();
    boost::asio::io_context io;
    auto running =
        rt->start(io, make_spec("owner", {"/bin/sleep", "60"}, dir.path), [](Evidence) {});
    Json d = rt->describe();
    if (d.contains("hierarchies")) {  // v1: the worker's leaves carry the owner's name
      prefix = d["leaf_prefix"].get<std::string>();
      CHECK(prefix.starts_with("assayd-" + std::to_string(::getpid()) + "-"));
      for (auto& [k, v] : d["hierarchies"].items()) {
        fs::path base = v.get<std::string>();
        bases.push_back(base);
        CHECK(fs::is_directory(base / (prefix + "owner-" + std::to_string(::getpid()))));
      }
    } else {
      bases.push_back(d["workers_dir"].get<std::string>());
      CHECK(fs::exists(bases.back()));
    }
    running->kill();
    io.run();
  }
  for (const auto& b : bases) {
    if (prefix.empty()) {
      CHECK_FALSE(fs::exists(b));  // v2: the owner (or workers) directory went with the runtime
      continue;
    }
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(b, ec)) {
      CHECK_FALSE(e.path().filename().string().starts_with(prefix));
    }
  }
}

TEST_CASE("a command that cannot be executed is an error naming it, and leaves no cgroup") {
  TempDir dir;
  auto rt = runtime();
  try {
    rt->run(make_spec("noexec", {"/nonexistent/tool", "x"}, dir.path));
    FAIL("expected contain.spawn_failed");
  } catch (const assay::common::Error& e) {
    CHECK(e.code() == "contain.spawn_failed");
    CHECK(std::string(e.what()).find("/nonexistent/tool") != std::string::npos);
  }
  CHECK(my_cgroups(*rt).empty());
}

TEST_CASE("the worker runs in its leaf cgroup of every hierarchy before it executes") {
  TempDir dir;
  auto rt = runtime();
  auto spec = make_spec("where", {"/bin/cat", "/proc/self/cgroup"}, dir.path);
  Evidence e = rt->run(spec);
  REQUIRE(e.succeeded());
  REQUIRE(e.spawn);
  REQUIRE(e.cgroup);
  std::string method = e.spawn->method;
  std::string leaf = "/" + spec.name;
  std::string seen = slurp(spec.stdout_path);
  if (rt->backend() == "cgroup-v1") {
    CHECK((method == "clone3-self-attach" || method == "clone-self-attach"));
    for (const auto& [controller, dir_path] : e.cgroup->hierarchies) {
      std::string leaf_v1 = "/" + fs::path(dir_path).filename().string();
      CHECK(leaf_v1.ends_with("." + spec.name));  // <owner>.<worker>
      bool found = false;
      std::istringstream lines(seen);
      for (std::string line; std::getline(lines, line);) {
        auto second = line.find(':', line.find(':') + 1);
        std::string ctrls =
            "," + line.substr(line.find(':') + 1, second - line.find(':') - 1) + ",";
        if (ctrls.find("," + controller + ",") == std::string::npos) continue;
        found = line.ends_with(leaf_v1);
      }
      CHECK_MESSAGE(found, controller << " not in the leaf: " << seen);
    }
  } else {
    CHECK(seen.find("0::") != std::string::npos);
    CHECK(seen.find(leaf + "\n") != std::string::npos);
  }
  CHECK(my_cgroups(*rt).empty());
}

// A cgroup whose self-attach file cannot be written: the child must not run the command.
class UnwritableCgroup : public assay::contain::detail::Cgroup {
 public:
  const std::string& name() const override { return name_; }
  std::string path() const override { return "/unwritable"; }
  std::map<std::string, std::string> hierarchies() const override { return {}; }
  int clone_into_fd() const override { return -1; }
  void attach(pid_t) override { FAIL("the parent must not attach when the child attaches itself"); }
  std::vector<std::string> self_attach_files() const override {
    return {"/nonexistent-cgroup/tasks"};
  }
  void set_limits(const Limits&) override {}
  int kill_all() override { return 0; }
  std::vector<pid_t> pids() const override { return {}; }
  Counters counters() const override { return {}; }
  void remove() override {}

 private:
  std::string name_ = "unwritable";
};

TEST_CASE("a child that cannot move itself into its cgroup never executes, and says which file") {
  TempDir dir;
  fs::path marker = dir.path / "ran";
  auto spec = make_spec("noattach", {"/bin/touch", marker.string()}, dir.path);
  UnwritableCgroup cg;
  try {
    assay::contain::detail::finish_spawn(assay::contain::detail::prespawn(spec, nullptr), &cg);
    FAIL("expected contain.spawn_failed");
  } catch (const assay::common::Error& e) {
    CHECK(e.code() == "contain.spawn_failed");
    CHECK(std::string(e.what()).find("/nonexistent-cgroup/tasks") != std::string::npos);
  }
  CHECK(!fs::exists(marker));
}

TEST_CASE("a child started before the runtime is taken over and runs in its cgroup (v1)") {
  TempDir dir;
  auto spec = make_spec("early", {"/bin/cat", "/proc/self/cgroup"}, dir.path);
  auto early = assay::contain::EarlyChild::start(spec);  // before the backend is known
  auto rt = runtime();
  boost::asio::io_context io;
  Evidence e;
  auto running = rt->start(
      io, spec, [&](Evidence ev) { e = std::move(ev); }, early);
  io.run();
  REQUIRE(e.succeeded());
  REQUIRE(e.network);
  CHECK(e.network->private_namespace);
  CHECK(e.network->interfaces == std::vector<std::string>{"lo"});
  REQUIRE(e.spawn);
  if (rt->backend() == "cgroup-v1") {
    CHECK(early == nullptr);  // taken over
    CHECK(e.spawn->method == "clone3-self-attach");
    std::string seen = slurp(spec.stdout_path);
    REQUIRE(e.cgroup);
    for (const auto& [controller, path] : e.cgroup->hierarchies) {
      CHECK_MESSAGE(seen.find(fs::path(path).filename().string() + "\n") != std::string::npos,
                    controller << " leaf not in " << seen);
    }
  } else {
    CHECK(early != nullptr);  // v2 clones a fresh child into the cgroup
    CHECK(e.spawn->method == "clone3-into-cgroup");
  }
  CHECK(my_cgroups(*rt).empty());
}

TEST_CASE("a child started early and never used is killed and reaped, and never runs") {
  TempDir dir;
  fs::path marker = dir.path / "ran";
  auto spec = make_spec("unused", {"/bin/touch", marker.string()}, dir.path);
  auto early = assay::contain::EarlyChild::start(spec);
  pid_t pid = dynamic_cast<assay::contain::detail::Prespawned&>(*early).pid();
  REQUIRE(pid > 0);
  early.reset();
  errno = 0;
  CHECK(::kill(pid, 0) == -1);
  CHECK(errno == ESRCH);  // not even a zombie: reaped
  CHECK_FALSE(fs::exists(marker));
}

TEST_CASE("the worker gets the CPUs its supervisor had, and the supervisor gets them back") {
  TempDir dir;
  cpu_set_t before;
  REQUIRE(::sched_getaffinity(0, sizeof before, &before) == 0);
  auto rt = runtime();
  auto spec = make_spec("cpus", {"/bin/grep", "Cpus_allowed_list", "/proc/self/status"}, dir.path);
  auto early = assay::contain::EarlyChild::start(spec);  // the CLI's path
  cpu_set_t during;
  REQUIRE(::sched_getaffinity(0, sizeof during, &during) == 0);
  boost::asio::io_context io;
  Evidence e;
  auto running = rt->start(
      io, spec, [&](Evidence ev) { e = std::move(ev); }, early);
  io.run();
  early.reset();
  REQUIRE(e.succeeded());
  cpu_set_t after;
  REQUIRE(::sched_getaffinity(0, sizeof after, &after) == 0);
  CHECK(CPU_EQUAL(&before, &after));
  std::string mine = slurp("/proc/self/status");
  auto at = mine.find("Cpus_allowed_list:");
  REQUIRE(at != std::string::npos);
  CHECK(slurp(spec.stdout_path) == mine.substr(at, mine.find('\n', at) - at + 1));
  if (CPU_COUNT(&before) > 1) {  // the supervisor made room for the child on its CPU
    CHECK(CPU_COUNT(&during) == CPU_COUNT(&before) - 1);
  }
  // And through the daemon's path, without an early child.
  spec.name += "-2";
  Evidence e2 = rt->run(spec);
  REQUIRE(e2.succeeded());
  REQUIRE(::sched_getaffinity(0, sizeof after, &after) == 0);
  CHECK(CPU_EQUAL(&before, &after));
  CHECK(slurp(spec.stdout_path) == mine.substr(at, mine.find('\n', at) - at + 1));
}

TEST_CASE("a bad worker name is rejected before anything is created") {
  TempDir dir;
  auto rt = runtime();
  auto spec = make_spec("x", {"/bin/true"}, dir.path);
  spec.name = "../escape";
  CHECK_THROWS_WITH(rt->run(spec), doctest::Contains("../escape"));
  CHECK(my_cgroups(*rt).empty());
}

TEST_CASE("cgroup v1 refuses memory_high instead of pretending, and leaves no cgroup") {
  TempDir dir;
  auto rt = runtime();
  if (rt->backend() != "cgroup-v1") return;
  auto spec = make_spec("high", {"/bin/true"}, dir.path);
  spec.limits.memory_high = 32 * kMiB;
  try {
    rt->run(spec);
    FAIL("expected contain.unsupported_limit");
  } catch (const assay::common::Error& e) {
    CHECK(e.code() == "contain.unsupported_limit");
  }
  CHECK(my_cgroups(*rt).empty());
}

TEST_CASE("pids_max is enforced and pids.peak is reported") {
  TempDir dir;
  auto rt = runtime();
  auto spec = make_spec(
      "pids", {"/bin/sh", "-c", "for i in 1 2 3 4 5 6 7 8; do sleep 0.3 & done; wait; echo done"},
      dir.path);
  spec.limits.pids_max = 4;
  Evidence e = rt->run(spec);
  REQUIRE(e.pids_peak);
  CHECK(*e.pids_peak <= 4);
  CHECK(*e.pids_peak >= 2);
  REQUIRE(e.limits);
  CHECK(e.limits->pids_max == 4u);
  CHECK(slurp(spec.stderr_path).find("fork") != std::string::npos);
}

TEST_CASE("mode none runs without a cgroup and says so: no counters, oom unknown") {
  TempDir dir;
  RuntimeOptions o;
  o.mode = Mode::kNone;
  auto rt = Runtime::create(o);
  Evidence e = rt->run(make_spec("none", {"/bin/true"}, dir.path));
  CHECK(e.mode == "none");
  CHECK_FALSE(e.cgroup);
  CHECK_FALSE(e.counters);
  CHECK_FALSE(e.oom_killed);
  CHECK_FALSE(e.memory_peak_bytes);
  CHECK(e.kill_scope == "process-group");
  CHECK(e.succeeded());  // an unknown OOM state is not an OOM kill
  Json doc = e.to_json();
  CHECK(doc["cgroup"].is_null());
  CHECK(doc["counters"].is_null());
  CHECK(doc["oom_killed"].is_null());
  CHECK(doc["memory"]["peak_bytes"].is_null());
  check_schema(doc, dir.path);
  CHECK(Evidence::from_json(doc) == e);
}

TEST_CASE("worker cgroups left by a crashed supervisor are found, killed, read and removed") {
  TempDir dir;
  std::string name = "orphan-" + std::to_string(::getpid());
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  std::fflush(nullptr);
  pid_t sup = ::fork();
  REQUIRE(sup >= 0);
  if (sup == 0) {
    // The "crashed assayd": starts a worker and dies without cleaning up.
    auto rt = runtime();
    boost::asio::io_context io;
    auto spec = make_spec("orphan", {"/bin/sleep", "60"}, dir.path);
    spec.name = name;
    auto r = rt->start(io, spec, [](Evidence) {});
    char c = 1;
    (void)!::write(ready[1], &c, 1);
    ::_exit(0);
  }
  ::close(ready[1]);
  char c;
  REQUIRE(::read(ready[0], &c, 1) == 1);
  ::close(ready[0]);
  int status;
  ::waitpid(sup, &status, 0);
  auto rt = runtime();
  auto orphans = rt->cleanup_orphans();
  const Evidence* mine = nullptr;
  for (const auto& o : orphans) {
    if (o.name == name) mine = &o;
  }
  REQUIRE(mine != nullptr);
  CHECK(mine->orphan);
  CHECK(mine->leftover_processes_killed == 2);  // the worker and its init
  CHECK(mine->cgroup_killed);
  REQUIRE(mine->cgroup);
  CHECK(mine->cgroup->removed);
  CHECK(mine->memory_peak_bytes.value_or(0) > 0);
  CHECK_FALSE(mine->exit);
  CHECK(mine->failure_reason() == "left no exit status in its evidence");
  Json doc = mine->to_json();
  for (const char* absent :
       {"spawn", "limits", "network", "mounts", "started_at", "wall_usec", "exit", "output"}) {
    CHECK_MESSAGE(doc[absent].is_null(), absent);
  }
  CHECK(doc["cpu"]["user_usec"].is_null());
  check_schema(doc, dir.path);
  CHECK(Evidence::from_json(doc) == *mine);
  for (const auto& [k, v] : mine->cgroup->hierarchies) CHECK_FALSE(fs::exists(v));
}

TEST_CASE("v1 worker cgroups of the earlier layout (<owner>/<worker>) are still cleaned up") {
  auto rt = runtime();
  Json d = rt->describe();
  if (!d.contains("hierarchies")) return;  // cgroup v1 only
  pid_t gone = ::fork();
  REQUIRE(gone >= 0);
  if (gone == 0) ::_exit(0);
  ::waitpid(gone, nullptr, 0);
  std::string owner = "assayd-" + std::to_string(gone) + "-1";
  std::string worker = "legacy-" + std::to_string(::getpid());
  std::vector<fs::path> made;
  for (auto& [k, v] : d["hierarchies"].items()) {
    fs::path leaf = fs::path(v.get<std::string>()) / owner / worker;
    REQUIRE(fs::create_directories(leaf));
    made.push_back(leaf);
  }
  auto orphans = rt->cleanup_orphans();
  bool found = false;
  for (const auto& o : orphans) found = found || o.name == worker;
  CHECK(found);
  for (const auto& leaf : made) {
    CHECK_FALSE(fs::exists(leaf));
    CHECK_FALSE(fs::exists(leaf.parent_path()));
  }
}

TEST_CASE("assayd contain prints the evidence and exits 0 whatever the command's outcome") {
  auto r = run_cli({"--memory-max", "64M", "--timeout", "5", "--", "sh", "-c", "exit 3"});
  REQUIRE(r.status == 0);
  Json doc = Json::parse(r.out);
  CHECK(doc["exit"]["code"] == 3);
  CHECK(doc["limits"]["memory_max"] == 64 * kMiB);
  CHECK(doc["limits"]["timeout_ms"] == 5000);
  CHECK(doc["spawn"]["argv"][0] == "/usr/bin/sh");
  Evidence e = Evidence::from_json(doc);  // what the CLI prints, the reader takes
  CHECK(e.failure_reason() == "exited with code 3");
  CHECK(e.to_json() == doc);
}

TEST_CASE("assayd contain exits 1 naming the error when the evidence cannot be written") {
  auto r = run_cli({"--", "/bin/true"}, "/dev/full");
  CHECK(r.status == 1);
  CHECK(r.err.find("cannot write the evidence to stdout: No space left on device") !=
        std::string::npos);
}

TEST_CASE("assayd contain fails with one line and exit 1 when containment is unavailable") {
  auto r = run_cli({"--mode", "v2", "--", "/bin/true"});
  TempDir probe;
  RuntimeOptions o = test_options();
  o.mode = Mode::kV2;
  bool v2_usable = true;
  try {
    Runtime::create(o);
  } catch (const assay::common::Error&) {
    v2_usable = false;
  }
  if (v2_usable) return;  // a host with a delegated v2 memory controller
  CHECK(r.status == 1);
  CHECK(r.out.empty());
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK(r.err.find("contain.unavailable") != std::string::npos);
}

TEST_CASE("assayd contain rejects bad options with exit 2 naming the value") {
  auto bad_bytes = run_cli({"--memory-max", "lots", "--", "/bin/true"});
  CHECK(bad_bytes.status == 2);
  CHECK(bad_bytes.err.find("\"lots\"") != std::string::npos);
  auto no_command = run_cli({"--timeout", "1"});
  CHECK(no_command.status == 2);
  auto missing = run_cli({"--", "no-such-command-xyz"});
  CHECK(missing.status == 2);
  CHECK(missing.err.find("no-such-command-xyz") != std::string::npos);
}

TEST_CASE("/proc/self/cgroup and mountinfo parsing finds hierarchies and mounted sub-trees") {
  using namespace assay::contain::detail;
  auto m = parse_proc_cgroup("4:memory:/a/b\n1:cpu,cpuacct:/\n0::/user.slice\n");
  for (const char* bad : {"no colon at all\n", "4:memory\n", "x:memory:/\n"}) {
    CHECK_THROWS_WITH(parse_proc_cgroup(bad), doctest::Contains("malformed /proc/self/cgroup"));
  }
  REQUIRE(m.size() == 3);
  CHECK(m[0].controllers == std::vector<std::string>{"memory"});
  CHECK(m[0].path == "/a/b");
  CHECK(m[2].controllers.empty());
  auto mounts = parse_mountinfo_cgroups(
      "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
      "41 31 0:38 /sub /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw,nsdelegate\n"
      "50 31 0:40 / /tmp rw - tmpfs tmpfs rw\n");
  REQUIRE(mounts.size() == 2);
  CHECK(mounts[0].controllers == std::vector<std::string>{"memory"});
  CHECK(mounts[1].v2);
  CHECK(cgroup_dir(mounts[0], "/a/b") == "/sys/fs/cgroup/memory/a/b");
  CHECK(cgroup_dir(mounts[1], "/sub/w") == "/sys/fs/cgroup/w");
  CHECK_THROWS_WITH(cgroup_dir(mounts[1], "/other"), doctest::Contains("/other"));
}
