#include "supervisor/executors/slurm.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <sstream>

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "supervisor/executors/command.h"
#include "supervisor/executors/spawn_spec_json.h"

namespace assay::executors {

namespace asio = boost::asio;
namespace fs = std::filesystem;
using common::Error;
using Clock = std::chrono::steady_clock;

namespace {

constexpr std::size_t kMaxEvidenceBytes = 16 * 1024 * 1024;
const char* const kSqueueFormat = "JobID:|,State:|,Reason:|,NodeList:|,Partition:|,RestartCnt:|";

bool terminal(const std::string& state) {
  static const std::set<std::string> kTerminal = {
      "COMPLETED", "FAILED",    "CANCELLED", "TIMEOUT",  "OUT_OF_MEMORY",
      "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "VANISHED"};
  return kTerminal.contains(state);
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string random_token() {
  std::random_device rd;
  std::ostringstream s;
  s << std::hex << rd() << rd();
  return s.str();
}

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  std::size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (true) {
    auto p = s.find(sep, start);
    out.push_back(s.substr(start, p == std::string::npos ? std::string::npos : p - start));
    if (p == std::string::npos) return out;
    start = p + 1;
  }
}

std::optional<std::string> read_small(const fs::path& p) {
  try {
    return trim(common::read_file(p, 4096));
  } catch (const Error&) {
    return std::nullopt;
  }
}

std::string job_name(const std::string& step_name, const std::string& token) {
  return "assay-" + step_name + "-" + token;
}

}  // namespace

common::Json SlurmResult::executor_json() const {
  return {
      {"kind", "slurm"},
      {"slurm_job_id", step.slurm_job_id},
      {"node", step.node.empty() ? common::Json(nullptr) : common::Json(step.node)},
      {"partition", step.partition.empty() ? common::Json(nullptr) : common::Json(step.partition)},
      {"state", step.state},
      {"restarts", step.restarts},
      {"evidence_sha256",
       evidence_sha256.empty() ? common::Json(nullptr) : common::Json(evidence_sha256)},
      {"memory_limit_hit",
       memory_limit_hit.empty() ? common::Json(nullptr) : common::Json(memory_limit_hit)}};
}

struct SlurmExecutor::Impl : std::enable_shared_from_this<Impl> {
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

  Impl(asio::io_context& io, SlurmOptions o) : io(io), options(std::move(o)), timer(io) {}

  asio::io_context& io;
  SlurmOptions options;
  asio::steady_timer timer;
  bool poll_scheduled = false, poll_running = false;
  std::map<std::string, std::shared_ptr<Tracked>> active;  // by job id, until concluded

  // --- submission -----------------------------------------------------------------------

  std::vector<std::string> sbatch_argv(const contain::SpawnSpec& spec, const fs::path& dir,
                                       const std::string& token) const {
    std::uint64_t mem =
        spec.limits.memory_max.value_or(options.default_memory_bytes) + options.memory_margin_bytes;
    std::uint64_t mem_mib = (mem + (1ULL << 20) - 1) >> 20;
    auto total = spec.limits.timeout + spec.limits.kill_grace +
                 std::chrono::duration_cast<std::chrono::milliseconds>(options.time_margin);
    auto minutes = std::max<std::int64_t>(1, (total.count() + 59999) / 60000);
    std::vector<std::string> argv = {"sbatch",
                                     "--parsable",
                                     "--job-name=" + job_name(spec.name, token),
                                     "--chdir=" + dir.string(),
                                     "--output=" + (dir / "slurm.out").string(),
                                     "--error=" + (dir / "slurm.err").string(),
                                     "--nodes=1",
                                     "--ntasks=1",
                                     "--mem=" + std::to_string(mem_mib) + "M",
                                     "--time=" + std::to_string(minutes),
                                     "--export=NONE"};
    if (!options.partition.empty()) argv.push_back("--partition=" + options.partition);
    if (!options.account.empty()) argv.push_back("--account=" + options.account);
    if (!options.qos.empty()) argv.push_back("--qos=" + options.qos);
    if (!options.gres.empty()) argv.push_back("--gres=" + options.gres);
    argv.insert(argv.end(), options.sbatch_args.begin(), options.sbatch_args.end());
    argv.push_back((dir / "step.sh").string());
    return argv;
  }

