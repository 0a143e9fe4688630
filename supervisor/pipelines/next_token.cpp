// Next-token jobs: fingerprint the model directory, check its identity against the request's,
// run the oracle over the input token ids, and attribute the reference argmax to an engine.
#include <thread>

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

class NextTokenPipeline final : public Pipeline {
 public:
  NextTokenPipeline(const Config& config, fs::path job_dir, std::string model_dir)
      : config_(config),
        job_dir_(std::move(job_dir)),
        model_dir_(std::move(model_dir)),
        request_(common::validate_request(read_request(job_dir_))),
        receipts_(read_checks(job_dir_).value(
            "receipts", common::receipts_not_checked("the job was accepted before assayd checked "
                                                     "receipts"))) {}

  std::uint64_t required_bytes() override {
    std::uint64_t need = estimate_required_bytes(model_dir_, request_.input_token_ids.size());
    if (!request_.numerics.is_null())
      need = std::max(need, numerics_required_bytes(model_dir_, request_.input_token_ids.size(),
                                                    request_.numerics));
    return prompt_check_applies(request_) ? std::max(need, kPromptCheckBytes) : need;
  }
  common::RequestLimits limits() const override { return request_.limits; }
  // Either backend's oracle may run on a resident worker (assay-oracle serve, assay-hf-worker
  // serve) that holds exactly this job's bytes.
  bool may_use_resident() const override {
    return config_.resident_steps() && !request_.limits.memory_bytes;
  }

  std::vector<Step> plan() override {
    std::string name = request_.model_identity ? (*request_.model_identity)["id"].get<std::string>()
                                               : fs::path(model_dir_).filename().string();
    const std::string backend = request_.backend.value_or(config_.oracle_backend);
    // One pass over the weights: the libtorch oracle of a job of its own reads and hashes every
    // shard anyway, so the fingerprint leaves the shards it would hash to it (a resident worker
    // read them at load; on a Slurm node the files are read by path on another host).
    const bool defer =
        backend != "transformers" && !may_use_resident() && config_.executor == "local";
    Step fingerprint = fingerprint_step(config_, "fingerprint", model_dir_, name,
                                        request_.model_identity, fingerprint_, defer);
    auto input = [this] {
      Json candidates = Json::array();
      for (const auto& c : request_.candidates)
        candidates.push_back(
            Json{{"engine", c.engine}, {"token_id", c.token_id}, {"text", c.text}});
      Json in = oracle_input(model_dir_, request_, candidates, config_.oracle_device,
                             worker_threads(config_));
      // Only the first reader after the fingerprint gets them: it completes the identity.
      if (Json deferred = deferred_files(fingerprint_); !deferred.empty())
        in["unchanged_files"] = std::move(deferred);
      return in;
    };
    // "both": the libtorch oracle makes the result; transformers runs the same input after it
    // and the result says whether their logits agree bit for bit.
    Step oracle =
        oracle_step("oracle", backend == "transformers" ? config_.hf_worker : config_.oracle_worker,
                    input, oracle_, oracle_evidence_);
    // A shard left to the oracle must still be the file the fingerprint saw when the oracle's
    // descriptors are opened (the oracle checks it again while it reads).
    if (defer)
      oracle.opened_model = [this](const OpenedModel& m) {
        check_deferred_unchanged(fingerprint_, m, "oracle");
      };
    Step second =
        oracle_step("oracle-transformers", config_.hf_worker, input, second_, second_evidence_);
    if (may_use_resident()) {
      oracle.resident_bytes = [this](const Json& bytes_used) {
        check_bytes_used(Json{{"bytes_used", bytes_used}}, fingerprint_, "resident oracle");
      };
      second.resident_bytes = [this](const Json& bytes_used) {
        check_bytes_used(Json{{"bytes_used", bytes_used}}, fingerprint_,
                         "resident transformers oracle");
      };
    }
    std::vector<Step> steps;
    steps.push_back(std::move(fingerprint));
    if (!prompt_check_applies(request_))
      prompt_ = prompt_check_skipped(request_);
    else if (!prompt_check_available(config_))
      prompt_ = prompt_check_unavailable(config_);
    else
      steps.push_back(prompt_check_step(config_, model_dir_, request_, fingerprint_, prompt_));
    steps.push_back(std::move(oracle));
    if (backend == "both") steps.push_back(std::move(second));
    if (!request_.numerics.is_null())
      steps.push_back(numerics_step(config_, model_dir_, input, request_.numerics,
                                    Json::array({Json{{"index", 0},
                                                      {"input_token_ids", request_.input_token_ids},
                                                      {"candidate_tokens", candidates_json()}}}),
                                    fingerprint_, numerics_, numerics_evidence_));
    return steps;
  }

