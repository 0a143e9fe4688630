// The durable job store: one directory per job, STATE/jobs/<id>/, whose job.json is rewritten
// atomically (temp, fsync, rename, directory fsync) on every state change a client relies on
// before anyone is told about the change; the files of one change are fsynced together.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <sys/types.h>

#include "common/json.h"
#include "supervisor/pipelines/pipeline.h"  // CommitFiles

namespace assay::supervisor {

enum class JobState { kQueued, kRunning, kSucceeded, kFailed, kCancelled };

std::string_view state_name(JobState s);
// Throws common::Error("api.bad_state") for an unknown name.
JobState state_from_name(std::string_view name);
bool is_terminal(JobState s);

struct Job {
  std::string id;
  std::string key;  // sha256 identity of {request_sha256, model_dir}: the dedup key
  std::string request_sha256;
  std::string request_schema;
  std::string request_id;
  std::string model_dir;
  uid_t submitter_uid = 0;
  gid_t submitter_gid = 0;
  bool submitter_admin = false;
  // What admission opened (admission.h opened_record): a job whose files changed owner, mode or
  // identity before it starts fails instead of reading them.
  common::Json admitted = common::Json::array();
  JobState state = JobState::kQueued;
  std::string phase = "queued";  // finer than state: preflight, fingerprint, oracle, ...
  std::string created_at;        // RFC 3339 UTC
  std::string updated_at;
  double created_unix = 0;
  int attempts = 0;                   // pipeline starts, including ones cut off by a restart
  std::optional<common::Json> error;  // {"code","message"} once failed
  std::string waiting_reason;         // why a queued job is not started (preflight)
  // A batch's state: {"id": the batch job, "index"}; such a job is recorded terminal at once.
  std::optional<common::Json> batch;
  // Every phase change, in order. On disk in STATE/jobs/<id>/events.jsonl, one line each,
  // appended as they come (job.json does not grow with them); the first `events_logged` are there.
  common::Json events = common::Json::array();
  std::size_t events_logged = 0;
  // GET /v1/jobs/{id} as rendered since the last save(); status requests far outnumber changes.
  std::string rendered;

  bool is_fidelity() const;  // an assay.fidelity-request.v1 job (else a next-token job)
  // The artifact its result names, as its kind says (pipelines/kinds.cpp): logits.safetensors,
  // kl.safetensors (fidelity), trajectory.safetensors, states.jsonl (a batch's summary).
  std::string artifact_name() const;

  common::Json to_json() const;
  static Job from_json(const common::Json& j);
  // Public view for the API: to_json() plus links, without the event list.
  common::Json summary() const;
};

class JobStore {
 public:
  // Creates STATE/jobs (0700) if it is missing (an existing one is not written to, so a full
  // disk does not stop a start) and loads every job in it.
  explicit JobStore(std::filesystem::path state_dir);

  const std::filesystem::path& jobs_dir() const { return jobs_dir_; }
  std::filesystem::path job_dir(const std::string& id) const { return jobs_dir_ / id; }

  Job* find(const std::string& id);
  Job* find_by_key(const std::string& key);
  // Jobs in creation order.
  std::vector<Job*> all();

  // Writes request.json, the `extra` files (name, content) and job.json of a new job durably,
  // then indexes it. Throws Error("fs.no_space") when the disk is full, leaving nothing of the
  // job behind.
  Job& create(Job job, const std::string& request_canonical,
              const std::vector<std::pair<std::string, std::string>>& extra = {});
  // Writes a job that is terminal from the start (a batch's state) as one new directory:
  // request.json, `files.write`, the files `moved` in (source, name: renamed, not copied) and
  // job.json, all fsynced before the directory is renamed into place, so that a crash leaves
  // the whole job or nothing of it. Throws Error("fs.no_space") etc., leaving nothing behind.
  Job& create_finished(Job job, const std::string& request_canonical, const CommitFiles& files,
                       const std::vector<std::pair<std::filesystem::path, std::string>>& moved);
  // Rewrites job.json atomically after `job` was changed; durably (fsync of file and directory)
  // unless `durable` is false, which is for changes nobody relies on across a crash: a restart
  // re-runs a running job whatever its phase, so losing one of those to a power cut is harmless.
  void save(Job& job, bool durable = true);
  // A durable save() of `job` together with the files of its terminal state, as one group commit
  // (see store.cpp) instead of one temp-fsync-rename-directory-fsync per file. A job.json that
  // says "succeeded" while a file of its group is missing (a crash inside the commit, before
  // anyone was told) is re-run on the next start.
  void commit(Job& job, const CommitFiles& files);
  // Appends an event {at, state, phase, message} to the job (then call save()).
  static void add_event(Job& job, const std::string& message);

 private:
  // Appends the events not yet in the job's events.jsonl (fsynced when `durable`).
  void append_events(Job& job, bool durable);
  std::filesystem::path jobs_dir_;
  std::map<std::string, Job> jobs_;
  std::map<std::string, std::string> by_key_;
};

}  // namespace assay::supervisor