  std::string script(const fs::path& dir) const {
    std::string contain = shell_quote(options.node_assayd.string()) + " contain";
    for (const auto& a : options.contain_args) contain += " " + shell_quote(a);
    return "#!/bin/sh\n"
           "# One assay worker step, contained on this node by `assayd contain`, which refuses\n"
           "# (exit 1) rather than run it uncontained. Written by assayd's Slurm executor.\n"
           "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"
           "export PATH\n"
           "rm -f " +
           shell_quote((dir / "evidence.json").string()) +  // a re-queued run starts clean
           "\nexec " + contain + " --spec " + shell_quote((dir / "spec.json").string()) +
           " --evidence-out " + shell_quote((dir / "evidence.json").string()) + "\n";
  }

  std::shared_ptr<contain::Running> start(const contain::SpawnSpec& spec, SlurmCallbacks cb) {
    fs::path dir = options.shared_dir / "slurm" / spec.name;
    std::string token = random_token();
    try {
      std::error_code ec;
      fs::remove_all(dir, ec);
      if (ec)
        common::throw_errno("slurm.step_dir", "cannot remove the earlier " + dir.string(),
                            ec.value());
      fs::create_directories(dir);
      common::atomic_write_file(dir / "spec.json", spawn_spec_to_json(spec).dump(2) + "\n", 0644);
      common::atomic_write_file(dir / "step.sh", script(dir), 0755);
      common::atomic_write_file(dir / "token", token + "\n", 0644);
    } catch (const Error& e) {
      throw Error("slurm.step_dir",
                  "cannot write the Slurm step directory " + dir.string() + ": " + e.what());
    } catch (const fs::filesystem_error& e) {
      throw Error("slurm.step_dir",
                  "cannot write the Slurm step directory " + dir.string() + ": " + e.what());
    }
    auto t = std::make_shared<Tracked>();
    t->impl = weak_from_this();
    t->step.step_dir = dir;
    t->step.state = "SUBMITTING";
    t->cb = std::move(cb);
    run_command(io, sbatch_argv(spec, dir, token), [w = weak_from_this(), t](CommandResult r) {
      auto self = w.lock();
      if (!self) return;
      std::string id = trim(split(trim(r.out), ';')[0]);
      bool numeric = !id.empty() && std::all_of(id.begin(), id.end(), ::isdigit);
      if (r.status != 0 || !numeric) {
        self->finish(t, "slurm.submit_failed", "sbatch refused the step: " + r.describe());
        return;
      }
      try {
        common::atomic_write_file(t->step.step_dir / "slurm_job_id", id + "\n", 0644);
      } catch (const Error& e) {
        // Not durable: the job must not run unrecorded.
        t->step.slurm_job_id = id;
        self->scancel(t->step);
        self->finish(t, "slurm.step_dir", "cannot record Slurm job " + id + ": " + e.what());
        return;
      }
      t->step.slurm_job_id = id;
      t->step.state = "PENDING";
      self->active[id] = t;
      if (t->cb.submitted) t->cb.submitted(t->step);
      if (t->cancel_requested) self->scancel(t->step);
      self->schedule_poll(std::chrono::milliseconds(0));
    });
    return t;
  }

  // --- attach after a restart ---------------------------------------------------------

