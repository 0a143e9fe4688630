#include "supervisor/jobs/store.h"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <thread>

#include <fcntl.h>
#include <pwd.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "common/error.h"
#include "common/fs.h"
#include "common/protocol.h"
#include "common/result.h"
#include "common/time.h"
#include "common/trajectory.h"
#include "supervisor/pipelines/pipeline.h"

namespace assay::supervisor {

using common::Json;

namespace fs = std::filesystem;

namespace {
constexpr std::size_t kMaxJobFileBytes = 64 * 1024 * 1024;

// Where a file or job directory is built before its rename into place. Names starting with '.'
// are never job ids nor final file names, so a crash leaves nothing that passes for either.
fs::path staging_path(const fs::path& path) {
  return path.parent_path() / ("." + path.filename().string() + ".staged");
}

void rename_or_throw(const fs::path& from, const fs::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    common::throw_errno("fs.rename", "rename " + from.string() + " to " + to.string(), errno);
}

constexpr std::string_view kEventsFile = "events.jsonl";

std::string event_lines(const Json& events, std::size_t from) {
  std::string out;
  for (std::size_t i = from; i < events.size(); ++i) out += events[i].dump() + "\n";
  return out;
}

// The job's events from its log; a last line cut off by a crash is dropped.
void load_events(const fs::path& file, Job& job) {
  std::error_code ec;
  if (!fs::exists(file, ec)) return;
  std::string text = common::read_file(file, 1ull << 30);
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) break;
    try {
      job.events.push_back(common::parse_strict(text.substr(pos, nl - pos)));
    } catch (const common::Error& e) {
      spdlog::warn("{}: skipping an unreadable event line: {}", file.string(), e.what());
    }
    pos = nl + 1;
  }
  job.events_logged = job.events.size();
}

// Makes a new job directory with `files` in it (0600) under a staging name and renames it into
// place once the files and the directory are on disk: a crash leaves no job or a whole one, and
// the three fsyncs run at once instead of two temp-file commits and a directory fsync in a row.
void create_dir_durably(const fs::path& dir,
                        const std::vector<std::pair<std::string, std::string>>& files,
                        const std::vector<std::pair<fs::path, std::string>>& moved = {},
                        mode_t mode = 0600) {
  fs::path staging = staging_path(dir);
  std::error_code ec;
  fs::remove_all(staging, ec);  // a leftover of a submission that failed or was cut off
  try {
    if (::mkdir(staging.c_str(), 0700) != 0)
      common::throw_errno("fs.mkdir", "mkdir " + staging.string(), errno);
    std::vector<fs::path> to_sync;
    for (const auto& [source, name] : moved) {
      rename_or_throw(source, staging / name);
      to_sync.push_back(staging / name);
    }
    for (const auto& [name, content] : files) {
      common::write_unsynced(staging / name, content, name == "job.json" ? 0600 : mode);
      to_sync.push_back(staging / name);
    }
    to_sync.push_back(staging);
    common::fsync_together(to_sync);
    rename_or_throw(staging, dir);
  } catch (const std::exception&) {
    fs::remove_all(staging, ec);  // best effort; the next start removes it otherwise
    throw;
  }
}

// Whether the files a succeeded job's job.json promises are all there.
bool has_result_files(const fs::path& dir, const Job& job) {
  for (auto name : {std::string(common::kResultFileName), std::string(common::kEnvelopeFileName),
                    job.artifact_name()})
    if (std::error_code ec; !fs::exists(dir / name, ec)) return false;
  return true;
}
}  // namespace

std::string_view state_name(JobState s) {
  switch (s) {
    case JobState::kQueued:
      return "queued";
    case JobState::kRunning:
      return "running";
    case JobState::kSucceeded:
      return "succeeded";
    case JobState::kFailed:
      return "failed";
    case JobState::kCancelled:
      return "cancelled";
  }
  return "unknown";
}

