#include "supervisor/service.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <thread>

#include <grp.h>
#include <pwd.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>
#include <boost/asio/post.hpp>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "common/result.h"
#include "supervisor/evidence.h"

#ifndef ASSAY_VERSION
#define ASSAY_VERSION "0.0.0"
#endif

namespace assay::supervisor {

using common::Error;
using common::Json;
namespace fs = std::filesystem;

namespace {

constexpr std::size_t kMaxWorkerOutputBytes = 64 * 1024 * 1024;

ApiResponse json_response(unsigned status, const Json& j) {
  return ApiResponse{status, "application/json", j.dump() + "\n", {}};
}

// Splits "a/b/c?x=y" into path segments and the query string.
struct Target {
  std::vector<std::string> segments;
  std::string query;
};

Target split_target(const std::string& target) {
  Target t;
  auto q = target.find('?');
  std::string path = target.substr(0, q);
  if (q != std::string::npos) t.query = target.substr(q + 1);
  std::stringstream ss(path);
  std::string seg;
  while (std::getline(ss, seg, '/'))
    if (!seg.empty()) t.segments.push_back(seg);
  return t;
}

std::string url_decode(const std::string& s) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && std::isxdigit(static_cast<unsigned char>(s[i + 1])) &&
        std::isxdigit(static_cast<unsigned char>(s[i + 2]))) {
      out += static_cast<char>(std::stoi(s.substr(i + 1, 2), nullptr, 16));
      i += 2;
    } else if (s[i] == '+') {
      out += ' ';
    } else {
      out += s[i];
    }
  }
  return out;
}

std::map<std::string, std::string> parse_query(const std::string& q) {
  std::map<std::string, std::string> out;
  std::stringstream ss(q);
  std::string kv;
  while (std::getline(ss, kv, '&')) {
    if (kv.empty()) continue;
    auto eq = kv.find('=');
    std::string k = url_decode(kv.substr(0, eq));
    std::string v = eq == std::string::npos ? "" : url_decode(kv.substr(eq + 1));
    if (!out.emplace(k, v).second)
      throw Error("api.bad_query", "query parameter \"" + k + "\" appears twice");
  }
  return out;
}

bool valid_job_id(const std::string& id) {
  if (id.size() != 26 || id.rfind("j-", 0) != 0) return false;
  return std::all_of(id.begin() + 2, id.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

std::uint64_t read_uint_file(const fs::path& p, bool& ok) {
  std::ifstream in(p);
  std::string s;
  ok = false;
  if (!(in >> s) || s == "max") return 0;
  try {
    ok = true;
    return std::stoull(s);
  } catch (const std::exception&) {
    ok = false;
    return 0;
  }
}

std::string fmt_bytes(std::uint64_t b) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%llu bytes (%.1f MiB)", static_cast<unsigned long long>(b),
                b / 1048576.0);
  return buf;
}

