// Fidelity jobs: KL(reference || candidate) over a panel of contexts.
//
// Steps, each worker contained like a next-token job's: fingerprint the reference (and a
// candidate checkpoint), capture the reference's logits at every scored position with
// `assay-oracle capture` (again in a second run for reproduction_confirmation, and for a
// candidate checkpoint), compare with `assay-compare run` in fp64; then the receipt
// `assay.fidelity-result.v1`. Capture files move from one worker's workspace into the next one's,
// since a worker sees no other part of the state directory.
#include <algorithm>
#include <map>

#include "common/error.h"
#include "common/fidelity.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "common/result.h"
#include "common/time.h"
#include "supervisor/pipelines/admission.h"
#include "supervisor/pipelines/documents.h"
#include "supervisor/pipelines/pipeline.h"
#include "supervisor/pipelines/steps.h"

namespace assay::supervisor {

using common::Error;
using common::Json;
namespace fs = std::filesystem;

namespace {

constexpr const char* kCompareRole = "compare";

Json capture_input(const std::string& model_dir, const common::FidelityRequest& r,
                   const Config& config) {
  const std::string& device = config.oracle_device;
  Json contexts = Json::array();
  for (const auto& c : r.panel)
    contexts.push_back(Json{{"id", c.id},
                            {"token_ids", c.token_ids},
                            {"positions", common::position_ranges_json(c.positions)}});
  return Json{{"schema", protocol::kOracleCaptureInput},
              {"model_dir", model_dir},
              {"contexts", contexts},
              {"block_positions", r.block_positions},
              {"execution",
               {{"device", device},
                {"dtype", execution_dtype(model_dir)},
                {"threads", worker_threads(config)}}}};
}

// Checks a capture's output.json against what was asked; throws Error("worker.capture_output").
void check_capture_output(const Json& out, const common::FidelityRequest& r, std::int64_t vocab,
                          const std::string& side) {
  auto bad = [&](const std::string& m) {
    throw Error("worker.capture_output", side + " capture: " + m);
  };
  if (out.value("schema", "") != protocol::kOracleCaptureOutput)
    bad("output.json has schema " + out.value("schema", std::string("(none)")));
  if (out.value("vocab_size", std::int64_t{-1}) != vocab)
    bad("vocab_size " + out.value("vocab_size", Json()).dump() + ", expected " +
        std::to_string(vocab));
  const Json& caps = common::require(out, "captures", "capture output");
  if (!caps.is_array() || caps.size() != r.panel.size())
    bad("captures for " + std::to_string(caps.size()) + " contexts, expected " +
        std::to_string(r.panel.size()));
  for (std::size_t i = 0; i < caps.size(); ++i) {
    const Json& c = caps[i];
    if (c.value("id", "") != r.panel[i].id ||
        c.value("scored_positions", std::int64_t{-1}) != r.panel[i].scored ||
        c.value("file", "") != "capture-" + std::to_string(i) + ".safetensors" ||
        !common::is_identity(c.value("logits_sha256", "")))
      bad("captures[" + std::to_string(i) + "] does not match context \"" + r.panel[i].id +
          "\": " + c.dump().substr(0, 300));
  }
}

// The receipt's view of one capture run: what ran, how, and the digest of every context.
Json capture_section(const Json& out, const contain::Evidence& evidence) {
  Json section = out;
  // loaded_libraries: hashed into the result's "implementation".
  for (const char* k : {"schema", "peak_rss_bytes", "loaded_libraries"}) section.erase(k);
  for (Json& c : section["captures"]) c.erase("file");
  section["process"] = evidence.to_json();
  return section;
}

std::vector<std::string> capture_digests(const Json& out) {
  std::vector<std::string> d;
  // Copies: operator[] on a key a worker left out is null (then a type error), not undefined.
  for (Json c : out.value("captures", Json::array()))
    d.push_back(c["logits_sha256"].get<std::string>());
  return d;
}

struct CaptureRun {
  Json output;  // assay.oracle-capture-output.v1
  std::optional<contain::Evidence> evidence;
};

class FidelityPipeline final : public Pipeline {
 public:
  FidelityPipeline(const Config& config, fs::path job_dir)
      : config_(config),
        job_dir_(std::move(job_dir)),
        r_(common::validate_fidelity_request(read_request(job_dir_))),
        vocab_(read_vocab_size(r_.reference.model_dir)) {}

