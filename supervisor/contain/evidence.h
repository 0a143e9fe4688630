// What the kernel saw of one contained worker, as typed values: the supervisor reads fields,
// never JSON spellings. The assay.process-containment.v1 document
// (schemas/process-containment.schema.json) has one writer, Evidence::to_json, and one reader,
// Evidence::from_json.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <sys/types.h>

#include "common/json.h"

namespace assay::contain {

// The limits a worker runs under (SpawnSpec::limits), recorded as given in its evidence.
struct Limits {
  std::optional<std::uint64_t> memory_max;
  std::optional<std::uint64_t> memory_high;
  std::optional<std::uint64_t> swap_max;
  std::optional<std::uint64_t> pids_max;
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  std::chrono::milliseconds kill_grace{std::chrono::seconds(2)};
  bool operator==(const Limits&) const = default;
};

struct CgroupEvidence {
  std::string path;                                // relative to the (memory) hierarchy root
  std::map<std::string, std::string> hierarchies;  // controller ("unified" on v2) -> directory
  bool removed = false;
  bool operator==(const CgroupEvidence&) const = default;
};

// Capability sets as the worker's process read them back right before execve (the /proc
// status lines CapInh, CapPrm, CapEff, CapBnd, CapAmb).
struct Capabilities {
  std::uint64_t inheritable = 0, permitted = 0, effective = 0, bounding = 0, ambient = 0;
  bool operator==(const Capabilities&) const = default;
};

// The seccomp filter installed right before execve (seccomp.h). Always true, and so not stored:
// clone with CLONE_NEW* flags, x32 and other architectures' calls are denied too.
struct SeccompEvidence {
  std::string policy_sha256;        // "sha256:<hex>" of the BPF program's bytes
  std::string arch;                 // "x86_64", "aarch64"
  std::vector<std::string> denied;  // fail with EPERM
  std::vector<std::string> enosys;  // fail with ENOSYS ("clone3": libc falls back to clone)
  bool operator==(const SeccompEvidence&) const = default;
};

// How the worker was started. Always true, and so not stored: no_new_privs, RLIMIT_CORE 0,
// stdin /dev/null, not dumpable until execve (which makes a binary the worker may read
// dumpable again: a kernel rule; the worker sets PR_SET_DUMPABLE itself if it cares).
struct SpawnEvidence {
  std::string method;  // "clone3-into-cgroup", "clone3-self-attach", ... (spawn.h)
  std::vector<std::string> argv;
  std::string workdir;
  std::vector<std::string> environment_keys;
  std::optional<uid_t> uid;  // real = effective = saved, as the worker read them back
  std::optional<gid_t> gid;
  std::uint64_t rlimit_nofile = 0;
  std::uint32_t pass_fds = 0;  // SpawnSpec::pass_fds, received as fds 3, 4, ...
  Capabilities capabilities;
  SeccompEvidence seccomp;
  bool operator==(const SpawnEvidence&) const = default;
};

// The child's network namespace as it reported it before it ran anything of its own.
struct NetworkEvidence {
  bool private_namespace = false;       // its namespace differed from the supervisor's
  std::vector<std::string> interfaces;  // as listed in its /proc/self/net/dev
  common::Json to_json() const;
  bool operator==(const NetworkEvidence&) const = default;
};

// The child's (always private) mount namespace, with /proc of its PID namespace and /sys of its
// network namespace mounted fresh.
struct MountsEvidence {
  std::vector<std::string> hidden;  // hidden paths, a hidden parent standing for its children
  std::vector<std::string> absent;  // requested hidden paths that did not exist
  bool operator==(const MountsEvidence&) const = default;
};

struct ExitStatus {
  std::optional<int> code;    // exited normally
  std::optional<int> signal;  // killed by a signal
  std::optional<std::string> signal_name;
  bool core_dumped = false;
  bool operator==(const ExitStatus&) const = default;
};

struct CpuEvidence {
  std::optional<std::uint64_t> user_usec;          // rusage of the main process and its waited-for
  std::optional<std::uint64_t> system_usec;        // children; null when it could not be reaped
  std::optional<std::uint64_t> cgroup_usage_usec;  // every process of the cgroup
  bool operator==(const CpuEvidence&) const = default;
};

// One raw counter file, named by the kernel: a single number ("memory.peak") or flat
// "key value" lines ("memory.events"). A file the kernel does not offer is neither (null), a
// key the file lacks is nullopt: never 0.
struct Counter {
  std::optional<std::uint64_t> value;
  std::optional<std::map<std::string, std::optional<std::uint64_t>>> keys;
  bool operator==(const Counter&) const = default;
};
using Counters = std::map<std::string, Counter>;  // kernel file name -> counter

struct StreamEvidence {
  std::optional<std::string> path;  // null: discarded
  std::uint64_t bytes = 0;          // kept
  std::uint64_t dropped_bytes = 0;  // beyond the cap
  bool operator==(const StreamEvidence&) const = default;
};

struct OutputEvidence {
  StreamEvidence out, err;  // the worker's stdout and stderr
  std::uint64_t cap_bytes = 0;
  bool operator==(const OutputEvidence&) const = default;
};

// Kiln result v2's per-process evidence, derived from the raw counters and the fields above
// (Evidence::normalised), so that the two can never disagree. Each field is null only where the
// kernel has no such counter; `sources` names the kernel file (and key) each value was read from.
struct NormalisedEvidence {
  std::optional<std::uint64_t> memory_high_events;      // v2 memory.events high; v1: none
  std::optional<std::uint64_t> memory_max_events;       // v2 memory.events max; v1 memory.failcnt
  std::optional<std::uint64_t> memory_oom_events;       // v2 memory.events oom; v1: none
  std::optional<std::uint64_t> memory_oom_kill_events;  // v2 memory.events oom_kill; v1 oom_control
  std::optional<std::uint64_t> memory_peak_bytes;       // v2 memory.peak; v1 max_usage_in_bytes
  std::optional<std::uint64_t>
      memory_swap_bytes;                       // v2 swap.peak (else swap.current); v1 memsw-usage
  std::optional<double> elapsed_seconds;       // wall_usec / 1e6
  std::optional<double> timeout_seconds;       // limits.timeout
  std::optional<int> exit_code;                // null when signalled or not reaped
  std::map<std::string, std::string> sources;  // field -> "file" or "file:key"
  bool operator==(const NormalisedEvidence&) const = default;
};

// A job that a resident worker (one that stays loaded across jobs) ran: which worker, and the
// raw counters as the job began, so that per-job figures are the difference. Counters that
// reset_peaks() reset at the job's start read per job as they are.
struct ResidentEvidence {
  std::string worker;                         // the worker's id, "r-<n>-<its start time>"
  std::string loaded_at;                      // UTC, when it had loaded (and hashed) the model
  std::uint64_t jobs_before = 0;              // jobs it ran before this one
  std::string started_at;                     // UTC, this job's start on it
  std::optional<Counters> counters_at_start;  // null when they could not be read
  std::vector<std::string> reset;             // counter files reset to 0 as the job began
  bool operator==(const ResidentEvidence&) const = default;
};

// Orphans (worker cgroups an earlier assayd left) have no spawn, limits, network, PID namespace,
// mounts,
// started_at, wall_usec, exit or output.
struct Evidence {
  std::string name;
  std::string mode;  // "cgroup-v2", "cgroup-v1", "none"
  bool orphan = false;
  std::optional<CgroupEvidence> cgroup;  // null in mode none
  std::optional<SpawnEvidence> spawn;
  std::optional<Limits> limits;
  std::optional<NetworkEvidence> network;
  // The worker's PID namespace differed from the supervisor's (its init, assayd's code, is
  // pid 1 there and the worker pid 2).
  std::optional<bool> pid_namespace_private;
  std::optional<MountsEvidence> mounts;
  std::optional<std::string> started_at;   // UTC, "2024-05-01T12:00:00.123Z"
  std::optional<std::uint64_t> wall_usec;  // spawn to the main process's exit
  std::optional<ExitStatus> exit;          // null when the worker could not be reaped
  CpuEvidence cpu;
  bool timed_out = false, cancelled = false, sigterm_sent = false;
  bool cgroup_killed = false;         // the whole cgroup was killed (grace over, cancel, orphan)
  std::string kill_scope = "cgroup";  // or "process-group" (mode none)
  int leftover_processes_killed = 0;  // still in the cgroup after the main process exited
  std::optional<bool> oom_killed;     // null when the kernel had no counter
  std::optional<std::uint64_t> memory_peak_bytes;
  std::optional<std::uint64_t> memory_swap_current_bytes;
  std::optional<std::uint64_t> memory_swap_peak_bytes;
  std::optional<std::uint64_t> pids_peak;
  std::optional<Counters> counters;  // null without a cgroup, or when they could not be read
  std::optional<OutputEvidence> output;
  std::vector<std::string> errors;  // problems met while measuring or cleaning up
  // Where the worker ran when not on this host: the Slurm executor's {kind: "slurm",
  // slurm_job_id, node, partition, state, restarts, evidence_sha256 (of the node's own document),
  // memory_limit_hit} (executors/slurm.h). Absent: this host.
  std::optional<common::Json> executor;
  // Set when a resident worker ran the job: `counters` are then read as it ended (the worker
  // still running), `exit` is null unless the worker ended during the job, `wall_usec` and
  // `started_at` are the job's, and `normalised` and the summary fields (oom_killed, memory,
  // pids_peak, cpu.cgroup_usage_usec) are per-job (job_counters).
  std::optional<ResidentEvidence> resident;

  // The counters over this process's run: `counters`, or a resident job's per-job view of them
  // (see `resident`).
  std::optional<Counters> job_counters() const;
  // The Kiln-v2 view of the fields above; to_json writes it as "normalised" and from_json
  // checks that a document's "normalised" equals it.
  NormalisedEvidence normalised() const;

  // Exited with code 0, not timed out, not OOM-killed; for a resident job: the worker was
  // still alive when the job ended (exit null), not timed out, no OOM kill during the job.
  bool succeeded() const;
  // Why it did not succeed, e.g. "exited with code 3" (empty when it succeeded).
  std::string failure_reason() const;
  // Each memory counter that shows pressure, named by its kernel file and value, e.g.
  // "memory.events:high = 3" or "swap 4096 bytes (memory.swap.peak)"; empty: none did (a counter
  // the kernel does not offer shows nothing).
  std::vector<std::string> memory_pressure() const;

  common::Json to_json() const;
  // Strict: throws common::Error("contain.bad_evidence", ...) naming the field on a missing,
  // unknown or mistyped field or a value outside the schema.
  static Evidence from_json(const common::Json& json);

  bool operator==(const Evidence&) const = default;
};

using CompletionHandler = std::function<void(Evidence)>;

}  // namespace assay::contain
