// Steps as Slurm jobs (Config::executor "slurm"): each worker runs inside `assayd contain` on a
// compute node (executors/slurm.h), its workspace in the shared directory; the node's evidence
// comes back hashed, with where it ran. A restart collects the steps that ended before it from
// their records and re-attaches to the one still in Slurm, by its job id: never run twice.
#include <spdlog/spdlog.h>
#include <boost/asio/post.hpp>

#include "common/error.h"
#include "common/fs.h"
#include "common/json.h"
#include "supervisor/jobs/engine.h"

namespace assay::supervisor {

using common::Error;
using common::Json;
namespace fs = std::filesystem;

namespace {

constexpr std::size_t kMaxStepRecordBytes = 128 * 1024 * 1024;

fs::path step_record(const fs::path& job_dir, const std::string& role, const char* extension) {
  return job_dir / "steps" / (role + extension);
}

// "gpu:N" for an oracle step when the oracle runs on a GPU; else none.
std::string step_gres(const Config& config, const Step& step) {
  bool gpu = config.oracle_device.rfind("cuda", 0) == 0;
  if (!gpu || config.slurm.oracle_gpus == 0 || step.worker != config.oracle_worker) return {};
  return "gpu:" + std::to_string(config.slurm.oracle_gpus);
}

std::string describe(const executors::SlurmStep& s) {
  std::string id = s.slurm_job_id.empty() ? std::string("(no id yet)") : s.slurm_job_id;
  if (s.state == "PENDING")
    return "Slurm job " + id + " pending (" + (s.reason.empty() ? "None" : s.reason) + ")";
  if (s.state == "RUNNING") return "Slurm job " + id + " running on " + s.node;
  return "Slurm job " + id + " " + s.state;
}

}  // namespace

fs::path Engine::workspace(const std::string& id, const std::string& role) const {
  if (slurm_) return config_.slurm.shared_dir / "jobs" / id / role;
  return store_.job_dir(id) / role;
}

void Engine::keep_step_record(const std::string& id, const std::string& role, const Json& output,
                              const contain::Evidence& evidence) {
  fs::path dir = store_.job_dir(id) / "steps";
  try {
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
      common::throw_errno("fs.mkdir", "mkdir " + dir.string(), errno);
    // In the state directory, not the shared one, where the workers could write.
    common::replace_file_fast(
        step_record(store_.job_dir(id), role, ".json"),
        common::canonical(Json{{"output", output}, {"evidence", evidence.to_json()}}), 0600);
  } catch (const Error& e) {
    // Without it a restart runs the step again; nothing is lost.
    spdlog::warn("cannot keep the record of {} {}: {}", id, role, e.what());
  }
}

bool Engine::resume_step(JobRun& run, Step& step) {
  const std::string id = run.id, role = step.role;
  fs::path job_dir = store_.job_dir(id);
  std::error_code ec;
  // A harvesting step (a batch's oracle) has no record: its ended parts are jobs already.
  if (fs::path record = step_record(job_dir, role, ".json");
      !step.harvest && fs::exists(record, ec)) {
    Json doc;
    std::optional<contain::Evidence> evidence;
    try {
      doc = common::parse_strict(common::read_file(record, kMaxStepRecordBytes),
                                 {.max_bytes = kMaxStepRecordBytes, .exact_integers = false});
      evidence = contain::Evidence::from_json(doc.at("evidence"));
    } catch (const std::exception& e) {
      spdlog::warn("cannot read the record of {} {} ({}): running it again", id, role, e.what());
      return false;
    }
    set_phase(*store_.find(id), role,
              "the " + role + " step ended before the restart: collected, not run again");
    try {
      accept_output(step, doc.at("output"), *evidence, "recorded output");
    } catch (const Error& e) {
      fail(id, e.code(), e.what());
      return true;
    }
    next_step(run);
    return true;
  }
  if (fs::exists(step_record(job_dir, role, ".slurm"), ec)) {
    // The worker in Slurm was given the parts not yet recorded, which are the pending ones
    // now: the pipeline rebuilds its view of that run (its input is not written again).
    if (step.harvest) step.input();
    contain::SpawnSpec spec;
    spec.name = id + "-" + role;
    start_slurm(run, step, spec, true);
    return true;
  }
  return false;
}

void Engine::start_slurm(JobRun& run, Step& step, const contain::SpawnSpec& spec, bool attach) {
  const std::string id = run.id, role = step.role, name = spec.name;
  executors::SlurmCallbacks callbacks{[this, id, role](const executors::SlurmStep& s) {
                                        ++metrics_.slurm_submitted;
                                        if (Job* job = store_.find(id))
                                          set_phase(*job, role, describe(s) + " submitted");
                                      },
                                      [this, id, role, name](const executors::SlurmStep& s) {
                                        metrics_.slurm_steps[name] = s.state;
                                        if (Job* job = store_.find(id))
                                          set_phase(*job, role, describe(s));
                                      },
                                      [this, id, role, name](executors::SlurmResult r) {
                                        metrics_.slurm_steps.erase(name);
                                        slurm_done(id, role, std::move(r));
                                      }};
  if (step.progress) {
    run.progress_timer = std::make_unique<boost::asio::steady_timer>(io_);
    boost::asio::post(io_, [this, id, role] { poll_progress(id, role); });
  }
  if (attach) {
    set_phase(*store_.find(id), role,
              "re-attaching to the " + role + " step's Slurm job after the restart");
    run.process = slurm_->attach(slurm_->step_dir(name), std::move(callbacks));
    return;
  }
  // Recorded before sbatch runs: a restart re-attaches (by the job id, or by the token in the
  // job's name when assayd died before sbatch answered) instead of submitting again.
  fs::path dir = store_.job_dir(id) / "steps";
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    common::throw_errno("fs.mkdir", "mkdir " + dir.string(), errno);
  common::replace_file_fast(step_record(store_.job_dir(id), role, ".slurm"), name + "\n", 0600);
  set_phase(*store_.find(id), role, "submitting the " + role + " worker to Slurm");
  run.process = slurm_->start(spec, std::move(callbacks), step_gres(config_, step));
}

void Engine::slurm_done(const std::string& id, const std::string& role, executors::SlurmResult r) {
  auto it = runs_.find(id);
  if (it == runs_.end()) return;
  JobRun& run = *it->second;
  std::optional<contain::Evidence> evidence = std::move(r.evidence);
  if (evidence) evidence->executor = r.executor_json();
  if (r.ok() && evidence) return step_done(id, role, std::move(*evidence));
  run.process.reset();
  std::error_code ec;
  fs::remove(step_record(store_.job_dir(id), role, ".slurm"), ec);
  if (run.cancel_requested)
    return finish(id, JobState::kCancelled,
                  "cancelled while the " + role + " step ran in Slurm (scancel)");
  Step& step = run.steps[run.next_step - 1];
  if (step.harvest && r.error_code != "slurm.vanished") {
    // Slurm ended the worker (its time, its memory, the node): for a batch that is a worker
    // that died, whose ended states are kept and whose other states run again.
    if (!evidence) {
      evidence.emplace();
      evidence->name = run.id + "-" + role;
      evidence->mode = "none";
      evidence->executor = r.executor_json();
    }
    evidence->errors.push_back(r.error_code + ": " + r.error_message);
    return step_done(id, role, std::move(*evidence));
  }
  if (r.error_code == "slurm.vanished") {
    // Slurm forgot the job and no evidence was written: it did not run to an end. Again.
    set_phase(*store_.find(id), role,
              "Slurm job " + r.step.slurm_job_id + " vanished without evidence: submitting again");
    return start_step(run, step);
  }
  if (evidence) {
    try {
      common::replace_file_fast(store_.job_dir(id) / role / "evidence.json",
                                common::canonical(evidence->to_json()), 0600);
    } catch (const Error& e) {
      spdlog::error("cannot keep evidence of {} {}: {}", id, role, e.what());
    }
  }
  std::string message = "the " + role + " step's Slurm job " + r.step.slurm_job_id + " (" +
                        r.step.state + (r.step.node.empty() ? "" : " on " + r.step.node) +
                        ") ended without a result: " + r.error_message;
  if (!r.memory_limit_hit.empty()) message += "; memory limit hit first: " + r.memory_limit_hit;
  fail(id, r.error_code.empty() ? "slurm.failed" : r.error_code, message);
}

}  // namespace assay::supervisor
