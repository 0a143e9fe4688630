// Batch jobs: many next-token states on one model. One fingerprint, then one oracle worker that
// loads the model once and runs every state in turn (assay-oracle next-token-batch). Each state
// ends as a job of its own whose result is a single job's plus "batch" (pipeline.h, Part); a
// worker that dies part-way is run again for the states not yet done; the batch's own result is
// a signed summary whose artifact lists every state's result digest.
#include <unistd.h>

#include <chrono>
#include <map>
#include <set>

#include "common/batch.h"
#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/kiln_receipt.h"
#include "common/protocol.h"
#include "common/result.h"
#include "common/time.h"
#include "supervisor/pipelines/admission.h"
#include "supervisor/pipelines/documents.h"
#include "supervisor/pipelines/next_token.h"
#include "supervisor/pipelines/numerics.h"
#include "supervisor/pipelines/pipeline.h"
#include "supervisor/pipelines/prompt_check.h"
#include "supervisor/pipelines/steps.h"

namespace assay::supervisor {

using common::Error;
using common::Json;
namespace fs = std::filesystem;

namespace {

constexpr std::size_t kMaxStateOutputBytes = 64 * 1024 * 1024;
// Runs of the worker in a row that end no state before a state is failed alone.
constexpr int kFruitlessRunsPerState = 2;
// States harvested per turn of the engine's io_context (each is parsed, checked, sealed, signed
// and committed as a job, three fsyncs): thousands of states must not keep the daemon from
// answering. Few per turn, so that a slow disk (10 ms an fsync) still leaves it answering within
// a fraction of a second; the turns themselves cost next to nothing.
constexpr std::size_t kStatesPerHarvest = 4;

std::string state_file(std::size_t index, const char* extension) {
  return "state-" + std::to_string(index) + extension;
}

class BatchPipeline final : public Pipeline {
 public:
  BatchPipeline(const Config& config, fs::path job_dir, std::string model_dir)
      : config_(config),
        job_dir_(std::move(job_dir)),
        job_id_(job_dir_.filename().string()),
        model_dir_(std::move(model_dir)),
        request_(common::validate_batch_request(read_request(job_dir_))) {}

  std::uint64_t required_bytes() override {
    std::size_t longest = 0;
    for (const auto& state : request_.states)
      longest = std::max(longest, state.input_token_ids.size());
    std::uint64_t need = estimate_required_bytes(model_dir_, longest);
    if (!numerics_spec().is_null())
      need = std::max(need, numerics_required_bytes(model_dir_, longest, numerics_spec()));
    return need;
  }
  common::RequestLimits limits() const override { return request_.limits; }
  bool may_use_resident() const override {
    return config_.resident_steps() && !request_.limits.memory_bytes;
  }
  std::size_t part_count() const override { return request_.states.size(); }
  void part_recorded(const PartRecord& record) override {
    records_[record.index] = record;
    // Runs of the worker are numbered across restarts: a new run follows the last recorded one.
    if (record.succeeded) attempt_ = std::max(attempt_, record.result["batch"].value("attempt", 0));
  }

  std::vector<Step> plan() override {
    std::string name = request_.model_identity ? (*request_.model_identity)["id"].get<std::string>()
                                               : fs::path(model_dir_).filename().string();
    std::vector<Step> steps;
    steps.push_back(fingerprint_step(config_, "fingerprint", model_dir_, name,
                                     request_.model_identity, fingerprint_));
    // A restart after the last state was recorded has only the summary left to make.
    if (records_.size() < request_.states.size()) {
      if (std::optional<Step> envelope = numerics_step_for_pending())
        steps.push_back(std::move(*envelope));
      steps.push_back(oracle_step());
    }
    return steps;
  }

  Sealed assemble(const RunFacts& facts) override;

 private:
  std::vector<std::size_t> pending() const {
    std::vector<std::size_t> out;
    for (std::size_t i = 0; i < request_.states.size(); ++i)
      if (!records_.contains(i)) out.push_back(i);
    return out;
  }