// The host signing key, created (0600, in a 0700 directory) on first start.
common::SigningKey load_host_key(const fs::path& dir) {
  fs::create_directories(dir);
  ::chmod(dir.c_str(), 0700);
  return common::SigningKey::load_or_create(dir / "host.key");
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

ApiResponse error_response(unsigned status, const std::string& code, const std::string& message) {
  return json_response(status, Json{{"error", {{"code", code}, {"message", message}}}});
}

// ---------------------------------------------------------------------------------------------
// Memory preflight.

std::uint64_t MemoryView::available() const {
  std::uint64_t a = mem_available;
  if (cgroup_limit) {
    std::uint64_t used = cgroup_usage.value_or(0);
    std::uint64_t room = *cgroup_limit > used ? *cgroup_limit - used : 0;
    a = std::min(a, room);
  }
  return a;
}

MemoryView read_memory_view() {
  MemoryView v;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::uint64_t value = 0;
  std::string unit;
  while (meminfo >> key >> value) {
    std::getline(meminfo, unit);
    if (key == "MemAvailable:") v.mem_available = value * 1024;
  }
  // The supervisor's own cgroup: v2 memory.max/current, or v1 limit_in_bytes/usage_in_bytes.
  std::ifstream cg("/proc/self/cgroup");
  std::string line;
  while (std::getline(cg, line)) {
    auto a = line.find(':');
    auto b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    std::string controllers = line.substr(a + 1, b - a - 1);
    std::string path = line.substr(b + 1);
    bool ok = false;
    if (controllers.empty()) {
      fs::path dir = fs::path("/sys/fs/cgroup") / fs::path(path).relative_path();
      auto limit = read_uint_file(dir / "memory.max", ok);
      if (ok) {
        v.cgroup_limit = limit;
        auto usage = read_uint_file(dir / "memory.current", ok);
        if (ok) v.cgroup_usage = usage;
      }
    } else if (("," + controllers + ",").find(",memory,") != std::string::npos) {
      fs::path dir = fs::path("/sys/fs/cgroup/memory") / fs::path(path).relative_path();
      auto limit = read_uint_file(dir / "memory.limit_in_bytes", ok);
      // v1 reports "no limit" as a huge page-aligned number.
      if (ok && limit < (1ull << 60)) {
        v.cgroup_limit = limit;
        auto usage = read_uint_file(dir / "memory.usage_in_bytes", ok);
        if (ok) v.cgroup_usage = usage;
      }
    }
  }
  return v;
}

std::uint64_t estimate_required_bytes(const fs::path& model_dir) {
  std::uint64_t shard_bytes = 0;
  for (const auto& e : fs::directory_iterator(model_dir))
    if (e.is_regular_file() && e.path().extension() == ".safetensors") shard_bytes += e.file_size();
  // Weights are mapped in their stored dtype and, for bf16 and float32 checkpoints, executed in it
  // (execution_dtype): no copy. Without a readable config.json the dtype is unknown: assume half
  // the bytes get converted.
  double factor = 1.0;
  try {
    common::parse_strict(common::read_file(model_dir / "config.json", 4 << 20));
  } catch (const Error&) {
    factor = 1.5;
  }
  // Activations, the logits row and the runtime itself: a quarter of the weights + 256 MiB.
  return static_cast<std::uint64_t>(shard_bytes * factor) + shard_bytes / 4 + (256ull << 20);
}

// ---------------------------------------------------------------------------------------------

Service::Service(boost::asio::io_context& io, Config config)
    : io_(io),
      config_(std::move(config)),
      store_(config_.state_dir),
      runtime_(contain::Runtime::create(config_.containment)),
      key_(load_host_key(config_.state_dir / "keys")),
      retry_timer_(io) {
  common::atomic_write_file(config_.state_dir / "keys" / "host.pub", key_.public_key_pem(), 0644);
  if (!config_.worker_user.empty() && ::geteuid() == 0) {
    struct passwd* pw = ::getpwnam(config_.worker_user.c_str());
    if (!pw)
      throw Error("config.invalid", "worker_user \"" + config_.worker_user + "\" does not exist");
    worker_uid_ = pw->pw_uid;
    worker_gid_ = pw->pw_gid;
  }
  if (!config_.admin_group.empty()) {
    struct group* gr = ::getgrnam(config_.admin_group.c_str());
    if (!gr)
      throw Error("config.invalid", "admin_group \"" + config_.admin_group + "\" does not exist");
    admin_gid_ = gr->gr_gid;
  }
  started_unix_ = now_unix();
}

Service::~Service() = default;

void Service::start() {
  // Worker cgroups left by an assayd that died: kill, measure, remove.
  for (const Json& ev : runtime_->cleanup_orphans())
    spdlog::warn("removed an orphaned worker cgroup: {}", ev.dump());
  for (Job* job : store_.all()) {
    if (job->state == JobState::kRunning) {
      job->state = JobState::kQueued;
      job->phase = "queued";
      JobStore::add_event(*job, "re-queued: assayd restarted while attempt " +
                                    std::to_string(job->attempts) + " was running");
      store_.save(*job);
    }
    if (job->state == JobState::kQueued) queue_.push_back(job->id);
  }
  spdlog::info("recovered {} jobs, {} queued", store_.all().size(), queue_.size());
  schedule();
}

void Service::stop() {
  stopping_ = true;
  retry_timer_.cancel();
}

// ---------------------------------------------------------------------------------------------
// API.

ApiResponse Service::handle(const std::string& method, const std::string& target,
                            const std::string& body, const Peer& peer) {
  try {
    Target t = split_target(target);
    const auto& s = t.segments;
    if (s.size() == 1 && s[0] == "metrics" && method == "GET") return metrics();
    if (s.empty() || s[0] != "v1")
      return error_response(404, "api.not_found", "no route for " + method + " " + target);
    if (s.size() == 2 && s[1] == "health" && method == "GET")
      return json_response(200, Json{{"status", "ok"},
                                     {"queue_depth", queue_.size()},
                                     {"running", running_slots_.size()}});
    if (s.size() == 2 && s[1] == "info" && method == "GET") return info();
    if (s.size() == 2 && s[1] == "jobs") {
      if (method == "POST") return submit(t.query, body, peer);
      if (method == "GET") return list(t.query, peer);
      return error_response(405, "api.method_not_allowed", method + " is not allowed on /v1/jobs");
    }
    if (s.size() >= 3 && s[1] == "jobs") {
      const std::string& id = s[2];
      std::optional<ApiResponse> refusal;
      Job* job = visible_job(id, peer, refusal);
      if (!job) return *refusal;
      fs::path dir = store_.job_dir(id);
      if (s.size() == 3 && method == "GET") {
        if (job->rendered.empty()) {
          Json j = job->summary();
          j["events"] = job->events;
          job->rendered = j.dump() + "\n";
        }
        return ApiResponse{200, "application/json", job->rendered, {}};
      }
      if (s.size() == 3 && method == "DELETE") return cancel(*job);
      if (s.size() == 4 && method == "GET") {
        const std::string& what = s[3];
        if (what != "result" && what != "attestation" && what != "artifact")
          return error_response(404, "api.not_found", "no route for " + method + " " + target);
        if (job->state != JobState::kSucceeded)
          return error_response(409, "api.not_ready",
                                "job " + id + " is " + std::string(state_name(job->state)) +
                                    "; its " + what + " exists once it succeeded");
        ApiResponse r;
        if (what == "result") {
          r.body = common::read_file(dir / common::kResultFileName, 64 << 20);
        } else if (what == "attestation") {
          r.body = common::read_file(dir / common::kEnvelopeFileName, 64 << 20);
        } else {
          r.content_type = "application/octet-stream";
          r.file = dir / job->artifact_name();
        }
        return r;
      }
      return error_response(405, "api.method_not_allowed",
                            method + " is not allowed on " + target.substr(0, 200));
    }
    return error_response(404, "api.not_found",
                          "no route for " + method + " " + target.substr(0, 200));
  } catch (const Error& e) {
    return error_response(400, e.code(), e.what());
  }
}

std::string Service::resolve_model_dir(const common::NextTokenRequest& request,
                                       const std::string& query_model) const {
  std::string dir = !query_model.empty() ? query_model : request.model_dir.value_or("");
  if (dir.empty())
    throw Error("request.no_model_dir",
                "no model directory: the request has no model_dir (Kiln requests never do); "
                "pass ?model_dir=/abs/dir");
  return check_model_dir(dir);
}

std::string Service::check_model_dir(std::string dir) const {
  if (dir.empty() || dir.front() != '/')
    throw Error("request.bad_model", "model directory \"" + dir + "\" is not absolute");
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0)
    throw Error("request.bad_model", "model directory \"" + dir + "\" does not exist");
  if (S_ISLNK(st.st_mode))
    throw Error("request.bad_model", "model directory \"" + dir + "\" is a symlink");
  if (!S_ISDIR(st.st_mode))
    throw Error("request.bad_model", "model directory \"" + dir + "\" is not a directory");
  std::error_code ec;
  auto real = fs::canonical(dir, ec);
  if (ec || real.string() != fs::path(dir).lexically_normal().string())
    throw Error("request.bad_model", "model directory \"" + dir +
                                         "\" has a symlink or .. in its path (resolves to \"" +
                                         real.string() + "\")");
  return dir;
}

