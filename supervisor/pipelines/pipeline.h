// A job kind is a list of typed steps: each step runs one worker in a contained process (a fresh
// workspace, its input.json, the containment evidence, its output.json) and hands the output to
// the kind's typed state; once every step ran, the kind assembles the result that gets sealed.
// The engine (jobs/engine.h) runs the steps; a kind knows nothing of the store or the transport.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <sys/types.h>

#include "common/json.h"
#include "common/request.h"
#include "common/worker_schemas.h"
#include "supervisor/config.h"
#include "supervisor/contain/evidence.h"
#include "supervisor/peer.h"

namespace assay::supervisor {

// What a submission is, once checked: the durable record's fields.
struct Admission {
  std::string key;  // dedup key (sha256 identity)
  std::string request_sha256;
  std::string request_schema;
  std::string request_id;
  std::string model_dir;
  // What was opened to check the paths the request names (admission.h opened_record).
  common::Json opened = common::Json::array();
  // What admission checked beyond the document ({"receipts": ...}), kept beside the request as
  // checks.json (kChecksFile) for the result to say; null: nothing.
  common::Json checks = nullptr;
  std::string accepted_note = "";  // appended to the "accepted" event: what was checked
};

inline constexpr std::string_view kChecksFile = "checks.json";

struct SubmitContext {
  const Config& config;
  const Peer& peer;
  std::string query_model_dir = "";  // ?model_dir= (next-token requests only)
  std::string receipts_dir = "";     // ?receipts_dir= (Kiln next-token requests only)
};

struct Part;
struct RunFacts;
struct OpenedModel;

struct Step {
  std::string role;              // workspace name: "fingerprint", "capture-reference", ...
  std::filesystem::path worker;  // executable
  std::string mode;              // its first argument
  // The model directory whose files the worker reads: the engine opens each of them and hands
  // the worker the descriptors ("model_fds" in its input), so that a worker that runs as
  // another user reads exactly what the submitter may read, and nothing by path.
  std::string model_dir;
  // Files (absolute paths, already checked against the submitter's rights) the engine opens and
  // hands over before the model's files: fds 3, 4, ... in this order.
  std::vector<std::string> open_files;
  std::function<common::Json()> input;  // built when the step starts, after the previous ones
  // Files moved into the fresh workspace first (source, name there): a worker sees only its
  // own workspace of the state directory.
  std::function<std::vector<std::pair<std::filesystem::path, std::string>>()> move_in;
  // Checks and keeps the worker's output; throws common::Error to fail the job.
  std::function<void(common::Json output, const contain::Evidence& evidence)> accept;

