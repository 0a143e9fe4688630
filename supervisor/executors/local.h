// The local executor: each step's worker a fresh contained process of this host's runtime
// (contain::Runtime), reading the model through descriptors assayd opened as the submitter.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

#include "common/fs.h"
#include "supervisor/executors/executor.h"
#include "supervisor/metrics.h"

namespace assay::supervisor {

// Reads a running step's progress (Step::progress) from its workspace every kProgressPoll into
// the job's events, and stops its worker (`stop`) when the step says it stalled (Step::stalled);
// the worker's end still comes through the host. Used by the local and the Slurm executor.
class ProgressPoll {
 public:
  ProgressPoll(boost::asio::io_context& io, StepHost& host, std::string id, std::string role,
               std::filesystem::path workspace, std::function<void()> stop);
  void start();

 private:
  void poll();
  StepHost& host_;
  std::string id_, role_;
  std::filesystem::path workspace_;
  std::function<void()> stop_;
  boost::asio::steady_timer timer_;
};

// The step's workspace made afresh: its input, the files the step moves in (Step::move_in),
// each given to the worker user. Throws Error("worker.workspace").
void prepare_workspace(const Step& step, const common::Json& input, const std::filesystem::path& ws,
                       const StepHost& host);

class LocalExecutor : public Executor {
 public:
  LocalExecutor(boost::asio::io_context& io, contain::Runtime& runtime, StepHost& host,
                Metrics& metrics);
  std::string name() const override { return "local"; }
  bool start(StepLaunch& launch) override;
  bool cancel(const std::string& id) override;
  std::filesystem::path workspace(const std::string& id, const std::string& role) const override;

 private:
  struct Running {
    std::shared_ptr<contain::Running> process;
    std::vector<common::UniqueFd> model_fds;  // the step's files, opened by assayd
    std::unique_ptr<ProgressPoll> progress;
  };
  // Opens the step's own files, then every regular file at the top of its model directory, for
  // the worker (fds 3, 4, ... in its spawn) as the submitter may (admission.h: no link followed,
  // rights checked), and lists the model's in the input's "model_fds".
  void open_step_files(StepLaunch& launch, Running& running) const;

  boost::asio::io_context& io_;
  contain::Runtime& runtime_;
  StepHost& host_;
  Metrics& metrics_;
  std::map<std::string, Running> running_;  // by job id
};

}  // namespace assay::supervisor