ApiResponse Service::submit(const std::string& query, const std::string& body, const Peer& peer) {
  Job job;
  Json document;
  try {
    auto params = parse_query(query);
    document = common::parse_strict(body, {.max_bytes = common::kMaxRequestBytes});
    if (document.is_object() && document.value("schema", Json()) == protocol::kFidelityRequest) {
      if (!params.empty())
        throw Error("api.bad_query", "a fidelity request names its model directories itself; "
                                     "query parameter \"" + params.begin()->first +
                                         "\" is not allowed");
      job = accept_fidelity(document, peer);
    } else {
      std::string query_model;
      for (const auto& [k, v] : params) {
        if (k != "model_dir" && k != "model")
          throw Error("api.bad_query", "unknown query parameter \"" + k + "\" (only model_dir=)");
        query_model = v;
      }
      auto request = common::validate_request(document);
      std::string model_dir = resolve_model_dir(request, query_model);
      request.check_vocab(read_vocab_size(model_dir));
      job.key = common::sha256_canonical_id(
          Json{{"request_sha256", request.request_sha256}, {"model_dir", model_dir}});
      job.request_sha256 = request.request_sha256;
      job.request_schema = request.schema;
      job.request_id = request.id;
      job.model_dir = model_dir;
    }
  } catch (const Error& e) {
    ++rejected_;
    return error_response(e.code() == "json.invalid" ? 400 : 422, e.code(), e.what());
  }
  return enqueue(std::move(job), document, peer);
}

