// Where a step's worker runs: the one seam between the engine (jobs/engine.h: the queue, the
// memory preflight, a job's steps and its end) and the ways a worker can be run. The engine hands
// each step to the first executor that takes it (a resident worker when one may run it, else the
// host's executor: the local contained runtime or a Slurm step) and is told, through StepHost,
// how it ended. Everything runs on the io_context's one thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "common/json.h"
#include "supervisor/contain/contain.h"
#include "supervisor/peer.h"
#include "supervisor/pipelines/pipeline.h"

namespace assay::supervisor {

// How often a running step's progress (Step::progress) is read.
inline constexpr auto kProgressPoll = std::chrono::milliseconds(250);

// What an executor may ask of the engine (implemented by Engine). A step's end is reported once,
// by exactly one of ended, failed, cancelled or again.
class StepHost {
 public:
  virtual ~StepHost() = default;
  // An event of job `id` while its `role` step runs (the job's phase becomes `role`).
  virtual void phase(const std::string& id, const std::string& role,
                     const std::string& message) = 0;
  // The worker ended and left what it left in the step's workspace: the engine keeps the
  // evidence and judges the step (exit, limits, output).
  virtual void ended(const std::string& id, const std::string& role,
                     contain::Evidence evidence) = 0;
  // The step ended without a worker's end to judge (or with one its executor judged): the job
  // fails with `code`.
  virtual void failed(const std::string& id, const std::string& code,
                      const std::string& message) = 0;
  virtual void cancelled(const std::string& id, const std::string& message) = 0;
  // The step never ran to an end and may run again from the start (Slurm forgot its job).
  virtual void again(const std::string& id) = 0;
  // After a restart: the step ended before it and its record says how (output and evidence);
  // the engine accepts it as it would have then.
  virtual void collected(const std::string& id, const std::string& role, const common::Json& output,
                         const contain::Evidence& evidence) = 0;
  // The step job `id` is running now (null when the job is gone), and whether its cancel was
  // asked.
  virtual Step* current_step(const std::string& id) = 0;
  virtual bool cancel_requested(const std::string& id) = 0;
  // Memory or a worker slot came free: a waiting job may start.
  virtual void freed() = 0;
  // STATE/jobs/ID: the job's directory in the state directory.
  virtual std::filesystem::path job_dir(const std::string& id) const = 0;
  // Files assayd made for a worker, given to the worker user (when workers run as one): chown,
  // or Error("worker.workspace") naming the file.
  virtual void hand_to_worker(const std::vector<std::filesystem::path>& paths) const = 0;
};

// One step handed to an executor.
struct StepLaunch {
  std::string job_id;
  Step& step;
  Peer submitter;           // whose rights the step's files are opened with
  common::Json input;       // the worker's input (the executor adds model_fds where it opens them)
  contain::SpawnSpec spec;  // its contained worker; workdir: Executor::workspace(job_id, role)
};

class Executor {
 public:
  virtual ~Executor() = default;
  virtual std::string name() const = 0;
  // Takes the step: true when it is under way here (its end comes through the host) or its job
  // already ended through the host; false leaves it to the next executor. Throws common::Error
  // when it cannot start it (the engine fails the job with it).
  virtual bool start(StepLaunch& launch) = 0;
  // After a restart, before the step's input is built: collects job `id`'s `step` that ended
  // before it (StepHost::collected), or re-attaches to it still running. False: it starts afresh.
  virtual bool resume(const std::string& /*id*/, Step& /*step*/) { return false; }
  // Stops job `id`'s step if it runs here; its end still comes through the host.
  virtual bool cancel(const std::string& id) = 0;
  // Where job `id`'s `role` step works (what it leaves there, the engine reads at
  // STATE/jobs/ID/ROLE, which links here when it is elsewhere).
  virtual std::filesystem::path workspace(const std::string& id, const std::string& role) const = 0;
  // Whether the step's workspace is elsewhere, linked from the job directory.
  virtual bool linked_workspaces() const { return false; }
  // Whether its workers read the model through descriptors assayd opens on this host (so that
  // assayd may settle the model's files and reuse an earlier step's result first).
  virtual bool local_files() const { return true; }
  // The step's output was accepted (a record a restart collects, where the executor keeps one).
  virtual bool keeps_records() const { return false; }
  virtual void accepted(const std::string& /*id*/, const std::string& /*role*/,
                        const common::Json& /*output*/, const contain::Evidence& /*evidence*/) {}
  // Memory its idle workers hold (the preflight counts it as free), the memory an idle worker
  // holding `model_dir` would free for a job on it, and stopping every idle worker (true: some).
  virtual std::uint64_t idle_bytes() const { return 0; }
  virtual std::uint64_t held_for(const std::string& /*model_dir*/) { return 0; }
  virtual bool release_idle(const std::string& /*why*/) { return false; }
  // Starts nothing more and ends its long-lived workers; how many are still alive.
  virtual void stop() {}
  virtual std::size_t alive() const { return 0; }
};

}  // namespace assay::supervisor
