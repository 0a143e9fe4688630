// The engine's queue: in order onto device slots, the memory preflight (a job that does not fit
// keeps its place and is retried on a timer, never in a loop, while the jobs behind it that fit
// start), refusal of what no host state could fit, cancel and recovery.
#include <stdlib.h>

#include <algorithm>

#include <spdlog/spdlog.h>
#include <boost/asio/post.hpp>

#include "common/error.h"
#include "common/time.h"
#include "supervisor/contain/memory.h"
#include "supervisor/executors/local.h"
#include "supervisor/executors/pool.h"
#include "supervisor/executors/slurm_steps.h"
#include "supervisor/jobs/engine.h"
#include "supervisor/pipelines/admission.h"
#include "supervisor/pipelines/steps.h"

namespace assay::supervisor {

using common::Error;
using common::Json;
namespace fs = std::filesystem;

namespace {

std::uint64_t add_saturating(std::uint64_t a, std::uint64_t b) {
  return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

std::string fmt_bytes(std::uint64_t b) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%llu bytes (%.1f MiB)", static_cast<unsigned long long>(b),
                static_cast<double>(b) / 1048576.0);
  return buf;
}

}  // namespace

Engine::Engine(boost::asio::io_context& io, const Config& config, JobStore& store,
               contain::Runtime& runtime, const common::SigningKey& key, Watchers& watchers,
               Metrics& metrics, std::optional<contain::WorkerIdentity> worker,
               executors::SlurmExecutor* slurm)
    : io_(io),
      config_(config),
      store_(store),
      runtime_(runtime),
      key_(key),
      watchers_(watchers),
      metrics_(metrics),
      worker_(std::move(worker)),
      retry_timer_(io) {
  // The host's executor takes every step; resident workers, where configured (not with Slurm),
  // are asked first.
  if (slurm)
    executor_ = std::make_unique<SlurmStepExecutor>(io, config, *slurm,
                                                    static_cast<StepHost&>(*this), metrics);
  else
    executor_ =
        std::make_unique<LocalExecutor>(io, runtime, static_cast<StepHost&>(*this), metrics);
  resident_ = std::make_unique<ResidentExecutor>(io, config, runtime, static_cast<StepHost&>(*this),
                                                 !slurm);
  if (slurm && config.slurm.pool.nodes > 0)
    pool_ = std::make_unique<PoolExecutor>(io, config, static_cast<StepHost&>(*this), metrics);
  // Every result names these by digest: hashed now, off the loop, so that the first job's
  // assembly finds them in the cache (the oracle alone is tens of MB).
  std::vector<DigestFile> executables{{"/proc/self/exe", true}};
  for (const fs::path& p : {config.fingerprint_worker, config.oracle_worker, config.compare_worker})
    if (!p.empty()) executables.push_back({p, true});
  boost::asio::post(digest_pool_, [executables] { warm_digests(executables); });
}

void Engine::recover() {
  // Worker cgroups left by an assayd that died: kill, measure, remove.
  for (const contain::Evidence& ev : runtime_.cleanup_orphans())
    spdlog::warn("removed an orphaned worker cgroup: {}", ev.to_json().dump());
  for (Job* job : store_.all()) {
    if (job->state == JobState::kRunning) {
      job->state = JobState::kQueued;
      job->phase = "queued";
      JobStore::add_event(*job, "re-queued: assayd restarted while attempt " +
                                    std::to_string(job->attempts) + " was running");
      recovered_.insert(job->id);
      try {
        store_.save(*job);
      } catch (const Error& e) {
        // The disk says running, which a later start re-queues the same way.
        ++metrics_.store_write_failures;
        spdlog::error("cannot record the re-queue of {}: {}", job->id, e.what());
      }
    }
    if (job->state == JobState::kQueued) queue_.push_back(job->id);
  }
  spdlog::info("recovered {} jobs, {} queued", store_.all().size(), queue_.size());
  schedule();
}

void Engine::stop() {
  stopping_ = true;
  retry_timer_.cancel();
  if (resident_) resident_->stop();
  if (pool_) pool_->stop();
  executor_->stop();
}

std::size_t Engine::residents() const {
  return resident_ ? resident_->alive() : 0;
}

void Engine::enqueue(const std::string& id) {
  queue_.push_back(id);
  boost::asio::post(io_, [this] { schedule(); });
}

bool Engine::cancel(Job& job) {
  if (is_terminal(job.state)) return false;
  if (job.state == JobState::kQueued) {
    queue_.erase(std::remove(queue_.begin(), queue_.end(), job.id), queue_.end());
    waiting_need_.erase(job.id);
    finish(job.id, JobState::kCancelled, "cancelled while queued");
    return true;
  }
  auto it = runs_.find(job.id);
  if (it == runs_.end()) return false;
  it->second->cancel_requested = true;
  JobStore::add_event(job, "cancel requested");
  try {
    store_.save(job, false);
  } catch (const Error& e) {
    spdlog::warn("cannot record the cancel request of {}: {}", job.id, e.what());
  }
  watchers_.publish(job);
  if (Executor* executor = it->second->executor) executor->cancel(job.id);
  return true;
}