ApiResponse Service::enqueue(Job job, const Json& document, const Peer& peer) {
  if (Job* existing = store_.find_by_key(job.key)) {
    if (!peer.admin && existing->submitter_uid != peer.uid)
      return error_response(
          409, "api.duplicate",
          "an identical request was submitted by another user as " + existing->id);
    ++duplicates_;
    Json j = existing->summary();
    j["duplicate"] = true;
    return json_response(200, j);
  }
  if (queue_.size() >= config_.max_queue) {
    ++queue_full_;
    return error_response(
        429, "api.queue_full",
        "the queue holds " + std::to_string(queue_.size()) + " jobs, its limit (max_queue)");
  }
  job.id = "j-" + job.key.substr(7, 24);
  job.submitter_uid = peer.uid;
  job.created_at = now_rfc3339();
  job.created_unix = now_unix();
  JobStore::add_event(job, "accepted");
  try {
    Job& stored = store_.create(std::move(job), common::canonical(document));
    ++submissions_;
    queue_.push_back(stored.id);
    Json j = stored.summary();
    j["duplicate"] = false;
    auto resp = json_response(201, j);
    boost::asio::post(io_, [this] { schedule(); });
    return resp;
  } catch (const Error& e) {
    return error_response(500, e.code(), std::string("could not store the job: ") + e.what());
  }
}

ApiResponse Service::list(const std::string& query, const Peer& peer) {
  auto params = parse_query(query);
  std::optional<JobState> filter;
  for (const auto& [k, v] : params) {
    if (k == "state")
      filter = state_from_name(v);
    else
      throw Error("api.bad_query", "unknown query parameter \"" + k + "\" (only state=)");
  }
  Json jobs = Json::array();
  for (Job* job : store_.all()) {
    if (!peer.admin && job->submitter_uid != peer.uid) continue;
    if (filter && job->state != *filter) continue;
    jobs.push_back(job->summary());
  }
  return json_response(200, Json{{"jobs", jobs}});
}

ApiResponse Service::info() const {
  return json_response(
      200,
      Json{{"version", ASSAY_VERSION},
           {"containment", {{"backend", runtime_->backend()}, {"runtime", runtime_->describe()}}},
           {"key_id", key_.key_id()},
           {"public_key_pem", key_.public_key_pem()},
           {"workers",
            {{"fingerprint", config_.fingerprint_worker.string()},
             {"oracle", config_.oracle_worker.string()}}},
           {"limits",
            {{"max_body_bytes", config_.max_body_bytes},
             {"max_header_bytes", config_.max_header_bytes},
             {"max_queue", config_.max_queue},
             {"max_connections", config_.max_connections},
             {"read_timeout_ms", config_.read_timeout_ms},
             {"idle_timeout_ms", config_.idle_timeout_ms},
             {"device_slots", config_.device_slots},
             {"worker_timeout_seconds", config_.worker_timeout_seconds},
             {"memory_reserve_bytes", config_.memory_reserve_bytes}}}});
}

ApiResponse Service::metrics() const {
  std::ostringstream o;
  o << "# HELP assay_build_info Build information.\n# TYPE assay_build_info gauge\n"
    << "assay_build_info{version=\"" << ASSAY_VERSION << "\",backend=\"" << runtime_->backend()
    << "\"} 1\n";
  std::map<JobState, int> counts;
  for (Job* job : const_cast<JobStore&>(store_).all()) counts[job->state]++;
  o << "# HELP assay_jobs Jobs by state.\n# TYPE assay_jobs gauge\n";
  for (auto s : {JobState::kQueued, JobState::kRunning, JobState::kSucceeded, JobState::kFailed,
                 JobState::kCancelled})
    o << "assay_jobs{state=\"" << state_name(s) << "\"} " << counts[s] << "\n";
  o << "# HELP assay_queue_depth Jobs waiting for a device slot.\n# TYPE assay_queue_depth gauge\n"
    << "assay_queue_depth " << queue_.size() << "\n";
  auto counter = [&](const char* name, const char* help, std::uint64_t v) {
    o << "# HELP " << name << " " << help << "\n# TYPE " << name << " counter\n"
      << name << " " << v << "\n";
  };
  counter("assay_submissions_total", "Jobs accepted.", submissions_);
  counter("assay_duplicate_submissions_total", "Submissions answered with an existing job.",
          duplicates_);
  counter("assay_rejected_submissions_total", "Submissions refused as invalid.", rejected_);
  counter("assay_queue_full_total", "Submissions refused because the queue was full.", queue_full_);
  counter("assay_preflight_refusals_total", "Jobs failed by the memory preflight.",
          preflight_refusals_);
  counter("assay_preflight_waits_total", "Times the preflight kept a job queued.",
          preflight_waits_);
  counter("assay_oom_kills_total", "Workers killed by the OOM killer.", oom_kills_);
  counter("assay_timeouts_total", "Workers killed at their timeout.", timeouts_);
  counter("assay_connections_refused_total", "Connections refused at max_connections.",
          connections_refused_);
  o << "# HELP assay_duration_seconds Job and phase durations.\n# TYPE assay_duration_seconds "
       "summary\n";
  for (const auto& [phase, values] : durations_) {
    double sum = 0;
    for (double v : values) sum += v;
    o << "assay_duration_seconds{phase=\"" << phase << "\",quantile=\"0.5\"} " << median(values)
      << "\n"
      << "assay_duration_seconds_sum{phase=\"" << phase << "\"} " << sum << "\n"
      << "assay_duration_seconds_count{phase=\"" << phase << "\"} " << values.size() << "\n";
  }
  return ApiResponse{200, "text/plain; version=0.0.4", o.str(), {}};
}

