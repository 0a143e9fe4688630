// The engine's steps: each in a fresh workspace, contained, judged by its typed evidence; then
// the kind assembles the result, which is sealed, signed and committed with the terminal state.
#include "supervisor/jobs/engine.h"

#include <algorithm>

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "common/fs.h"
#include "common/protocol.h"
#include "common/text.h"
#include "common/time.h"
#include "fingerprint/model_fds.h"
#include "supervisor/pipelines/admission.h"
#include "supervisor/pipelines/documents.h"
#include "supervisor/pipelines/steps.h"

namespace assay::supervisor {

using common::Error;
using common::Json;
namespace fs = std::filesystem;

namespace {

constexpr std::size_t kMaxWorkerOutputBytes = 64 * 1024 * 1024;
constexpr std::size_t kMaxMessageBytes = 16 * 1024;

// The limits of one worker: what the request asks for (admission refused anything above the
// configured maxima), else the configured defaults; memory from the preflight estimate.
contain::Limits worker_limits(const Config& config, const common::RequestLimits& asked,
                              std::uint64_t required_bytes, bool has_memory_high) {
  contain::Limits l;
  double timeout = asked.timeout_seconds.value_or(config.worker_timeout_seconds);
  l.timeout = std::chrono::milliseconds(static_cast<long long>(timeout * 1000));
  std::uint64_t memory = asked.memory_bytes.value_or(static_cast<std::uint64_t>(
      static_cast<double>(required_bytes) * config.worker_memory_margin));
  if (config.worker_memory_max) memory = std::min(memory, *config.worker_memory_max);
  l.memory_max = memory;
  // Reclaim pressure before the hard limit, where the kernel has memory.high (v2).
  if (has_memory_high) l.memory_high = memory / 10 * 9;
  l.pids_max = config.worker_pids_max;
  return l;
}

}  // namespace

void Engine::next_step(JobRun& run) {
  if (run.cancel_requested) return finish(run.id, JobState::kCancelled, "cancelled between steps");
  if (run.next_step == run.steps.size()) return complete(run);
  start_step(run, run.steps[run.next_step++]);
}

void Engine::hand_to_worker(const std::vector<fs::path>& paths) const {
  if (!worker_) return;
  for (const auto& p : paths)
    if (::chown(p.c_str(), worker_->uid, worker_->gid) != 0)
      common::throw_errno("worker.workspace", "cannot hand " + p.string() + " to the worker user",
                          errno);
}

contain::SpawnSpec Engine::worker_spec(const JobRun& run, const Step& step,
                                       const fs::path& ws) const {
  contain::SpawnSpec spec;
  spec.name = run.id + "-" + step.role;
  // Relative to the workspace, the worker's cwd: a worker that runs as another user reaches it
  // although it may not search the directories above the state directory.
  spec.argv = {step.worker.string(), step.mode, "--input", std::string(protocol::kInputFile),
               "--workdir",          "."};
  spec.workdir = ws;
  // Passive OpenMP waiting: torch's libgomp otherwise spins its idle threads, which starved
  // assayd's one thread on a 2-core host during long batches.
  spec.env = {"PATH=/usr/bin:/bin", "LANG=C.UTF-8", "HOME=" + ws.string(),
              "OMP_NUM_THREADS=" + std::to_string(worker_threads(config_)),
              "OMP_WAIT_POLICY=PASSIVE"};
  spec.stdout_path = ws / protocol::kStdoutFile;
  spec.stderr_path = ws / protocol::kStderrFile;
  // The worker sees neither the state directory (other jobs, the signing key) nor the socket;
  // the runtime bind-mounts its own workspace back.
  spec.hidden_paths = {config_.state_dir};
  if (!config_.socket.empty()) spec.hidden_paths.push_back(config_.socket);
  if (worker_) {
    spec.uid = worker_->uid;
    spec.gid = worker_->gid;
  }
  spec.allow_root = config_.allow_root_workers;
  spec.limits = worker_limits(config_, run.pipeline->limits(), run.required_bytes,
                              runtime_.backend() == "cgroup-v2");
  spec.limits.timeout = std::chrono::milliseconds(
      static_cast<long long>(static_cast<double>(spec.limits.timeout.count()) *
                             std::max(1.0, step.timeout_factor ? step.timeout_factor() : 1.0)));
  if (step.timeout_cap) spec.limits.timeout = std::min(spec.limits.timeout, *step.timeout_cap);
  return spec;
}

Peer Engine::submitter_of(const Job& job) {
  return submitter_peer(job.submitter_uid, job.submitter_gid, job.submitter_admin);
}

void Engine::start_step(JobRun& run, Step& step) {
  const std::string id = run.id, role = step.role;
  Job& job = *store_.find(id);
  try {
    if (run.recovered && executor_->resume(id, step)) {
      run.executor = executor_.get();
      return;
    }
    run.recovered = false;
    run.executor = nullptr;
    if (::access(step.worker.c_str(), X_OK) != 0)
      throw Error("worker.missing",
                  "worker executable " + step.worker.string() + " is missing or not executable");
    // Settling the model's files (the reuse check, the fingerprint's directory record) writes
    // back their dirty pages on this loop, about 0.6 s per GiB for a model copied in just
    // before the job: that writeback is done first on digest_pool_, and the step starts again
    // here once it is, so the settle finds clean pages and returns at once.
    const bool local_files = executor_->local_files() && !step.model_dir.empty();
    if ((step.reuse || step.opened_model) && local_files && run.written_back != role) {
      run.written_back = role;
      // The guard keeps io_ running (it may have no other work) until the step is handed back.
      boost::asio::post(digest_pool_, [this, id, role, dir = step.model_dir,
                                       work = boost::asio::make_work_guard(io_)] {
        fingerprint::write_back_directory(dir);
        boost::asio::post(io_, [this, id, role] {
          auto it = runs_.find(id);
          if (it == runs_.end()) return;
          JobRun& again = *it->second;
          if (again.cancel_requested)
            return finish(id, JobState::kCancelled, "cancelled before the " + role + " started");
          if (again.next_step == 0 || again.steps[again.next_step - 1].role != role) return;
          start_step(again, again.steps[again.next_step - 1]);
        });
      });
      return;
    }
    if (step.reuse && local_files) {
      // Opened as for a worker (the submitter's rights, no links), and closed again.
      OpenedModel opened = open_model_as(step.model_dir, submitter_of(job));
      bool reused = false;
      try {
        reused = step.reuse(opened);
      } catch (const Error& e) {
        return fail(id, e.code(), e.what());
      }
      if (reused) {
        set_phase(job, role, "the " + role + " of an earlier job stands: its files are unchanged");
        return next_step(run);
      }
    }
    StepLaunch launch{id, step, submitter_of(job), step.input(),
                      worker_spec(run, step, executor_->workspace(id, role))};
    for (Executor* executor :
         {static_cast<Executor*>(resident_.get()), pool_.get(), executor_.get()}) {
      if (!executor) continue;
      // Set first: an executor may report the step's end before it returns.
      run.executor = executor;
      if (executor->start(launch)) return;
    }
    run.executor = nullptr;
    throw Error("supervisor.internal", "no executor took the " + role + " step");
  } catch (const Error& e) {
    fail(id, e.code(), "cannot start the " + role + " worker: " + e.what());
  } catch (const std::exception& e) {
    fail(id, "supervisor.internal", "cannot start the " + role + " worker: " + e.what());
  }
}

void Engine::ended(const std::string& id, const std::string& role, contain::Evidence evidence) {
  auto it = runs_.find(id);
  if (it == runs_.end()) return;
  fs::path ws = store_.job_dir(id) / role;
  try {
    common::replace_file_fast(ws / "evidence.json", common::canonical(evidence.to_json()), 0600);
  } catch (const Error& e) {
    spdlog::error("cannot keep evidence of {} {}: {}", id, role, e.what());
  }
  if (evidence.oom_killed.value_or(false)) ++metrics_.oom_kills;
  if (evidence.timed_out) ++metrics_.timeouts;
  // The first job after a start or an upgrade names LibTorch (~0.5 GB) before the digest cache
  // has it: hashing that on the loop held /v1/health for a second.
  std::vector<DigestFile> unseen = uncached_digests(reported_libraries(ws / protocol::kOutputFile));
  if (unseen.empty()) return step_ended(id, role, std::move(evidence));
  boost::asio::post(
      digest_pool_, [this, id, role, unseen = std::move(unseen), evidence = std::move(evidence),
                     work = boost::asio::make_work_guard(io_)]() mutable {
        warm_digests(unseen);
        boost::asio::post(io_, [this, id, role, evidence = std::move(evidence)]() mutable {
          step_ended(id, role, std::move(evidence));
        });
      });
}

void Engine::step_ended(const std::string& id, const std::string& role,
                        contain::Evidence evidence) {
  auto it = runs_.find(id);
  if (it == runs_.end()) return;
  JobRun& run = *it->second;
  fs::path ws = store_.job_dir(id) / role;
  Step& step = run.steps[run.next_step - 1];
  if (memory_policy(run.pipeline->limits(), config_) == common::MemoryPolicy::kReject &&
      !run.cancel_requested)
    if (auto seen = evidence.memory_pressure(); !seen.empty()) {
      std::string counters;
      for (const auto& s : seen) counters += (counters.empty() ? "" : ", ") + s;
      return fail(id, "worker.memory_pressure",
                  role + " worker saw memory pressure (" + counters +
                      "); this job runs under memory_events \"reject\"");
    }
  if (step.harvest) {
    run.harvesting = std::move(evidence);
    return harvest_step(id);
  }
  if (run.cancel_requested)
    return finish(id, JobState::kCancelled, "cancelled while the " + role + " worker ran");
  if (!evidence.succeeded()) {
    std::string limit;
    // A step stopped by its own cap (a chat template that loops) says which limit stopped it.
    if (evidence.timed_out && step.timeout_cap && evidence.limits &&
        evidence.limits->timeout >= *step.timeout_cap)
      limit = " after " +
              fmt::format("{:g}", static_cast<double>(step.timeout_cap->count()) / 1e3) +
              " s, the limit " + step.timeout_cap_key +
              " sets for this step whatever the job's timeout";
    return fail(id, "worker." + role + "_failed",
                role + " worker " + evidence.failure_reason() + limit +
                    "; stderr: " + tail_file(ws / protocol::kStderrFile, 2000));
  }
  try {
    Json output;
    try {
      output = common::parse_strict(
          common::read_file(ws / protocol::kOutputFile, kMaxWorkerOutputBytes),
          // A statistic may be a double past 2^53 that canonical JSON writes without a fraction.
          {.max_bytes = kMaxWorkerOutputBytes, .exact_integers = false});
    } catch (const Error& e) {
      throw Error("worker." + role + "_output",
                  role + " worker exited 0 but its output.json is unusable: " + e.what());
    }
    Json kept = executor_->keeps_records() ? output : Json();
    accept_output(step, std::move(output), evidence);
    if (executor_->keeps_records()) executor_->accepted(id, role, kept, evidence);
  } catch (const Error& e) {
    return fail(id, e.code(), e.what());
  } catch (const std::exception& e) {
    return fail(id, "supervisor.internal", e.what());
  }
  next_step(run);
}

void Engine::phase(const std::string& id, const std::string& role, const std::string& message) {
  if (Job* job = store_.find(id)) set_phase(*job, role, message);
}

void Engine::failed(const std::string& id, const std::string& code, const std::string& message) {
  fail(id, code, message);
}

void Engine::cancelled(const std::string& id, const std::string& message) {
  finish(id, JobState::kCancelled, message);
}

void Engine::again(const std::string& id) {
  auto it = runs_.find(id);
  if (it == runs_.end() || it->second->next_step == 0) return;
  JobRun& run = *it->second;
  start_step(run, run.steps[run.next_step - 1]);
}

void Engine::collected(const std::string& id, const std::string& /*role*/, const Json& output,
                       const contain::Evidence& evidence) {
  auto it = runs_.find(id);
  if (it == runs_.end() || it->second->next_step == 0) return;
  JobRun& run = *it->second;
  try {
    accept_output(run.steps[run.next_step - 1], output, evidence, "recorded output");
  } catch (const Error& e) {
    return fail(id, e.code(), e.what());
  }
  next_step(run);
}

Step* Engine::current_step(const std::string& id) {
  auto it = runs_.find(id);
  if (it == runs_.end() || it->second->next_step == 0) return nullptr;
  return &it->second->steps[it->second->next_step - 1];
}

bool Engine::cancel_requested(const std::string& id) {
  auto it = runs_.find(id);
  return it != runs_.end() && it->second->cancel_requested;
}

void Engine::freed() {
  schedule();
}

RunFacts Engine::run_facts(const JobRun& run) const {
  return RunFacts{run.id,          store_.job_dir(run.id), run.started_unix,
                  run.host_memory, runtime_.backend(),     key_.key_id()};
}

void Engine::complete(JobRun& run) {
  Job& job = *store_.find(run.id);
  set_phase(job, "assembling", "assembling and signing the result");
  try {
    Sealed sealed = run.pipeline->assemble(run_facts(run));
    CommitFiles files = seal(sealed, key_);
    finish(run.id, JobState::kSucceeded, sealed.message, std::nullopt, files);
  } catch (const Error& e) {
    fail(run.id, e.code(), e.what());
  } catch (const std::exception& e) {
    fail(run.id, "supervisor.internal", e.what());
  }
}

void Engine::set_phase(Job& job, const std::string& phase, const std::string& message,
                       bool durable) {
  job.phase = phase;
  JobStore::add_event(job, message);
  try {
    store_.save(job, durable);
  } catch (const Error& e) {
    // A phase is progress, not a promise: a restart re-runs the job from what the disk holds.
    ++metrics_.store_write_failures;
    spdlog::warn("cannot record phase {} of {}: {}", phase, job.id, e.what());
  }
  watchers_.publish(job);
}

void Engine::finish(const std::string& id, JobState state, const std::string& message,
                    std::optional<Json> error, const CommitFiles& files) {
  Job* job = store_.find(id);
  if (!job) return;
  job->state = state;
  job->phase = std::string(state_name(state));
  job->error = std::move(error);
  job->waiting_reason.clear();
  JobStore::add_event(*job, message);
  try {
    store_.commit(*job, files);
  } catch (const Error& e) {
    // The disk still says queued or running, so a restart runs the job again; until then the
    // job reads as failed, saying why, and nothing claims a result that was not recorded.
    ++metrics_.store_write_failures;
    spdlog::error("cannot record the end of job {}: {}", id, e.what());
    std::string why = "could not record the job's end (" + std::string(state_name(state)) +
                      ") in the state directory: " + e.what() + "; a restart runs it again";
    job->state = JobState::kFailed;
    job->phase = "failed";
    job->error = Json{{"code", e.code() == "fs.no_space" ? "store.full" : "store.unwritable"},
                      {"message", why}};
    JobStore::add_event(*job, "failed: " + why);
  }
  metrics_.durations["job"].add(common::now_unix() - job->created_unix);
  watchers_.publish(*job);
  release(id);
}

void Engine::fail(const std::string& id, const std::string& code, const std::string& message) {
  if (code == "supervisor.internal") ++metrics_.internal_errors;
  // Messages carry workers' and clients' bytes: always valid UTF-8 in the record.
  std::string text = common::printable(message, kMaxMessageBytes);
  spdlog::warn("job {} failed: {} ({})", id, text, code);
  finish(id, JobState::kFailed, "failed: " + text, Json{{"code", code}, {"message", text}});
}

}  // namespace assay::supervisor