  std::uint64_t required_bytes() override {
    // The workers run one after another: the larger checkpoint sets the need.
    std::uint64_t longest = 0;
    for (const auto& c : r_.panel) longest = std::max<std::uint64_t>(longest, c.token_ids.size());
    auto rows = static_cast<std::uint64_t>(r_.block_positions);
    std::uint64_t need = estimate_required_bytes(r_.reference.model_dir, longest, rows);
    if (r_.candidate_model)
      need = std::max(need, estimate_required_bytes(r_.candidate_model->model_dir, longest, rows));
    return need;
  }
  common::RequestLimits limits() const override { return r_.limits; }

  std::vector<Step> plan() override {
    std::vector<Step> steps;
    steps.push_back(fingerprint("reference", r_.reference));
    if (r_.candidate_model) steps.push_back(fingerprint("candidate", *r_.candidate_model));
    steps.push_back(capture("reference", r_.reference.model_dir));
    if (r_.reproduction_confirmation) {
      steps.push_back(capture("reproduction", r_.reference.model_dir));
      // The weights_identity_equal gate: the reference directory hashed again after both
      // captures, not its first identity compared with itself.
      steps.push_back(fingerprint("reproduction", r_.reference));
    }
    if (r_.candidate_model) steps.push_back(capture("candidate", r_.candidate_model->model_dir));
    steps.push_back(compare());
    return steps;
  }

  Sealed assemble(const RunFacts& facts) override {
    // A copy: operator[] on a key the worker left out is null here, not undefined behaviour
    // (const operator[]; fuzz_worker_output found it).
    Json cmp = compare_output_;
    fs::path artifact = job_dir_ / common::kKlArtifactFileName;
    std::string artifact_sha =
        take_reported_artifact(job_dir_ / kCompareRole / common::kKlArtifactFileName, artifact,
                               cmp.value("kl_file_sha256", Json()), "the KL vector");
    auto artifact_bytes = fs::file_size(artifact);
    const contain::Evidence& ref_evidence = *captures_.at("reference").evidence;

    Json panel_contexts = Json::array();
    for (const auto& c : r_.panel)
      panel_contexts.push_back(
          Json{{"id", c.id},
               {"token_count", c.token_ids.size()},
               {"input_token_ids_sha256", common::token_ids_sha256(c.token_ids)},
               {"positions", common::position_ranges_json(c.positions)},
               {"scored_positions", c.scored}});
    Json result{
        {"schema", protocol::kFidelityResult},
        {"created_at_utc", common::now_rfc3339()},
        {"duration_seconds", common::now_unix() - facts.started_unix},
        {"job_id", facts.job_id},
        {"supervisor", {{"version", ASSAY_VERSION}, {"key_id", facts.key_id}}},
        {"source", source_section()},
        {"implementation", implementation()},
        {"request",
         {{"schema", r_.schema},
          {"id", r_.id},
          {"sha256", r_.request_sha256},
          {"panel_sha256", r_.panel_sha256},
          {"reproduction_confirmation", r_.reproduction_confirmation},
          {"block_positions", r_.block_positions}}},
        {"panel",
         {{"contexts", panel_contexts},
          {"scored_positions", r_.scored_positions()},
          {"vocab_size", vocab_}}},
        {"reference", model_block("reference")},
        {"candidate", candidate_block()},
        {"reproduction", reproduction_block()},
        {"comparison",
         {{"metrics", cmp["metrics"]},
          {"contexts", cmp["contexts"]},
          {"histogram", cmp.value("histogram", Json(nullptr))},
          {"positions", cmp.value("positions", Json(nullptr))},
          {"seconds", cmp.value("seconds", Json(nullptr))},
          {"statistics", cmp.value("statistics", Json(nullptr))},
          {"process", compare_evidence_->to_json()}}},
        {"containment",
         {{"host_memory", facts.host_memory},
          {"backend", facts.backend},
          {"network", ref_evidence.network ? ref_evidence.network->to_json() : Json("host")}}},
        {"kl_artifact",
         {{"name", common::kKlArtifactFileName},
          {"bytes", artifact_bytes},
          {"sha256", artifact_sha}}}};
    for (const char* k : {"comparison_kind", "metric", "scope", "comparator"})
      if (cmp.contains(k)) result[k] = cmp[k];
    Json gates = gates_block();
    if (!gates.is_null()) result["gates"] = gates;
    // The worker's figures, read without trusting their shape (fuzz_worker_output: a
    // comparison without metrics).
    if (!cmp["metrics"].is_object() || !cmp["metrics"]["kl"].is_object())
      throw Error("worker.compare_output", "the comparison has no metrics.kl object");
    const Json& kl = cmp["metrics"]["kl"];
    char summary[200];
    std::snprintf(summary, sizeof summary,
                  "succeeded: mean KL %.6g, max %.6g, top-1 agreement %.6g; gates %s",
                  kl.value("mean", 0.0), kl.value("max", 0.0),
                  cmp["metrics"].value("top1_agreement", 0.0),
                  gates.is_object() ? gates.value("status", std::string("none")).c_str() : "none");
    return Sealed{std::move(result),
                  artifact,
                  artifact_sha,
                  std::string(common::kKlArtifactFileName),
                  std::string(protocol::kFidelityPredicateType),
                  summary};
  }

