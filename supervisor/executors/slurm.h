// The Slurm executor: each worker step runs as a Slurm batch job on a compute node, inside
// `assayd contain --spec SPEC --evidence-out EVIDENCE` there, so that a supervisor process on the
// node measures the worker exactly as the local runtime does. The head (this process) talks to
// Slurm only through its command line (sbatch --parsable, squeue, scontrol show job, scancel),
// stable from Slurm 22.05 on; the step directory under `shared_dir` (visible at the same path on
// the head and the nodes) carries the spec in and the evidence out.
//
// Step directory <shared_dir>/slurm/<spec.name>/:
//   spec.json       the SpawnSpec (assay.contain-spec.v1, contain/spawn_spec_json.h)
//   step.sh         the batch script: exec <node_assayd> contain --spec ... --evidence-out ...
//   token           a random token in the Slurm job name (finds the job if assayd died between
//                   sbatch's answer and the next file)
//   slurm_job_id    the job id, written durably before `submitted` runs
//   evidence.json   written durably by `assayd contain` on the node (assay.process-containment.v1)
//   slurm.out, slurm.err   the batch script's own output (assayd contain's messages)
#pragma once

#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>

#include "common/json.h"
#include "supervisor/contain/contain.h"

namespace assay::executors {

struct SlurmOptions {
  std::filesystem::path shared_dir;      // same path on the head and every node
  std::string partition, account, qos;   // empty: Slurm's default
  std::string gres;                      // e.g. "gpu:1" (oracle steps on a GPU); empty: none
  std::vector<std::string> sbatch_args;  // appended to each sbatch command line
  std::filesystem::path node_assayd = "assayd";  // `assayd` on the nodes (absolute, or in PATH)
  std::vector<std::string> contain_args;  // node-side `assayd contain` options, e.g. --mode v1
  // --mem = the spec's memory_max (or default_memory_bytes without one) + memory_margin_bytes
  // (`assayd contain` itself, page cache), so that assay's own cgroup limit is met first.
  std::uint64_t default_memory_bytes = 1ULL << 30;
  std::uint64_t memory_margin_bytes = 64ULL << 20;
  // --time = the spec's timeout + kill_grace + time_margin, in whole minutes (Slurm's unit).
  std::chrono::seconds time_margin{60};
  std::chrono::milliseconds poll{1000};  // squeue interval, one call for all steps
  // How long a job Slurm reports ended may lack its evidence file (attribute caches of a shared
  // file system) before the step fails with slurm.evidence_missing.
  std::chrono::milliseconds evidence_wait{std::chrono::seconds(30)};
};

// What Slurm says of one step.
struct SlurmStep {
  std::string slurm_job_id;
  std::filesystem::path step_dir;
  std::string node;  // empty until it runs
  std::string partition;
  std::string state;   // PENDING, RUNNING, COMPLETED, TIMEOUT, OUT_OF_MEMORY, ... or VANISHED
  std::string reason;  // Slurm's reason (pending: Priority, Resources, ...); "None" otherwise
  int restarts = 0;    // re-queues (preemption, node failure)
  std::optional<int> exit_code;  // of `assayd contain`, when Slurm still knew the job at its end
  bool operator==(const SlurmStep&) const = default;
};

struct SlurmResult {
  SlurmStep step;
  // The node-side evidence, read strictly (Evidence::from_json), and the sha256 identity of the
  // file's exact bytes; absent when the node wrote none (refused to contain, node lost, ...).
  std::optional<contain::Evidence> evidence;
  std::string evidence_sha256;
  // Empty when Slurm ran the step to its end (the evidence then says how the worker did).
  // Otherwise a stable code: slurm.submit_failed, slurm.timeout, slurm.out_of_memory,
  // slurm.node_failed, slurm.preempted, slurm.boot_failed, slurm.deadline, slurm.cancelled,
  // slurm.contain_refused (the node's `assayd contain` exited 1: it cannot contain there and ran
  // nothing), slurm.contain_usage (exit 2), slurm.failed, slurm.vanished (Slurm forgot the job
  // and no evidence was written: re-run the step), slurm.evidence_missing, slurm.bad_evidence.
  std::string error_code, error_message;
  // Which memory limit ended the worker: "assay-cgroup" (the node evidence's oom_killed),
  // "slurm" (Slurm said OUT_OF_MEMORY, assay's cgroup did not), "" (none).
  std::string memory_limit_hit;
  bool ok() const { return error_code.empty(); }
  // The evidence's `executor` object (schemas/process-containment.schema.json):
  // {kind:"slurm", slurm_job_id, node, partition, state, restarts, evidence_sha256,
  // memory_limit_hit}, nulls for empty strings.
  common::Json executor_json() const;
};

struct SlurmCallbacks {
  // The job id, already durable in the step directory. Optional.
  std::function<void(const SlurmStep&)> submitted;
  // Each change of state, reason or node (events stream, /metrics). Optional.
  std::function<void(const SlurmStep&)> progress;
  // Exactly once, on the io_context, unless the executor is destroyed first.
  std::function<void(SlurmResult)> done;
};

class SlurmExecutor {
 public:
  // Commands run with this process's environment (SLURM_CONF included).
  SlurmExecutor(boost::asio::io_context& io, SlurmOptions options);
  // Stops following its steps; their Slurm jobs keep running (attach() collects them later).
  ~SlurmExecutor();
  SlurmExecutor(const SlurmExecutor&) = delete;
  SlurmExecutor& operator=(const SlurmExecutor&) = delete;

  std::filesystem::path step_dir(const std::string& name) const;

  // Writes the step directory (replacing one an earlier attempt left), submits it with sbatch
  // without blocking, records the job id, then follows the job until it ended and its evidence
  // is read. Throws common::Error("slurm.step_dir", ...) when the step directory cannot be
  // written. The returned Running's kill() is scancel: `done` still runs (slurm.cancelled), with
  // the node's evidence when the worker had started (Slurm's SIGTERM reaches the worker and
  // `assayd contain`, which measures its end); pid() is 0 (the process lives on a node).
  // Dropping the Running does not cancel the job.
  // `gres`: this step's --gres (e.g. "gpu:1" for an oracle step on a GPU); empty: the options'.
  std::shared_ptr<contain::Running> start(const contain::SpawnSpec& spec, SlurmCallbacks callbacks,
                                          const std::string& gres = {});

  // Follows a step submitted before a restart, by its step directory (the job id file, or the
  // token in the job's name when assayd died before writing it): never re-submits. A job Slurm
  // no longer knows whose evidence is there completes normally; one without evidence ends with
  // slurm.vanished.
  std::shared_ptr<contain::Running> attach(const std::filesystem::path& step_dir,
                                           SlurmCallbacks callbacks);

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace assay::executors
