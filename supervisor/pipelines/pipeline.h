// A job kind is a list of typed steps: each step runs one worker in a contained process (a fresh
// workspace, its input.json, the containment evidence, its output.json) and hands the output to
// the kind's typed state; once every step ran, the kind assembles the result that gets sealed.
// The engine (jobs/engine.h) runs the steps; a kind knows nothing of the store or the transport.
#pragma once

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
#include "supervisor/config.h"
#include "supervisor/contain/evidence.h"

namespace assay::supervisor {

// Who asked: the peer credentials of the connection, resolved once per connection.
struct Peer {
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;
  bool admin = false;  // root or a member of the admin group
};

// What a submission is, once checked: the durable record's fields.
struct Admission {
  std::string key;  // dedup key (sha256 identity)
  std::string request_sha256;
  std::string request_schema;
  std::string request_id;
  std::string model_dir;
};

struct SubmitContext {
  const Config& config;
  const Peer& peer;
  std::string query_model_dir;  // ?model_dir= (next-token requests only)
};

struct Step {
  std::string role;              // workspace name: "fingerprint", "capture-reference", ...
  std::filesystem::path worker;  // executable
  std::string mode;              // its first argument
  // The model directory whose files the worker reads: the engine opens each of them and hands
  // the worker the descriptors ("model_fds" in its input), so that a worker that runs as
  // another user reads exactly what the submitter may read, and nothing by path.
  std::string model_dir;
  // Files (absolute paths, already checked against the submitter's rights) the engine opens and
  // hands over after the model's files: fds 3, 4, ... in this order when there is no model_dir.
  std::vector<std::string> open_files;
  std::function<common::Json()> input;  // built when the step starts, after the previous ones
  // Files moved into the fresh workspace first (source, name there): a worker sees only its
  // own workspace of the state directory.
  std::function<std::vector<std::pair<std::filesystem::path, std::string>>()> move_in;
  // Checks and keeps the worker's output; throws common::Error to fail the job.
  std::function<void(common::Json output, const contain::Evidence& evidence)> accept;
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
};

// One entry per job kind; a new kind is a new file plus one line in kinds().
struct JobKind {
  std::string_view name;
  std::string_view request_schema;  // empty: the default kind (next-token, two schemas)
  std::string_view artifact_name;
  Admission (*admit)(const common::Json& document, const SubmitContext& context);
  std::unique_ptr<Pipeline> (*open)(const Config& config, const std::filesystem::path& job_dir,
                                    const std::string& model_dir);
};

const std::vector<JobKind>& kinds();
// The kind a request document (or a stored request_schema) belongs to.
const JobKind& kind_for_schema(std::string_view schema);

std::unique_ptr<Pipeline> open_next_token(const Config&, const std::filesystem::path&,
                                          const std::string&);
Admission admit_next_token(const common::Json&, const SubmitContext&);
std::unique_ptr<Pipeline> open_fidelity(const Config&, const std::filesystem::path&,
                                        const std::string&);
Admission admit_fidelity(const common::Json&, const SubmitContext&);
std::unique_ptr<Pipeline> open_trajectory(const Config&, const std::filesystem::path&,
                                          const std::string&);
Admission admit_trajectory(const common::Json&, const SubmitContext&);

}  // namespace assay::supervisor
