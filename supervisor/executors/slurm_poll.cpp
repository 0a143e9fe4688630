// The Slurm executor's following of a submitted job (squeue, scontrol) and the mapping of its
// end to a result.
#include <chrono>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "supervisor/executors/slurm_impl.h"

namespace assay::executors {

namespace asio = boost::asio;
namespace fs = std::filesystem;
using common::Error;
using slurm_detail::split;
using slurm_detail::trim;

namespace {

constexpr std::size_t kMaxEvidenceBytes = 16 * 1024 * 1024;
const char* const kSqueueFormat = "JobID:|,State:|,Reason:|,NodeList:|,Partition:|,RestartCnt:|";

bool terminal(const std::string& state) {
  static const std::set<std::string> kTerminal = {
      "COMPLETED", "FAILED",    "CANCELLED", "TIMEOUT",  "OUT_OF_MEMORY",
      "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "VANISHED"};
  return kTerminal.contains(state);
}

std::string read_small_tail(const fs::path& p) {
  try {
    std::string s = common::read_file(p, 1 << 20);
    if (s.size() > 2000) s = s.substr(s.size() - 2000);
    return trim(s);
  } catch (const Error&) {
    return "";
  }
}

}  // namespace

void SlurmExecutor::Impl::schedule_poll(std::chrono::milliseconds after) {
  if (poll_scheduled || poll_running) return;
  poll_scheduled = true;
  timer.expires_after(after);
  timer.async_wait([w = weak_from_this()](boost::system::error_code ec) {
    auto self = w.lock();
    if (!self || ec) return;
    self->poll_scheduled = false;
    self->poll();
  });
}

void SlurmExecutor::Impl::poll() {
  // Only the jobs asked about now: one submitted while squeue runs is in the next poll.
  std::set<std::string> asked;
  std::string ids;
  for (const auto& [id, t] : active) {
    if (t->concluding) continue;
    asked.insert(id);
    ids += (ids.empty() ? "" : ",") + id;
  }
  if (ids.empty()) return;
  poll_running = true;
  run_command(io, {"squeue", "-h", "-t", "all", "-j", ids, "-O", kSqueueFormat},
              [w = weak_from_this(), asked](CommandResult r) {
                auto self = w.lock();
                if (!self) return;
                self->poll_running = false;
                self->polled(r, asked);
                if (!self->active.empty()) self->schedule_poll(self->options.poll);
              });
}

void SlurmExecutor::Impl::polled(const CommandResult& r, const std::set<std::string>& asked) {
  bool all_absent = r.status != 0 && r.err.find("Invalid job id") != std::string::npos;
  if (r.status != 0 && !all_absent) {
    // slurmctld unreachable or busy: nothing is decided, the next poll asks again.
    for (auto& [id, t] : active) {
      if (t->concluding || !asked.contains(id)) continue;
      std::string reason = "squeue failed: " + r.describe();
      if (t->step.reason != reason) {
        t->step.reason = reason;
        if (t->cb.progress) t->cb.progress(t->step);
      }
    }
    return;
  }
  std::map<std::string, std::vector<std::string>> rows;
  if (!all_absent) {
    std::istringstream lines(r.out);
    for (std::string line; std::getline(lines, line);) {
      auto f = split(line, '|');
      if (f.size() < 6) continue;
      for (auto& x : f) x = trim(x);
      rows[f[0]] = f;
    }
  }
  std::vector<std::shared_ptr<Tracked>> ended;
  for (auto& [id, t] : active) {
    if (t->concluding || !asked.contains(id)) continue;
    auto it = rows.find(id);
    if (it == rows.end()) {
      // Slurm forgot the job (MinJobAge passed, or it never existed here).
      t->step.state = "VANISHED";
      ended.push_back(t);
      continue;
    }
    const auto& f = it->second;
    SlurmStep before = t->step;
    t->step.state = f[1];
    t->step.reason = f[2];
    if (!f[3].empty() && f[3] != "(null)") t->step.node = f[3];
    t->step.partition = f[4];
    try {
      t->step.restarts = std::stoi(f[5]);
    } catch (...) {
    }
    if (!(before == t->step) && t->cb.progress) t->cb.progress(t->step);
    if (terminal(t->step.state)) ended.push_back(t);
  }
  for (auto& t : ended) {
    t->concluding = true;
    if (t->step.state == "VANISHED") {
      conclude(t);
      continue;
    }
    run_command(io, {"scontrol", "show", "job", "-o", t->step.slurm_job_id},
                [w = weak_from_this(), t](CommandResult r) {
                  auto self = w.lock();
                  if (!self) return;
                  static const std::regex kExit(R"((?:^| )ExitCode=(\d+):(\d+))");
                  std::smatch m;
                  if (r.status == 0 && std::regex_search(r.out, m, kExit))
                    t->step.exit_code = std::stoi(m[1]);
                  self->conclude(t);
                });
  }
}

void SlurmExecutor::Impl::conclude(const std::shared_ptr<Tracked>& t) {
  t->concluding = true;
  SlurmResult result;
  const std::string& st = t->step.state;
  fs::path file = t->step.step_dir / "evidence.json";
  std::string bytes;
  bool have = false;
  try {
    bytes = common::read_file(file, kMaxEvidenceBytes);
    have = true;
  } catch (const Error&) {
  }
  // A job that ended normally wrote its evidence before exiting; a shared file system may
  // show it late.
  if (!have && st == "COMPLETED") {
    auto now = Clock::now();
    if (!t->ended_without_evidence) t->ended_without_evidence = now;
    if (now - *t->ended_without_evidence < options.evidence_wait) {
      auto timer = std::make_shared<asio::steady_timer>(io, options.poll);
      timer->async_wait([w = weak_from_this(), t, timer](boost::system::error_code ec) {
        if (auto self = w.lock(); self && !ec) self->conclude(t);
      });
      return;
    }
  }
  if (have) {
    result.evidence_sha256 = common::sha256_id(bytes);
    try {
      result.evidence = contain::Evidence::from_json(
          common::parse_strict(bytes, {.max_bytes = kMaxEvidenceBytes}));
    } catch (const Error& e) {
      return finish(t, "slurm.bad_evidence",
                    "the evidence " + file.string() + " of Slurm job " + t->step.slurm_job_id +
                        " is unusable: " + e.what(),
                    std::move(result));
    }
  }
  conclude_state(t, std::move(result), have, file);
}

void SlurmExecutor::Impl::conclude_state(const std::shared_ptr<Tracked>& t, SlurmResult result,
                                         bool have, const fs::path& file) {
  const std::string& st = t->step.state;
  const std::string job = "Slurm job " + t->step.slurm_job_id +
                          (t->step.node.empty() ? "" : " on node " + t->step.node);
  bool assay_oom = result.evidence && result.evidence->oom_killed.value_or(false);
  if (assay_oom)
    result.memory_limit_hit = "assay-cgroup";
  else if (st == "OUT_OF_MEMORY")
    result.memory_limit_hit = "slurm";
  auto tail = [&] {
    auto err = read_small_tail(t->step.step_dir / "slurm.err");
    return err.empty() ? std::string() : "; its stderr: " + err;
  };
  if (st == "COMPLETED" && have) return finish(t, "", "", std::move(result));
  if (st == "COMPLETED")
    return finish(t, "slurm.evidence_missing",
                  job + " completed but wrote no evidence to " + file.string(), std::move(result));
  if (st == "TIMEOUT")
    return finish(t, "slurm.timeout", job + " was ended by Slurm at its time limit (--time)",
                  std::move(result));
  if (st == "OUT_OF_MEMORY")
    return finish(t, "slurm.out_of_memory",
                  job + " ran out of memory; the limit met first was " +
                      (assay_oom ? "assay's cgroup limit (the node evidence's oom_killed)"
                                 : "Slurm's --mem (assay's cgroup saw no OOM kill)"),
                  std::move(result));
  if (st == "NODE_FAIL")
    return finish(t, "slurm.node_failed", job + " was lost with its node", std::move(result));
  if (st == "PREEMPTED")
    return finish(t, "slurm.preempted", job + " was preempted and not re-queued",
                  std::move(result));
  if (st == "BOOT_FAIL")
    return finish(t, "slurm.boot_failed", job + ": its node failed to boot", std::move(result));
  if (st == "DEADLINE")
    return finish(t, "slurm.deadline", job + " missed its deadline", std::move(result));
  if (st == "CANCELLED")
    return finish(t, "slurm.cancelled",
                  job + (t->cancel_requested ? " was cancelled by assay (scancel)"
                                             : " was cancelled outside assay"),
                  std::move(result));
  if (st == "VANISHED") {
    if (have) {
      // Slurm forgot the job after it ended; the node wrote its evidence durably before.
      return finish(t, "", "", std::move(result));
    }
    return finish(t, "slurm.vanished",
                  "Slurm no longer knows job " + t->step.slurm_job_id +
                      " and it wrote no evidence to " + file.string() + ": re-run the step",
                  std::move(result));
  }
  // FAILED: `assayd contain` itself failed.
  if (!have && t->step.exit_code == 1)
    return finish(
        t, "slurm.contain_refused",
        job + ": `assayd contain` could not contain the worker there and ran nothing" + tail(),
        std::move(result));
  if (!have && t->step.exit_code == 2)
    return finish(t, "slurm.contain_usage",
                  job + ": `assayd contain` rejected the step's spec" + tail(), std::move(result));
  return finish(t, "slurm.failed",
                job + " ended " + st +
                    (t->step.exit_code ? " (exit " + std::to_string(*t->step.exit_code) + ")"
                                       : std::string()) +
                    tail(),
                std::move(result));
}

}  // namespace assay::executors