  std::shared_ptr<contain::Running> attach(const fs::path& dir, SlurmCallbacks cb) {
    auto t = std::make_shared<Tracked>();
    t->impl = weak_from_this();
    t->step.step_dir = dir;
    t->step.state = "ATTACHING";
    t->cb = std::move(cb);
    if (auto id = read_small(dir / "slurm_job_id")) {
      t->step.slurm_job_id = *id;
      asio::post(io, [w = weak_from_this(), t] {
        if (auto self = w.lock()) {
          self->active[t->step.slurm_job_id] = t;
          self->schedule_poll(std::chrono::milliseconds(0));
        }
      });
      return t;
    }
    auto token = read_small(dir / "token");
    if (!token) {
      asio::post(io, [w = weak_from_this(), t] {
        if (auto self = w.lock())
          self->finish(t, "slurm.vanished",
                       "step directory " + t->step.step_dir.string() +
                           " has neither a Slurm job id nor a submission token: never submitted");
      });
      return t;
    }
    // assayd died between sbatch's answer and writing the id: find the job by its name.
    std::string name = job_name(dir.filename().string(), *token);
    run_command(io, {"squeue", "-h", "-t", "all", "--name=" + name, "-O", "JobID:|"},
                [w = weak_from_this(), t, name](CommandResult r) {
                  auto self = w.lock();
                  if (!self) return;
                  std::string id = trim(split(trim(r.out), '|')[0]);
                  if (r.status == 0 && !id.empty()) {
                    try {
                      common::atomic_write_file(t->step.step_dir / "slurm_job_id", id + "\n", 0644);
                    } catch (const Error&) {
                    }
                    t->step.slurm_job_id = id;
                    self->active[id] = t;
                    self->schedule_poll(std::chrono::milliseconds(0));
                    return;
                  }
                  t->step.state = "VANISHED";
                  self->conclude(t);
                });
    return t;
  }

  // --- following --------------------------------------------------------------------------

  void schedule_poll(std::chrono::milliseconds after) {
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

  void poll() {
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

  void polled(const CommandResult& r, const std::set<std::string>& asked) {
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

  // --- the end of a step -------------------------------------------------------------------

  void conclude(const std::shared_ptr<Tracked>& t) {
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
                    job + " completed but wrote no evidence to " + file.string(),
                    std::move(result));
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
                    job + ": `assayd contain` rejected the step's spec" + tail(),
                    std::move(result));
    return finish(t, "slurm.failed",
                  job + " ended " + st +
                      (t->step.exit_code ? " (exit " + std::to_string(*t->step.exit_code) + ")"
                                         : std::string()) +
                      tail(),
                  std::move(result));
  }

  static std::string read_small_tail(const fs::path& p) {
    try {
      std::string s = common::read_file(p, 1 << 20);
      if (s.size() > 2000) s = s.substr(s.size() - 2000);
      return trim(s);
    } catch (const Error&) {
      return "";
    }
  }

  void finish(const std::shared_ptr<Tracked>& t, std::string code, std::string message,
              SlurmResult result = {}) {
    if (t->finished) return;
    t->finished = true;
    if (!t->step.slurm_job_id.empty()) active.erase(t->step.slurm_job_id);
    result.step = t->step;
    result.error_code = std::move(code);
    result.error_message = std::move(message);
    if (t->cb.done) {
      auto done = std::move(t->cb.done);
      done(std::move(result));
    }
  }

  void scancel(const SlurmStep& step) {
    run_command(io, {"scancel", step.slurm_job_id}, [id = step.slurm_job_id](CommandResult) {
      // Whether or not it took, the job's end is what the poll reports.
    });
  }
};

SlurmExecutor::SlurmExecutor(asio::io_context& io, SlurmOptions options)
    : impl_(std::make_shared<Impl>(io, std::move(options))) {
  if (impl_->options.shared_dir.empty() || !impl_->options.shared_dir.is_absolute())
    throw Error("slurm.config", "shared_dir \"" + impl_->options.shared_dir.string() +
                                    "\" must be an absolute directory visible on every node");
}

SlurmExecutor::~SlurmExecutor() {
  impl_->timer.cancel();
  impl_->active.clear();
}

fs::path SlurmExecutor::step_dir(const std::string& name) const {
  return impl_->options.shared_dir / "slurm" / name;
}

std::shared_ptr<contain::Running> SlurmExecutor::start(const contain::SpawnSpec& spec,
                                                       SlurmCallbacks callbacks) {
  return impl_->start(spec, std::move(callbacks));
}

std::shared_ptr<contain::Running> SlurmExecutor::attach(const fs::path& step_dir,
                                                        SlurmCallbacks callbacks) {
  return impl_->attach(step_dir, std::move(callbacks));
}

}  // namespace assay::executors
