// Containment runtime: each worker runs in a fresh leaf cgroup, in private PID, network and
// mount namespaces, never as root unless allowed, with no capabilities and a seccomp filter,
// under a hard timeout; the supervisor reads what the kernel counted.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <sys/types.h>
#include <boost/asio/io_context.hpp>

#include "common/json.h"
#include "supervisor/contain/evidence.h"
#include "supervisor/contain/identity.h"

namespace assay::contain {

enum class Mode { kAuto, kV2, kV1, kNone };

struct RuntimeOptions {
  Mode mode = Mode::kAuto;
  // v2 without systemd delegation, or v1: the cgroup (relative to the hierarchy root) below
  // which worker cgroups are made. Empty: the process's own cgroup.
  std::string base_cgroup;
  // Move assayd into <own>/supervisor and make <own>/workers (v2 under Delegate=yes).
  bool delegated = false;
};

struct SpawnSpec {
  std::string name;               // unique leaf name, e.g. "<job>-oracle"
  std::vector<std::string> argv;  // argv[0] is an absolute path
  std::filesystem::path workdir;  // cwd of the worker
  std::vector<std::string> env;   // KEY=VALUE, the whole environment
  // Names whose values come from the environment of the process that runs the spec elsewhere
  // (`assayd contain --spec` on a Slurm node: CUDA_VISIBLE_DEVICES, the GPUs Slurm allocated
  // there), added to `env` there when set. Not used by a local spawn.
  std::vector<std::string> node_env;
  std::filesystem::path stdout_path;
  std::filesystem::path stderr_path;
  std::uint64_t output_cap_bytes = 8 * 1024 * 1024;
  std::vector<std::filesystem::path> hidden_paths;  // made unreachable in the worker
  // Unset: assayd's own. A worker that would run as uid 0 or gid 0 is refused
  // (contain.root_worker) unless allow_root; give it default_worker_identity() (identity.h).
  std::optional<uid_t> uid;
  std::optional<gid_t> gid;
  bool allow_root = false;  // development only
  // Open descriptors the worker receives as fds 3, 4, 5, ... in this order (close-on-exec
  // cleared there; the caller keeps and closes its own). Every other fd above 2 is closed.
  std::vector<int> pass_fds;
  std::uint64_t nofile = 4096;  // RLIMIT_NOFILE (soft and hard); RLIMIT_CORE is always 0
  Limits limits;                // evidence.h
};

// A started, contained process. Destroying it before completion kills it.
class Running {
 public:
  virtual ~Running() = default;
  // Kills the whole cgroup now (cancel); the completion handler still runs with the evidence.
  virtual void kill() = 0;
  // The worker's init (pid 1 of its PID namespace; the worker itself is pid 2 there).
  virtual pid_t pid() const = 0;

  // For a worker that stays alive across jobs (a resident oracle):
  // Writes 0 to the counters the kernel lets be reset (cgroup v1 memory.max_usage_in_bytes,
  // memory.failcnt and their memsw twins; none on v2) and returns their file names.
  virtual std::vector<std::string> reset_peaks() { return {}; }
  // The raw counters now; null without a cgroup, once the process exited, or when unreadable.
  virtual std::optional<Counters> counters() { return std::nullopt; }
  // Evidence of a job the running process did (ResidentEvidence, evidence.h): its cgroup,
  // spawn, limits and namespaces, the counters now, started_at the job's; no exit, no rusage,
  // no output. The caller sets wall_usec and the job's flags (timed_out, cancelled). A process
  // not run by this host's runtime (a Slurm step) has none: common::Error("contain.unsupported").
  virtual Evidence snapshot(const ResidentEvidence& resident);
};

// A child started for a SpawnSpec before the Runtime exists: it makes its network and mount
// namespaces (most of a spawn's time) while the caller detects the backend. Runtime::start
// takes it over for the same spec where the backend does not clone into the cgroup (v1,
// none); destroying it unused kills it. For one-shot tools (`assayd contain`).
class EarlyChild {
 public:
  virtual ~EarlyChild() = default;
  // Throws common::Error("contain.spawn_failed", ...) as Runtime::start does.
  static std::unique_ptr<EarlyChild> start(const SpawnSpec& spec);
};

class Runtime {
 public:
  virtual ~Runtime() = default;
  // Detects the backend from /proc/self/cgroup and /proc/self/mountinfo; throws
  // common::Error("contain.unavailable", ...) when no usable memory controller is writable.
  static std::unique_ptr<Runtime> create(const RuntimeOptions& options);

  virtual std::string backend() const = 0;  // "cgroup-v2", "cgroup-v1", "none"
  virtual common::Json describe() const = 0;
  // Finds worker cgroups left by an earlier assayd, kills, reads and removes them; returns
  // their evidence (`orphan` true).
  virtual std::vector<Evidence> cleanup_orphans() = 0;
  // Starts the process; `done` (CompletionHandler, evidence.h) runs on `io` once it exited (or
  // was killed) and was measured. Until its gate opens, the child dies with the calling thread
  // (PR_SET_PDEATHSIG).
  // Throws common::Error("contain.spawn_failed", ...) if it could not be started, and
  // common::Error("contain.root_worker", ...) before anything is made for a root worker that
  // `allow_root` does not allow.
  virtual std::shared_ptr<Running> start(boost::asio::io_context& io, const SpawnSpec& spec,
                                         CompletionHandler done) = 0;
  // The same with a child started for `spec` by EarlyChild::start: taken over (`early` is
  // null afterwards) unless this backend clones into cgroups (v2), which needs a fresh child.
  virtual std::shared_ptr<Running> start(boost::asio::io_context& io, const SpawnSpec& spec,
                                         CompletionHandler done,
                                         std::unique_ptr<EarlyChild>& early) = 0;
  // Blocking convenience for tools and tests.
  Evidence run(const SpawnSpec& spec);
};

}  // namespace assay::contain
