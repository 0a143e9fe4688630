// Trajectory jobs: where each engine's greedy continuation first left the reference.
//
// Steps: fingerprint the model; per engine one `assay-oracle capture` over prompt + continuation
// scoring the positions that predict the continuation's tokens ([P-1, P-1+C)), its bytes_used
// checked against the fingerprint; then `assay-compare trajectory` over the captures (moved into
// its workspace) reduces each row to the reference argmax, margin and the engine token's rank.
// The result `assay.trajectory-result.v1` carries per engine the first departure, which engine
// departed first, and the engines' first divergence with its attribution; the artifact holds
// argmax and margin per position (and the full logits only at departure rows).
#include <unistd.h>

#include <algorithm>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "common/result.h"
#include "common/text.h"
#include "common/time.h"
#include "common/trajectory.h"
#include "supervisor/pipelines/admission.h"
#include "supervisor/pipelines/documents.h"
#include "supervisor/pipelines/numerics.h"
#include "supervisor/pipelines/pipeline.h"
#include "supervisor/pipelines/steps.h"

namespace assay::supervisor {

using common::Error;
using common::Json;
namespace fs = std::filesystem;

namespace {

constexpr const char* kCompareRole = "compare";

struct CaptureRun {
  Json output;  // assay.oracle-capture-output.v1
  std::optional<contain::Evidence> evidence;
};

class TrajectoryPipeline final : public Pipeline {
 public:
  TrajectoryPipeline(const Config& config, fs::path job_dir)
      : config_(config),
        job_dir_(std::move(job_dir)),
        r_(common::validate_trajectory_request(read_request(job_dir_))),
        vocab_(read_vocab_size(r_.model_dir)),
        captures_(r_.continuations.size()) {}

  std::uint64_t required_bytes() override {
    std::uint64_t longest = 0;
    for (const auto& c : r_.continuations)
      longest = std::max<std::uint64_t>(longest, r_.prompt_token_ids.size() + c.token_ids.size());
    std::uint64_t need = estimate_required_bytes(r_.model_dir, longest,
                                                 static_cast<std::uint64_t>(r_.block_positions));
    if (!r_.numerics.is_null())
      need = std::max(need, numerics_required_bytes(r_.model_dir, longest, r_.numerics));
    return need;
  }
  common::RequestLimits limits() const override { return r_.limits; }

  std::vector<Step> plan() override {
    std::string name = r_.model_identity ? (*r_.model_identity)["id"].get<std::string>()
                                         : fs::path(r_.model_dir).filename().string();
    std::vector<Step> steps;
    steps.push_back(fingerprint_step(config_, "fingerprint", r_.model_dir, name, r_.model_identity,
                                     fingerprint_));
    for (std::size_t i = 0; i < r_.continuations.size(); ++i) steps.push_back(capture(i));
    steps.push_back(compare());
    // Is the first divergence numerics? The envelope of the state where the continuations first
    // differ, when the request asks and at least two engines have a token there.
    if (!r_.numerics.is_null()) {
      auto d = r_.divergence();
      if (!d)
        numerics_skipped_ = "the continuations are all equal: there is no divergence to classify";
      else if (d->candidates.size() < 2)
        numerics_skipped_ = "only one engine has a token at the divergence (index " +
                            std::to_string(d->index) +
                            "; the others' continuations ended): no dispute to classify";
      else
        steps.push_back(numerics_step(
            config_, r_.model_dir,
            [this] {
              return Json{{"model_dir", r_.model_dir},
                          {"execution",
                           {{"device", config_.oracle_device},
                            {"dtype", execution_dtype(r_.model_dir)},
                            {"threads", worker_threads(config_)}}}};
            },
            r_.numerics,
            Json::array({Json{{"index", d->index},
                              {"input_token_ids", d->input_token_ids},
                              {"candidate_tokens", d->candidates}}}),
            fingerprint_, numerics_, numerics_evidence_));
    }
    return steps;
  }