  // The numerics spec the batch's states ask for (validate_batch_request: all alike), or null.
  const Json& numerics_spec() const {
    static const Json none;
    for (const auto& state : request_.states)
      if (!state.numerics.is_null()) return state.numerics;
    return none;
  }

  // The numerics envelope of every pending state that asks for it, in one worker (one model
  // load), before the oracle: each state's result is sealed as the oracle ends it, and its
  // "numerics" is built then from the oracle's figures and these. A state whose ids are outside
  // the vocabulary is left out (it fails alone in the oracle, as without numerics).
  std::optional<Step> numerics_step_for_pending() {
    const Json& spec = numerics_spec();
    if (spec.is_null()) return std::nullopt;
    const std::int64_t vocab = read_vocab_size(model_dir_);
    Json states = Json::array();
    std::size_t first = request_.states.size();
    for (std::size_t i : pending()) {
      const common::NextTokenRequest& r = request_.states[i];
      if (r.numerics.is_null()) continue;
      bool inside = true;
      for (std::int64_t id : r.input_token_ids) inside = inside && id < vocab;
      for (const auto& c : r.candidates) inside = inside && c.token_id < vocab;
      if (!inside) continue;
      Json candidates = Json::array();
      for (const auto& c : r.candidates)
        candidates.push_back(Json{{"engine", c.engine}, {"token_id", c.token_id}});
      states.push_back(Json{{"index", i},
                            {"input_token_ids", r.input_token_ids},
                            {"candidate_tokens", std::move(candidates)}});
      first = std::min(first, i);
    }
    if (states.empty()) return std::nullopt;
    const double count = static_cast<double>(states.size());
    Step step = numerics_step(
        config_, model_dir_,
        [this, first] {
          return supervisor::oracle_input(model_dir_, request_.states[first], Json::array(),
                                          config_.oracle_device, worker_threads(config_));
        },
        spec, std::move(states), fingerprint_, numerics_, numerics_evidence_);
    // Each state gets the worker timeout of a single job's envelope.
    step.timeout_factor = [count] { return count; };
    return step;
  }

  // A state's "numerics" when the envelope measured it (else null).
  Json numerics_of(std::size_t index, const Json& oracle_output) const {
    if (!numerics_evidence_ || request_.states[index].numerics.is_null()) return nullptr;
    for (const Json& state : numerics_.value("states", Json::array()))
      if (state.value("index", Json()) == Json(index)) {
        Json candidates = Json::array();
        for (const auto& c : request_.states[index].candidates)
          candidates.push_back(Json{{"engine", c.engine}, {"token_id", c.token_id}});
        return numerics_section(request_.states[index].numerics, candidates, oracle_output, state,
                                numerics_, *numerics_evidence_);
      }
    return nullptr;
  }

  Step oracle_step() {
    Step step{"oracle", config_.oracle_worker, "next-token-batch", model_dir_, {}, {}, {}, {}};
    step.input = [this] { return oracle_input(); };
    step.timeout_factor = [this] { return static_cast<double>(running_.size()); };
    step.harvest = [this](const RunFacts& facts, const fs::path& ws,
                          const contain::Evidence& evidence,
                          Step::Then& then) { return harvest(facts, ws, evidence, then); };
    step.progress = [this](const fs::path& ws) { return progress(ws); };
    // A resident worker that holds exactly this batch's bytes may run it (as a single job).
    if (may_use_resident())
      step.resident_bytes = [this](const Json& bytes_used) {
        check_bytes_used(Json{{"bytes_used", bytes_used}}, fingerprint_, "resident oracle");
      };
    step.stalled = [this]() -> std::optional<std::string> {
      // Each state (the first with the model's load) gets the worker timeout of a single job.
      double limit = request_.limits.timeout_seconds.value_or(config_.worker_timeout_seconds);
      if (stalled_ ||
          std::chrono::steady_clock::now() - last_progress_ < std::chrono::duration<double>(limit))
        return std::nullopt;
      stalled_ = true;
      return "no state ended in " + std::to_string(static_cast<long long>(limit)) +
             " s (the timeout of one state)";
    };
    return step;
  }

