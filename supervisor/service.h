// The supervisor as its API sees it, without HTTP: submissions, job documents, results, cancel,
// event streams, health and what /metrics shows. Every call throws common::Error with a stable
// code on refusal (supervisor/api/errors.cpp maps codes to answers); nothing here knows a status
// code. Everything runs on the io_context's one thread.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <boost/asio/io_context.hpp>

#include "common/json.h"
#include "common/sign.h"
#include "supervisor/config.h"
#include "supervisor/contain/contain.h"
#include "supervisor/jobs/engine.h"
#include "supervisor/jobs/events.h"
#include "supervisor/jobs/store.h"
#include "supervisor/metrics.h"
#include "supervisor/peer.h"

namespace assay::supervisor {

// "j-" and 24 lowercase hex digits.
bool valid_job_id(const std::string& id);

struct Submitted {
  common::Json job;  // the job's summary, with "duplicate"
  bool created = false;
};

class Service {
 public:
  // Loads the store and the signing key (creating what is missing), detects the containment
  // backend. Throws Error("config.invalid"/"store.unusable"/...) when it cannot serve.
  Service(boost::asio::io_context& io, Config config);
  ~Service();
  void start();  // recovers the queue and starts scheduling
  void stop();   // starts no new work; resident workers are told to exit
  // Resident oracle workers not yet reaped: after stop(), the caller runs the io_context until
  // this is 0 (their cgroups and workspaces removed) or its patience ends.
  std::size_t residents() const;

  // `options`: model_dir (next-token jobs without one), retry ("1": run a failed or cancelled
  // identical job again instead of answering with it).
  Submitted submit(const common::Json& document, const std::map<std::string, std::string>& options,
                   const Peer& peer);
  common::Json list(std::optional<JobState> state, const Peer& peer);
  const std::string& job_document(const std::string& id, const Peer& peer);
  // Returns the job's summary and whether the cancel completed (false: a worker is being killed).
  std::pair<common::Json, bool> cancel(const std::string& id, const Peer& peer);
  // result.json, result.dsse.json or the artifact of a succeeded job.
  std::filesystem::path result_file(const std::string& id, const std::string& what,
                                    const Peer& peer);
  std::uint64_t watch(const std::string& id, const Peer& peer, Watchers::Sink sink);
  void unwatch(const std::string& id, std::uint64_t handle);

  // Drops the cached digests of a model directory the peer may read (`assay fingerprint
  // --refresh`): its next fingerprint hashes every file. {"model_dir", "dropped"}.
  common::Json refresh_fingerprint(const std::string& model_dir, const Peer& peer);
  common::Json health() const;
  common::Json info() const;
  const Config& config() const { return config_; }
  Metrics& metrics() { return metrics_; }
  // Jobs by (kind, state): the kind's name from kinds(), "next-token-batch-state" for the
  // states of a batch (recorded as jobs of their own, but parts of one).
  std::map<std::pair<std::string, JobState>, int> job_counts();
  std::size_t queue_depth() const { return engine_->queue_depth(); }
  std::string backend() const { return runtime_->backend(); }
  std::string key_id() const { return key_.key_id(); }

 private:
  Job& visible_job(const std::string& id, const Peer& peer);

  boost::asio::io_context& io_;
  Config config_;
  JobStore store_;
  std::unique_ptr<contain::Runtime> runtime_;
  std::unique_ptr<executors::SlurmExecutor> slurm_;  // executor slurm; null: local
  common::SigningKey key_;
  Metrics metrics_;
  Watchers watchers_;
  common::Json engine_worker_;  // who workers run as, for /v1/info
  std::unique_ptr<Engine> engine_;
};

}  // namespace assay::supervisor