  Sealed assemble(const RunFacts& facts) override {
    // A copy: operator[] on a key the worker left out is null here, not undefined behaviour
    // (const operator[]; fuzz_worker_output found it).
    Json cmp = compare_output_;
    fs::path artifact = job_dir_ / common::kTrajectoryArtifactFileName;
    std::string artifact_sha = take_reported_artifact(
        job_dir_ / kCompareRole / common::kTrajectoryArtifactFileName, artifact,
        cmp.value("artifact_sha256", Json()), "the trajectory artifact");
    Json engines = Json::array();
    for (std::size_t i = 0; i < r_.continuations.size(); ++i) {
      const auto& c = r_.continuations[i];
      Json e = cmp["engines"][i];
      e["continuation_token_ids_sha256"] = common::token_ids_sha256(c.token_ids);
      Json capture = captures_[i].output;
      for (const char* k : {"schema", "peak_rss_bytes"}) capture.erase(k);
      for (Json& x : capture["captures"]) x.erase("file");
      capture["process"] = captures_[i].evidence->to_json();
      e["capture"] = std::move(capture);
      engines.push_back(std::move(e));
    }
    const contain::Evidence& first = *captures_.front().evidence;
    Json result{{"schema", common::kTrajectoryResult},
                {"created_at_utc", common::now_rfc3339()},
                {"duration_seconds", common::now_unix() - facts.started_unix},
                {"job_id", facts.job_id},
                {"supervisor", {{"version", ASSAY_VERSION}, {"key_id", facts.key_id}}},
                {"request",
                 {{"schema", r_.schema},
                  {"id", r_.id},
                  {"sha256", r_.request_sha256},
                  {"model_dir", r_.model_dir},
                  {"prompt_length", r_.prompt_token_ids.size()},
                  {"prompt_token_ids_sha256", common::token_ids_sha256(r_.prompt_token_ids)}}},
                {"model_identity", fingerprint_.identity()},
                {"model_fingerprint", fingerprint_section(fingerprint_)},
                {"engines", engines},
                {"departed_first", cmp["departed_first"]},
                {"divergence", cmp["divergence"]},
                {"comparison",
                 {{"estimator_sha256", cmp.value("estimator_sha256", Json(nullptr))},
                  {"seconds", cmp.value("seconds", Json(nullptr))},
                  {"process", compare_evidence_->to_json()}}},
                {"containment",
                 {{"host_memory", facts.host_memory},
                  {"backend", facts.backend},
                  {"network", first.network ? first.network->to_json() : Json("host")}}},
                {"trajectory_artifact",
                 {{"name", common::kTrajectoryArtifactFileName},
                  {"bytes", fs::file_size(artifact)},
                  {"sha256", artifact_sha}}}};
    if (!r_.numerics.is_null()) {
      if (numerics_evidence_)
        result["numerics"] = numerics_section_own_reference(
            r_.numerics, r_.divergence()->candidates, numerics_["states"][0], numerics_,
            *numerics_evidence_,
            "the transformers worker's eager forward of the divergence state (prompt and the "
            "shared prefix), the member list's first");
      else
        result["numerics"] = Json{{"requested", r_.numerics}, {"reason", numerics_skipped_}};
    }
    std::string message = "succeeded: ";
    for (Json e : cmp["engines"])  // copies: operator[] stays defined on a missing key
      message +=
          e["engine"].get<std::string>() + " departs at " +
          (e["first_departure"].is_null() ? std::string("never") : e["first_departure"].dump()) +
          "; ";
    Json d = cmp["divergence"];
    message += d.is_null() ? std::string("the continuations are equal")
                           : "they diverge at " + d["index"].dump() + " -> " +
                                 d["argmax_candidate"].get<std::string>();
    return Sealed{std::move(result),
                  artifact,
                  artifact_sha,
                  std::string(common::kTrajectoryArtifactFileName),
                  std::string(common::kTrajectoryPredicateType),
                  message};
  }

