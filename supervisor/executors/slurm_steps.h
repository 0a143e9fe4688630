// The Slurm step executor (Config::executor "slurm"): each worker runs inside `assayd contain`
// on a compute node as a Slurm job of its own (executors/slurm.h, the sbatch client), its
// workspace in the shared directory; the node's evidence comes back hashed, with where it ran. A
// restart collects the steps that ended before it from their records and re-attaches to the one
// still in Slurm, by its job id: never run twice.
#pragma once

#include <map>
#include <memory>
#include <string>

#include <boost/asio/io_context.hpp>

#include "supervisor/config.h"
#include "supervisor/executors/executor.h"
#include "supervisor/executors/local.h"
#include "supervisor/executors/slurm.h"
#include "supervisor/metrics.h"

namespace assay::supervisor {

// Makes `ws` (in the shared directory) afresh and links STATE/jobs/ID/ROLE to it, so that
// everything after the step reads it where a local step's would be. Throws
// common::Error("worker.workspace").
void link_shared_workspace(StepHost& host, const std::string& id, const std::string& role,
                           const std::filesystem::path& ws);

class SlurmStepExecutor : public Executor {
 public:
  SlurmStepExecutor(boost::asio::io_context& io, const Config& config,
                    executors::SlurmExecutor& slurm, StepHost& host, Metrics& metrics);
  std::string name() const override { return "slurm"; }
  bool start(StepLaunch& launch) override;
  bool resume(const std::string& id, Step& step) override;
  bool cancel(const std::string& id) override;
  // SHARED/jobs/ID/ROLE, which STATE/jobs/ID/ROLE links to.
  std::filesystem::path workspace(const std::string& id, const std::string& role) const override;
  bool linked_workspaces() const override { return true; }
  // Descriptors do not cross hosts: a worker on a node reads the model by path.
  bool local_files() const override { return false; }
  // What a step that ended well leaves for resume: its output and evidence.
  bool keeps_records() const override { return true; }
  void accepted(const std::string& id, const std::string& role, const common::Json& output,
                const contain::Evidence& evidence) override;

 private:
  struct Running {
    std::shared_ptr<contain::Running> process;
    std::unique_ptr<ProgressPoll> progress;
  };
  void submit(const std::string& id, Step& step, const contain::SpawnSpec& spec, bool attach);
  void done(const std::string& id, const std::string& role, executors::SlurmResult r);

  boost::asio::io_context& io_;
  const Config& config_;
  executors::SlurmExecutor& slurm_;
  StepHost& host_;
  Metrics& metrics_;
  std::map<std::string, Running> running_;  // by job id
};

}  // namespace assay::supervisor
