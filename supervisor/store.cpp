#include "supervisor/store.h"

#include <algorithm>
#include <chrono>
#include <ctime>

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "common/error.h"
#include "common/fs.h"

namespace assay::supervisor {

using common::Json;

namespace {
constexpr std::size_t kMaxJobFileBytes = 64 * 1024 * 1024;
}

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

std::string now_rfc3339() {
  auto now = std::chrono::system_clock::now();
  auto secs = std::chrono::system_clock::to_time_t(now);
  auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[40];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  char out[48];
  std::snprintf(out, sizeof out, "%s.%03dZ", buf, static_cast<int>(ms));
  return out;
}

double now_unix() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

Json Job::to_json() const {
  Json j{{"id", id},
         {"key", key},
         {"request_sha256", request_sha256},
         {"request_schema", request_schema},
         {"request_id", request_id},
         {"model_dir", model_dir},
         {"submitter_uid", submitter_uid},
         {"state", state_name(state)},
         {"phase", phase},
         {"created_at", created_at},
         {"updated_at", updated_at},
         {"created_unix", created_unix},
         {"attempts", attempts},
         {"error", error ? *error : Json(nullptr)},
         {"waiting_reason", waiting_reason.empty() ? Json(nullptr) : Json(waiting_reason)},
         {"events", events}};
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
  job.state = state_from_name(common::require_string(j, "state", "job"));
  job.phase = common::require_string(j, "phase", "job");
  job.created_at = common::require_string(j, "created_at", "job");
  job.updated_at = common::require_string(j, "updated_at", "job");
  job.created_unix = common::require(j, "created_unix", "job").get<double>();
  job.attempts = static_cast<int>(common::require_int(j, "attempts", "job"));
  if (auto e = j.find("error"); e != j.end() && !e->is_null()) job.error = *e;
  if (auto w = j.find("waiting_reason"); w != j.end() && w->is_string()) job.waiting_reason = *w;
  job.events = common::require(j, "events", "job");
  return job;
}

Json Job::summary() const {
  Json j = to_json();
  j.erase("events");
  j.erase("key");
  j.erase("created_unix");
  j["links"] = {{"self", "/v1/jobs/" + id},
                {"events", "/v1/jobs/" + id + "/events"},
                {"result", "/v1/jobs/" + id + "/result"},
                {"attestation", "/v1/jobs/" + id + "/attestation"},
                {"artifact", "/v1/jobs/" + id + "/artifact"}};
  return j;
}

JobStore::JobStore(std::filesystem::path state_dir) : jobs_dir_(state_dir / "jobs") {
  std::filesystem::create_directories(jobs_dir_);
  ::chmod(jobs_dir_.c_str(), 0700);
  for (const auto& entry : std::filesystem::directory_iterator(jobs_dir_)) {
    if (!entry.is_directory()) continue;
    auto file = entry.path() / "job.json";
    if (!std::filesystem::exists(file)) {
      // A job directory without job.json was never acknowledged: creation writes job.json last.
      spdlog::warn("ignoring {}: no job.json (its submission was never acknowledged)",
                   entry.path().string());
      continue;
    }
    try {
      Job job = Job::from_json(common::parse_strict(common::read_file(file, kMaxJobFileBytes)));
      by_key_[job.key] = job.id;
      jobs_.emplace(job.id, std::move(job));
    } catch (const common::Error& e) {
      spdlog::error("cannot load {}: {} ({})", file.string(), e.what(), e.code());
    }
  }
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

Job& JobStore::create(Job job, const std::string& request_canonical) {
  auto dir = job_dir(job.id);
  std::filesystem::create_directories(dir);
  ::chmod(dir.c_str(), 0700);
  common::atomic_write_file(dir / "request.json", request_canonical, 0600);
  common::atomic_write_file(dir / "job.json", common::canonical(job.to_json()), 0600);
  common::fsync_directory(jobs_dir_);
  by_key_[job.key] = job.id;
  auto [it, inserted] = jobs_.insert_or_assign(job.id, std::move(job));
  return it->second;
}

void JobStore::save(Job& job, bool durable) {
  job.rendered.clear();
  auto path = job_dir(job.id) / "job.json";
  if (durable)
    common::atomic_write_file(path, common::canonical(job.to_json()), 0600);
  else
    replace_file_fast(path, common::canonical(job.to_json()), 0600);
}

void replace_file_fast(const std::filesystem::path& path, std::string_view content, mode_t mode) {
  auto tmp = path;
  tmp += ".tmp";
  {
    common::UniqueFd fd = common::open_nofollow(tmp, O_WRONLY | O_CREAT | O_TRUNC, mode);
    std::size_t off = 0;
    while (off < content.size()) {
      ssize_t n = ::write(fd.get(), content.data() + off, content.size() - off);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) common::throw_errno("fs.write", "write " + tmp.string(), errno);
      off += static_cast<std::size_t>(n);
    }
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    common::throw_errno("fs.rename", "rename " + tmp.string(), err);
  }
}

void JobStore::add_event(Job& job, const std::string& message) {
  job.rendered.clear();
  job.updated_at = now_rfc3339();
  job.events.push_back(Json{{"at", job.updated_at},
                            {"state", state_name(job.state)},
                            {"phase", job.phase},
                            {"message", message}});
}

}  // namespace assay::supervisor