ApiResponse Service::cancel(Job& job) {
  if (is_terminal(job.state))
    return error_response(409, "api.already_finished",
                          "job " + job.id + " is already " + std::string(state_name(job.state)));
  if (job.state == JobState::kQueued) {
    queue_.erase(std::remove(queue_.begin(), queue_.end(), job.id), queue_.end());
    finish(job, JobState::kCancelled, "cancelled while queued");
    return json_response(200, job.summary());
  }
  cancel_requested_[job.id] = true;
  JobStore::add_event(job, "cancel requested");
  store_.save(job);
  publish(job);
  if (auto it = processes_.find(job.id); it != processes_.end()) it->second->kill();
  return json_response(202, job.summary());
}

Job* Service::visible_job(const std::string& id, const Peer& peer,
                          std::optional<ApiResponse>& refusal) {
  if (!valid_job_id(id)) {
    refusal = error_response(400, "api.bad_job_id",
                             "job id \"" + id.substr(0, 64) + "\" is not j-<24 hex digits>");
    return nullptr;
  }
  Job* job = store_.find(id);
  if (!job || (!peer.admin && job->submitter_uid != peer.uid)) {
    refusal = error_response(404, "api.no_such_job", "no job " + id);
    return nullptr;
  }
  return job;
}

std::optional<ApiResponse> Service::watch(const std::string& id, const Peer& peer, EventSink sink,
                                          std::uint64_t& handle) {
  std::optional<ApiResponse> refusal;
  Job* job = visible_job(id, peer, refusal);
  if (!job) return refusal;
  bool terminal = is_terminal(job->state);
  for (std::size_t i = 0; i < job->events.size(); ++i)
    sink(job->events[i].dump() + "\n", terminal && i + 1 == job->events.size());
  if (!terminal) {
    handle = next_watch_++;
    watchers_[id][handle] = std::move(sink);
  }
  return std::nullopt;
}

void Service::unwatch(const std::string& id, std::uint64_t handle) {
  auto it = watchers_.find(id);
  if (it == watchers_.end()) return;
  it->second.erase(handle);
  if (it->second.empty()) watchers_.erase(it);
}

void Service::publish(const Job& job) {
  auto it = watchers_.find(job.id);
  if (it == watchers_.end() || job.events.empty()) return;
  bool last = is_terminal(job.state);
  std::string line = job.events.back().dump() + "\n";
  auto sinks = it->second;  // a sink may unwatch while we iterate
  if (last) watchers_.erase(it);
  for (auto& [h, sink] : sinks) sink(line, last);
}

// ---------------------------------------------------------------------------------------------
// Scheduling and the pipeline.

void Service::schedule() {
  if (stopping_) return;
  while (!queue_.empty() && static_cast<int>(running_slots_.size()) < config_.device_slots) {
    std::string id = queue_.front();
    queue_.erase(queue_.begin());
    int slot = 0;
    std::vector<int> used;
    for (auto& [j, s] : running_slots_) used.push_back(s);
    while (std::find(used.begin(), used.end(), slot) != used.end()) ++slot;
    running_slots_[id] = slot;
    run_pipeline(id);
  }
}

void Service::release_slot(const std::string& id) {
  // Logits the workers left in their workspaces are scratch, whatever the outcome: a result's
  // artifact has moved to the job directory itself, and a fidelity job's captures ([positions,
  // vocab] floats each) are named by digest in its receipt. Logs and evidence stay.
  std::error_code ec;
  for (const auto& ws : fs::directory_iterator(store_.job_dir(id), ec)) {
    if (!ws.is_directory(ec) || ws.is_symlink(ec)) continue;
    for (const auto& file : fs::directory_iterator(ws.path(), ec))
      if (file.path().extension() == ".safetensors") fs::remove(file.path(), ec);
  }
  running_slots_.erase(id);
  processes_.erase(id);
  cancel_requested_.erase(id);
  scratch_.erase(id);
  fidelity_requests_.erase(id);
  boost::asio::post(io_, [this] { schedule(); });
}

