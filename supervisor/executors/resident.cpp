// The resident executor (resident.h).
#include "supervisor/executors/resident.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <string_view>

#include <spdlog/spdlog.h>
#include <boost/asio/post.hpp>

#include "common/error.h"
#include "common/fs.h"
#include "common/protocol.h"
#include "common/text.h"
#include "common/time.h"
#include "supervisor/pipelines/admission.h"
#include "supervisor/pipelines/documents.h"

namespace assay::supervisor {

using common::Error;
using common::Json;
namespace fs = std::filesystem;

namespace {

constexpr std::size_t kMaxLoadedBytes = 16u << 20;
constexpr std::size_t kMaxErrorBytes = 64u << 10;
// A resident worker's own timeout: it ends by its idle timeout long before; each job has the
// step's timeout (a timer of the engine's).
constexpr auto kResidentLifetime = std::chrono::hours(24 * 30);

std::uint64_t unix_ms() {
  return static_cast<std::uint64_t>(common::now_unix() * 1000);
}

// What a job must share with a worker to run on it.
std::string resident_key(const std::string& model_dir, const fs::path& worker, const Json& input) {
  return model_dir + "\n" + worker.string() + "\n" + common::canonical(input.at("execution"));
}

}  // namespace

namespace {

// What the engine reads of a job a resident worker runs, and the most it reads of each: a
// next-token job's files, and a batch's state files (one of each per state of its input).
// Every job's files come first; a batch's follow, each state's .json then its .safetensors.
constexpr std::array<std::pair<std::string_view, std::size_t>, 4> kEveryJobFiles = {{
    {protocol::kInputFile, 256u << 20},
    {protocol::kOutputFile, 64u << 20},
    {"logits.safetensors", 256u << 20},
    {"error.json", kMaxErrorBytes},
}};
std::vector<std::pair<std::string, std::size_t>> job_files(const Json& input) {
  std::vector<std::pair<std::string, std::size_t>> files;
  for (const auto& [name, limit] : kEveryJobFiles) files.emplace_back(name, limit);
  if (input.value("schema", Json()) == protocol::kOracleBatchInput)
    for (const Json& state : input.at("states")) {
      const std::string index = std::to_string(state.at("index").get<std::uint64_t>());
      files.emplace_back("state-" + index + ".json", 64u << 20);
      files.emplace_back("state-" + index + ".safetensors", 256u << 20);
    }
  return files;
}

// Opens `file` below `dir` (a descriptor of a directory the worker owns) without following a
// link and without blocking on a FIFO; nullopt when it does not exist, an error when it is not
// a regular file.
std::optional<Opened> open_worker_file(int dir, const std::string& shown, const std::string& file) {
  Opened f;
  f.path = shown + "/" + file;
  f.fd =
      common::UniqueFd(::openat(dir, file.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (!f.fd && errno == ENOENT) return std::nullopt;
  if (!f.fd) common::throw_errno("worker.workspace", "open " + f.path, errno);
  if (::fstat(f.fd.get(), &f.st) != 0)
    common::throw_errno("worker.workspace", "stat " + f.path, errno);
  if (!S_ISREG(f.st.st_mode)) throw Error("worker.workspace", f.path + " is not a regular file");
  return f;
}

common::UniqueFd open_job_dir(const fs::path& workspace, const std::string& name) {
  common::UniqueFd base(::open(workspace.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!base) common::throw_errno("worker.workspace", "open " + workspace.string(), errno);
  common::UniqueFd dir(
      ::openat(base.get(), name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!dir)
    common::throw_errno("worker.workspace", "open the job directory " + (workspace / name).string(),
                        errno);
  return dir;
}

// Copies the job's files from directory `name` of the worker's workspace into a fresh `ws`. The
// worker owns that directory (not the workspace's place in the state directory), so it could
// have made the directory or a file in it a link, a FIFO or a huge file: each is opened from a
// descriptor of the workspace without following a link, regular files only, each at most its
// limit. A copy, not a rename: the worker outlives the job and could still write a file it made
// (an open descriptor, a hard link) after assayd hashed it; the copies are out of its reach. A
// file it did not write is left out (the step then says what is missing). Throws common::Error
// naming what it refused.
void copy_job_files(const fs::path& workspace, const std::string& name, const fs::path& ws,
                    const std::vector<std::pair<std::string, std::size_t>>& files) {
  const std::string shown = (workspace / name).string();
  common::UniqueFd dir = open_job_dir(workspace, name);
  std::error_code ec;
  fs::remove_all(ws, ec);
  if (::mkdir(ws.c_str(), 0700) != 0)
    common::throw_errno("worker.workspace", "mkdir " + ws.string(), errno);
  for (const auto& [file, limit] : files)
    if (auto f = open_worker_file(dir.get(), shown, file))
      common::write_unsynced(ws / file, read_opened(*f, limit, "worker.workspace"), 0600);
  fs::remove_all(workspace / name, ec);
}

}  // namespace

ResidentExecutor::ResidentExecutor(boost::asio::io_context& io, const Config& config,
                                   contain::Runtime& runtime, StepHost& host, bool enabled)
    : io_(io), config_(config), runtime_(runtime), host_(host), enabled_(enabled) {
  std::error_code ec;
  fs::remove_all(root(), ec);
}

fs::path ResidentExecutor::root() const {
  return config_.state_dir / "resident";
}

fs::path ResidentExecutor::workspace(const std::string& id, const std::string& role) const {
  return host_.job_dir(id) / role;
}

bool ResidentExecutor::start(StepLaunch& launch) {
  Step& step = launch.step;
  if (config_.resident.count == 0 || !enabled_ || !step.resident_bytes) return false;
  const std::string id = launch.job_id;
  const std::string key = resident_key(step.model_dir, step.worker, launch.input);
  ResidentWorker* w = nullptr;
  for (auto& [n, r] : residents_)
    if (r->key == key && r->state != ResidentWorker::State::kStopping) w = r.get();
  // Busy with another job (device_slots > 1) or loading for one: this job loads its own.
  if (w && w->state != ResidentWorker::State::kIdle) return false;
  // The memory limit this job's own worker would get (it grows with the prompt's length).
  const std::uint64_t limit = launch.spec.limits.memory_max.value_or(0);
  std::string replaced, why;
  if (w) {
    try {
      step.resident_bytes(w->bytes_used);
    } catch (const Error& e) {
      // The job's events say only that the bytes differ: what the worker loaded may be a file
      // this job's submitter could never read (issue 36, defect 5). The figures go to assayd's
      // own log.
      why = "the job's fingerprint differs from the bytes it loaded";
      spdlog::info("resident worker {} does not hold job {}'s bytes: {}", w->id, id, e.what());
    }
    if (why.empty() && limit > w->memory_limit)
      why = "the job needs memory.max " + std::to_string(limit) + ", above its " +
            std::to_string(w->memory_limit);
    if (!why.empty()) {
      replaced = w->id;
      stop_worker(*w, "replaced: " + why);
      w = nullptr;
    }
  }
  if (w) {
    dispatch(*w, id, step.role, launch.input, launch.spec.limits.timeout);
    return true;
  }
  if (!make_room(limit, key)) return false;
  ResidentWorker* fresh = spawn(launch, key);
  fresh->job_id = id;
  fresh->role = step.role;
  jobs_[id] = fresh->number;
  host_.phase(
      id, step.role,
      "loading the model into resident worker " + fresh->id +
          (replaced.empty() ? std::string() : " (replacing " + replaced + ": " + why + ")"));
  fresh->pending = launch.input;  // runs once the worker has loaded
  fresh->pending_timeout = launch.spec.limits.timeout;
  return true;
}

ResidentWorker* ResidentExecutor::spawn(StepLaunch& launch, const std::string& key) {
  const Step& step = launch.step;
  const int number = next_++;
  auto w = std::make_unique<ResidentWorker>(io_);
  w->number = number;
  w->id = "r-" + std::to_string(number) + "-" + std::to_string(unix_ms());
  w->key = key;
  w->model_dir = step.model_dir;
  w->workspace = root() / w->id;
  w->last_used = common::now_unix();
  if (::mkdir(root().c_str(), 0700) != 0 && errno != EEXIST)
    common::throw_errno("worker.workspace", "mkdir " + root().string(), errno);
  if (::mkdir(w->workspace.c_str(), 0700) != 0)
    common::throw_errno("worker.workspace", "mkdir " + w->workspace.string(), errno);

  int pair[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) != 0)
    common::throw_errno("worker.spawn", "socketpair for resident worker " + w->id, errno);
  common::UniqueFd ours(pair[0]), theirs(pair[1]);

  // The step's own worker's spec, in the worker's workspace, for its life.
  contain::SpawnSpec spec = launch.spec;
  spec.name = "resident-" + std::to_string(number) + "-" + w->id.substr(w->id.rfind('-') + 1);
  spec.argv = {step.worker.string(), "serve", "--input", std::string(protocol::kInputFile),
               "--workdir",          "."};
  spec.workdir = w->workspace;
  for (auto& kv : spec.env)
    if (kv.rfind("HOME=", 0) == 0) kv = "HOME=" + w->workspace.string();
  spec.stdout_path = w->workspace / protocol::kStdoutFile;
  spec.stderr_path = w->workspace / protocol::kStderrFile;
  spec.limits.timeout = kResidentLifetime;
  w->memory_limit = spec.limits.memory_max.value_or(0);
  // fd 3: the control socket; 4, 5, ...: the model's files, opened as this job's submitter.
  spec.pass_fds = {theirs.get()};
  OpenedModel m = open_model_as(step.model_dir, launch.submitter);
  Json listed = Json::array();
  for (std::size_t i = 0; i < m.files.size(); ++i) {
    listed.push_back(Json{{"name", m.names[i]}, {"fd", 4 + static_cast<int>(i)}});
    spec.pass_fds.push_back(m.files[i].fd.get());
  }
  Json serve{{"schema", protocol::kOracleServeInput},
             {"model_dir", launch.input.at("model_dir")},
             {"model_fds", std::move(listed)},
             {"execution", launch.input.at("execution")},
             {"control_fd", 3}};
  common::replace_file_fast(w->workspace / protocol::kInputFile, common::canonical(serve), 0600);
  host_.hand_to_worker({w->workspace, w->workspace / protocol::kInputFile});
  w->process = runtime_.start(io_, spec, [this, number](contain::Evidence evidence) {
    exited(number, std::move(evidence));
  });
  w->control.assign(ours.release());
  spdlog::info("resident worker {} started for {} (memory.max {})", w->id, step.model_dir,
               w->memory_limit);
  ResidentWorker* out = w.get();
  residents_[number] = std::move(w);
  read(number);
  return out;
}

void ResidentExecutor::read(int number) {
  auto it = residents_.find(number);
  if (it == residents_.end()) return;
  ResidentWorker& w = *it->second;
  w.control.async_read_some(boost::asio::buffer(w.buffer),
                            [this, number](boost::system::error_code ec, std::size_t n) {
                              auto it = residents_.find(number);
                              // Closed or failed: the worker's exit (exited) says why.
                              if (ec || it == residents_.end()) return;
                              std::string text(it->second->buffer.data(), n);
                              message(number, text);
                              if (residents_.count(number)) read(number);
                            });
}

void ResidentExecutor::message(int number, const std::string& message) {
  ResidentWorker& w = *residents_.at(number);
  using State = ResidentWorker::State;
  if (w.state == State::kStopping) return;
  if (message == "loaded" && w.state == State::kLoading) return loaded(w);
  const bool done = message == "done " + w.job_dir, failed = message == "failed " + w.job_dir;
  if (w.state == State::kBusy && (done || failed)) return job_ended(w, done);
  stop_worker(w, "unexpected control message \"" + common::printable(message, 80) + "\"");
}

void ResidentExecutor::loaded(ResidentWorker& w) {
  w.loaded_at = common::now_rfc3339();
  try {
    Json loaded =
        common::parse_strict(common::read_file(w.workspace / "loaded.json", kMaxLoadedBytes),
                             {.max_bytes = kMaxLoadedBytes, .exact_integers = false});
    if (loaded.value("schema", Json()) != protocol::kOracleServeLoaded ||
        !loaded.value("bytes_used", Json()).is_object())
      throw Error("worker.oracle_output", "loaded.json is not " +
                                              std::string(protocol::kOracleServeLoaded) +
                                              " with a bytes_used object");
    w.bytes_used = loaded["bytes_used"];
    w.load_seconds = loaded.value("load_seconds", 0.0);
  } catch (const Error& e) {
    stop_worker(w, std::string("unusable loaded.json: ") + e.what());
    return;
  }
  w.state = ResidentWorker::State::kIdle;
  spdlog::info("resident worker {} loaded {} in {:.2f} s", w.id, w.model_dir, w.load_seconds);
  const std::string id = w.job_id;
  auto job = jobs_.find(id);
  const bool ours = job != jobs_.end() && job->second == w.number;
  Step* step = ours ? host_.current_step(id) : nullptr;
  if (!step || host_.cancel_requested(id)) {
    // The job it loaded for is gone (cancelled): it waits for the next one.
    if (ours) {
      jobs_.erase(job);
      if (step) host_.cancelled(id, "cancelled while the resident worker loaded");
    }
    w.job_id.clear();
    return arm_idle(w);
  }
  try {
    step->resident_bytes(w.bytes_used);
  } catch (const Error& e) {
    // The model changed between the fingerprint and the load: as a worker of its own would.
    jobs_.erase(id);
    stop_worker(w, std::string("loaded other bytes than the job's fingerprint: ") + e.what());
    return host_.failed(id, e.code(), e.what());
  }
  Json input = std::move(w.pending);
  w.pending = nullptr;
  dispatch(w, id, w.role, input, w.pending_timeout);
}

void ResidentExecutor::dispatch(ResidentWorker& w, const std::string& id, const std::string& role,
                                const Json& input, std::chrono::milliseconds timeout) {
  w.timer.cancel();
  w.job_id = id;
  w.role = role;
  w.job_dir = id + "-" + role;
  w.timed_out = false;
  w.job_files = job_files(input);
  w.progressed = 0;
  jobs_[id] = w.number;
  const fs::path dir = w.workspace / w.job_dir;
  try {
    std::error_code ec;
    fs::remove_all(dir, ec);
    if (::mkdir(dir.c_str(), 0700) != 0)
      common::throw_errno("worker.workspace", "mkdir " + dir.string(), errno);
    Json job_input = input;
    job_input.erase("model_fds");
    common::replace_file_fast(dir / protocol::kInputFile, common::canonical(job_input), 0600);
    host_.hand_to_worker({dir, dir / protocol::kInputFile});
  } catch (const Error& e) {
    jobs_.erase(id);
    w.job_id.clear();
    arm_idle(w);
    return host_.failed(
        id, e.code(),
        "cannot start the " + role + " job on resident worker " + w.id + ": " + e.what());
  }
  contain::ResidentEvidence job;
  job.worker = w.id;
  job.loaded_at = w.loaded_at;
  job.jobs_before = w.jobs;
  try {
    job.reset = w.process->reset_peaks();
  } catch (const Error& e) {
    spdlog::warn("resident worker {}: cannot reset its peaks: {}", w.id, e.what());
  }
  job.counters_at_start = w.process->counters();
  job.started_at = common::now_rfc3339();
  w.job = std::move(job);
  w.job_started = std::chrono::steady_clock::now();
  w.state = ResidentWorker::State::kBusy;
  const std::string message = "run " + w.job_dir;
  if (::send(w.control.native_handle(), message.data(), message.size(),
             MSG_NOSIGNAL | MSG_DONTWAIT) != static_cast<ssize_t>(message.size())) {
    // The worker is gone or wedged: its exit fails the job (exited).
    stop_worker(w, std::string("cannot send it the job: ") + std::strerror(errno));
    return;
  }
  const int number = w.number;
  w.job_timeout = timeout;
  w.timer.expires_after(timeout);
  w.timer.async_wait([this, number](boost::system::error_code ec) {
    auto it = residents_.find(number);
    if (ec || it == residents_.end() || it->second->state != ResidentWorker::State::kBusy) return;
    it->second->timed_out = true;
    stop_worker(*it->second, "the job's timeout passed");
  });
  host_.phase(id, role,
              "running " + role + " on resident worker " + w.id + " (job " +
                  std::to_string(w.jobs + 1) + " since it loaded the model at " + w.loaded_at +
                  ")");
  if (Step* step = host_.current_step(id); step && step->progress) poll_progress(number);
}

// A batch on a resident worker: the state files that ended since the last poll are copied
// (as at the job's end: no link followed, regular files only, bounded) into the step's
// workspace, where the step's progress reads them; a stalled batch stops the worker.
void ResidentExecutor::poll_progress(int number) {
  auto r = residents_.find(number);
  if (r == residents_.end() || r->second->state != ResidentWorker::State::kBusy) return;
  ResidentWorker& w = *r->second;
  const std::string id = w.job_id, role = w.role;
  Step* step = host_.current_step(id);
  if (!step || step->role != role) return;
  try {
    const fs::path ws = workspace(id, role);
    std::error_code ec;
    fs::create_directories(ws, ec);  // the job's end replaces it with the complete copy
    common::UniqueFd dir = open_job_dir(w.workspace, w.job_dir);
    const std::string shown = (w.workspace / w.job_dir).string();
    // A batch's state .json files as they appear (states end in order), which progress reads;
    // the job's end copies every file.
    for (std::size_t at = kEveryJobFiles.size() + 2 * w.progressed; at < w.job_files.size();
         at += 2) {
      const auto& [name, limit] = w.job_files[at];
      auto state = open_worker_file(dir.get(), shown, name);
      if (!state) break;
      common::write_unsynced(ws / name, read_opened(*state, limit, "worker.workspace"), 0600);
      ++w.progressed;
    }
    for (const std::string& message : step->progress(ws)) host_.phase(id, role, message);
    if (step->stalled)
      if (auto why = step->stalled()) {
        host_.phase(id, role, *why + ": stopping the worker");
        stop_worker(w, *why);
        return;  // its end comes through exited
      }
  } catch (const std::exception& e) {
    spdlog::warn("progress of {} {}: {}", id, role, e.what());
  }
  w.progress.expires_after(kProgressPoll);
  w.progress.async_wait([this, number](const boost::system::error_code& ec) {
    if (!ec) poll_progress(number);
  });
}

contain::Evidence ResidentExecutor::job_evidence(const ResidentWorker& w,
                                                 contain::Evidence evidence) const {
  evidence.resident = w.job;
  if (evidence.limits) evidence.limits->timeout = w.job_timeout;
  evidence.timed_out = evidence.timed_out || w.timed_out;
  evidence.wall_usec =
      static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                     std::chrono::steady_clock::now() - w.job_started)
                                     .count());
  return evidence;
}

void ResidentExecutor::job_ended(ResidentWorker& w, bool done) {
  w.timer.cancel();
  w.progress.cancel();
  contain::Evidence evidence = job_evidence(w, w.process->snapshot(w.job));
  const std::string id = w.job_id, role = w.role, name = w.job_dir;
  w.jobs += 1;
  w.state = ResidentWorker::State::kIdle;
  w.last_used = common::now_unix();
  w.job_id.clear();
  arm_idle(w);
  auto job = jobs_.find(id);
  if (job == jobs_.end() || job->second != w.number) return;
  jobs_.erase(job);
  if (!host_.current_step(id)) return;
  fs::path ws = workspace(id, role);
  try {
    copy_job_files(w.workspace, name, ws, w.job_files);
  } catch (const Error& e) {
    stop_worker(w, std::string("its job directory is unusable: ") + e.what());
    return host_.failed(
        id, "worker." + role + "_output",
        role + " (resident worker " + w.id + ") left an unusable job directory: " + e.what());
  }
  if (done) return host_.ended(id, role, std::move(evidence));
  try {
    common::replace_file_fast(ws / "evidence.json", common::canonical(evidence.to_json()), 0600);
  } catch (const Error& e) {
    spdlog::error("cannot keep evidence of {} {}: {}", id, role, e.what());
  }
  std::string code = "oracle.internal", what = "its error.json is missing or unreadable";
  try {
    Json error = common::parse_strict(common::read_file(ws / "error.json", kMaxErrorBytes));
    if (error.value("code", Json()).is_string()) code = error["code"];
    if (error.value("message", Json()).is_string()) what = error["message"];
  } catch (const Error&) {
  }
  if (host_.cancel_requested(id))
    return host_.cancelled(id, "cancelled while the " + role + " worker ran");
  host_.failed(id, "worker." + role + "_failed",
               role + " (resident worker " + w.id + ") failed: [" + common::printable(code, 100) +
                   "] " + what);
}

void ResidentExecutor::exited(int number, contain::Evidence evidence) {
  auto node = residents_.extract(number);
  if (node.empty()) return;
  std::unique_ptr<ResidentWorker> w = std::move(node.mapped());
  spdlog::info("resident worker {} ended ({}){}", w->id,
               evidence.failure_reason().empty() ? "exited" : evidence.failure_reason(),
               w->stop_reason.empty() ? "" : ": " + w->stop_reason);
  auto job = jobs_.find(w->job_id);
  // assayd stops: a job the worker was running stays running in the store, and the next start
  // queues it again, as it does any job a stop cut off.
  if (!stopping_ && !w->job_id.empty() && job != jobs_.end() && job->second == number) {
    // It ended with a job: while loading for it (its whole life was that job's), or running it
    // (the job's evidence is its share of the worker's counters). The job fails, with the
    // worker's stderr and what it finished (a batch's ended states, each checked as ever).
    jobs_.erase(job);
    if (!w->job_dir.empty()) evidence = job_evidence(*w, std::move(evidence));
    const std::string id = w->job_id, role = w->role;
    fs::path ws = workspace(id, role);
    std::error_code ec;
    // What it finished before it ended (a batch's states) is kept, copied as at a job's end.
    bool copied = false;
    if (!w->job_dir.empty()) try {
        copy_job_files(w->workspace, w->job_dir, ws, w->job_files);
        copied = true;
      } catch (const Error& e) {
        spdlog::warn("resident worker {}: its job directory is unusable: {}", w->id, e.what());
      }
    if (!copied) {
      fs::remove_all(ws, ec);
      fs::create_directories(ws, ec);
    }
    try {
      common::replace_file_fast(ws / protocol::kStderrFile,
                                tail_file(w->workspace / protocol::kStderrFile, 64u << 10), 0600);
    } catch (const Error&) {
    }
    if (host_.current_step(id)) host_.ended(id, role, std::move(evidence));
  }
  std::error_code ec;
  fs::remove_all(w->workspace, ec);
  // Another job may be waiting for the memory or the slot it held.
  boost::asio::post(io_, [this] { host_.freed(); });
}

void ResidentExecutor::stop_worker(ResidentWorker& w, const std::string& why) {
  if (w.state == ResidentWorker::State::kStopping) return;
  if (w.state != ResidentWorker::State::kBusy) w.job_dir.clear();
  spdlog::info("stopping resident worker {}: {}", w.id, why);
  w.stop_reason = why;
  w.state = ResidentWorker::State::kStopping;
  w.timer.cancel();
  w.progress.cancel();
  boost::system::error_code ignored;
  w.control.close(ignored);  // the worker exits at the end of the socket; the kill makes sure
  w.process->kill();
}

void ResidentExecutor::arm_idle(ResidentWorker& w) {
  const int number = w.number;
  w.timer.expires_after(
      std::chrono::milliseconds(static_cast<long long>(config_.resident.idle_seconds * 1000)));
  w.timer.async_wait([this, number](boost::system::error_code ec) {
    auto it = residents_.find(number);
    if (ec || it == residents_.end() || it->second->state != ResidentWorker::State::kIdle) return;
    stop_worker(*it->second, "idle for " + std::to_string(config_.resident.idle_seconds) + " s");
  });
}

bool ResidentExecutor::make_room(std::uint64_t bytes, const std::string& keep_key) {
  using State = ResidentWorker::State;
  if (config_.resident.memory_bytes && bytes > *config_.resident.memory_bytes) return false;
  for (;;) {
    std::uint64_t held = 0;
    unsigned live = 0;
    ResidentWorker* oldest = nullptr;
    for (auto& [n, r] : residents_) {
      if (r->state == State::kStopping) continue;
      ++live;
      held += r->memory_limit;
      if (r->state == State::kIdle && r->key != keep_key &&
          (!oldest || r->last_used < oldest->last_used))
        oldest = r.get();
    }
    const bool fits =
        !config_.resident.memory_bytes || held + bytes <= *config_.resident.memory_bytes;
    if (live < config_.resident.count && fits) return true;
    if (!oldest) return false;
    stop_worker(*oldest, "evicted to make room for another model's worker");
  }
}

std::uint64_t ResidentExecutor::held_for(const std::string& model_dir) {
  for (auto& [n, r] : residents_) {
    if (r->model_dir != model_dir || r->state != ResidentWorker::State::kIdle) continue;
    auto counters = r->process->counters();
    if (!counters) return 0;
    for (const char* file : {"memory.usage_in_bytes", "memory.peak"}) {
      auto it = counters->find(file);
      if (it != counters->end() && it->second.value) return *it->second.value;
    }
  }
  return 0;
}

std::uint64_t ResidentExecutor::idle_bytes() const {
  std::uint64_t bytes = 0;
  for (const auto& [n, r] : residents_)
    if (r->state == ResidentWorker::State::kIdle) bytes += r->memory_limit;
  return bytes;
}

bool ResidentExecutor::release_idle(const std::string& why) {
  bool any = false;
  for (auto& [n, w] : residents_)
    if (w->state == ResidentWorker::State::kIdle) {
      stop_worker(*w, why);
      any = true;
    }
  return any;
}

bool ResidentExecutor::cancel(const std::string& id) {
  auto job = jobs_.find(id);
  if (job == jobs_.end()) return false;
  auto r = residents_.find(job->second);
  if (r == residents_.end()) return false;
  stop_worker(*r->second, "its job " + id + " was cancelled");
  return true;
}

void ResidentExecutor::stop() {
  stopping_ = true;
  for (auto& [n, w] : residents_) stop_worker(*w, "assayd stops");
}

}  // namespace assay::supervisor