 private:
  std::string capture_role(std::size_t i) const { return "capture-" + std::to_string(i); }

  Json capture_input(std::size_t i) const {
    const auto& c = r_.continuations[i];
    std::int64_t first = r_.first_scored();
    Json contexts = Json::array({Json{
        {"id", c.engine},
        {"token_ids", r_.sequence(i)},
        {"positions", Json::array({Json::array(
                          {first, first + static_cast<std::int64_t>(c.token_ids.size())})})}}});
    return Json{{"schema", protocol::kOracleCaptureInput},
                {"model_dir", r_.model_dir},
                {"contexts", contexts},
                {"block_positions", r_.block_positions},
                {"execution",
                 {{"device", config_.oracle_device},
                  {"dtype", execution_dtype(r_.model_dir)},
                  {"threads", worker_threads(config_)}}}};
  }

  void check_capture_output(const Json& out, std::size_t i) const {
    const auto& c = r_.continuations[i];
    auto bad = [&](const std::string& m) {
      throw Error("worker.capture_output", "capture of \"" + c.engine + "\": " + m);
    };
    if (out.value("schema", "") != protocol::kOracleCaptureOutput)
      bad("output.json has schema " + out.value("schema", std::string("(none)")));
    if (out.value("vocab_size", std::int64_t{-1}) != vocab_)
      bad("vocab_size " + out.value("vocab_size", Json()).dump() + ", expected " +
          std::to_string(vocab_));
    const Json& caps = common::require(out, "captures", "capture output");
    if (!caps.is_array() || caps.size() != 1) bad("not exactly one capture");
    const Json& x = caps[0];
    if (x.value("id", "") != c.engine ||
        x.value("scored_positions", std::int64_t{-1}) !=
            static_cast<std::int64_t>(c.token_ids.size()) ||
        x.value("file", "") != "capture-0.safetensors" ||
        x.value("input_token_ids_sha256", "") != common::token_ids_sha256(r_.sequence(i)) ||
        !common::is_identity(x.value("logits_sha256", "")))
      bad("the capture does not match the request: " + x.dump().substr(0, 300));
  }

  Step capture(std::size_t i) {
    return Step{capture_role(i),
                config_.oracle_worker,
                "capture",
                r_.model_dir,
                {},
                [this, i] { return capture_input(i); },
                {},
                [this, i](Json output, const contain::Evidence& evidence) {
                  check_capture_output(output, i);
                  check_bytes_used(output, fingerprint_, capture_role(i));
                  captures_[i] = CaptureRun{std::move(output), evidence};
                }};
  }

  Json compare_input(std::vector<std::pair<fs::path, std::string>>* move_in) const {
    Json engines = Json::array();
    for (std::size_t i = 0; i < r_.continuations.size(); ++i) {
      std::string name = "engine-" + std::to_string(i) + ".safetensors";
      if (move_in)
        move_in->emplace_back(job_dir_ / capture_role(i) / "capture-0.safetensors", name);
      engines.push_back(Json{{"engine", r_.continuations[i].engine},
                             {"token_ids", r_.continuations[i].token_ids},
                             {"logits", name}});
    }
    return Json{{"schema", common::kCompareTrajectoryInput},
                {"vocab_size", vocab_},
                {"prompt_length", r_.prompt_token_ids.size()},
                {"artifact_file", common::kTrajectoryArtifactFileName},
                {"engines", engines}};
  }

  Step compare() {
    return compare_step(
        config_, "trajectory", {}, [this](auto* move_in) { return compare_input(move_in); },
        [this](const Json& output) { check_compare_output(output); }, compare_output_,
        compare_evidence_);
  }