void Service::set_phase(Job& job, const std::string& phase, const std::string& message,
                        bool durable) {
  job.phase = phase;
  JobStore::add_event(job, message);
  store_.save(job, durable);
  publish(job);
}

void Service::finish(Job& job, JobState state, const std::string& message,
                     std::optional<Json> error, const CommitFiles& files) {
  job.state = state;
  job.phase = std::string(state_name(state));
  job.error = std::move(error);
  job.waiting_reason.clear();
  JobStore::add_event(job, message);
  store_.commit(job, files);
  durations_["job"].push_back(now_unix() - job.created_unix);
  publish(job);
}

void Service::fail(const std::string& id, const std::string& code, const std::string& message) {
  Job* job = store_.find(id);
  if (!job) return;
  spdlog::warn("job {} failed: {} ({})", id, message, code);
  finish(*job, JobState::kFailed, "failed: " + message, Json{{"code", code}, {"message", message}});
  release_slot(id);
}

void Service::run_pipeline(const std::string& id) {
  Job* job = store_.find(id);
  if (!job) return;
  job->state = JobState::kRunning;
  job->attempts += 1;
  scratch_[id] = Json{{"started_unix", now_unix()}};
  try {
    // Not durable: a crash leaves the job queued on disk, which a restart runs just as it would
    // re-run a running one; only the attempt count of this start is lost.
    set_phase(*job, "preflight", "started attempt " + std::to_string(job->attempts));
    step_preflight(id);
  } catch (const Error& e) {
    fail(id, e.code(), e.what());
  } catch (const std::exception& e) {
    fail(id, "supervisor.internal", e.what());
  }
}

void Service::step_preflight(const std::string& id) {
  Job* job = store_.find(id);
  std::uint64_t required = 0;
  try {
    required = job->is_fidelity() ? fidelity_required_bytes(*job)
                                  : estimate_required_bytes(job->model_dir);
  } catch (const std::exception& e) {
    return fail(id, "preflight.bad_model", std::string("cannot size the model: ") + e.what());
  }
  MemoryView mem = read_memory_view();
  std::uint64_t available = mem.available();
  std::uint64_t reserve = config_.memory_reserve_bytes;
  std::uint64_t ceiling = mem.cgroup_limit.value_or(UINT64_MAX);
  scratch_[id]["host_memory"] = Json{{"available_bytes_before", available},
                                     {"required_bytes", required},
                                     {"reserve_bytes", reserve}};
  if (required + reserve > ceiling) {
    ++preflight_refusals_;
    return fail(id, "preflight.refused",
                "the model needs " + fmt_bytes(required) + " plus a reserve of " +
                    fmt_bytes(reserve) + " but the supervisor's cgroup limit is " +
                    fmt_bytes(ceiling));
  }
  if (required + reserve > available) {
    // Could fit once other work ends: keep the job queued (first in line) and retry.
    ++preflight_waits_;
    job->state = JobState::kQueued;
    job->waiting_reason = "needs " + fmt_bytes(required) + " + reserve " + fmt_bytes(reserve) +
                          ", available " + fmt_bytes(available);
    set_phase(*job, "queued", "waiting for memory: " + job->waiting_reason, true);
    running_slots_.erase(id);
    scratch_.erase(id);
    fidelity_requests_.erase(id);
    queue_.insert(queue_.begin(), id);
    if (!retry_armed_) {
      retry_armed_ = true;
      retry_timer_.expires_after(std::chrono::milliseconds(config_.preflight_retry_ms));
      retry_timer_.async_wait([this](boost::system::error_code ec) {
        retry_armed_ = false;
        if (!ec) schedule();
      });
    }
    return;
  }
  job->waiting_reason.clear();
  if (job->is_fidelity())
    fidelity_start(id);
  else
    step_fingerprint(id);
}

