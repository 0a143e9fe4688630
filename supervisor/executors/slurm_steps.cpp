// The Slurm step executor (slurm_steps.h).
#include "supervisor/executors/slurm_steps.h"

#include <sys/stat.h>

#include <spdlog/spdlog.h>
#include <boost/asio/post.hpp>

#include "common/error.h"
#include "common/fs.h"
#include "common/json.h"

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

void link_shared_workspace(StepHost& host, const std::string& id, const std::string& role,
                           const fs::path& ws) {
  std::error_code ec;
  fs::remove_all(ws, ec);  // a previous attempt's leftovers
  fs::path link = host.job_dir(id) / role;
  fs::create_directories(ws.parent_path(), ec);
  ::chmod(ws.parent_path().c_str(), 0755);
  fs::remove_all(link, ec);
  fs::create_directory_symlink(ws, link, ec);
  if (ec)
    common::throw_errno("worker.workspace", "cannot link " + link.string() + " to " + ws.string(),
                        ec.value());
}

SlurmStepExecutor::SlurmStepExecutor(boost::asio::io_context& io, const Config& config,
                                     executors::SlurmExecutor& slurm, StepHost& host,
                                     Metrics& metrics)
    : io_(io), config_(config), slurm_(slurm), host_(host), metrics_(metrics) {}

fs::path SlurmStepExecutor::workspace(const std::string& id, const std::string& role) const {
  return config_.slurm.shared_dir / "jobs" / id / role;
}

void SlurmStepExecutor::accepted(const std::string& id, const std::string& role, const Json& output,
                                 const contain::Evidence& evidence) {
  fs::path dir = host_.job_dir(id) / "steps";
  try {
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
      common::throw_errno("fs.mkdir", "mkdir " + dir.string(), errno);
    // In the state directory, not the shared one, where the workers could write.
    common::replace_file_fast(
        step_record(host_.job_dir(id), role, ".json"),
        common::canonical(Json{{"output", output}, {"evidence", evidence.to_json()}}), 0600);
  } catch (const Error& e) {
    // Without it a restart runs the step again; nothing is lost.
    spdlog::warn("cannot keep the record of {} {}: {}", id, role, e.what());
  }
}

bool SlurmStepExecutor::resume(const std::string& id, Step& step) {
  const std::string role = step.role;
  fs::path job_dir = host_.job_dir(id);
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
    host_.phase(id, role,
                "the " + role + " step ended before the restart: collected, not run again");
    host_.collected(id, role, doc.at("output"), *evidence);
    return true;
  }
  if (fs::exists(step_record(job_dir, role, ".slurm"), ec)) {
    // The worker in Slurm was given the parts not yet recorded, which are the pending ones
    // now: the pipeline rebuilds its view of that run (its input is not written again).
    if (step.harvest) step.input();
    contain::SpawnSpec spec;
    spec.name = id + "-" + role;
    submit(id, step, spec, true);
    return true;
  }
  return false;
}

bool SlurmStepExecutor::start(StepLaunch& launch) {
  const std::string id = launch.job_id;
  Step& step = launch.step;
  if (!step.open_files.empty())
    throw Error("executor.unsupported",
                "the slurm executor cannot hand a node the files this step reads (" +
                    step.open_files.front() +
                    ", ...): give the candidate as a model_dir, or "
                    "run the job with executor local");
  // The workspace is in the shared directory (the nodes see it).
  const fs::path ws = launch.spec.workdir;
  link_shared_workspace(host_, id, step.role, ws);
  prepare_workspace(step, launch.input, ws, host_);
  // The GPUs Slurm allocates to the step are named on the node, in its environment.
  launch.spec.node_env = {"CUDA_VISIBLE_DEVICES"};
  submit(id, step, launch.spec, false);
  return true;
}