  Sealed assemble(const RunFacts& facts) override {
    // The reference artifact moves out of the worker's workspace into the job directory.
    fs::path artifact = take_artifact(facts.job_dir / "oracle" / oracle_artifact_name(oracle_),
                                      facts.job_dir / common::kArtifactFileName);
    Json result = next_token_result(config_, facts, request_, fingerprint_, oracle_,
                                    *oracle_evidence_, artifact, receipts_, prompt_);
    if (second_evidence_) result["backends"] = backends_section();
    if (numerics_evidence_)
      result["numerics"] = numerics_section(request_.numerics, candidates_json(), oracle_,
                                            numerics_["states"][0], numerics_, *numerics_evidence_);
    std::string message = next_token_message(result);
    std::string artifact_sha = result["reference_artifact"]["sha256"];
    return Sealed{std::move(result),
                  artifact,
                  artifact_sha,
                  std::string(common::kArtifactFileName),
                  std::string(protocol::kResultPredicateType),
                  message};
  }

 private:
  // A next-token worker run over the oracle's input, its bytes and configuration checked, kept
  // in `output` and `evidence` (members: they outlive the step).
  Step oracle_step(const std::string& role, const fs::path& worker, std::function<Json()> input,
                   Json& output, std::optional<contain::Evidence>& evidence) {
    return Step{.role = role,
                .worker = worker,
                .mode = "next-token",
                .model_dir = model_dir_,
                .open_files = {},
                .input = std::move(input),
                .move_in = {},
                .accept = [this, role, &output, &evidence](Json out, const contain::Evidence& e) {
                  complete_fingerprint(fingerprint_, out, role);
                  check_bytes_used(out, fingerprint_, role);
                  check_configuration(out, role);
                  output = std::move(out);
                  evidence = e;
                }};
  }

  const Config& config_;
  fs::path job_dir_;
  std::string model_dir_;
  common::NextTokenRequest request_;
  Json receipts_;  // what admission checked of the receipts the request names
  Json prompt_;    // request.prompt_check: Kiln's prompt check, or why it did not run
  // "both": what the transformers backend computed from the same input, beside the libtorch
  // oracle that made the result, and whether the two agree bit for bit (a disagreement is a
  // fact of the result, not a failure).
  Json backends_section() const {
    Json other = oracle_section(second_, second_evidence_->to_json());
    // value(): a worker's output may lack a field (const operator[] on a missing key is
    // undefined behaviour; fuzz_worker_output found it).
    const Json sha = second_.value("logits_sha256", Json()),
               argmax = second_.value("argmax", Json());
    const bool agree = sha.is_string() && sha == oracle_.value("logits_sha256", Json());
    return Json{{"compared", Json::array({"libtorch", "transformers"})},
                {"logits_bitwise_equal", agree},
                {"argmax_equal", !argmax.is_null() && argmax == oracle_.value("argmax", Json())},
                {"transformers", std::move(other)}};
  }
  // request.candidates as [{engine, token_id}].
  Json candidates_json() const {
    Json out = Json::array();
    for (const auto& c : request_.candidates)
      out.push_back(Json{{"engine", c.engine}, {"token_id", c.token_id}});
    return out;
  }
  Json numerics_;  // the numerics envelope's output, when the request asked for it
  std::optional<contain::Evidence> numerics_evidence_;
  Json second_;  // "both": the transformers backend's output
  std::optional<contain::Evidence> second_evidence_;
  FingerprintRun fingerprint_;
  Json oracle_;
  std::optional<contain::Evidence> oracle_evidence_;
};

}  // namespace

Json next_token_result(const Config& config, const RunFacts& facts,
                       const common::NextTokenRequest& request, const FingerprintRun& fingerprint,
                       const Json& oracle, const contain::Evidence& oracle_evidence,
                       const fs::path& artifact, const Json& receipts, const Json& prompt_check) {
  Json verdict = make_verdict(request, oracle);
  // The workers that computed this result: the oracle of its backend, and the transformers
  // worker when it also rendered the prompt or was compared with the oracle (both).
  const bool transformers = oracle.value("backend", "libtorch") == "transformers";
  std::vector<std::pair<std::string, fs::path>> executables{
      {"assayd-serve", "/proc/self/exe"},
      {"assay-fingerprint", config.fingerprint_worker},
      transformers ? std::pair<std::string, fs::path>{"assay-hf-worker", config.hf_worker}
                   : std::pair<std::string, fs::path>{"assay-oracle", config.oracle_worker}};
  const bool both = request.backend.value_or(config.oracle_backend) == "both";
  if (!transformers &&
      (both || prompt_check.value("checked", false) || !request.numerics.is_null()))
    executables.emplace_back("assay-hf-worker", config.hf_worker);
  Json network = oracle_evidence.network ? oracle_evidence.network->to_json() : Json("host");
  return Json{
      {"schema", protocol::kNextTokenResult},
      {"created_at_utc", common::now_rfc3339()},
      {"duration_seconds", common::now_unix() - facts.started_unix},
      {"job_id", facts.job_id},
      {"supervisor", {{"version", ASSAY_VERSION}, {"key_id", facts.key_id}}},
      {"source", source_section()},
      {"implementation",
       implementation_section(executables, oracle.value("loaded_libraries", Json(nullptr)))},
      {"request",
       {{"schema", request.schema},
        {"id", request.id},
        {"sha256", request.request_sha256},
        {"input_token_ids_sha256", request.input_token_ids_sha256},
        {"source", request.source},
        {"receipts", receipts},
        {"prompt_check", prompt_check}}},
      {"model_identity", fingerprint.output["model_identity"]},
      {"model_fingerprint", fingerprint_section(fingerprint)},
      {"containment",
       {{"host_memory", facts.host_memory}, {"backend", facts.backend}, {"network", network}}},
      {"oracle", oracle_section(oracle, oracle_evidence.to_json())},
      {"reference_artifact",
       {{"name", common::kArtifactFileName},
        {"bytes", fs::file_size(artifact)},
        {"sha256", common::sha256_file_id(artifact)}}},
      {"verdict", verdict}};
}