 private:
  // Every executable whose evidence is in the result, and the runtime libraries each capture
  // reported (the same files, hashed once, when both ran on one LibTorch).
  Json implementation() const {
    Json libraries = Json::array();
    for (const auto& [side, cap] : captures_)
      for (const Json& l : cap.output.value("loaded_libraries", Json::array()))
        if (std::find(libraries.begin(), libraries.end(), l) == libraries.end())
          libraries.push_back(l);
    return implementation_section({{"assayd-serve", "/proc/self/exe"},
                                   {"assay-fingerprint", config_.fingerprint_worker},
                                   {"assay-oracle", config_.oracle_worker},
                                   {"assay-compare", config_.compare_worker}},
                                  libraries);
  }

  // What a capture run produced, without file names: equal for two runs that computed the same.
  static std::string capture_content_digest(const Json& output) {
    Json caps = Json::array();
    for (Json c : output["captures"]) {
      c.erase("file");
      caps.push_back(std::move(c));
    }
    return common::sha256_canonical_id(caps);
  }

  // assay-compare's gates with the two it cannot decide: the captures' content and the
  // reference's weights hashed again after both captures.
  Json gates_block() const {
    Json gates = compare_output_.value("gates", Json(nullptr));
    if (!gates.is_object()) return gates;
    if (gates["reproduction"].is_object()) {
      gates["reproduction"]["capture_content_digest_equal"] =
          capture_content_digest(captures_.at("reference").output) ==
          capture_content_digest(captures_.at("reproduction").output);
      gates["reproduction"]["weights_identity_equal"] =
          fingerprints_.at("reproduction").identity()["content_sha256"] ==
          fingerprints_.at("reference").identity()["content_sha256"];
    }
    return common::finalize_gates(std::move(gates));
  }

  Json model_block(const std::string& side) const {
    const FingerprintRun& fp = fingerprints_.at(side);
    const CaptureRun& cap = captures_.at(side);
    return Json{
        {"model_dir", side == "reference" ? r_.reference.model_dir : r_.candidate_model->model_dir},
        {"model_identity", fp.identity()},
        {"model_fingerprint", fingerprint_section(fp)},
        {"capture", capture_section(cap.output, *cap.evidence)}};
  }

  Json candidate_block() const {
    // A copy: operator[] on a key the worker left out is null here, not undefined behaviour
    // (const operator[]; fuzz_worker_output found it).
    Json cmp = compare_output_;
    Json candidate;
    if (r_.candidate_model) {
      candidate = model_block("candidate");
      candidate["kind"] = "model";
    } else {
      Json files = Json::array();
      for (std::size_t i = 0; i < r_.candidate_logits.size(); ++i)
        files.push_back(
            Json{{"context", r_.panel[i].id},
                 {"path", r_.candidate_logits[i].path},
                 {"file_sha256", r_.candidate_logits[i].sha256},
                 {"logits_sha256", cmp["contexts"][i].value("candidate_sha256", Json())},
                 {"dtype", cmp["contexts"][i].value("candidate_dtype", Json())}});
      candidate = Json{{"kind", "logits"}, {"model_identity", nullptr}, {"logits_files", files}};
    }
    candidate["label"] = r_.candidate_label.empty() ? Json(nullptr) : Json(r_.candidate_label);

    return candidate;
  }

