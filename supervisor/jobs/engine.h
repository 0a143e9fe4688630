// The job engine: a FIFO queue onto device slots, the memory preflight, and each running job's
// steps (workspace, contained worker, evidence, output) through to the sealed, signed result.
// It owns retries of the preflight, cancel, restart recovery and the job's events. Everything
// runs on the io_context's one thread; nothing here throws to its caller once a job is accepted.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <sys/types.h>
#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>

#include "common/fs.h"
#include "common/sign.h"
#include "supervisor/config.h"
#include "supervisor/contain/contain.h"
#include "supervisor/executors/executor.h"
#include "supervisor/executors/resident.h"
#include "supervisor/executors/slurm.h"
#include "supervisor/jobs/events.h"
#include "supervisor/jobs/store.h"
#include "supervisor/metrics.h"
#include "supervisor/pipelines/pipeline.h"

namespace assay::supervisor {

// One running job: everything the engine keeps while it runs, in one place.
struct JobRun {
  std::string id;
  int slot = 0;
  double started_unix = 0;
  bool cancel_requested = false;
  std::unique_ptr<Pipeline> pipeline;
  std::vector<Step> steps;
  std::size_t next_step = 0;
  std::uint64_t required_bytes = 0;
  common::Json host_memory;      // the preflight's record, for the result
  Executor* executor = nullptr;  // the one running its current step, once one took it
  std::optional<contain::Evidence> harvesting;  // the run whose parts are being recorded
  // The step whose model files' dirty pages were written back off the loop (start_step).
  std::string written_back;
  // Re-queued by a restart: with an executor that keeps records (Slurm), steps that ended
  // before it are collected from their records and a step still running is re-attached, until
  // one starts afresh.
  bool recovered = false;
};

class Engine : private StepHost {
 public:
  Engine(boost::asio::io_context& io, const Config& config, JobStore& store,
         contain::Runtime& runtime, const common::SigningKey& key, Watchers& watchers,
         Metrics& metrics, std::optional<contain::WorkerIdentity> worker,
         executors::SlurmExecutor* slurm = nullptr);

  // Re-queues jobs cut off by a restart and starts scheduling.
  void recover();
  // Starts no new work and tells every resident worker to exit.
  void stop();
  // Resident workers not yet reaped (after stop(): those still exiting).
  std::size_t residents() const;
  // Queues an accepted job.
  void enqueue(const std::string& id);
  // Cancels a queued job at once, a running one by killing its worker (its step then ends the
  // job as cancelled). Returns false when the job is already terminal.
  bool cancel(Job& job);
  std::size_t queue_depth() const { return queue_.size(); }
  // At admission: throws Error("preflight.refused") naming the figures when the kind's memory
  // estimate for `document` (plus the reserve) exceeds what this host can ever make available
  // (contain::MemoryView::capacity): such a job would wait at no end. An estimate that cannot be
  // made here is left to the job's start, which reports it.
  void check_capacity(const JobKind& kind, const common::Json& document, const common::Json& checks,
                      const std::string& model_dir);
  std::size_t running() const { return runs_.size(); }

 private:
  // scheduler.cpp
  enum class Begun { kStarted, kWaiting, kEnded };
  void schedule();
  // kWaiting: the preflight holds it back (waiting_need_ says for how much); kEnded: failed.
  Begun begin(const std::string& id);
  Begun preflight(JobRun& run);
  void arm_retry();
  void release(const std::string& id);

  // parts.cpp: a batch's states, each recorded as a job of its own (pipeline.h, Part)
  // Hands the pipeline the parts an earlier run recorded.
  void restore_parts(JobRun& run);
  // After a run of a harvesting step: records the parts it ended, a few per turn of the
  // io_context, then runs the step again or goes on (or ends the job: failed, cancelled).
  void harvest_step(const std::string& id);
  void record_part(JobRun& run, Part& part);

  // StepHost (executors/executor.h): what the executors tell the engine.
  void phase(const std::string& id, const std::string& role, const std::string& message) override;
  void ended(const std::string& id, const std::string& role, contain::Evidence evidence) override;
  void failed(const std::string& id, const std::string& code, const std::string& message) override;
  void cancelled(const std::string& id, const std::string& message) override;
  void again(const std::string& id) override;
  void collected(const std::string& id, const std::string& role, const common::Json& output,
                 const contain::Evidence& evidence) override;
  Step* current_step(const std::string& id) override;
  bool cancel_requested(const std::string& id) override;
  void freed() override;
  std::filesystem::path job_dir(const std::string& id) const override { return store_.job_dir(id); }
  // Gives files assayd made to the worker user (when workers run as one): chown, or
  // Error("worker.workspace") naming the file.
  void hand_to_worker(const std::vector<std::filesystem::path>& paths) const override;

  // engine.cpp
  void next_step(JobRun& run);
  void start_step(JobRun& run, Step& step);
  // A worker ended (StepHost::ended): keeps its evidence, hashes on digest_pool_ the libraries
  // its output names that the digest cache has not seen (the loop keeps answering meanwhile),
  // then step_ended.
  void step_ended(const std::string& id, const std::string& role, contain::Evidence evidence);
  void complete(JobRun& run);
  RunFacts run_facts(const JobRun& run) const;
  contain::SpawnSpec worker_spec(const JobRun& run, const Step& step,
                                 const std::filesystem::path& ws) const;
  static Peer submitter_of(const Job& job);
  // Records a phase change and tells watchers; `durable` when a restart must see it.
  void set_phase(Job& job, const std::string& phase, const std::string& message,
                 bool durable = false);
  // Records the terminal state (with `files`, a success's result, in the same commit) before
  // watchers are told, and frees the slot.
  void finish(const std::string& id, JobState state, const std::string& message,
              std::optional<common::Json> error = std::nullopt, const CommitFiles& files = {});
  void fail(const std::string& id, const std::string& code, const std::string& message);

  boost::asio::io_context& io_;
  const Config& config_;
  JobStore& store_;
  contain::Runtime& runtime_;
  const common::SigningKey& key_;
  Watchers& watchers_;
  Metrics& metrics_;
  // Who workers run as: set whenever assayd is root (never root itself unless
  // allow_root_workers); unset when assayd is not root and workers run as assayd's user.
  std::optional<contain::WorkerIdentity> worker_;
  // Where steps run: resident workers first where they may (null: none configured), then a
  // Slurm worker pool where one is configured, then the host's executor (the local runtime, or
  // Slurm steps), which takes every step it is given.
  std::unique_ptr<ResidentExecutor> resident_;  // takes no step unless configured
  std::unique_ptr<Executor> pool_;              // Slurm worker pools (slurm.pool.nodes > 0)
  std::unique_ptr<Executor> executor_;
  std::set<std::string> recovered_;  // jobs recover() re-queued, until they begin

  std::vector<std::string> queue_;                       // FIFO of queued job ids
  std::map<std::string, std::unique_ptr<JobRun>> runs_;  // running jobs
  // Queued jobs the preflight holds back, with what each needs (estimate + reserve).
  std::map<std::string, std::uint64_t> waiting_need_;
  boost::asio::steady_timer retry_timer_;
  bool retry_armed_ = false;
  bool stopping_ = false;
  // One thread that hashes implementation files (steps.h, warm_digests) off the loop. Last, so
  // it is joined first: its hand-backs go to io_, which outlives the engine.
  boost::asio::thread_pool digest_pool_{1};
};

}  // namespace assay::supervisor