void SlurmStepExecutor::submit(const std::string& id, Step& step, const contain::SpawnSpec& spec,
                               bool attach) {
  const std::string role = step.role, name = spec.name;
  executors::SlurmCallbacks callbacks{[this, id, role](const executors::SlurmStep& s) {
                                        ++metrics_.slurm_submitted;
                                        host_.phase(id, role, describe(s) + " submitted");
                                      },
                                      [this, id, role, name](const executors::SlurmStep& s) {
                                        metrics_.slurm_steps[name] = s.state;
                                        host_.phase(id, role, describe(s));
                                      },
                                      [this, id, role, name](executors::SlurmResult r) {
                                        metrics_.slurm_steps.erase(name);
                                        done(id, role, std::move(r));
                                      }};
  // Kept only once the step is in Slurm: a submission that throws leaves nothing behind.
  Running running;
  if (attach) {
    host_.phase(id, role, "re-attaching to the " + role + " step's Slurm job after the restart");
    running.process = slurm_.attach(slurm_.step_dir(name), std::move(callbacks));
  } else {
    // Recorded before sbatch runs: a restart re-attaches (by the job id, or by the token in the
    // job's name when assayd died before sbatch answered) instead of submitting again.
    fs::path dir = host_.job_dir(id) / "steps";
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
      common::throw_errno("fs.mkdir", "mkdir " + dir.string(), errno);
    common::replace_file_fast(step_record(host_.job_dir(id), role, ".slurm"), name + "\n", 0600);
    host_.phase(id, role, "submitting the " + role + " worker to Slurm");
    running.process = slurm_.start(spec, std::move(callbacks), step_gres(config_, step));
  }
  if (step.progress) {
    running.progress = std::make_unique<ProgressPoll>(
        io_, host_, id, role, host_.job_dir(id) / role, [this, id] { cancel(id); });
    boost::asio::post(io_, [this, id] {
      auto it = running_.find(id);
      if (it != running_.end() && it->second.progress) it->second.progress->start();
    });
  }
  running_[id] = std::move(running);
}

bool SlurmStepExecutor::cancel(const std::string& id) {
  auto it = running_.find(id);
  if (it == running_.end() || !it->second.process) return false;
  it->second.process->kill();
  return true;
}

void SlurmStepExecutor::done(const std::string& id, const std::string& role,
                             executors::SlurmResult r) {
  running_.erase(id);
  Step* step = host_.current_step(id);
  if (!step) return;
  std::optional<contain::Evidence> evidence = std::move(r.evidence);
  if (evidence) evidence->executor = r.executor_json();
  if (r.ok() && evidence) return host_.ended(id, role, std::move(*evidence));
  std::error_code ec;
  fs::remove(step_record(host_.job_dir(id), role, ".slurm"), ec);
  if (host_.cancel_requested(id))
    return host_.cancelled(id, "cancelled while the " + role + " step ran in Slurm (scancel)");
  if (step->harvest && r.error_code != "slurm.vanished") {
    // Slurm ended the worker (its time, its memory, the node): for a batch that is a worker
    // that died, whose ended states are kept and whose other states run again.
    if (!evidence) {
      evidence.emplace();
      evidence->name = id + "-" + role;
      evidence->mode = "none";
      evidence->executor = r.executor_json();
    }
    evidence->errors.push_back(r.error_code + ": " + r.error_message);
    return host_.ended(id, role, std::move(*evidence));
  }
  if (r.error_code == "slurm.vanished") {
    // Slurm forgot the job and no evidence was written: it did not run to an end. Again.
    host_.phase(
        id, role,
        "Slurm job " + r.step.slurm_job_id + " vanished without evidence: submitting again");
    return host_.again(id);
  }
  if (evidence) {
    try {
      common::replace_file_fast(host_.job_dir(id) / role / "evidence.json",
                                common::canonical(evidence->to_json()), 0600);
    } catch (const Error& e) {
      spdlog::error("cannot keep evidence of {} {}: {}", id, role, e.what());
    }
  }
  std::string message = "the " + role + " step's Slurm job " + r.step.slurm_job_id + " (" +
                        r.step.state + (r.step.node.empty() ? "" : " on " + r.step.node) +
                        ") ended without a result: " + r.error_message;
  if (!r.memory_limit_hit.empty()) message += "; memory limit hit first: " + r.memory_limit_hit;
  host_.failed(id, r.error_code.empty() ? "slurm.failed" : r.error_code, message);
}

}  // namespace assay::supervisor