void Engine::check_capacity(const JobKind& kind, const Json& document, const Json& checks,
                            const std::string& model_dir) {
  if (config_.state_dir.empty()) return;
  // The kind's own estimate, from the request as it would be stored: a scratch job directory.
  const fs::path root = config_.state_dir / "admission";
  std::error_code ec;
  fs::create_directories(root, ec);
  std::string dir = (root / "XXXXXX").string();
  if (!::mkdtemp(dir.data()))
    common::throw_errno("store.io", "mkdtemp below " + root.string(), errno);
  std::uint64_t required = 0;
  try {
    common::write_unsynced(fs::path(dir) / "request.json", common::canonical(document), 0600);
    if (!checks.is_null())
      common::write_unsynced(fs::path(dir) / kChecksFile, common::canonical(checks), 0600);
    required = kind.open(config_, dir, model_dir)->required_bytes();
  } catch (...) {
    fs::remove_all(dir, ec);
    // What the estimate cannot read, the job's start reports as it always has.
    return;
  }
  fs::remove_all(dir, ec);
  contain::MemoryView mem = contain::read_memory_view();
  const std::uint64_t need = add_saturating(required, config_.memory_reserve_bytes);
  if (need <= mem.capacity()) return;
  ++metrics_.preflight_refusals;
  throw Error("preflight.refused",
              "the job needs " + fmt_bytes(required) + " plus a reserve of " +
                  fmt_bytes(config_.memory_reserve_bytes) +
                  ", more than this host can ever give (" +
                  (mem.cgroup_limit && *mem.cgroup_limit < mem.mem_total
                       ? "the supervisor's cgroup limit, " + fmt_bytes(*mem.cgroup_limit)
                       : "its memory, MemTotal " + fmt_bytes(mem.mem_total)) +
                  "); the estimate comes from " + model_dir + "/config.json and the shards' sizes");
}

void Engine::schedule() {
  if (stopping_) return;
  // In order of submission, but a job waiting for memory holds back none behind it: each job
  // that fits now starts now. A waiting job is tried again (begin) only when what is free, with
  // every idle resident worker's memory, could hold it; that keeps a pass over a long queue a
  // comparison per job.
  std::uint64_t free_now = 0;
  bool measured = false;
  for (std::size_t at = 0;
       at < queue_.size() && static_cast<int>(runs_.size()) < config_.device_slots;) {
    const std::string id = queue_[at];
    if (auto w = waiting_need_.find(id); w != waiting_need_.end()) {
      if (!measured) {
        try {
          free_now = contain::read_memory_view().available();
        } catch (const Error&) {
          free_now = UINT64_MAX;  // begin's preflight reports it
        }
        if (resident_) free_now = add_saturating(free_now, resident_->idle_bytes());
        measured = true;
      }
      if (w->second > free_now) {
        arm_retry();  // memory may free up outside assayd too
        ++at;
        continue;
      }
    }
    queue_.erase(queue_.begin() + static_cast<std::ptrdiff_t>(at));
    if (begin(id) == Begun::kWaiting) {
      queue_.insert(queue_.begin() + static_cast<std::ptrdiff_t>(at), id);
      ++at;
      measured = false;  // a resident worker may have been stopped for it
    }
  }
}

Engine::Begun Engine::begin(const std::string& id) {
  waiting_need_.erase(id);
  Job* job = store_.find(id);
  if (!job || job->state != JobState::kQueued) return Begun::kEnded;
  std::vector<int> used;
  for (const auto& [other, run] : runs_) used.push_back(run->slot);
  auto run = std::make_unique<JobRun>();
  run->id = id;
  while (std::find(used.begin(), used.end(), run->slot) != used.end()) ++run->slot;
  JobRun& r = *(runs_[id] = std::move(run));
  try {
    const JobKind& kind = kind_for_schema(job->request_schema);
    // Before anything of the job's files is read (the pipeline reads config.json): the paths
    // are still what admission checked, and still the submitter's to read.
    verify_admitted(job->admitted, submitter_of(*job));
    r.pipeline = kind.open(config_, store_.job_dir(id), job->model_dir);
    r.recovered = recovered_.erase(id) > 0 && executor_->keeps_records();
    if (!r.recovered) {
      // A fresh start: no step of an earlier attempt may be collected or re-attached.
      std::error_code ec;
      fs::remove_all(store_.job_dir(id) / "steps", ec);
    }
    restore_parts(r);
    r.required_bytes = r.pipeline->required_bytes();
  } catch (const Error& e) {
    fail(id, e.code() == "json.invalid" ? "job.bad_request" : e.code(), e.what());
    return Begun::kEnded;
  } catch (const std::exception& e) {
    fail(id, "preflight.bad_model", std::string("cannot size the model: ") + e.what());
    return Begun::kEnded;
  }
  try {
    if (Begun b = preflight(r); b != Begun::kStarted) return b;
  } catch (const Error& e) {
    fail(id, e.code(), std::string("preflight: ") + e.what());
    return Begun::kEnded;
  }
  job->state = JobState::kRunning;
  job->attempts += 1;
  job->waiting_reason.clear();
  r.started_unix = common::now_unix();
  // Not durable: a crash leaves the job queued on disk, which a restart runs just as it would
  // re-run a running one; only the attempt count of this start is lost.
  set_phase(*job, "preflight", "started attempt " + std::to_string(job->attempts));
  try {
    r.steps = r.pipeline->plan();
  } catch (const Error& e) {
    fail(id, e.code(), e.what());
    return Begun::kEnded;
  }
  next_step(r);
  return Begun::kStarted;
}

