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
#include "supervisor/executors/slurm.h"
#include "supervisor/jobs/events.h"
#include "supervisor/jobs/metrics.h"
#include "supervisor/jobs/store.h"
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
  common::Json host_memory;  // the preflight's record, for the result
  std::shared_ptr<contain::Running> process;
  std::vector<common::UniqueFd> model_fds;  // the running step's model files, opened by assayd
  std::unique_ptr<boost::asio::steady_timer> progress_timer;  // a step with Step::progress
  std::optional<contain::Evidence> harvesting;  // the run whose parts are being recorded
  int resident = -1;  // the resident worker running its step (resident.cpp), or -1
  // The step whose model files' dirty pages were written back off the loop (start_step).
  std::string written_back;
  // Re-queued by a restart: with the Slurm executor, steps that ended before it are collected
  // from their records and a step still in Slurm is re-attached, until one starts afresh.
  bool recovered = false;
};

// A resident oracle worker (Config::resident, resident.cpp): `assay-oracle serve`, contained
// like every worker, loaded once, running one next-token job at a time when the job's
// fingerprint equals the bytes it loaded.
// How often a running step's progress (Step::progress) is read.
inline constexpr auto kProgressPoll = std::chrono::milliseconds(250);

struct ResidentWorker {
  enum class State { kLoading, kIdle, kBusy, kStopping };
  explicit ResidentWorker(boost::asio::io_context& io) : control(io), timer(io) {}
  int number = 0;
  std::string id;   // "r-<number>-<start, Unix ms>"
  std::string key;  // model_dir, executable and execution: what a job must match
  std::string model_dir;
  std::filesystem::path workspace;  // STATE/resident/<id>
  std::uint64_t memory_limit = 0;
  State state = State::kLoading;
  std::shared_ptr<contain::Running> process;
  boost::asio::posix::stream_descriptor control;  // our end of the SOCK_SEQPACKET pair
  std::array<char, 4096> buffer{};
  boost::asio::steady_timer timer;  // the running job's timeout, or the idle timeout
  common::Json bytes_used;          // from loaded.json: fixed for its life
  std::string loaded_at;
  double load_seconds = 0;
  std::uint64_t jobs = 0;
  double last_used = 0;  // Unix seconds, for eviction
  // The job it runs (or loads for): its id, step role, directory name, the job's start.
  std::string job_id, role, job_dir;
  contain::ResidentEvidence job;
  std::chrono::steady_clock::time_point job_started;
  std::chrono::milliseconds job_timeout{0};  // the step's: the evidence's limits.timeout
  bool timed_out = false;
  std::string stop_reason;  // why it was stopped (replaced, idle, evicted), for the log
  common::Json pending;     // the input of the job it loads for, run once loaded
  // What the engine copies out of the job's directory, and the most of each (resident.cpp);
  // for a batch, its state files; `progressed`: how many states' .json were copied while it
  // ran (for progress; states end in order).
  std::vector<std::pair<std::string, std::size_t>> job_files;
  std::size_t progressed = 0;
};

class Engine {
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
  std::size_t residents() const { return residents_.size(); }
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
  void poll_progress(const std::string& id, const std::string& role);
  void poll_resident_progress(const std::string& id, const std::string& role);

  // slurm_steps.cpp: steps as Slurm jobs (Config::executor "slurm")
  // Where a step's workspace is: STATE/jobs/ID/ROLE, or with Slurm SHARED/jobs/ID/ROLE (which
  // STATE/jobs/ID/ROLE then links to).
  std::filesystem::path workspace(const std::string& id, const std::string& role) const;
  // After a restart: collects a step that ended before it (its record in STATE/jobs/ID/steps/)
  // or re-attaches to its Slurm job. False when the step must start afresh.
  bool resume_step(JobRun& run, Step& step);
  void start_slurm(JobRun& run, Step& step, const contain::SpawnSpec& spec, bool attach);
  void slurm_done(const std::string& id, const std::string& role, executors::SlurmResult r);
  // What a step that ended well leaves for resume_step: its output and evidence.
  void keep_step_record(const std::string& id, const std::string& role, const common::Json& output,
                        const contain::Evidence& evidence);

