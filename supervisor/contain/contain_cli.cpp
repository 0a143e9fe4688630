// `assayd contain`: runs one contained process and prints its evidence JSON. Exit 0 when the
// process ran and was measured, whatever its own outcome; 1 when containment itself failed;
// 2 on a usage error.
#include <unistd.h>

#include <charconv>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>

#include <CLI/CLI.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>

#include "common/error.h"
#include "common/fs.h"
#include "supervisor/contain/contain.h"
#include "supervisor/contain/contain_cli.h"
#include "supervisor/contain/spawn_spec_json.h"

namespace assay::supervisor {

namespace {

namespace fs = std::filesystem;
using contain::Mode;

constexpr const char* kDefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

// "64M", "1G", "4096" -> bytes (binary suffixes K, M, G, T).
std::uint64_t parse_bytes(const std::string& option, const std::string& text) {
  std::uint64_t value = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, value);
  std::uint64_t mult = 1;
  if (ec == std::errc() && p + 1 == end) {
    switch (*p) {
      case 'K':
      case 'k':
        mult = 1ULL << 10;
        break;
      case 'M':
      case 'm':
        mult = 1ULL << 20;
        break;
      case 'G':
      case 'g':
        mult = 1ULL << 30;
        break;
      case 'T':
      case 't':
        mult = 1ULL << 40;
        break;
      default:
        mult = 0;
    }
    ++p;
  }
  if (ec != std::errc() || p != end || mult == 0 || text.empty() ||
      value > std::numeric_limits<std::uint64_t>::max() / mult) {
    throw common::Error("contain.usage", option + " \"" + text +
                                             "\" is not a byte count (digits, optional K/M/G/T)");
  }
  return value * mult;
}

std::chrono::milliseconds parse_seconds(const std::string& option, double seconds) {
  if (!std::isfinite(seconds) || seconds <= 0 || seconds > 7 * 24 * 3600) {
    throw common::Error("contain.usage",
                        option + " " + std::to_string(seconds) + " must be in (0, 604800] seconds");
  }
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::llround(seconds * 1000)));
}

