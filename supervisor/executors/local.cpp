// The local executor (local.h) and what the executors share: a step's workspace and the reading
// of its progress.
#include "supervisor/executors/local.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "common/fs.h"
#include "common/protocol.h"
#include "common/time.h"
#include "supervisor/pipelines/admission.h"

namespace assay::supervisor {

using common::Error;
using common::Json;
namespace fs = std::filesystem;

ProgressPoll::ProgressPoll(boost::asio::io_context& io, StepHost& host, std::string id,
                           std::string role, fs::path workspace, std::function<void()> stop)
    : host_(host),
      id_(std::move(id)),
      role_(std::move(role)),
      workspace_(std::move(workspace)),
      stop_(std::move(stop)),
      timer_(io) {}

void ProgressPoll::start() {
  poll();
}

void ProgressPoll::poll() {
  Step* step = host_.current_step(id_);
  if (!step || step->role != role_) return;
  try {
    for (const std::string& message : step->progress(workspace_)) host_.phase(id_, role_, message);
    if (step->stalled) {
      if (auto why = step->stalled()) {
        host_.phase(id_, role_, *why + ": stopping the worker");
        stop_();
        return;  // its end comes through the host, as any other
      }
    }
  } catch (const std::exception& e) {
    spdlog::warn("progress of {} {}: {}", id_, role_, e.what());
  }
  timer_.expires_after(kProgressPoll);
  // The timer is this object's: destroyed with the step's end, it calls back with an error.
  timer_.async_wait([this](const boost::system::error_code& ec) {
    if (!ec) poll();
  });
}

void prepare_workspace(const Step& step, const Json& input, const fs::path& ws,
                       const StepHost& host) {
  std::error_code ec;
  fs::remove_all(ws, ec);  // a previous attempt's leftovers
  if (::mkdir(ws.c_str(), 0700) != 0)
    common::throw_errno("worker.workspace", "mkdir " + ws.string(), errno);
  common::replace_file_fast(ws / protocol::kInputFile, common::canonical(input), 0600);
  std::vector<fs::path> handed{ws, ws / protocol::kInputFile};
  if (step.move_in) {
    for (const auto& [source, name] : step.move_in()) {
      if (::rename(source.c_str(), (ws / name).c_str()) != 0)
        common::throw_errno("worker.workspace",
                            "cannot move " + source.string() + " into " + ws.string(), errno);
      handed.push_back(ws / name);
    }
  }
  host.hand_to_worker(handed);
}

LocalExecutor::LocalExecutor(boost::asio::io_context& io, contain::Runtime& runtime, StepHost& host,
                             Metrics& metrics)
    : io_(io), runtime_(runtime), host_(host), metrics_(metrics) {}

fs::path LocalExecutor::workspace(const std::string& id, const std::string& role) const {
  return host_.job_dir(id) / role;
}

void LocalExecutor::open_step_files(StepLaunch& launch, Running& running) const {
  // Whether they are still what admission saw was checked when the job began (scheduler.cpp);
  // a shard replaced between steps is the oracle's bytes_used check's to find.
  auto hand = [&](Opened& f) {
    launch.spec.pass_fds.push_back(f.fd.get());
    running.model_fds.push_back(std::move(f.fd));
  };
  // The step's own files first, so that their numbers (3, 4, ...) are known when its input is
  // built; then the model's, listed in the input.
  for (const auto& path : launch.step.open_files) {
    Opened f = open_file_as(path, launch.submitter, "request.bad_logits_file", "file");
    hand(f);
  }
  if (!launch.step.model_dir.empty()) {
    OpenedModel m = open_model_as(launch.step.model_dir, launch.submitter);
    if (launch.step.opened_model) launch.step.opened_model(m);
    Json listed = Json::array();
    for (std::size_t i = 0; i < m.files.size(); ++i) {
      listed.push_back(
          Json{{"name", m.names[i]}, {"fd", 3 + static_cast<int>(running.model_fds.size())}});
      hand(m.files[i]);
    }
    launch.input["model_fds"] = std::move(listed);
  }
}

bool LocalExecutor::start(StepLaunch& launch) {
  const std::string id = launch.job_id, role = launch.step.role;
  Running running;
  open_step_files(launch, running);
  prepare_workspace(launch.step, launch.input, launch.spec.workdir, host_);
  host_.phase(id, role, "running " + role + " worker");
  const double t0 = common::now_unix();
  running.process =
      runtime_.start(io_, launch.spec, [this, id, role, t0](contain::Evidence evidence) {
        metrics_.durations[role].add(common::now_unix() - t0);
        running_.erase(id);  // its descriptors closed, its progress no longer read
        host_.ended(id, role, std::move(evidence));
      });
  Running& kept = running_[id] = std::move(running);
  if (launch.step.progress) {
    kept.progress = std::make_unique<ProgressPoll>(io_, host_, id, role, launch.spec.workdir,
                                                   [this, id] { cancel(id); });
    kept.progress->start();
  }
  return true;
}

bool LocalExecutor::cancel(const std::string& id) {
  auto it = running_.find(id);
  if (it == running_.end() || !it->second.process) return false;
  it->second.process->kill();
  return true;
}

}  // namespace assay::supervisor