  // The comparison read the very logits the captures wrote, for the engines asked, in order.
  void check_compare_output(const Json& out) const {
    auto bad = [](const std::string& m) { throw Error("worker.compare_output", m); };
    if (out.value("schema", "") != common::kCompareTrajectoryOutput)
      bad("compare output.json has schema " + out.value("schema", std::string("(none)")));
    const Json& engines = common::require(out, "engines", "compare output");
    if (!engines.is_array() || engines.size() != r_.continuations.size())
      bad("compare output covers " + std::to_string(engines.size()) + " engines, not " +
          std::to_string(r_.continuations.size()));
    for (std::size_t i = 0; i < engines.size(); ++i) {
      const Json& want = captures_[i].output["captures"][0]["logits_sha256"];
      if (engines[i].value("engine", "") != r_.continuations[i].engine ||
          engines[i].value("logits_sha256", Json()) != want)
        bad("engine " + std::to_string(i) + ": the comparison read " +
            engines[i].value("logits_sha256", Json()).dump() + " for \"" +
            engines[i].value("engine", std::string("?")) + "\" but " + want.dump() +
            " was captured for \"" + r_.continuations[i].engine + "\"");
    }
  }

  const Config& config_;
  fs::path job_dir_;
  common::TrajectoryRequest r_;
  std::int64_t vocab_;
  FingerprintRun fingerprint_;
  std::vector<CaptureRun> captures_;  // by engine
  Json compare_output_;
  std::optional<contain::Evidence> compare_evidence_;
  Json numerics_;  // the envelope's output at the divergence, when asked for and applicable
  std::optional<contain::Evidence> numerics_evidence_;
  std::string numerics_skipped_;
};

}  // namespace

Admission admit_trajectory(const Json& document, const SubmitContext& context) {
  common::TrajectoryRequest r = common::validate_trajectory_request(document);
  check_request_limits(r.limits, context.config);
  if (!r.numerics.is_null() && ::access(context.config.hf_worker.c_str(), X_OK) != 0)
    throw Error("request.numerics_unavailable",
                "request.numerics needs assay-hf-worker (transformers), which this host does not "
                "have (" +
                    context.config.hf_worker.string() + ")");
  Json opened = Json::array();
  std::string model_dir = check_model_dir(r.model_dir, context.peer, &opened);
  if (model_dir != r.model_dir)
    throw Error("request.bad_model",
                "model_dir \"" + r.model_dir + "\" is not normalised (as " + model_dir + ")");
  r.check_vocab(read_vocab_size(model_dir));
  if (auto max_positions = read_max_positions(model_dir)) r.check_context_length(*max_positions);
  // A continuation runs up to its first end-of-sequence: tokens after it (an engine's padding)
  // would be scored as departures, so they are refused rather than silently cut.
  std::vector<std::int64_t> eos = read_eos_token_ids(model_dir);
  for (std::size_t i = 0; i < r.continuations.size(); ++i) {
    const auto& ids = r.continuations[i].token_ids;
    auto first = std::find_first_of(ids.begin(), ids.end(), eos.begin(), eos.end());
    if (first == ids.end() || first + 1 == ids.end()) continue;
    auto at = first - ids.begin();
    throw Error("request.tokens_after_eos",
                "continuations[" + std::to_string(i) + "] (engine \"" +
                    common::printable(r.continuations[i].engine, 64) + "\") has " +
                    std::to_string(ids.end() - first - 1) +
                    " tokens after its first end-of-sequence token " + std::to_string(*first) +
                    " at index " + std::to_string(at) +
                    " (config.json eos_token_id); a continuation ends at its first EOS: send "
                    "token_ids[0.." +
                    std::to_string(at) + "]");
  }
  return Admission{common::sha256_canonical_id(
                       Json{{"request_sha256", r.request_sha256}, {"kind", "trajectory"}}),
                   r.request_sha256,
                   r.schema,
                   r.id,
                   model_dir,
                   std::move(opened)};
}

std::unique_ptr<Pipeline> open_trajectory(const Config& config, const fs::path& job_dir,
                                          const std::string&) {
  return std::make_unique<TrajectoryPipeline>(config, job_dir);
}

}  // namespace assay::supervisor
