#include "supervisor/executors/slurm.h"

#include "supervisor/executors/slurm_impl.h"

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
#include "supervisor/contain/spawn_spec_json.h"
#include "supervisor/executors/command.h"

namespace assay::executors {

namespace asio = boost::asio;
namespace fs = std::filesystem;
using common::Error;
using slurm_detail::split;
using slurm_detail::trim;

namespace {

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

namespace slurm_detail {

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

}  // namespace slurm_detail

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

std::vector<std::string> SlurmExecutor::Impl::sbatch_argv(const contain::SpawnSpec& spec,
                                                          const fs::path& dir,
                                                          const std::string& token,
                                                          const std::string& gres) const {
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
  if (!gres.empty() || !options.gres.empty())
    argv.push_back("--gres=" + (gres.empty() ? options.gres : gres));
  argv.insert(argv.end(), options.sbatch_args.begin(), options.sbatch_args.end());
  argv.push_back((dir / "step.sh").string());
  return argv;
}

std::string SlurmExecutor::Impl::script(const fs::path& dir) const {
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

std::shared_ptr<contain::Running> SlurmExecutor::Impl::start(const contain::SpawnSpec& spec,
                                                             SlurmCallbacks cb,
                                                             const std::string& gres) {
  fs::path dir = options.shared_dir / "slurm" / spec.name;
  std::string token = random_token();
  try {
    std::error_code ec;
    fs::remove_all(dir, ec);
    if (ec)
      common::throw_errno("slurm.step_dir", "cannot remove the earlier " + dir.string(),
                          ec.value());
    fs::create_directories(dir);
    common::atomic_write_file(dir / "spec.json", contain::spawn_spec_to_json(spec).dump(2) + "\n",
                              0644);
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
  run_command(io, sbatch_argv(spec, dir, token, gres), [w = weak_from_this(), t](CommandResult r) {
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

std::shared_ptr<contain::Running> SlurmExecutor::Impl::attach(const fs::path& dir,
                                                              SlurmCallbacks cb) {
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

void SlurmExecutor::Impl::finish(const std::shared_ptr<Tracked>& t, std::string code,
                                 std::string message, SlurmResult result) {
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

void SlurmExecutor::Impl::scancel(const SlurmStep& step) {
  run_command(io, {"scancel", step.slurm_job_id}, [id = step.slurm_job_id](CommandResult) {
    // Whether or not it took, the job's end is what the poll reports.
  });
}

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
                                                       SlurmCallbacks callbacks,
                                                       const std::string& gres) {
  return impl_->start(spec, std::move(callbacks), gres);
}

std::shared_ptr<contain::Running> SlurmExecutor::attach(const fs::path& step_dir,
                                                        SlurmCallbacks callbacks) {
  return impl_->attach(step_dir, std::move(callbacks));
}

}  // namespace assay::executors