// The resident executor (Config::resident): `assay-oracle serve` (or `assay-hf-worker serve`)
// loads a model once and runs next-token jobs and batches on it one at a time, for as long as
// each job's fingerprint equals the bytes it loaded. It is contained as every worker is (its own
// cgroup, namespaces, seccomp, worker user); a job's evidence is its share of that worker's
// counters (contain::ResidentEvidence). Its crash, OOM kill or a job's timeout ends the worker
// and fails only the job it was running. Asked before the host's executor; a step it does not
// take runs there.
#pragma once

#include <array>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>

#include "supervisor/config.h"
#include "supervisor/executors/executor.h"

namespace assay::supervisor {

struct ResidentWorker {
  enum class State { kLoading, kIdle, kBusy, kStopping };
  explicit ResidentWorker(boost::asio::io_context& io) : control(io), timer(io), progress(io) {}
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
  boost::asio::steady_timer timer;     // the running job's timeout, or the idle timeout
  boost::asio::steady_timer progress;  // the running job's progress (a batch's states)
  common::Json bytes_used;             // from loaded.json: fixed for its life
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
  // The input and timeout of the job it loads for, run once loaded.
  common::Json pending;
  std::chrono::milliseconds pending_timeout{0};
  // What the engine copies out of the job's directory, and the most of each (resident.cpp);
  // for a batch, its state files; `progressed`: how many states' .json were copied while it
  // ran (for progress; states end in order).
  std::vector<std::pair<std::string, std::size_t>> job_files;
  std::size_t progressed = 0;
};

class ResidentExecutor : public Executor {
 public:
  // Removes the workspaces of resident workers an earlier assayd left (their cgroups are the
  // runtime's cleanup_orphans'). It takes steps when Config::resident allows workers and
  // `enabled` (not beside the Slurm executor).
  ResidentExecutor(boost::asio::io_context& io, const Config& config, contain::Runtime& runtime,
                   StepHost& host, bool enabled);
  std::string name() const override { return "resident"; }
  // Runs the step on a worker that holds its model, or on a new one (replacing a worker that
  // holds other bytes, evicting idle ones for room); false for a step that may not run on a
  // resident worker (no Step::resident_bytes) or when busy workers leave no room.
  bool start(StepLaunch& launch) override;
  bool cancel(const std::string& id) override;
  std::filesystem::path workspace(const std::string& id, const std::string& role) const override;
  std::uint64_t idle_bytes() const override;
  // Memory an idle resident worker holding `model_dir` frees for a job on that model (it runs
  // the job, or is replaced by its worker): its cgroup's current usage, else 0.
  std::uint64_t held_for(const std::string& model_dir) override;
  bool release_idle(const std::string& why) override;
  void stop() override;
  std::size_t alive() const override { return residents_.size(); }

 private:
  ResidentWorker* spawn(StepLaunch& launch, const std::string& key);
  void dispatch(ResidentWorker& w, const std::string& id, const std::string& role,
                const common::Json& input, std::chrono::milliseconds timeout);
  void read(int number);
  void message(int number, const std::string& message);
  void loaded(ResidentWorker& w);
  void job_ended(ResidentWorker& w, bool done);
  // `evidence` as the job's: its share of the worker's counters (w.job), its timeout and wall.
  contain::Evidence job_evidence(const ResidentWorker& w, contain::Evidence evidence) const;
  void exited(int number, contain::Evidence evidence);
  void stop_worker(ResidentWorker& w, const std::string& why);
  void arm_idle(ResidentWorker& w);
  void poll_progress(int number);
  // Stops idle workers (least recently used first) until `bytes` more fit under
  // resident.memory_bytes and a worker slot is free; false when the busy ones leave no room.
  bool make_room(std::uint64_t bytes, const std::string& keep_key);
  std::filesystem::path root() const;

  boost::asio::io_context& io_;
  const Config& config_;
  contain::Runtime& runtime_;
  StepHost& host_;
  std::map<int, std::unique_ptr<ResidentWorker>> residents_;
  std::map<std::string, int> jobs_;  // job id -> the worker running (or loading for) its step
  int next_ = 0;
  bool enabled_ = true;
  bool stopping_ = false;
};

}  // namespace assay::supervisor