std::string resolve_command(const std::string& command, const std::string& path_list) {
  if (command.find('/') != std::string::npos) return fs::absolute(command).lexically_normal();
  std::size_t start = 0;
  while (start <= path_list.size()) {
    auto colon = path_list.find(':', start);
    std::string dir =
        path_list.substr(start, colon == std::string::npos ? std::string::npos : colon - start);
    if (!dir.empty()) {
      fs::path candidate = fs::path(dir) / command;
      if (::access(candidate.c_str(), X_OK) == 0 && !fs::is_directory(candidate)) {
        return candidate;
      }
    }
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  throw common::Error("contain.usage",
                      "command \"" + command + "\" not found in PATH \"" + path_list + "\"");
}

// What the command line says.
struct CliArgs {
  std::string memory_max, memory_high, swap_max, output_cap = "8M";
  std::optional<std::uint64_t> pids_max;
  double timeout = 600, grace = 2;
  std::string workdir, mode_name = "auto", base_cgroup, name, stdout_path, stderr_path;
  std::string spec_file, evidence_out;
  std::vector<std::string> env, pass_env, hide, command;
  std::optional<uid_t> uid;
  std::optional<gid_t> gid;
  std::string user;
  bool delegated = false, cleanup = false, allow_root = false;
};

void add_options(CLI::App& app, CliArgs& a) {
  app.add_option("--memory-max", a.memory_max, "memory limit in bytes (K/M/G suffixes allowed)");
  app.add_option("--memory-high", a.memory_high, "memory.high throttle limit (cgroup v2 only)");
  app.add_option("--swap-max", a.swap_max, "swap limit in bytes");
  app.add_option("--pids-max", a.pids_max, "maximum number of processes and threads");
  app.add_option("--timeout", a.timeout,
                 "seconds before SIGTERM to the process group (default 600)");
  app.add_option("--kill-grace", a.grace,
                 "seconds between SIGTERM and killing the whole cgroup (default 2)");
  app.add_option("--workdir", a.workdir, "working directory of the command (default: current)");
  app.add_option("--mode", a.mode_name, "containment backend: auto, v2, v1 or none (development)")
      ->check(CLI::IsMember({"auto", "v2", "v1", "none"}));
  app.add_option("--base-cgroup", a.base_cgroup,
                 "cgroup (relative to the hierarchy root) below which to make worker cgroups; "
                 "default: this process's own");
  app.add_flag("--delegated", a.delegated,
               "cgroup v2 under systemd Delegate=yes: move into <own>/supervisor, workers in "
               "<own>/workers");
  app.add_option("--name", a.name, "leaf cgroup name (default contain-<pid>)");
  app.add_option("--env", a.env, "KEY=VALUE for the command's environment (repeatable)");
  app.add_option("--pass-env", a.pass_env,
                 "pass this variable from assayd's environment (repeatable); PATH is always set");
  app.add_option("--stdout", a.stdout_path, "file for the command's stdout (default: discarded)");
  app.add_option("--stderr", a.stderr_path, "file for the command's stderr (default: discarded)");
  app.add_option("--output-cap", a.output_cap, "bytes kept of each of stdout/stderr (default 8M)");
  app.add_option("--hide", a.hide, "path made unreachable inside (repeatable)");
  app.add_option("--user", a.user,
                 "run as this user (name or uid; its primary group unless --gid); default when "
                 "root: assay-worker, else a transient uid/gid");
  app.add_option("--uid", a.uid, "run as this user id (group: --gid, else the same number)");
  app.add_option("--gid", a.gid, "run as this group id");
  app.add_flag("--allow-root", a.allow_root,
               "development only: without --user/--uid, run COMMAND as root (still without "
               "capabilities)");
  app.add_flag("--cleanup-orphans", a.cleanup,
               "instead of running a command: kill, measure and remove worker cgroups left by "
               "assayd processes that are gone; prints a JSON array of their evidence");
  app.add_option("--spec", a.spec_file,
                 "run the spawn spec in this file (assay.contain-spec.v1, written by the Slurm "
                 "executor) instead of COMMAND and the options that describe it");
  app.add_option("--evidence-out", a.evidence_out,
                 "write the evidence to this file (temp file, fsync, rename, fsync of the "
                 "directory) instead of stdout");
  app.add_option("command", a.command, "COMMAND [ARGS...] (after --)");
  app.positionals_at_end();
}

// Options that contradict one another, or no COMMAND.
void check_usage(const CLI::App& app, const CliArgs& a) {
  if (!a.spec_file.empty()) {
    // The spec is the whole description of the process: no option may add to it.
    for (const char* opt :
         {"--memory-max", "--memory-high", "--swap-max", "--pids-max", "--timeout", "--kill-grace",
          "--workdir", "--name", "--env", "--pass-env", "--stdout", "--stderr", "--output-cap",
          "--hide", "--uid", "--gid", "--cleanup-orphans"}) {
      if (app.count(opt) > 0)
        throw common::Error("contain.usage", std::string(opt) +
                                                 " cannot be combined with --spec (the spec "
                                                 "file describes the whole process)");
    }
    if (!a.command.empty())
      throw common::Error("contain.usage",
                          "--spec \"" + a.spec_file + "\" and a COMMAND cannot both be given");
  } else if (!a.cleanup && a.command.empty()) {
    throw common::Error("contain.usage",
                        "no COMMAND given (usage: assayd contain [options] -- "
                        "COMMAND [ARGS...])");
  }
}

// The spawn spec the head wrote (--spec).
contain::SpawnSpec spec_from_file(const std::string& spec_file) {
  contain::SpawnSpec spec;
  try {
    spec = contain::spawn_spec_from_json(
        common::parse_strict(common::read_file(spec_file, 4 * 1024 * 1024)));
  } catch (const common::Error& e) {
    throw common::Error("contain.usage", "--spec \"" + spec_file + "\" is unusable: " + e.what());
  }
  if (!fs::is_directory(spec.workdir)) {
    throw common::Error("contain.usage", "--spec \"" + spec_file + "\": workdir \"" +
                                             spec.workdir.string() + "\" is not a directory");
  }
  return spec;
}

// A spec written on another host (the Slurm head) names no uid: as root, the worker runs as this
// node's default worker identity, which gets the workspace the spec names (the head cannot know
// who that is).
void give_to_default_worker(contain::SpawnSpec& spec) {
  contain::WorkerIdentity who = contain::default_worker_identity();
  spec.uid = who.uid;
  spec.gid = who.gid;
  std::error_code ec;
  std::vector<fs::path> paths{spec.workdir};
  for (const auto& e : fs::directory_iterator(spec.workdir, ec))
    if (!e.is_symlink(ec)) paths.push_back(e.path());
  for (const auto& p : paths)
    if (::lchown(p.c_str(), who.uid, who.gid) != 0)
      throw common::Error("contain.usage", "cannot hand " + p.string() + " to the worker (uid " +
                                               std::to_string(who.uid) +
                                               "): " + std::strerror(errno));
}

}  // namespace