Engine::Begun Engine::preflight(JobRun& run) {
  Job& job = *store_.find(run.id);
  contain::MemoryView mem = contain::read_memory_view();
  std::uint64_t available = mem.available();
  std::uint64_t required = run.required_bytes, reserve = config_.memory_reserve_bytes;
  const std::uint64_t need = add_saturating(required, reserve);
  run.host_memory = Json{{"available_bytes_before", available},
                         {"required_bytes", required},
                         {"reserve_bytes", reserve}};
  // Admission refuses such a job; one queued before a restart on a smaller host, or before
  // the cgroup limit was lowered, is refused here.
  if (need > mem.capacity()) {
    ++metrics_.preflight_refusals;
    fail(run.id, "preflight.refused",
         "the model needs " + fmt_bytes(required) + " plus a reserve of " + fmt_bytes(reserve) +
             ", more than this host can ever give (" + fmt_bytes(mem.capacity()) + ")");
    return Begun::kEnded;
  }
  // An idle resident worker that holds this job's model either runs its step or is replaced by
  // the step's own worker: its memory is this job's to use.
  if (resident_ && run.pipeline->may_use_resident())
    if (std::uint64_t held = resident_->held_for(job.model_dir)) {
      available += held;
      run.host_memory["resident_worker_bytes"] = held;
    }
  if (need <= available) return Begun::kStarted;
  // Idle resident workers give their memory back to a job that needs it.
  if (resident_ && resident_->release_idle("job " + job.id + " needs its memory")) {
    runs_.erase(run.id);
    waiting_need_[job.id] = need;
    arm_retry();
    return Begun::kWaiting;
  }
  // Could fit once other work ends: the job keeps its place and is retried on a timer, while
  // jobs behind it that fit go ahead. Only the start of a wait is an event; later retries
  // change nothing on disk.
  std::string reason = "needs " + fmt_bytes(required) + " + reserve " + fmt_bytes(reserve) +
                       ", available " + fmt_bytes(available);
  bool first = job.waiting_reason.empty();
  job.waiting_reason = reason;
  job.rendered.clear();
  if (first) {
    ++metrics_.preflight_waits;
    set_phase(job, "queued", "waiting for memory: " + reason);
  }
  runs_.erase(run.id);
  waiting_need_[job.id] = need;
  arm_retry();
  return Begun::kWaiting;
}

void Engine::arm_retry() {
  if (retry_armed_) return;
  retry_armed_ = true;
  retry_timer_.expires_after(std::chrono::milliseconds(config_.preflight_retry_ms));
  retry_timer_.async_wait([this](boost::system::error_code ec) {
    retry_armed_ = false;
    if (!ec) schedule();
  });
}

void Engine::release(const std::string& id) {
  // Logits the workers left in their workspaces are scratch, whatever the outcome: a result's
  // artifact has moved to the job directory itself, and a fidelity job's captures ([positions,
  // vocab] floats each) are named by digest in its receipt. Logs and evidence stay.
  std::error_code ec;
  for (const auto& ws : fs::directory_iterator(store_.job_dir(id), ec)) {
    // A symlink is a workspace elsewhere (a Slurm step's in the shared directory).
    if (!ws.is_directory(ec) || (ws.is_symlink(ec) && !executor_->linked_workspaces())) continue;
    for (const auto& file : fs::directory_iterator(ws.path(), ec))
      if (file.path().extension() == ".safetensors") fs::remove(file.path(), ec);
  }
  if (runs_.erase(id) && retry_armed_) {
    // A slot and its memory came free: the waiting head may fit now.
    retry_timer_.cancel();
    retry_armed_ = false;
  }
  boost::asio::post(io_, [this] { schedule(); });
}

}  // namespace assay::supervisor