  // A step whose worker ends parts of the job one by one (a batch's states) has `harvest`
  // instead of `accept`: called after every run of its worker, whatever the exit, with the
  // workspace and the evidence; returns some of the parts that run ended (the engine records
  // each as a job of its own) and says what then: kMore (call again for the rest: the engine
  // answers other requests in between, so that thousands of parts do not stall it), kAgain (run
  // the step once more for parts still to do, in a fresh workspace with input() rebuilt), kNext.
  // Throws common::Error to fail the job.
  enum class Then { kNext, kAgain, kMore };
  std::function<std::vector<Part>(const RunFacts& facts, const std::filesystem::path& workspace,
                                  const contain::Evidence& evidence, Then& then)>
      harvest = nullptr;
  // Polled while the worker runs: one progress message per piece of news (none: nothing new).
  std::function<std::vector<std::string>(const std::filesystem::path& workspace)> progress =
      nullptr;
  // Polled with `progress`: a reason when the worker made no progress for too long (a batch
  // state that hangs), and the engine stops it; its harvest then decides what runs again.
  std::function<std::optional<std::string>()> stalled = nullptr;
  // Set on a next-token oracle step that a resident worker may run (Config::resident, engine
  // resident.cpp): called with the bytes_used of a worker that already holds the model; throws
  // common::Error naming the first difference from this job's fingerprint, and the engine then
  // replaces that worker instead of using it. Unset: the step always runs a worker of its own.
  std::function<void(const common::Json& bytes_used)> resident_bytes = nullptr;
  // Called with the model's files as the engine opened them for this step's worker, before it
  // starts; throws common::Error to fail the job instead (a shard the fingerprint left to this
  // worker that is no longer in the state the fingerprint saw).
  std::function<void(const OpenedModel& opened)> opened_model = nullptr;
  // Called, where set, with the model's files opened before anything else of the step: returns
  // true when the step's outcome is already known without a worker (it then keeps it as
  // `accept` would; fingerprint_step's reuse of an unchanged directory's fingerprint), and the
  // engine goes on to the next step. Throws common::Error to fail the job.
  std::function<bool(const OpenedModel& opened)> reuse = nullptr;
  // The worker's timeout is the configured (or requested) one times this (called after input();
  // unset: 1), e.g. per state of a batch.
  std::function<double()> timeout_factor = nullptr;
  // The most this step's worker may run, whatever the job's timeout (unset: no cap), and the
  // configuration key that set it, named when the worker is stopped for it.
  std::optional<std::chrono::milliseconds> timeout_cap = std::nullopt;
  std::string timeout_cap_key = {};
};

// How every worker's output reaches its step, fresh or recorded by an earlier assayd: checked
// against its published schema (common/worker_schemas.h) before accept() reads any of it. Throws
// Error("worker.<role>_output") naming `what` and the JSON pointers, or what accept() throws.
inline void accept_output(Step& step, common::Json output, const contain::Evidence& evidence,
                          std::string_view what = "output.json") {
  common::check_worker_output(output, "worker." + step.role + "_output",
                              step.role + " worker's " + std::string(what));
  step.accept(std::move(output), evidence);
}

// Files that become durable together with a job's terminal state (JobStore::commit): what
// sealing a result makes (steps.h, seal).
struct CommitFiles {
  // name in the job directory -> content, written with mode 0644 (results are public to readers
  // of the job directory; job.json stays 0600)
  std::vector<std::pair<std::string, std::string>> write;
  std::vector<std::filesystem::path> in_place;  // already at their final path: only fsynced
};

// What the engine seals: the result document (without result_sha256) and its artifact.
struct Sealed {
  common::Json result;
  std::filesystem::path artifact;  // in the job directory already
  std::string artifact_sha256;
  std::string artifact_name;  // its name in the statement
  std::string predicate_type;
  std::string message;  // the terminal event
};

// A part of a job that ends before the job does (a batch's state). The engine keeps it as a job
// of its own, part_job_id(job, index), terminal from the start, with the request, the sealed
// result and the artifact a single job of that request would have (or its error): every tool
// that reads a job reads it.
struct Part {
  std::size_t index = 0;
  common::Json request;  // the part's request document, its request.json
  Admission admission;   // the part's request identity (its key is made unique by the engine)
  std::optional<Sealed> sealed;       // a success: its result's job_id is part_job_id(...)
  std::optional<common::Json> error;  // else {"code", "message"}
  std::string message;                // its terminal event
};

// What the store holds of a recorded part, handed back to the pipeline.
struct PartRecord {
  std::size_t index = 0;
  std::string job_id;
  bool succeeded = false;
  common::Json result;  // the sealed result of a success (with result_sha256), else null
  common::Json error;   // {"code", "message"} of a failure, else null
};

// The id of a job's part: "j-" and 24 hex digits of sha256({job, index}).
std::string part_job_id(const std::string& job_id, std::size_t index);

// Facts the engine hands to assemble().
struct RunFacts {
  std::string job_id;
  std::filesystem::path job_dir;
  double started_unix = 0;
  common::Json host_memory;  // the preflight's record
  std::string backend;       // containment backend
  std::string key_id;
};

class Pipeline {
 public:
  virtual ~Pipeline() = default;
  // Memory the largest worker of this job needs (preflight).
  virtual std::uint64_t required_bytes() = 0;
  // Limits the request asks for (they may only lower the configured ones).
  virtual common::RequestLimits limits() const = 0;
  virtual std::vector<Step> plan() = 0;
  // After the last step: moves the artifact into the job directory and builds the result.
  virtual Sealed assemble(const RunFacts& facts) = 0;
  // Parts (Part): how many this job has (0 for kinds without), and each the store holds, handed
  // back before plan() (those an earlier run recorded before a restart cut it off) and as each
  // is recorded.
  // Whether a step of this job may run on a resident worker (Step::resident_bytes): the
  // preflight then counts an idle resident worker holding its model as memory it may use.
  virtual bool may_use_resident() const { return false; }
  virtual std::size_t part_count() const { return 0; }
  virtual void part_recorded(const PartRecord&) {}
};

// One entry per job kind; a new kind is a new file plus one line in kinds().
struct JobKind {
  std::string_view name;
  std::string_view request_schema;  // empty: the default kind (next-token, two schemas)
  std::string_view artifact_name;
  bool model_dir_query = false;  // takes ?model_dir= (its requests may lack a model_dir)
  Admission (*admit)(const common::Json& document, const SubmitContext& context);
  std::unique_ptr<Pipeline> (*open)(const Config& config, const std::filesystem::path& job_dir,
                                    const std::string& model_dir);
};

const std::vector<JobKind>& kinds();
// The kind a request document (or a stored request_schema) belongs to.
const JobKind& kind_for_schema(std::string_view schema);
// The kind a batch's state is counted under (/metrics): a job of its own, part of a batch job.
inline constexpr std::string_view kBatchStateKind = "next-token-batch-state";

std::unique_ptr<Pipeline> open_next_token(const Config&, const std::filesystem::path&,
                                          const std::string&);
Admission admit_next_token(const common::Json&, const SubmitContext&);
std::unique_ptr<Pipeline> open_fidelity(const Config&, const std::filesystem::path&,
                                        const std::string&);
Admission admit_fidelity(const common::Json&, const SubmitContext&);
std::unique_ptr<Pipeline> open_trajectory(const Config&, const std::filesystem::path&,
                                          const std::string&);
Admission admit_trajectory(const common::Json&, const SubmitContext&);
std::unique_ptr<Pipeline> open_layers(const Config&, const std::filesystem::path&,
                                      const std::string&);
Admission admit_layers(const common::Json&, const SubmitContext&);
std::unique_ptr<Pipeline> open_audit(const Config&, const std::filesystem::path&,
                                     const std::string&);
Admission admit_audit(const common::Json&, const SubmitContext&);
std::unique_ptr<Pipeline> open_batch(const Config&, const std::filesystem::path&,
                                     const std::string&);
Admission admit_batch(const common::Json&, const SubmitContext&);

}  // namespace assay::supervisor