  Json oracle_input() {
    ++attempt_;
    running_ = pending();
    seen_ = 0;
    stalled_ = false;
    last_progress_ = std::chrono::steady_clock::now();
    Json states = Json::array();
    for (std::size_t i : running_) {
      const common::NextTokenRequest& r = request_.states[i];
      Json candidates = Json::array();
      for (const auto& c : r.candidates)
        candidates.push_back(
            Json{{"engine", c.engine}, {"token_id", c.token_id}, {"text", c.text}});
      Json single = supervisor::oracle_input(model_dir_, r, candidates, config_.oracle_device,
                                             worker_threads(config_));
      Json state{{"index", i},
                 {"input_token_ids", single["input_token_ids"]},
                 {"candidate_tokens", single["candidate_tokens"]}};
      if (single.contains("continuation_prefix"))
        state["continuation_prefix"] = single["continuation_prefix"];
      states.push_back(std::move(state));
    }
    Json input =
        supervisor::oracle_input(model_dir_, request_.states[running_.front()], Json::array(),
                                 config_.oracle_device, worker_threads(config_));
    return Json{{"schema", protocol::kOracleBatchInput},
                {"model_dir", model_dir_},
                {"execution", input["execution"]},
                {"states", std::move(states)}};
  }

  // States end in order: the first of this run's states without a file is the one running.
  // One message per state that ended since the last poll, with its argmax or its error.
  std::vector<std::string> progress(const fs::path& ws) {
    std::vector<std::string> news;
    while (seen_ < running_.size()) {
      std::size_t index = running_[seen_];
      fs::path file = ws / state_file(index, ".json");
      if (!fs::exists(file)) break;
      ++seen_;
      last_progress_ = std::chrono::steady_clock::now();
      std::string what;
      try {
        Json out =
            common::parse_strict(common::read_file(file, kMaxStateOutputBytes),
                                 {.max_bytes = kMaxStateOutputBytes, .exact_integers = false});
        what = out.contains("error") ? "failed (" + out["error"].value("code", "") + ")"
                                     : "argmax " + out.value("argmax", Json()).dump();
      } catch (const Error&) {
        what = "done";  // checked when the run ends
      }
      news.push_back("oracle: state " + std::to_string(index) + " " + what + " (" +
                     std::to_string(records_.size() + seen_) + "/" +
                     std::to_string(request_.states.size()) + " states done)");
    }
    return news;
  }

  std::vector<Part> harvest(const RunFacts& facts, const fs::path& ws,
                            const contain::Evidence& evidence, Step::Then& then);
  Part state_part(const RunFacts& facts, std::size_t index, const fs::path& ws,
                  const contain::Evidence& evidence);
  Part failed_part(std::size_t index, const std::string& code, const std::string& message) {
    return Part{index,
                request_.states[index].document,
                admission(index),
                std::nullopt,
                Json{{"code", code}, {"message", message}},
                "failed: " + message};
  }
  Admission admission(std::size_t index) const {
    const common::NextTokenRequest& r = request_.states[index];
    return Admission{"", r.request_sha256, r.schema, r.id, model_dir_};
  }
  Json summary(const RunFacts& facts, const fs::path& artifact) const;
  std::string exit_of(const contain::Evidence& evidence) const {
    if (evidence.succeeded()) return "succeeded";
    return stalled_ ? "stopped: no state ended within the timeout of one state"
                    : evidence.failure_reason();
  }

