// The Slurm executor's state (slurm.cpp: submission and attach; slurm_poll.cpp: following a
// job and mapping its end to a result). Internal to supervisor/executors.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

#include "supervisor/executors/command.h"
#include "supervisor/executors/slurm.h"

namespace assay::executors {

namespace slurm_detail {
std::string trim(std::string s);
std::vector<std::string> split(const std::string& s, char sep);
}  // namespace slurm_detail

struct SlurmExecutor::Impl : std::enable_shared_from_this<Impl> {
  using Clock = std::chrono::steady_clock;

  struct Tracked : contain::Running {
    std::weak_ptr<Impl> impl;
    SlurmStep step;
    SlurmCallbacks cb;
    bool cancel_requested = false, concluding = false, finished = false;
    std::optional<Clock::time_point> ended_without_evidence;
    void kill() override {
      cancel_requested = true;
      if (auto i = impl.lock(); i && !step.slurm_job_id.empty() && !finished) i->scancel(step);
    }
    pid_t pid() const override { return 0; }
  };

  Impl(boost::asio::io_context& io, SlurmOptions o) : io(io), options(std::move(o)), timer(io) {}

  boost::asio::io_context& io;
  SlurmOptions options;
  boost::asio::steady_timer timer;
  bool poll_scheduled = false, poll_running = false;
  std::map<std::string, std::shared_ptr<Tracked>> active;  // by job id, until concluded

  // --- submission (slurm.cpp) ---------------------------------------------------------------

  std::vector<std::string> sbatch_argv(const contain::SpawnSpec& spec,
                                       const std::filesystem::path& dir, const std::string& token,
                                       const std::string& gres) const;
  std::string script(const std::filesystem::path& dir) const;
  std::shared_ptr<contain::Running> start(const contain::SpawnSpec& spec, SlurmCallbacks cb,
                                          const std::string& gres);

  // --- attach after a restart (slurm.cpp) -------------------------------------------------

  std::shared_ptr<contain::Running> attach(const std::filesystem::path& dir, SlurmCallbacks cb);

  // --- following (slurm_poll.cpp) ---------------------------------------------------------

  void schedule_poll(std::chrono::milliseconds after);
  void poll();
  void polled(const CommandResult& r, const std::set<std::string>& asked);

  // --- the end of a step (slurm_poll.cpp; finish and scancel: slurm.cpp) -------------------

  void conclude(const std::shared_ptr<Tracked>& t);
  // Maps the ended job's state to the step's result (`have`: its evidence was read).
  void conclude_state(const std::shared_ptr<Tracked>& t, SlurmResult result, bool have,
                      const std::filesystem::path& file);
  void finish(const std::shared_ptr<Tracked>& t, std::string code, std::string message,
              SlurmResult result = {});
  void scancel(const SlurmStep& step);
};

}  // namespace assay::executors
