// The supervisor's core, independent of the transport: validates and stores submissions,
// schedules jobs FIFO onto device slots, runs each job's pipeline (preflight -> contained
// fingerprint -> identity check -> contained oracle -> assemble -> sign), and answers API calls.
// Everything runs on one io_context thread.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <sys/types.h>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

#include "common/fidelity.h"
#include "common/json.h"
#include "common/request.h"
#include "common/sign.h"
#include "supervisor/config.h"
#include "supervisor/contain/contain.h"
#include "supervisor/store.h"

namespace assay::supervisor {

struct Peer {
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;
  bool admin = false;  // root or a member of the admin group
};

struct ApiResponse {
  unsigned status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::filesystem::path file;  // when set, the body is this file's content (artifact)
};

// {"error":{"code","message"}} with `status`.
ApiResponse error_response(unsigned status, const std::string& code, const std::string& message);

class Service {
 public:
  Service(boost::asio::io_context& io, Config config);
  ~Service();

  // Recovers the store (re-queues jobs cut off by a restart, cleans orphaned cgroups) and starts
  // scheduling.
  void start();
  // Cancels nothing; stops starting new work (running workers are killed by their Running).
  void stop();

  ApiResponse handle(const std::string& method, const std::string& target, const std::string& body,
                     const Peer& peer);

  // Streams a job's events: `sink` receives every existing event, then each new one, as one
  // NDJSON line; `last` is true on the final line (the job is terminal). Returns an error
  // response when the job is unknown or not the peer's, else nullopt.
  using EventSink = std::function<void(const std::string& line, bool last)>;
  std::optional<ApiResponse> watch(const std::string& id, const Peer& peer, EventSink sink,
                                   std::uint64_t& handle);
  void unwatch(const std::string& id, std::uint64_t handle);

  const Config& config() const { return config_; }
  std::string key_id() const { return key_.key_id(); }
  std::string backend() const { return runtime_->backend(); }
  void count_connection_refused() { ++connections_refused_; }

 private:
  struct Slot;
  ApiResponse submit(const std::string& target, const std::string& body, const Peer& peer);
  ApiResponse list(const std::string& query, const Peer& peer);
  ApiResponse info() const;
  ApiResponse metrics() const;
  ApiResponse cancel(Job& job);
  // The job `id` if it exists and the peer may see it (its submitter or an admin); else null,
  // with `refusal` set to the 400 (malformed id) or 404 to answer.
  Job* visible_job(const std::string& id, const Peer& peer, std::optional<ApiResponse>& refusal);
  std::string resolve_model_dir(const common::NextTokenRequest& request,
                                const std::string& query_model) const;
  // Throws Error("request.bad_model") unless `dir` is an absolute path to a directory without
  // symlinks or .. in it; returns it without trailing slashes.
  std::string check_model_dir(std::string dir) const;
  // Dedup, queue limit, durable creation: the common end of both kinds of submission.
  ApiResponse enqueue(Job job, const common::Json& document, const Peer& peer);

  // Fidelity jobs (supervisor/fidelity.cpp): reference and candidate fingerprints, captures in
  // contained oracle runs, the contained comparison, the signed receipt.
  Job accept_fidelity(const common::Json& document, const Peer& peer);
  // The job's request, parsed from request.json once per run of the job (dropped by
  // release_slot): a panel can hold millions of token ids.
  const common::FidelityRequest& fidelity_request(const std::string& id);
  std::uint64_t fidelity_required_bytes(const Job& job);
  void fidelity_start(const std::string& id);
  void fidelity_next(const std::string& id);
  void fidelity_fingerprint(const std::string& id, const std::string& side);
  void fidelity_capture(const std::string& id, const std::string& side);
  void fidelity_compare(const std::string& id);
  void fidelity_finish(const std::string& id);

  void schedule();
  void run_pipeline(const std::string& id);
  void step_preflight(const std::string& id);
  void step_fingerprint(const std::string& id);
  void step_oracle(const std::string& id);
  void finish_success(const std::string& id);
  // Records the terminal state durably, with `files` (a success's result) in the same commit,
  // before watchers are told.
  void finish(Job& job, JobState state, const std::string& message,
              std::optional<common::Json> error = std::nullopt, const CommitFiles& files = {});
  // Records a phase change and tells watchers; `durable` when a restart must see it.
  void set_phase(Job& job, const std::string& phase, const std::string& message,
                 bool durable = false);
  void fail(const std::string& id, const std::string& code, const std::string& message);
  // Runs `worker mode --input ... --workdir STATE/jobs/ID/ROLE` contained; `move_in` files are
  // renamed into the fresh workspace first (source, name there), since a worker sees only its
  // own workspace of the state directory.
  void start_worker(const std::string& id, const std::string& role,
                    const std::filesystem::path& worker, const std::string& mode,
                    const common::Json& input, std::function<void(common::Json)> next,
                    const std::vector<std::pair<std::filesystem::path, std::string>>& move_in = {});
  void publish(const Job& job);
  void release_slot(const std::string& id);

  boost::asio::io_context& io_;
  Config config_;
  JobStore store_;
  std::unique_ptr<contain::Runtime> runtime_;
  common::SigningKey key_;
  std::optional<uid_t> worker_uid_;
  std::optional<gid_t> worker_gid_;
  std::optional<gid_t> admin_gid_;

  std::vector<std::string> queue_;            // FIFO of queued job ids
  std::map<std::string, int> running_slots_;  // job id -> slot
  std::map<std::string, std::shared_ptr<contain::Running>> processes_;
  std::map<std::string, bool> cancel_requested_;
  std::map<std::string, common::Json> scratch_;  // per running job: fingerprint/oracle outputs
  std::map<std::string, common::FidelityRequest> fidelity_requests_;  // see fidelity_request()
  boost::asio::steady_timer retry_timer_;
  bool retry_armed_ = false;
  bool stopping_ = false;

  std::map<std::string, std::map<std::uint64_t, EventSink>> watchers_;
  std::uint64_t next_watch_ = 1;

  // Metrics.
  std::uint64_t preflight_refusals_ = 0, preflight_waits_ = 0, oom_kills_ = 0, timeouts_ = 0;
  std::uint64_t submissions_ = 0, duplicates_ = 0, rejected_ = 0, queue_full_ = 0;
  std::uint64_t connections_refused_ = 0;
  std::map<std::string, std::vector<double>> durations_;  // "job", "fingerprint", "oracle"
  double started_unix_ = 0;
};

// Host memory as the preflight sees it.
struct MemoryView {
  std::uint64_t mem_available = 0;            // /proc/meminfo MemAvailable
  std::optional<std::uint64_t> cgroup_limit;  // the supervisor's own cgroup memory limit
  std::optional<std::uint64_t> cgroup_usage;
  std::uint64_t available() const;  // min of the two views
};
MemoryView read_memory_view();
// Bytes the oracle needs for a model directory: shard bytes and the dtype of config.json.
std::uint64_t estimate_required_bytes(const std::filesystem::path& model_dir);

}  // namespace assay::supervisor