JobState state_from_name(std::string_view name) {
  for (auto s : {JobState::kQueued, JobState::kRunning, JobState::kSucceeded, JobState::kFailed,
                 JobState::kCancelled})
    if (state_name(s) == name) return s;
  throw common::Error("api.bad_state",
                      "state \"" + std::string(name) +
                          "\" is not one of queued, running, succeeded, failed, cancelled");
}

bool is_terminal(JobState s) {
  return s == JobState::kSucceeded || s == JobState::kFailed || s == JobState::kCancelled;
}

Json Job::to_json() const {
  Json j{{"id", id},
         {"key", key},
         {"request_sha256", request_sha256},
         {"request_schema", request_schema},
         {"request_id", request_id},
         {"model_dir", model_dir},
         {"submitter_uid", submitter_uid},
         {"submitter_gid", submitter_gid},
         {"submitter_admin", submitter_admin},
         {"admitted", admitted},
         {"state", state_name(state)},
         {"phase", phase},
         {"created_at", created_at},
         {"updated_at", updated_at},
         {"created_unix", created_unix},
         {"attempts", attempts},
         {"error", error ? *error : Json(nullptr)},
         {"waiting_reason", waiting_reason.empty() ? Json(nullptr) : Json(waiting_reason)}};
  if (batch) j["batch"] = *batch;
  return j;
}

Job Job::from_json(const Json& j) {
  Job job;
  job.id = common::require_string(j, "id", "job");
  job.key = common::require_string(j, "key", "job");
  job.request_sha256 = common::require_string(j, "request_sha256", "job");
  job.request_schema = common::require_string(j, "request_schema", "job");
  job.request_id = common::require_string(j, "request_id", "job");
  job.model_dir = common::require_string(j, "model_dir", "job");
  job.submitter_uid = static_cast<uid_t>(common::require_int(j, "submitter_uid", "job"));
  // Records written before these fields: the submitter's own group, root alone an admin.
  if (auto g = j.find("submitter_gid"); g != j.end() && g->is_number_integer())
    job.submitter_gid = g->get<gid_t>();
  else if (struct passwd* pw = ::getpwuid(job.submitter_uid))
    job.submitter_gid = pw->pw_gid;
  job.submitter_admin = j.value("submitter_admin", job.submitter_uid == 0);
  if (auto a = j.find("admitted"); a != j.end() && a->is_array()) job.admitted = *a;
  job.state = state_from_name(common::require_string(j, "state", "job"));
  job.phase = common::require_string(j, "phase", "job");
  job.created_at = common::require_string(j, "created_at", "job");
  job.updated_at = common::require_string(j, "updated_at", "job");
  job.created_unix = common::require(j, "created_unix", "job").get<double>();
  job.attempts = static_cast<int>(common::require_int(j, "attempts", "job"));
  if (auto e = j.find("error"); e != j.end() && !e->is_null()) job.error = *e;
  if (auto w = j.find("waiting_reason"); w != j.end() && w->is_string()) job.waiting_reason = *w;
  // A record from before events.jsonl holds its events itself; they are logged on its next save.
  if (auto e = j.find("events"); e != j.end() && e->is_array()) job.events = *e;
  if (auto b = j.find("batch"); b != j.end() && b->is_object()) job.batch = *b;
  return job;
}

bool Job::is_fidelity() const {
  return request_schema == protocol::kFidelityRequest;
}

std::string Job::artifact_name() const {
  return std::string(kind_for_schema(request_schema).artifact_name);  // the kinds table decides
}

Json Job::summary() const {
  Json j = to_json();
  j.erase("key");
  j.erase("created_unix");
  j.erase("admitted");
  j.erase("submitter_gid");
  j.erase("submitter_admin");
  j["links"] = {{"self", "/v1/jobs/" + id},
                {"events", "/v1/jobs/" + id + "/events"},
                {"result", "/v1/jobs/" + id + "/result"},
                {"attestation", "/v1/jobs/" + id + "/attestation"},
                {"artifact", "/v1/jobs/" + id + "/artifact"}};
  return j;
}