void Service::start_worker(const std::string& id, const std::string& role, const fs::path& worker,
                           const std::string& mode, const Json& input,
                           std::function<void(Json)> next,
                           const std::vector<std::pair<fs::path, std::string>>& move_in) {
  Job* job = store_.find(id);
  fs::path ws = store_.job_dir(id) / role;
  std::error_code ec;
  fs::remove_all(ws, ec);  // a previous attempt's leftovers
  fs::create_directories(ws);
  ::chmod(ws.c_str(), 0700);
  replace_file_fast(ws / protocol::kInputFile, common::canonical(input), 0600);
  for (const auto& [source, name] : move_in) {
    fs::rename(source, ws / name, ec);
    if (ec)
      return fail(id, "worker.workspace",
                  "cannot move " + source.string() + " into " + ws.string() + ": " + ec.message());
    if (worker_uid_ && ::chown((ws / name).c_str(), *worker_uid_, *worker_gid_) != 0)
      return fail(id, "worker.workspace", "cannot hand " + (ws / name).string() + " to the worker user");
  }
  if (worker_uid_) {
    if (::chown(ws.c_str(), *worker_uid_, *worker_gid_) != 0 ||
        ::chown((ws / protocol::kInputFile).c_str(), *worker_uid_, *worker_gid_) != 0)
      return fail(id, "worker.workspace", "cannot hand " + ws.string() + " to the worker user");
  }
  if (::access(worker.c_str(), X_OK) != 0)
    return fail(id, "worker.missing", "worker executable " + worker.string() + " is not there");

  contain::SpawnSpec spec;
  spec.name = id + "-" + role;
  spec.argv = {worker.string(), mode,       "--input", (ws / protocol::kInputFile).string(),
               "--workdir",     ws.string()};
  spec.workdir = ws;
  spec.env = {
      "PATH=/usr/bin:/bin", "LANG=C.UTF-8", "HOME=" + ws.string(),
      "OMP_NUM_THREADS=" + std::to_string(std::max(1u, std::thread::hardware_concurrency()))};
  spec.stdout_path = ws / protocol::kStdoutFile;
  spec.stderr_path = ws / protocol::kStderrFile;
  // The worker sees neither the state directory (other jobs, the signing key) nor the socket;
  // the runtime bind-mounts its own workspace back.
  spec.hidden_paths = {config_.state_dir};
  if (!config_.socket.empty()) spec.hidden_paths.push_back(config_.socket);
  spec.uid = worker_uid_;
  spec.gid = worker_gid_;
  auto req_limits = scratch_[id].value("limits", Json::object());
  double timeout = req_limits.value("timeout_seconds", config_.worker_timeout_seconds);
  spec.limits.timeout = std::chrono::milliseconds(static_cast<long long>(timeout * 1000));
  if (req_limits.contains("memory_bytes"))
    spec.limits.memory_max = req_limits["memory_bytes"].get<std::uint64_t>();
  else
    spec.limits.memory_max = config_.worker_memory_max;

  set_phase(*job, role, "running " + role + " worker");
  double t0 = now_unix();
  try {
    auto running =
        runtime_->start(io_, spec, [this, id, role, ws, t0, next = std::move(next)](Json evidence) {
          processes_.erase(id);
          durations_[role].push_back(now_unix() - t0);
          try {
            replace_file_fast(ws / "evidence.json", common::canonical(evidence), 0600);
          } catch (const Error& e) {
            spdlog::error("cannot keep evidence of {} {}: {}", id, role, e.what());
          }
          Job* job = store_.find(id);
          if (!job) return;
          auto outcome = judge_evidence(evidence);
          if (outcome.oom_killed) ++oom_kills_;
          if (outcome.timed_out) ++timeouts_;
          if (cancel_requested_.count(id)) {
            finish(*job, JobState::kCancelled, "cancelled while the " + role + " worker ran");
            return release_slot(id);
          }
          if (!outcome.ok)
            return fail(id, "worker." + role + "_failed",
                        role + " worker " + outcome.reason +
                            "; stderr: " + tail_file(ws / protocol::kStderrFile, 2000));
          Json output;
          try {
            output = common::parse_strict(
                common::read_file(ws / protocol::kOutputFile, kMaxWorkerOutputBytes));
          } catch (const Error& e) {
            return fail(id, "worker." + role + "_output",
                        role + " worker exited 0 but its output.json is unusable: " + e.what());
          }
          scratch_[id][role + "_evidence"] = evidence;
          try {
            next(std::move(output));
          } catch (const Error& e) {
            fail(id, e.code(), e.what());
          } catch (const std::exception& e) {
            fail(id, "supervisor.internal", e.what());
          }
        });
    processes_[id] = std::move(running);
  } catch (const Error& e) {
    fail(id, e.code(), "cannot start the " + role + " worker: " + e.what());
  }
}

void Service::step_fingerprint(const std::string& id) {
  Job* job = store_.find(id);
  auto request = common::validate_request(
      common::parse_strict(common::read_file(store_.job_dir(id) / "request.json", 64 << 20)));
  scratch_[id]["limits"] = request.document.value("limits", Json::object());
  std::string model_name = request.model_identity
                               ? (*request.model_identity)["id"].get<std::string>()
                               : fs::path(job->model_dir).filename().string();
  Json input{{"schema", protocol::kFingerprintInput},
             {"model_dir", job->model_dir},
             {"id", model_name},
             {"threads", config_.fingerprint_threads}};
  start_worker(id, "fingerprint", config_.fingerprint_worker, "run", input,
               [this, id, request](Json output) {
                 if (output.value("schema", "") != protocol::kFingerprintOutput)
                   throw Error("worker.fingerprint_output",
                               "fingerprint output.json has schema " +
                                   output.value("schema", std::string("(none)")));
                 const Json& identity =
                     common::require(output, "model_identity", "fingerprint output");
                 scratch_[id]["fingerprint"] = output;
                 if (request.model_identity &&
                     (*request.model_identity)["content_sha256"] != identity["content_sha256"]) {
                   throw Error("job.identity_mismatch",
                               "the model directory's identity " +
                                   identity["content_sha256"].get<std::string>() +
                                   " differs from the request's expected identity " +
                                   (*request.model_identity)["content_sha256"].get<std::string>() +
                                   "; fingerprinted: " + identity.dump() +
                                   "; expected: " + request.model_identity->dump());
                 }
                 step_oracle(id);
               });
}