  const Config& config_;
  fs::path job_dir_;
  std::string job_id_;
  std::string model_dir_;
  common::BatchRequest request_;
  FingerprintRun fingerprint_;
  Json numerics_;  // the envelope's output over the pending states that asked for it
  std::optional<contain::Evidence> numerics_evidence_;
  std::map<std::size_t, PartRecord> records_;
  std::vector<std::size_t> running_;  // the states the current run of the worker was given
  std::size_t seen_ = 0;              // of those, how many have their file (progress)
  std::size_t harvested_ = 0;         // of those, how many the harvest has looked at
  std::size_t ended_ = 0;             // of those, how many had ended
  std::vector<std::size_t> left_;     // of those, the ones without a file
  bool elsewhere_ = false;            // of those, some were given to another node's run
  std::chrono::steady_clock::time_point last_progress_;  // the run's start or its last state
  bool stalled_ = false;  // the engine stopped this run: no state ended within one timeout
  int attempt_ = 0;
  int fruitless_ = 0;              // runs in a row that ended no state
  Json attempts_ = Json::array();  // each run's exit, for the summary
};

Part BatchPipeline::state_part(const RunFacts& facts, std::size_t index, const fs::path& ws,
                               const contain::Evidence& evidence) {
  Json output =
      common::parse_strict(common::read_file(ws / state_file(index, ".json"), kMaxStateOutputBytes),
                           {.max_bytes = kMaxStateOutputBytes, .exact_integers = false});
  if (output.contains("error")) {
    const Json& e = output["error"];
    return failed_part(index, e.value("code", "oracle.state_failed"), e.value("message", ""));
  }
  if (output.value("schema", "") != protocol::kOracleOutput ||
      output.value("batch_index", Json()) != Json(index))
    throw Error("worker.oracle_output", "state " + std::to_string(index) +
                                            ": the batch worker's file is not this state's "
                                            "assay.oracle-output.v1");
  // A state's result binds the bytes it was computed with, like a single job's.
  check_bytes_used(output, fingerprint_, "oracle");
  check_configuration(output, "oracle");
  output.erase("batch_index");
  fs::path artifact = ws / oracle_artifact_name(output);
  if (oracle_artifact_name(output) != state_file(index, ".safetensors"))
    throw Error("worker.oracle_output", "state " + std::to_string(index) + " names logits file " +
                                            oracle_artifact_name(output));
  RunFacts part_facts = facts;
  part_facts.job_id = part_job_id(job_id_, index);
  Json result =
      next_token_result(config_, part_facts, request_.states[index], fingerprint_, output, evidence,
                        artifact, common::receipts_not_given(request_.states[index]),
                        prompt_check_skipped(request_.states[index], true));
  result["batch"] = Json{
      {"id", job_id_}, {"index", index}, {"count", request_.states.size()}, {"attempt", attempt_}};
  if (Json numerics = numerics_of(index, output); !numerics.is_null())
    result["numerics"] = std::move(numerics);
  std::string message = next_token_message(result);
  std::string artifact_sha = result["reference_artifact"]["sha256"];
  Sealed sealed{std::move(result),
                artifact,
                artifact_sha,
                std::string(common::kArtifactFileName),
                std::string(protocol::kResultPredicateType),
                message};
  return Part{
      index,  request_.states[index].document, admission(index), std::move(sealed), std::nullopt,
      message};
}

std::vector<Part> BatchPipeline::harvest(const RunFacts& facts, const fs::path& ws,
                                         const contain::Evidence& evidence, Step::Then& then) {
  // A worker of a Slurm pool was given some of the run's states (a shard: executors/pool.h);
  // the others run on other nodes and come in runs of their own.
  std::optional<std::set<std::size_t>> given;
  if (evidence.executor && evidence.executor->contains("states")) {
    given.emplace();
    for (const Json& index : (*evidence.executor)["states"])
      given->insert(index.get<std::size_t>());
  }
  // A few states per call: the engine answers other requests between calls.
  std::vector<Part> parts;
  while (harvested_ < running_.size() && parts.size() < kStatesPerHarvest) {
    std::size_t index = running_[harvested_++];
    if (given && !given->count(index)) {
      elsewhere_ = true;
      continue;
    }
    if (fs::exists(ws / state_file(index, ".json"))) {
      parts.push_back(state_part(facts, index, ws, evidence));
      ++ended_;
    } else {
      left_.push_back(index);
    }
  }
  if (harvested_ < running_.size()) {
    then = Step::Then::kMore;
    return parts;
  }
  // The whole run is in: what comes next.
  std::vector<std::size_t> left = std::move(left_);
  std::size_t ended = ended_;
  const bool elsewhere = elsewhere_;
  left_.clear();
  harvested_ = ended_ = 0;
  elsewhere_ = false;
  attempts_.push_back(Json{{"attempt", attempt_},
                           {"states_given", given ? given->size() : running_.size()},
                           {"states_ended", ended},
                           {"exit", exit_of(evidence)},
                           {"process", evidence.to_json()}});
  // States still on other nodes: the engine asks for them again (the pool runs none twice).
  then = elsewhere ? Step::Then::kAgain : Step::Then::kNext;
  if (left.empty()) return parts;
  if (evidence.succeeded())
    throw Error("worker.oracle_output", "the batch worker exited 0 without state " +
                                            std::to_string(left.front()) + "'s file");
  // The worker died (a crash, the OOM killer, the timeout): the states it did not end run again
  // in a fresh worker. A state on which the worker dies run after run fails alone.
  fruitless_ = ended == 0 ? fruitless_ + 1 : 0;
  if (fruitless_ >= kFruitlessRunsPerState) {
    std::size_t index = left.front();
    parts.push_back(failed_part(index, "worker.oracle_failed",
                                "the oracle worker died on this state in " +
                                    std::to_string(fruitless_) +
                                    " runs in a row, the last time: " + exit_of(evidence) +
                                    "; stderr: " + tail_file(ws / protocol::kStderrFile, 2000)));
    fruitless_ = 0;
    left.erase(left.begin());
  }
  if (!left.empty()) then = Step::Then::kAgain;
  return parts;
}

Json BatchPipeline::summary(const RunFacts& facts, const fs::path& artifact) const {
  Json states = Json::array();
  std::map<std::string, std::size_t> verdicts;
  std::size_t succeeded = 0;
  for (const auto& [index, record] : records_) {
    Json s{{"index", index},
           {"job_id", record.job_id},
           {"request_id", request_.states[index].id},
           {"request_sha256", request_.states[index].request_sha256},
           {"state", record.succeeded ? "succeeded" : "failed"}};
    if (record.succeeded) {
      ++succeeded;
      const Json& verdict = record.result["verdict"];
      s["result_sha256"] = record.result["result_sha256"];
      s["argmax_candidate"] = verdict["argmax_candidate"];
      s["argmax_token_id"] = verdict["argmax_token_id"];
      s["attempt"] = record.result["batch"]["attempt"];
      ++verdicts[verdict["argmax_candidate"].get<std::string>()];
    } else {
      s["error"] = record.error;
    }
    states.push_back(std::move(s));
  }
  return Json{
      {"schema", protocol::kNextTokenBatchResult},
      {"created_at_utc", common::now_rfc3339()},
      {"duration_seconds", common::now_unix() - facts.started_unix},
      {"job_id", facts.job_id},
      {"supervisor", {{"version", ASSAY_VERSION}, {"key_id", facts.key_id}}},
      {"source", source_section()},
      {"request",
       {{"schema", request_.schema},
        {"id", request_.id},
        {"sha256", request_.request_sha256},
        {"states", request_.states.size()}}},
      {"model_identity", fingerprint_.output["model_identity"]},
      {"model_fingerprint", fingerprint_section(fingerprint_)},
      {"containment", {{"host_memory", facts.host_memory}, {"backend", facts.backend}}},
      {"counts",
       {{"states", request_.states.size()},
        {"succeeded", succeeded},
        {"failed", records_.size() - succeeded},
        {"argmax_candidate", verdicts}}},
      {"states", std::move(states)},
      // This run's workers; states recorded before a restart name their run in their own result.
      {"oracle_runs", attempts_},
      {"states_artifact",
       {{"name", common::kBatchArtifactFileName},
        {"bytes", fs::file_size(artifact)},
        {"sha256", common::sha256_file_id(artifact)}}}};
}

Sealed BatchPipeline::assemble(const RunFacts& facts) {
  if (records_.size() != request_.states.size())
    throw Error("supervisor.internal", "the batch ended with " + std::to_string(records_.size()) +
                                           " of " + std::to_string(request_.states.size()) +
                                           " states recorded");
  // The artifact binds every state's result: one canonical line per state, in index order.
  std::string lines;
  for (const auto& [index, record] : records_) {
    Json line{{"index", index}, {"job_id", record.job_id}};
    if (record.succeeded)
      line["result_sha256"] = record.result["result_sha256"];
    else
      line["error"] = record.error;
    lines += common::canonical(line) + "\n";
  }
  fs::path artifact = facts.job_dir / common::kBatchArtifactFileName;
  common::write_unsynced(artifact, lines, 0644);
  Json result = summary(facts, artifact);
  const Json& counts = result["counts"];
  std::string message = "succeeded: " + std::to_string(counts["succeeded"].get<std::size_t>()) +
                        " of " + std::to_string(request_.states.size()) + " states, " +
                        std::to_string(counts["failed"].get<std::size_t>()) + " failed; " +
                        counts["argmax_candidate"].dump();
  std::string sha = result["states_artifact"]["sha256"];
  return Sealed{std::move(result),
                artifact,
                sha,
                std::string(common::kBatchArtifactFileName),
                std::string(protocol::kBatchPredicateType),
                message};
}

}  // namespace

Admission admit_batch(const Json& document, const SubmitContext& context) {
  common::BatchRequest b = common::validate_batch_request(document);
  check_request_limits(b.limits, context.config);
  std::string dir =
      !context.query_model_dir.empty() ? context.query_model_dir : b.model_dir.value_or("");
  if (dir.empty())
    throw Error("request.no_model_dir",
                "no model directory: neither the batch nor its states name one (Kiln requests "
                "never do); pass ?model_dir=/abs/dir (assay submit --batch FILE --model DIR)");
  if (!context.query_model_dir.empty() && b.model_dir && *b.model_dir != context.query_model_dir)
    throw Error("request.mixed_models", "the batch names model_dir \"" + *b.model_dir +
                                            "\" and the submission \"" + context.query_model_dir +
                                            "\"");
  Json opened = Json::array();
  std::string model_dir = check_model_dir(dir, context.peer, &opened);
  if (context.query_model_dir.empty() && model_dir != dir)
    throw Error("request.bad_model",
                "model_dir \"" + dir + "\" is not normalised (as " + model_dir + ")");
  // Token ids outside the vocabulary fail their own state, not the batch: no check_vocab here.
  read_vocab_size(model_dir);
  for (const auto& state : b.states)
    if (!state.numerics.is_null() && ::access(context.config.hf_worker.c_str(), X_OK) != 0)
      throw Error("request.numerics_unavailable",
                  "the batch's states ask for numerics, which needs assay-hf-worker "
                  "(transformers); this host does not have it (" +
                      context.config.hf_worker.string() + ")");
  return Admission{common::sha256_canonical_id(Json{{"request_sha256", b.request_sha256},
                                                    {"model_dir", model_dir},
                                                    {"kind", "next-token-batch"}}),
                   b.request_sha256,
                   b.schema,
                   b.id,
                   model_dir,
                   std::move(opened)};
}

std::unique_ptr<Pipeline> open_batch(const Config& config, const fs::path& job_dir,
                                     const std::string& model_dir) {
  return std::make_unique<BatchPipeline>(config, job_dir, model_dir);
}

}  // namespace assay::supervisor