JobStore::JobStore(std::filesystem::path state_dir) : jobs_dir_(state_dir / "jobs") {
  struct stat st {};
  if (::lstat(jobs_dir_.c_str(), &st) != 0) {
    std::error_code mkdir_ec;
    fs::create_directories(state_dir, mkdir_ec);
    if (mkdir_ec)
      common::throw_errno("store.unusable", "mkdir " + state_dir.string(), mkdir_ec.value());
    if (::mkdir(jobs_dir_.c_str(), 0700) != 0 && errno != EEXIST)
      common::throw_errno("store.unusable", "mkdir " + jobs_dir_.string(), errno);
  } else if (!S_ISDIR(st.st_mode)) {
    throw common::Error("store.unusable", jobs_dir_.string() + " is not a directory");
  }
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(jobs_dir_, ec)) {
    if (!entry.is_directory(ec) || entry.is_symlink(ec)) continue;
    if (entry.path().filename().string().starts_with(".")) {
      // A staging directory: its submission was never acknowledged (create() renames it first).
      spdlog::warn("removing {}: an unfinished submission", entry.path().string());
      std::error_code ec;
      fs::remove_all(entry.path(), ec);
      ec.clear();
      continue;
    }
    auto file = entry.path() / "job.json";
    if (!std::filesystem::exists(file, ec)) {
      // A job directory without job.json was never acknowledged: creation writes job.json last.
      spdlog::warn("ignoring {}: no job.json (its submission was never acknowledged)",
                   entry.path().string());
      continue;
    }
    try {
      Job job = Job::from_json(common::parse_strict(common::read_file(file, kMaxJobFileBytes)));
      if (job.events.empty()) load_events(entry.path() / kEventsFile, job);
      if (job.state == JobState::kSucceeded && !has_result_files(entry.path(), job)) {
        // Cut off inside commit(), before the success was acknowledged: run it again.
        spdlog::warn("job {} says succeeded but lacks result files; re-running it", job.id);
        job.state = JobState::kRunning;
      }
      by_key_[job.key] = job.id;
      jobs_.emplace(job.id, std::move(job));
    } catch (const common::Error& e) {
      spdlog::error("cannot load {}: {} ({})", file.string(), e.what(), e.code());
    }
  }
  if (ec) common::throw_errno("store.unusable", "read directory " + jobs_dir_.string(), ec.value());
}

Job* JobStore::find(const std::string& id) {
  auto it = jobs_.find(id);
  return it == jobs_.end() ? nullptr : &it->second;
}

Job* JobStore::find_by_key(const std::string& key) {
  auto it = by_key_.find(key);
  return it == by_key_.end() ? nullptr : find(it->second);
}

std::vector<Job*> JobStore::all() {
  std::vector<Job*> out;
  for (auto& [id, job] : jobs_) out.push_back(&job);
  std::stable_sort(out.begin(), out.end(),
                   [](Job* a, Job* b) { return a->created_unix < b->created_unix; });
  return out;
}

Job& JobStore::create(Job job, const std::string& request_canonical,
                      const std::vector<std::pair<std::string, std::string>>& extra) {
  auto dir = job_dir(job.id);
  std::vector<std::pair<std::string, std::string>> files{{"request.json", request_canonical}};
  files.insert(files.end(), extra.begin(), extra.end());
  files.emplace_back(std::string(kEventsFile), event_lines(job.events, 0));
  files.emplace_back("job.json", common::canonical(job.to_json()));
  // A leftover of a job that did not load goes whole: none of its files (an earlier admission's
  // checks.json, a result, a workspace) may pass for the new job's.
  if (std::error_code ec; fs::exists(dir, ec)) fs::remove_all(dir, ec);
  create_dir_durably(dir, files);
  job.events_logged = job.events.size();
  common::fsync_directory(jobs_dir_);
  by_key_[job.key] = job.id;
  auto [it, inserted] = jobs_.insert_or_assign(job.id, std::move(job));
  return it->second;
}