std::string next_token_message(const Json& result) {
  const Json& verdict = result["verdict"];
  return "succeeded: reference argmax " +
         std::to_string(verdict["argmax_token_id"].get<std::int64_t>()) + " -> " +
         verdict["argmax_candidate"].get<std::string>();
}

// Kiln's receipt checks (common/kiln_receipt.h) on the receipts in `dir`, each opened as the
// submitter by the name the request gives it: what the result says of them.
Json check_receipts(const common::NextTokenRequest& request, const std::string& dir,
                    const Peer& peer) {
  if (dir.empty()) return common::receipts_not_given(request);
  if (request.kind != common::RequestKind::kKiln)
    throw Error("api.bad_query", "receipts_dir= applies to a Kiln request only; " + request.schema +
                                     " names no receipts");
  const std::string code = "request.receipt_mismatch";
  Opened folder = open_dir_as(dir, peer, code, "receipts directory");
  std::vector<common::ReceiptReport> reports;
  for (const auto& slot : common::receipt_slots()) {
    std::string name =
        fs::path(request.source[slot.key]["path"].get<std::string>()).filename().string();
    Opened file = open_file_as(folder.path + "/" + name, peer, code, slot.engine + " receipt");
    reports.push_back(common::check_kiln_receipt(
        request, slot, read_opened(file, common::kMaxReceiptBytes, code)));
  }
  return common::receipts_checked(reports);
}

Admission admit_next_token(const Json& document, const SubmitContext& context) {
  auto request = common::validate_request(document);
  check_request_limits(request.limits, context.config);
  if (!request.numerics.is_null() && !prompt_check_available(context.config))
    throw Error("request.numerics_unavailable",
                "request.numerics needs assay-hf-worker (transformers), which this host does not "
                "have (" +
                    context.config.hf_worker.string() + ")");
  // The transformers backend on a host without its worker: refused now, by name, rather than
  // accepted and failed when the step cannot start.
  const std::string backend = request.backend.value_or(context.config.oracle_backend);
  if (backend != "libtorch" && !prompt_check_available(context.config))
    throw Error("request.backend_unavailable",
                "oracle backend \"" + backend +
                    "\" needs assay-hf-worker (transformers), which this host does not have (" +
                    context.config.hf_worker.string() +
                    "; config hf_worker names it, packaging/README.md says how to install it)");
  Json receipts = check_receipts(request, context.receipts_dir, context.peer);
  std::string dir =
      !context.query_model_dir.empty() ? context.query_model_dir : request.model_dir.value_or("");
  if (dir.empty())
    throw Error("request.no_model_dir",
                "no model directory: the request has no model_dir (Kiln requests never do); "
                "pass ?model_dir=/abs/dir");
  Json opened = Json::array();
  std::string model_dir = check_model_dir(dir, context.peer, &opened);
  // The request's own model_dir is part of its identity: a second spelling of the same
  // directory would make a second job of the same dispute.
  if (context.query_model_dir.empty() && model_dir != dir)
    throw Error("request.bad_model",
                "model_dir \"" + dir + "\" is not normalised (as " + model_dir + ")");
  request.check_vocab(read_vocab_size(model_dir));
  // A dispute whose receipts were checked is another job than the same dispute unchecked.
  Json key{{"request_sha256", request.request_sha256}, {"model_dir", model_dir}};
  // A Kiln request's request_sha256 leaves assay's additions out; the key keeps them (an assay
  // request's request_sha256 is already its whole document's).
  if (request.kind == common::RequestKind::kKiln)
    key["document_sha256"] = common::sha256_canonical_id(request.document);
  std::string note;
  if (receipts["checked"] == true) {
    key["receipts_checked"] = true;
    for (const auto& r : receipts["receipts"])
      note += (note.empty() ? "; receipts checked: " : ", ") + r["engine"].get<std::string>() +
              " (" + std::to_string(r["checks"].size()) + " checks)";
  }
  return Admission{.key = common::sha256_canonical_id(key),
                   .request_sha256 = request.request_sha256,
                   .request_schema = request.schema,
                   .request_id = request.id,
                   .model_dir = model_dir,
                   .opened = std::move(opened),
                   .checks = Json{{"receipts", std::move(receipts)}},
                   .accepted_note = note};
}

std::unique_ptr<Pipeline> open_next_token(const Config& config, const fs::path& job_dir,
                                          const std::string& model_dir) {
  return std::make_unique<NextTokenPipeline>(config, job_dir, model_dir);
}

}  // namespace assay::supervisor