  Json reproduction_block() const {
    // A copy: operator[] on a key the worker left out is null here, not undefined behaviour
    // (const operator[]; fuzz_worker_output found it).
    Json cmp = compare_output_;
    Json reproduction = nullptr;
    if (captures_.count("reproduction")) {
      reproduction = cmp.value("reproduction", Json(nullptr));
      if (reproduction.is_object())
        reproduction["capture"] = capture_section(captures_.at("reproduction").output,
                                                  *captures_.at("reproduction").evidence);
    }
    return reproduction;
  }

  Step fingerprint(const std::string& side, const common::ModelSide& m) {
    std::string name = m.model_identity ? (*m.model_identity)["id"].get<std::string>()
                                        : fs::path(m.model_dir).filename().string();
    return fingerprint_step(config_, "fingerprint-" + side, m.model_dir, name, m.model_identity,
                            fingerprints_[side]);
  }

  Step capture(const std::string& side, const std::string& model_dir) {
    return Step{"capture-" + side,
                config_.oracle_worker,
                "capture",
                model_dir,
                {},
                [this, model_dir] { return capture_input(model_dir, r_, config_); },
                {},
                [this, side](Json output, const contain::Evidence& evidence) {
                  check_capture_output(output, r_, vocab_, side);
                  check_configuration(output, "capture-" + side);
                  check_bytes_used(
                      output, fingerprints_.at(side == "candidate" ? "candidate" : "reference"),
                      "capture-" + side);
                  captures_[side] = CaptureRun{std::move(output), evidence};
                }};
  }

  // Input for the comparison, and the capture files it reads moved into its workspace.
  Json compare_input(std::vector<std::pair<fs::path, std::string>>* move_in) const {
    Json contexts = Json::array();
    auto take = [&](const std::string& side, std::size_t i) {
      std::string name = side + "-" + std::to_string(i) + ".safetensors";
      if (move_in)
        move_in->emplace_back(
            job_dir_ / ("capture-" + side) / ("capture-" + std::to_string(i) + ".safetensors"),
            name);
      return Json{{"path", name}, {"sha256", nullptr}};  // in the compare workspace
    };
    for (std::size_t i = 0; i < r_.panel.size(); ++i) {
      Json c{{"id", r_.panel[i].id},
             {"positions", common::position_ranges_json(r_.panel[i].positions)},
             {"reference", take("reference", i)}};
      if (r_.candidate_model)
        c["candidate"] = take("candidate", i);
      else
        // The user's file, opened by assayd (Step::open_files): the worker user may not open it.
        c["candidate"] = Json{{"fd", 3 + static_cast<int>(i)},
                              {"path", r_.candidate_logits[i].path},
                              {"sha256", r_.candidate_logits[i].sha256}};
      c["token_ids"] = r_.panel[i].token_ids;
      if (r_.reproduction_confirmation) c["reproduction"] = take("reproduction", i);
      contexts.push_back(std::move(c));
    }
    Json input{{"schema", protocol::kCompareInput},
               {"vocab_size", vocab_},
               {"kl_file", common::kKlArtifactFileName},
               {"contexts", contexts}};
    if (!r_.thresholds.empty()) input["thresholds"] = common::thresholds_json(r_.thresholds);
    return input;
  }

  Step compare() {
    std::vector<std::string> files;
    if (!r_.candidate_model)
      for (const auto& f : r_.candidate_logits) files.push_back(f.path);
    return compare_step(
        config_, "run", files, [this](auto* move_in) { return compare_input(move_in); },
        [this](const Json& output) { check_compare_output(output); }, compare_output_,
        compare_evidence_);
  }