Job& JobStore::create_finished(Job job, const std::string& request_canonical,
                               const CommitFiles& files,
                               const std::vector<std::pair<fs::path, std::string>>& moved) {
  auto dir = job_dir(job.id);
  if (std::error_code ec; fs::exists(dir, ec)) fs::remove_all(dir, ec);  // a job that did not load
  std::vector<std::pair<std::string, std::string>> all{{"request.json", request_canonical}};
  all.insert(all.end(), files.write.begin(), files.write.end());
  all.emplace_back(std::string(kEventsFile), event_lines(job.events, 0));
  all.emplace_back("job.json", common::canonical(job.to_json()));
  job.events_logged = job.events.size();
  create_dir_durably(dir, all, moved, 0644);
  common::fsync_directory(jobs_dir_);
  by_key_[job.key] = job.id;
  auto [it, inserted] = jobs_.insert_or_assign(job.id, std::move(job));
  return it->second;
}

void JobStore::save(Job& job, bool durable) {
  if (durable) return commit(job, CommitFiles{});
  job.rendered.clear();
  append_events(job, false);
  common::replace_file_fast(job_dir(job.id) / "job.json", common::canonical(job.to_json()), 0600);
}

void JobStore::append_events(Job& job, bool durable) {
  if (job.events_logged >= job.events.size()) return;
  fs::path file = job_dir(job.id) / kEventsFile;
  common::UniqueFd fd = common::open_nofollow(file, O_WRONLY | O_APPEND | O_CREAT, 0600);
  std::string lines = event_lines(job.events, job.events_logged);
  for (std::size_t off = 0; off < lines.size();) {
    ssize_t n = ::write(fd.get(), lines.data() + off, lines.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      common::throw_errno(errno == ENOSPC ? "fs.no_space" : "fs.write",
                          "append to " + file.string(), errno);
    off += static_cast<std::size_t>(n);
  }
  if (durable && ::fsync(fd.get()) != 0)
    common::throw_errno("fs.fsync", "fsync " + file.string(), errno);
  job.events_logged = job.events.size();
}

// Every file is written under its staging name, all of them (and `in_place`) are fsynced at
// once, then renamed into place, job.json last, and one directory fsync makes the renames
// durable. A crash before that fsync may keep any subset of the renames, but each file that is
// there is whole, and the constructor re-runs a "succeeded" job whose result files are missing.
void JobStore::commit(Job& job, const CommitFiles& files) {
  job.rendered.clear();
  auto dir = job_dir(job.id);
  std::vector<std::pair<fs::path, fs::path>> renames;  // staged -> final
  std::vector<fs::path> to_sync = files.in_place;
  auto stage = [&](const std::string& name, std::string_view content, mode_t mode) {
    fs::path staged = staging_path(dir / name);
    common::write_unsynced(staged, content, mode);
    to_sync.push_back(staged);
    renames.emplace_back(staged, dir / name);
  };
  for (const auto& [name, content] : files.write) stage(name, content, 0644);
  // The events first, durably: job.json never names a state whose events are not on disk.
  append_events(job, true);
  stage("job.json", common::canonical(job.to_json()), 0600);
  common::fsync_together(to_sync);
  for (const auto& [from, to] : renames) rename_or_throw(from, to);
  common::fsync_directory(dir);
}

void JobStore::add_event(Job& job, const std::string& message) {
  job.rendered.clear();
  job.updated_at = common::now_rfc3339();
  job.events.push_back(Json{{"at", job.updated_at},
                            {"state", state_name(job.state)},
                            {"phase", job.phase},
                            {"message", message}});
}

}  // namespace assay::supervisor