  // resident.cpp: resident oracle workers (Config::resident)
  // Runs `step` on a resident worker when it may (true: the step is under way there or failed
  // the job); false: the caller starts a worker of its own.
  bool start_resident(JobRun& run, Step& step, const Job& job, const common::Json& input,
                      const std::filesystem::path& ws);
  ResidentWorker* spawn_resident(JobRun& run, const Step& step, const Job& job,
                                 const common::Json& input, const std::string& key);
  void dispatch_resident(ResidentWorker& w, JobRun& run, const common::Json& input);
  void read_resident(int number);
  void resident_message(int number, const std::string& message);
  void resident_loaded(ResidentWorker& w);
  void resident_job_ended(ResidentWorker& w, bool done);
  // `evidence` as the job's: its share of the worker's counters (w.job), its timeout and wall.
  contain::Evidence resident_job_evidence(const ResidentWorker& w,
                                          contain::Evidence evidence) const;
  void resident_exited(int number, contain::Evidence evidence);
  void stop_resident(ResidentWorker& w, const std::string& why);
  void arm_resident_idle(ResidentWorker& w);
  // Stops idle workers (least recently used first) until `bytes` more fit under
  // resident.memory_bytes and a worker slot is free; false when the busy ones leave no room.
  bool make_resident_room(std::uint64_t bytes, const std::string& keep_key);
  // Memory an idle resident worker holding `model_dir` frees for a job on that model (it runs
  // the job, or is replaced by its worker): its cgroup's current usage, else 0.
  std::uint64_t resident_memory_for(const std::string& model_dir);
  std::filesystem::path resident_root() const;

  // engine.cpp
  void next_step(JobRun& run);
  void start_step(JobRun& run, Step& step);
  // A worker ended: keeps its evidence, hashes on digest_pool_ the libraries its output names
  // that the digest cache has not seen (the loop keeps answering meanwhile), then step_ended.
  void step_done(const std::string& id, const std::string& role, contain::Evidence evidence);
  void step_ended(const std::string& id, const std::string& role, contain::Evidence evidence);
  void complete(JobRun& run);
  RunFacts run_facts(const JobRun& run) const;
  contain::SpawnSpec worker_spec(const JobRun& run, const Step& step,
                                 const std::filesystem::path& ws) const;
  // Gives files assayd made to the worker user (when workers run as one): chown, or
  // Error("worker.workspace") naming the file.
  void hand_to_worker(const std::vector<std::filesystem::path>& paths) const;
  void prepare_workspace(const Step& step, const common::Json& input,
                         const std::filesystem::path& ws) const;
  // Opens every regular file at the top of `model_dir` for the worker (fds 3, 4, ... in its
  // spawn) as the submitter may (admission.h: no link followed, rights checked) and lists them in
  // the input's "model_fds"; then the step's open_files.
  void open_step_files(JobRun& run, const Job& job, const Step& step, common::Json& input,
                       contain::SpawnSpec& spec) const;
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
  executors::SlurmExecutor* slurm_;  // null: the local executor
  std::set<std::string> recovered_;  // jobs recover() re-queued, until they begin

  std::vector<std::string> queue_;                       // FIFO of queued job ids
  std::map<std::string, std::unique_ptr<JobRun>> runs_;  // running jobs
  // Queued jobs the preflight holds back, with what each needs (estimate + reserve).
  std::map<std::string, std::uint64_t> waiting_need_;
  std::map<int, std::unique_ptr<ResidentWorker>> residents_;
  int next_resident_ = 0;
  boost::asio::steady_timer retry_timer_;
  bool retry_armed_ = false;
  bool stopping_ = false;
  // One thread that hashes implementation files (steps.h, warm_digests) off the loop. Last, so
  // it is joined first: its hand-backs go to io_, which outlives the engine.
  boost::asio::thread_pool digest_pool_{1};
};

}  // namespace assay::supervisor