  // The comparison read the very bytes the captures wrote and the user named.
  void check_compare_output(const Json& output) const {
    if (output.value("schema", "") != protocol::kCompareOutput)
      throw Error("worker.compare_output", "compare output.json has schema " +
                                               output.value("schema", std::string("(none)")));
    // The comparison read the very bytes the captures wrote and the user named.
    const Json& ctx = common::require(output, "contexts", "compare output");
    if (!ctx.is_array() || ctx.size() != r_.panel.size())
      throw Error("worker.compare_output", "compare output covers " + std::to_string(ctx.size()) +
                                               " contexts, not " + std::to_string(r_.panel.size()));
    auto ref = capture_digests(captures_.at("reference").output);
    auto cand = r_.candidate_model ? capture_digests(captures_.at("candidate").output)
                                   : std::vector<std::string>{};
    auto repro = captures_.count("reproduction")
                     ? capture_digests(captures_.at("reproduction").output)
                     : std::vector<std::string>{};
    for (std::size_t i = 0; i < r_.panel.size(); ++i) {
      auto mismatch = [&](const std::string& what, const Json& got, const std::string& want) {
        if (got != Json(want))
          throw Error("worker.compare_output",
                      "context \"" + r_.panel[i].id + "\": the comparison read " + what + " " +
                          got.dump() + " but " + want + " was captured or named");
      };
      mismatch("reference logits", ctx[i].value("reference_sha256", Json()), ref[i]);
      if (r_.candidate_model)
        mismatch("candidate logits", ctx[i].value("candidate_sha256", Json()), cand[i]);
      else
        mismatch("candidate file", ctx[i].value("candidate_file_sha256", Json()),
                 r_.candidate_logits[i].sha256);
      if (!repro.empty())
        mismatch("reproduction logits",
                 ctx[i].value("reproduction", Json::object()).value("sha256", Json()), repro[i]);
    }
  }

  const Config& config_;
  fs::path job_dir_;
  common::FidelityRequest r_;
  std::int64_t vocab_;
  std::map<std::string, FingerprintRun> fingerprints_;  // by side
  std::map<std::string, CaptureRun> captures_;          // reference, reproduction, candidate
  Json compare_output_;
  std::optional<contain::Evidence> compare_evidence_;
};

}  // namespace

Admission admit_fidelity(const Json& document, const SubmitContext& context) {
  common::FidelityRequest r = common::validate_fidelity_request(document);
  check_request_limits(r.limits, context.config);
  Json opened = Json::array();
  std::string ref_dir = check_model_dir(r.reference.model_dir, context.peer, &opened);
  if (ref_dir != r.reference.model_dir)
    throw Error("request.bad_model", "reference.model_dir \"" + r.reference.model_dir +
                                         "\" is not normalised (as " + ref_dir + ")");
  std::int64_t vocab = read_vocab_size(ref_dir);
  r.check_vocab(vocab);
  if (auto max_positions = read_max_positions(ref_dir)) r.check_context_length(*max_positions);
  if (r.candidate_model) {
    std::string cand_dir = check_model_dir(r.candidate_model->model_dir, context.peer, &opened);
    if (cand_dir != r.candidate_model->model_dir)
      throw Error("request.bad_model", "candidate.model_dir \"" + r.candidate_model->model_dir +
                                           "\" is not normalised (as " + cand_dir + ")");
    std::int64_t cand_vocab = read_vocab_size(cand_dir);
    if (cand_vocab != vocab)
      throw Error("request.vocab_mismatch",
                  "the candidate checkpoint " + cand_dir + " has vocab_size " +
                      std::to_string(cand_vocab) + " but the reference " + ref_dir + " has " +
                      std::to_string(vocab) + "; KL needs the same vocabulary");
  }
  for (std::size_t i = 0; i < r.candidate_logits.size(); ++i)
    check_readable_file(r.candidate_logits[i].path, context.peer, "request.bad_logits_file",
                        "request.candidate.logits[" + std::to_string(i) + "].path", &opened);
  return Admission{
      common::sha256_canonical_id(Json{{"request_sha256", r.request_sha256}, {"kind", "fidelity"}}),
      r.request_sha256,
      r.schema,
      r.id,
      ref_dir,
      std::move(opened)};
}

std::unique_ptr<Pipeline> open_fidelity(const Config& config, const fs::path& job_dir,
                                        const std::string&) {
  return std::make_unique<FidelityPipeline>(config, job_dir);
}

}  // namespace assay::supervisor