void Service::step_oracle(const std::string& id) {
  Job* job = store_.find(id);
  auto request = common::validate_request(
      common::parse_strict(common::read_file(store_.job_dir(id) / "request.json", 64 << 20)));
  Json candidates = Json::array();
  for (const auto& c : request.candidates)
    candidates.push_back(Json{{"engine", c.engine}, {"token_id", c.token_id}, {"text", c.text}});
  Json input = oracle_input(job->model_dir, request, candidates, config_.oracle_device,
                            static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  start_worker(id, "oracle", config_.oracle_worker, "next-token", input, [this, id](Json output) {
    scratch_[id]["oracle"] = std::move(output);
    finish_success(id);
  });
}

void Service::finish_success(const std::string& id) {
  Job* job = store_.find(id);
  set_phase(*job, "assembling", "assembling and signing the result");
  fs::path dir = store_.job_dir(id);
  auto request = common::validate_request(
      common::parse_strict(common::read_file(dir / "request.json", 64 << 20)));
  Json& s = scratch_[id];
  const Json& oracle = s["oracle"];

  // The reference artifact moves out of the worker's workspace into the job directory.
  fs::path artifact_src = dir / "oracle" / oracle_artifact_name(oracle);
  fs::path artifact = dir / common::kArtifactFileName;
  std::error_code ec;
  fs::rename(artifact_src, artifact, ec);
  if (ec)
    throw Error("job.artifact",
                "cannot move the oracle's artifact " + artifact_src.string() + ": " + ec.message());
  ::chmod(artifact.c_str(), 0600);
  // The artifact (its data and the rename) becomes durable in finish()'s group commit.
  std::string artifact_sha = common::sha256_file_id(artifact);
  auto artifact_bytes = fs::file_size(artifact);

  Json verdict = make_verdict(request, oracle);
  Json result{
      {"schema", protocol::kNextTokenResult},
      {"created_at_utc", now_rfc3339()},
      {"duration_seconds", now_unix() - s["started_unix"].get<double>()},
      {"job_id", id},
      {"supervisor", {{"version", ASSAY_VERSION}, {"key_id", key_.key_id()}}},
      {"request",
       {{"schema", request.schema},
        {"id", request.id},
        {"sha256", request.request_sha256},
        {"input_token_ids_sha256", request.input_token_ids_sha256},
        {"source", request.source}}},
      {"model_identity", s["fingerprint"]["model_identity"]},
      {"model_fingerprint",
       {{"implementation_sha256", s["fingerprint"].value("implementation_sha256", Json(nullptr))},
        {"process", s["fingerprint_evidence"]}}},
      {"containment",
       {{"host_memory", s["host_memory"]},
        {"backend", runtime_->backend()},
        {"network",
         s["oracle_evidence"].contains("network") && !s["oracle_evidence"]["network"].is_null()
             ? s["oracle_evidence"]["network"]
             : Json("host")}}},
      {"oracle", oracle_section(oracle, s["oracle_evidence"])},
      {"reference_artifact",
       {{"name", common::kArtifactFileName}, {"bytes", artifact_bytes}, {"sha256", artifact_sha}}},
      {"verdict", verdict}};
  std::string result_bytes = common::seal_result(result);
  Json statement = common::make_result_statement(result_bytes, artifact_sha);
  Json envelope = common::dsse_sign(common::kInTotoPayloadType, common::canonical(statement), key_);
  CommitFiles files{{{std::string(common::kResultFileName), result_bytes},
                     {std::string(common::kEnvelopeFileName), common::canonical(envelope) + "\n"}},
                    {artifact}};
  finish(*job, JobState::kSucceeded,
         "succeeded: reference argmax " +
             std::to_string(verdict["argmax_token_id"].get<std::int64_t>()) + " -> " +
             verdict["argmax_candidate"].get<std::string>(),
         std::nullopt, files);
  release_slot(id);
}

}  // namespace assay::supervisor