void adopt_remote_spec(contain::SpawnSpec& spec) {
  // What only this node knows (the GPUs Slurm allocated here), replacing the head's value.
  for (const auto& key : spec.node_env) {
    const char* value = std::getenv(key.c_str());
    if (!value) continue;
    std::erase_if(spec.env, [&](const std::string& kv) { return kv.starts_with(key + "="); });
    spec.env.push_back(key + "=" + value);
  }
  if (!spec.uid && !spec.allow_root && ::geteuid() == 0) give_to_default_worker(spec);
}

namespace {

// The spawn spec the options describe.
contain::SpawnSpec spec_from_options(const CliArgs& a) {
  contain::SpawnSpec spec;
  if (!a.memory_max.empty()) spec.limits.memory_max = parse_bytes("--memory-max", a.memory_max);
  if (!a.memory_high.empty()) spec.limits.memory_high = parse_bytes("--memory-high", a.memory_high);
  if (!a.swap_max.empty()) spec.limits.swap_max = parse_bytes("--swap-max", a.swap_max);
  spec.limits.pids_max = a.pids_max;
  spec.limits.timeout = parse_seconds("--timeout", a.timeout);
  spec.limits.kill_grace = parse_seconds("--kill-grace", a.grace);
  spec.output_cap_bytes = parse_bytes("--output-cap", a.output_cap);
  spec.name = a.name.empty() ? "contain-" + std::to_string(::getpid()) : a.name;
  spec.workdir = a.workdir.empty() ? fs::current_path() : fs::absolute(a.workdir);
  if (!fs::is_directory(spec.workdir)) {
    throw common::Error("contain.usage",
                        "--workdir \"" + spec.workdir.string() + "\" is not a directory");
  }
  std::string path = kDefaultPath;
  for (const auto& kv : a.env) {
    if (kv.find('=') == std::string::npos || kv.front() == '=') {
      throw common::Error("contain.usage", "--env \"" + kv + "\" is not KEY=VALUE");
    }
    if (kv.starts_with("PATH=")) path = kv.substr(5);
  }
  spec.env.push_back("PATH=" + path);
  for (const auto& kv : a.env) {
    if (!kv.starts_with("PATH=")) spec.env.push_back(kv);
  }
  for (const auto& key : a.pass_env) {
    const char* v = std::getenv(key.c_str());
    if (v && key != "PATH") spec.env.push_back(key + "=" + v);
  }
  spec.argv = a.command;
  spec.argv[0] = resolve_command(a.command[0], path);
  spec.stdout_path = a.stdout_path;
  spec.stderr_path = a.stderr_path;
  for (const auto& h : a.hide) spec.hidden_paths.emplace_back(h);
  std::optional<contain::WorkerIdentity> who;
  if (!a.user.empty()) {
    who = contain::worker_identity(a.user);
  } else if (!a.uid && !a.allow_root && ::geteuid() == 0) {
    who = contain::default_worker_identity();
  }
  spec.uid = a.uid ? a.uid : who ? std::optional<uid_t>(who->uid) : std::nullopt;
  spec.gid = a.gid ? a.gid : who ? std::optional<gid_t>(who->gid) : std::nullopt;
  if (a.uid && !a.gid && ::geteuid() == 0) spec.gid = *a.uid;  // not root's group
  spec.allow_root = a.allow_root;
  return spec;
}

// Runs the spec (or cleans up orphans) and prints or writes the evidence; the exit status.
int run_contained(const CliArgs& a, const contain::SpawnSpec& spec,
                  const contain::RuntimeOptions& options) {
  try {
    // The child first: it makes its namespaces while the backend is detected and its cgroup
    // made. Not for v2, which clones a fresh child into the cgroup; and never under
    // delegation, where assayd moves itself out of its cgroup and a child left there would
    // keep the cgroup from enabling controllers for its workers.
    std::unique_ptr<contain::EarlyChild> early;
    if (!a.cleanup && !a.delegated && options.mode != Mode::kV2) {
      early = contain::EarlyChild::start(spec);
    }
    auto runtime = contain::Runtime::create(options);
    if (a.cleanup) {
      common::Json all = common::Json::array();
      for (const auto& e : runtime->cleanup_orphans()) all.push_back(e.to_json());
      std::cout << all.dump(2) << std::endl;
      return 0;
    }
    boost::asio::io_context io;
    std::optional<contain::Evidence> evidence;
    // Ctrl-C or a TERM to this tool must not leave the worker (or its cgroup) behind.
    boost::asio::signal_set signals(io, SIGINT, SIGTERM);
    boost::asio::steady_timer grace(io);
    auto running = runtime->start(
        io, spec,
        [&](contain::Evidence e) {
          evidence = std::move(e);
          signals.cancel();
          grace.cancel();
        },
        early);
    early.reset();  // not taken over (v2): killed and reaped now
    // The signal goes to the worker first (through its init), as a batch system's TERM to
    // every process of its job would; the whole cgroup is killed after kill_grace.
    signals.async_wait([&](boost::system::error_code ec, int sig) {
      if (ec) return;
      if (running->pid() > 0) ::kill(running->pid(), sig);
      grace.expires_after(spec.limits.kill_grace);
      grace.async_wait([&](boost::system::error_code e) {
        if (!e) running->kill();
      });
    });
    io.run();
    running.reset();
    if (!evidence) throw common::Error("contain.internal", "no evidence was produced");
    if (!a.evidence_out.empty()) {
      // Durable before this process exits: the head trusts the file once Slurm says the job
      // ended, and hashes its bytes into the result.
      try {
        common::atomic_write_file(a.evidence_out, evidence->to_json().dump(2) + "\n", 0644);
      } catch (const common::Error& e) {
        std::fprintf(stderr, "assayd contain: cannot write the evidence to %s: %s\n",
                     a.evidence_out.c_str(), e.what());
        std::_Exit(1);
      }
      runtime.reset();
      std::_Exit(0);
    }
    std::cout << evidence->to_json().dump(2) << '\n';
    // Done: what must happen before exit has happened (the worker's cgroup is gone with its
    // evidence; the runtime's own directory, v2, goes now). The rest (the io_context and its
    // descriptors, the heap) the kernel takes back faster than the destructors: ~0.3 ms of a
    // one-shot run (bench/contain_overhead.md).
    runtime.reset();
    if (!std::cout.flush() || std::fflush(stdout) != 0) {
      std::fprintf(stderr, "assayd contain: cannot write the evidence to stdout: %s\n",
                   std::strerror(errno));
      std::_Exit(1);
    }
    std::_Exit(0);
  } catch (const common::Error& e) {
    std::fprintf(stderr, "assayd contain: %s: %s\n", e.code().c_str(), e.what());
    return 1;
  }
}
}  // namespace

