#include "supervisor/service.h"

#include <algorithm>

#include <grp.h>
#include <pwd.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "common/result.h"
#include "common/text.h"
#include "common/time.h"
#include "supervisor/pipelines/admission.h"
#include "supervisor/pipelines/steps.h"

namespace assay::supervisor {

using common::Error;
using common::Json;
namespace fs = std::filesystem;

bool valid_job_id(const std::string& id) {
  if (id.size() != 26 || id.rfind("j-", 0) != 0) return false;
  return std::all_of(id.begin() + 2, id.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

namespace {

// The host signing key, created (0600, in a 0700 directory) on first start. A start writes
// nothing that is already there, so a full disk does not keep the daemon from starting.
common::SigningKey load_host_key(const fs::path& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    common::throw_errno("config.invalid", "mkdir " + dir.string(), errno);
  common::SigningKey key = common::SigningKey::load_or_create(dir / "host.key");
  std::string pem = key.public_key_pem();
  std::string existing;
  try {
    existing = common::read_file(dir / "host.pub", 1 << 16);
  } catch (const Error&) {
  }
  if (existing != pem) common::atomic_write_file(dir / "host.pub", pem, 0644);
  return key;
}

// Workers never run as root: as root, assayd runs them as worker_user, else the package's
// assay-worker, else a transient id (contain::default_worker_identity); allow_root_workers
// (development only) keeps them root, still without capabilities.
std::optional<contain::WorkerIdentity> worker_identity(const Config& config) {
  if (::geteuid() != 0 || config.allow_root_workers) return std::nullopt;
  if (!config.worker_user.empty()) {
    try {
      return contain::worker_identity(config.worker_user);
    } catch (const Error& e) {
      throw Error("config.invalid", "worker_user: " + std::string(e.what()));
    }
  }
  return contain::default_worker_identity();
}

}  // namespace

Service::Service(boost::asio::io_context& io, Config config)
    : io_(io),
      config_(std::move(config)),
      store_(config_.state_dir),
      runtime_(contain::Runtime::create(config_.containment)),
      key_(load_host_key(config_.state_dir / "keys")),
      watchers_(config_.max_event_streams) {
  if (!config_.admin_group.empty() && !::getgrnam(config_.admin_group.c_str()))
    throw Error("config.invalid", "admin_group \"" + config_.admin_group + "\" does not exist");
  auto worker = worker_identity(config_);
  engine_worker_ =
      worker ? Json{{"uid", worker->uid},
                    {"gid", worker->gid},
                    {"user", worker->user.empty() ? Json(nullptr) : Json(worker->user)},
                    {"transient", worker->transient}}
             : Json(config_.allow_root_workers ? "root (allow_root_workers)" : "assayd's own user");
  if (config_.executor == "slurm") {
    executors::SlurmOptions o;
    o.shared_dir = config_.slurm.shared_dir;
    o.partition = config_.slurm.partition;
    o.account = config_.slurm.account;
    o.qos = config_.slurm.qos;
    o.sbatch_args = config_.slurm.sbatch_args;
    o.node_assayd = config_.slurm.node_assayd;
    o.contain_args = config_.slurm.contain_args;
    o.poll = std::chrono::milliseconds(config_.slurm.poll_ms);
    slurm_ = std::make_unique<executors::SlurmExecutor>(io_, std::move(o));
  }
  engine_ = std::make_unique<Engine>(io_, config_, store_, *runtime_, key_, watchers_, metrics_,
                                     worker, slurm_.get());
}

Service::~Service() = default;

void Service::start() {
  engine_->recover();
}
void Service::stop() {
  engine_->stop();
}

std::size_t Service::residents() const {
  return engine_->residents();
}

Submitted Service::submit(const Json& document, const std::map<std::string, std::string>& options,
                          const Peer& peer) {
  bool retry = false;
  Admission admission;
  try {
    if (!document.is_object()) throw Error("request.invalid", "a request must be a JSON object");
    auto schema = document.find("schema");
    if (schema != document.end() && !schema->is_string())
      throw Error("request.invalid", "\"schema\" is " + std::string(schema->type_name()) +
                                         ", not a string naming the request's kind");
    const JobKind& kind =
        kind_for_schema(schema == document.end() ? "" : schema->get_ref<const std::string&>());
    if (schema != document.end() && kind.request_schema.empty() &&
        *schema != protocol::kNextTokenRequest && *schema != protocol::kKilnNextTokenRequest) {
      // Every schema this endpoint takes, not only the next-token kind's own two.
      std::string accepted = "\"" + std::string(protocol::kNextTokenRequest) + "\", \"" +
                             std::string(protocol::kKilnNextTokenRequest) + "\"";
      for (const JobKind& k : kinds())
        if (!k.request_schema.empty()) accepted += ", \"" + std::string(k.request_schema) + "\"";
      throw Error("request.unknown_schema", "request.schema \"" +
                                                common::printable(schema->get<std::string>(), 80) +
                                                "\" is not one this endpoint takes: " + accepted);
    }
    SubmitContext context{
        .config = config_, .peer = peer, .query_model_dir = {}, .receipts_dir = {}};
    for (const auto& [k, v] : options) {
      if (k == "retry") {
        retry = v == "1" || v == "true";
      } else if ((k == "model_dir" || k == "model") && kind.model_dir_query) {
        context.query_model_dir = v;
      } else if (k == "receipts_dir" && kind.request_schema.empty()) {
        context.receipts_dir = v;
      } else {
        throw Error("api.bad_query",
                    "query parameter \"" + common::printable(k, 64) + "\" is not allowed for a " +
                        std::string(kind.name) + " request (only " +
                        (kind.model_dir_query ? "model_dir=, " : "") +
                        (kind.request_schema.empty() ? "receipts_dir=, " : "") + "retry=)");
      }
    }
    admission = kind.admit(document, context);
    engine_->check_capacity(kind, document, admission.checks, admission.model_dir);
  } catch (const Error&) {
    ++metrics_.rejected;
    throw;
  }
  // Each user's submissions are deduplicated among themselves: another user's identical request
  // neither blocks this one nor is revealed by the answer.
  admission.key =
      common::sha256_canonical_id(Json{{"key", admission.key}, {"submitter", peer.uid}});
  if (Job* existing = store_.find_by_key(admission.key)) {
    bool rerun =
        retry && (existing->state == JobState::kFailed || existing->state == JobState::kCancelled);
    if (!rerun) {
      ++metrics_.duplicates;
      Json j = existing->summary();
      j["duplicate"] = true;
      return Submitted{j, false};
    }
    existing->state = JobState::kQueued;
    existing->phase = "queued";
    existing->error.reset();
    existing->admitted = admission.opened;  // the files as this submission found them
    JobStore::add_event(*existing, "queued again: resubmitted with retry");
    store_.save(*existing);
    engine_->enqueue(existing->id);
    Json j = existing->summary();
    j["duplicate"] = true;
    j["retried"] = true;
    return Submitted{j, true};
  }
  if (engine_->queue_depth() >= config_.max_queue) {
    ++metrics_.queue_full;
    throw Error("api.queue_full", "the queue holds " + std::to_string(engine_->queue_depth()) +
                                      " jobs, its limit (max_queue)");
  }
  Job job;
  job.key = admission.key;
  job.id = "j-" + job.key.substr(7, 24);
  job.request_sha256 = admission.request_sha256;
  job.request_schema = admission.request_schema;
  job.request_id = admission.request_id;
  job.model_dir = admission.model_dir;
  job.submitter_uid = peer.uid;
  job.submitter_gid = peer.gid;
  job.submitter_admin = peer.admin;
  job.admitted = std::move(admission.opened);
  job.created_at = common::now_rfc3339();
  job.created_unix = common::now_unix();
  JobStore::add_event(job, "accepted" + admission.accepted_note);
  std::vector<std::pair<std::string, std::string>> extra;
  if (!admission.checks.is_null())
    extra.emplace_back(std::string(kChecksFile), common::canonical(admission.checks));
  Job& stored = store_.create(std::move(job), common::canonical(document), extra);
  ++metrics_.submissions;
  engine_->enqueue(stored.id);
  Json j = stored.summary();
  j["duplicate"] = false;
  return Submitted{j, true};
}

Json Service::list(std::optional<JobState> state, const Peer& peer) {
  Json jobs = Json::array();
  for (Job* job : store_.all()) {
    if (!peer.admin && job->submitter_uid != peer.uid) continue;
    if (state && job->state != *state) continue;
    jobs.push_back(job->summary());
  }
  return Json{{"jobs", jobs}};
}

Job& Service::visible_job(const std::string& id, const Peer& peer) {
  if (!valid_job_id(id))
    throw Error("api.bad_job_id",
                "job id \"" + common::printable(id, 64) + "\" is not j-<24 hex digits>");
  Job* job = store_.find(id);
  if (!job || (!peer.admin && job->submitter_uid != peer.uid))
    throw Error("api.no_such_job", "no job " + id);
  return *job;
}

const std::string& Service::job_document(const std::string& id, const Peer& peer) {
  Job& job = visible_job(id, peer);
  if (job.rendered.empty()) {
    // A bounded document whatever the job's length (a batch logs an event per state): its first
    // events and its latest, and how many there are; all of them are at links.events.
    constexpr std::size_t kFirst = 8, kLatest = 56;
    Json j = job.summary();
    const std::size_t total = job.events.size();
    j["events_total"] = total;
    if (total <= kFirst + kLatest) {
      j["events"] = job.events;
    } else {
      Json shown = Json::array();
      for (std::size_t i = 0; i < kFirst; ++i) shown.push_back(job.events[i]);
      for (std::size_t i = total - kLatest; i < total; ++i) shown.push_back(job.events[i]);
      j["events"] = std::move(shown);
      j["events_omitted"] = Json{{"after", kFirst}, {"count", total - kFirst - kLatest}};
    }
    job.rendered = j.dump() + "\n";
  }
  return job.rendered;
}

std::pair<Json, bool> Service::cancel(const std::string& id, const Peer& peer) {
  Job& job = visible_job(id, peer);
  bool queued = job.state == JobState::kQueued;
  if (!engine_->cancel(job))
    throw Error("api.already_finished",
                "job " + job.id + " is already " + std::string(state_name(job.state)));
  return {job.summary(), queued};
}

fs::path Service::result_file(const std::string& id, const std::string& what, const Peer& peer) {
  Job& job = visible_job(id, peer);
  if (job.state != JobState::kSucceeded)
    throw Error("api.not_ready", "job " + id + " is " + std::string(state_name(job.state)) +
                                     "; its " + what + " exists once it succeeded");
  fs::path dir = store_.job_dir(id);
  if (what == "result") return dir / common::kResultFileName;
  if (what == "attestation") return dir / common::kEnvelopeFileName;
  return dir / job.artifact_name();
}

std::uint64_t Service::watch(const std::string& id, const Peer& peer, Watchers::Sink sink) {
  return watchers_.watch(visible_job(id, peer), std::move(sink));
}

void Service::unwatch(const std::string& id, std::uint64_t handle) {
  watchers_.unwatch(id, handle);
}

Json Service::refresh_fingerprint(const std::string& model_dir, const Peer& peer) {
  std::string dir = check_model_dir(model_dir, peer);
  return Json{{"model_dir", dir}, {"dropped", drop_fingerprint_cache(config_.state_dir, dir)}};
}

Json Service::health() const {
  return Json{
      {"status", "ok"}, {"queue_depth", engine_->queue_depth()}, {"running", engine_->running()}};
}

std::map<std::pair<std::string, JobState>, int> Service::job_counts() {
  std::map<std::pair<std::string, JobState>, int> counts;
  for (Job* job : store_.all())
    counts[{job->batch ? std::string(kBatchStateKind)
                       : std::string(kind_for_schema(job->request_schema).name),
            job->state}]++;
  return counts;
}

Json Service::info() const {
  return Json{
      {"version", ASSAY_VERSION},
      {"containment", {{"backend", runtime_->backend()}, {"runtime", runtime_->describe()}}},
      {"executor", config_.executor},
      {"key_id", key_.key_id()},
      {"public_key_pem", key_.public_key_pem()},
      {"workers",
       {{"fingerprint", config_.fingerprint_worker.string()},
        {"oracle", config_.oracle_worker.string()},
        {"compare", config_.compare_worker.string()}}},
      {"worker_identity", engine_worker_},
      {"limits",
       {{"max_body_bytes", config_.max_body_bytes},
        {"max_header_bytes", config_.max_header_bytes},
        {"max_queue", config_.max_queue},
        {"max_connections", config_.max_connections},
        {"max_connections_per_user", config_.max_connections_per_user},
        {"max_event_streams", config_.max_event_streams},
        {"max_buffered_bytes", config_.max_buffered_bytes},
        {"read_timeout_ms", config_.read_timeout_ms},
        {"idle_timeout_ms", config_.idle_timeout_ms},
        {"device_slots", config_.device_slots},
        {"worker_timeout_seconds", config_.worker_timeout_seconds},
        {"prompt_render_timeout_seconds", config_.prompt_render_timeout_seconds},
        {"worker_memory_max",
         config_.worker_memory_max ? Json(*config_.worker_memory_max) : Json(nullptr)},
        {"worker_memory_margin", config_.worker_memory_margin},
        {"worker_pids_max", config_.worker_pids_max},
        {"memory_reserve_bytes", config_.memory_reserve_bytes}}}};
}

}  // namespace assay::supervisor