int contain_main(int argc, char** argv) {
  CLI::App app{
      "Runs COMMAND in a fresh leaf cgroup, in private PID, network (only lo) and mount "
      "namespaces, with no capabilities, a seccomp filter, a cleared environment and a hard "
      "timeout, then prints the evidence JSON (assay.process-containment.v1) on stdout. Run as "
      "root, COMMAND runs as the assay-worker user (else a transient uid/gid in 61184-65519) "
      "unless --user, --uid or --allow-root says otherwise.\n"
      "Exit status: 0 when the command ran and was measured (whatever its own outcome), 1 when "
      "containment failed, 2 on a usage error.\n"
      "On a Slurm node: `assayd contain --spec SPEC.json --evidence-out EVIDENCE.json` runs the "
      "spawn spec the head wrote (assay.contain-spec.v1) and writes the evidence durably.",
      "assayd contain"};
  CliArgs a;
  add_options(app, a);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  contain::SpawnSpec spec;
  contain::RuntimeOptions options;
  try {
    check_usage(app, a);
    options.mode = a.mode_name == "v2"     ? Mode::kV2
                   : a.mode_name == "v1"   ? Mode::kV1
                   : a.mode_name == "none" ? Mode::kNone
                                           : Mode::kAuto;
    options.base_cgroup = a.base_cgroup;
    options.delegated = a.delegated;
    if (!a.spec_file.empty()) {
      spec = spec_from_file(a.spec_file);
      adopt_remote_spec(spec);
    } else if (!a.cleanup) {
      spec = spec_from_options(a);
    }
  } catch (const common::Error& e) {
    std::fprintf(stderr, "assayd contain: %s\n", e.what());
    return 2;
  }
  return run_contained(a, spec, options);
}

}  // namespace assay::supervisor
