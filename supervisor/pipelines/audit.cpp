// Engine-audit jobs (common/audit.h): whether an engine's logits over a panel of contexts leave
// the model's arithmetic by more than legitimate executions do.
//
// Steps: fingerprint the model; `assay-hf-worker audit` builds it once (the bytes it read are
// checked against the fingerprint), computes the float32 anchor and every member at every
// position of every context, reads the engine's file of each context (fds 3, 4, ...: assayd opened
// them as the submitter; each one's sha256 is checked against the request's before anything is
// built) and writes per position the engine's and each member's squared distance to the anchor.
// assayd sums them per context in a fixed order and computes the statistic (common/audit.h); the
// worker's output is the artifact, so that a verifier re-adds the sums from it. The result is
// assay.engine-audit-result.v1.
#include <unistd.h>

#include <algorithm>
#include <cmath>

#include "common/audit.h"
#include "common/error.h"
#include "common/identity.h"
#include "common/safetensors.h"
#include "common/time.h"
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

constexpr const char* kRole = "audit";

class AuditPipeline final : public Pipeline {
 public:
  AuditPipeline(const Config& config, fs::path job_dir)
      : config_(config),
        job_dir_(std::move(job_dir)),
        r_(common::validate_audit_request(read_request(job_dir_))),
        vocab_(read_vocab_size(r_.model_dir)) {}

  std::uint64_t required_bytes() override {
    // The bf16 model three times while transformers builds it, its float32 copy, one context's
    // anchor, members and engine logits in float64, and Python with transformers.
    std::size_t longest = 0;
    for (const auto& c : r_.contexts) longest = std::max(longest, c.token_ids.size());
    const std::uint64_t weights = estimate_required_bytes(r_.model_dir, 0);
    const std::uint64_t rows = static_cast<std::uint64_t>(longest) *
                               static_cast<std::uint64_t>(vocab_) * 8 *
                               (r_.member_names().size() + 3);
    return 3 * weights + 2 * weights + estimate_sequence_bytes(r_.model_dir, longest, longest) +
           rows + (1ull << 30);
  }
  common::RequestLimits limits() const override { return r_.limits; }

  std::vector<Step> plan() override {
    std::string name = r_.model_identity ? (*r_.model_identity)["id"].get<std::string>()
                                         : fs::path(r_.model_dir).filename().string();
    std::vector<Step> steps;
    steps.push_back(fingerprint_step(config_, "fingerprint", r_.model_dir, name, r_.model_identity,
                                     fingerprint_));
    std::vector<std::string> files;
    for (const auto& c : r_.contexts) files.push_back(c.logits_path);
    steps.push_back(Step{.role = kRole,
                         .worker = config_.hf_worker,
                         .mode = "audit",
                         .model_dir = r_.model_dir,
                         .open_files = files,
                         .input = [this] { return worker_input(); },
                         .move_in = {},
                         .accept =
                             [this](Json output, const contain::Evidence& evidence) {
                               check_bytes_used(output, fingerprint_, kRole);
                               check_configuration(output, kRole);
                               sums_ = check_output(output);
                               output_ = std::move(output);
                               evidence_ = evidence;
                             }});
    return steps;
  }

  Sealed assemble(const RunFacts& facts) override {
    fs::path artifact =
        take_artifact(job_dir_ / kRole / "output.json", job_dir_ / common::kAuditArtifactFileName);
    const std::string artifact_sha = common::sha256_file_id(artifact);
    Json names = Json::array();
    for (const auto& n : r_.member_names()) names.push_back(n);
    Json statistics = common::audit_statistics(names, sums_, r_.policy);
    std::uint64_t differs = 0;
    for (const Json& c : output_["contexts"]) differs += c["argmax_differs"].get<std::uint64_t>();
    Json files = Json::array();
    for (std::size_t i = 0; i < r_.contexts.size(); ++i)
      files.push_back(Json{{"context", r_.contexts[i].id},
                           {"path", r_.contexts[i].logits_path},
                           {"sha256", r_.contexts[i].logits_sha256},
                           {"dtype", output_["contexts"][i]["engine_dtype"]}});
    Json result{
        {"schema", common::kAuditResult},
        {"created_at_utc", common::now_rfc3339()},
        {"duration_seconds", common::now_unix() - facts.started_unix},
        {"job_id", facts.job_id},
        {"supervisor", {{"version", ASSAY_VERSION}, {"key_id", facts.key_id}}},
        {"request",
         {{"schema", r_.schema},
          {"id", r_.id},
          {"sha256", r_.request_sha256},
          {"model_dir", r_.model_dir},
          {"contexts", r_.contexts.size()},
          {"positions", r_.positions()},
          {"audit",
           {{"reduction_seeds", r_.reduction_seeds},
            {"sdpa", r_.sdpa},
            {"policy", common::to_json(r_.policy)}}}}},
        {"model_identity", fingerprint_.identity()},
        {"model_fingerprint", fingerprint_section(fingerprint_)},
        {"engine",
         {{"name", r_.engine},
          {"logits_files", std::move(files)},
          {"argmax_differs_from_reference", differs}}},
        {"anchor",
         "the same bf16 weights with every activation in float32; distances are per position the "
         "mean over the vocabulary of the squared difference of log-softmaxes"},
        {"members", names},
        {"contexts", sums_},
        {"statistics", statistics},
        {"worker", numerics_worker_section(output_, *evidence_)},
        {"containment",
         {{"host_memory", facts.host_memory},
          {"backend", facts.backend},
          {"network", evidence_->network ? evidence_->network->to_json() : Json("host")}}},
        {"audit_artifact",
         {{"name", common::kAuditArtifactFileName},
          {"bytes", fs::file_size(artifact)},
          {"sha256", artifact_sha}}}};
    std::string message = "succeeded: " + statistics["class"].get<std::string>() + ", " +
                          std::to_string(statistics["ratio"].get<double>()).substr(0, 6) +
                          "x the legitimate spread, p = " +
                          std::to_string(statistics["test"]["p_value"].get<double>());
    return Sealed{std::move(result),
                  artifact,
                  artifact_sha,
                  std::string(common::kAuditArtifactFileName),
                  std::string(common::kAuditPredicateType),
                  message};
  }

 private:
  Json worker_input() const {
    Json contexts = Json::array();
    for (std::size_t i = 0; i < r_.contexts.size(); ++i)
      // Step::open_files come first: context i's engine file is fd 3 + i.
      contexts.push_back(
          Json{{"id", r_.contexts[i].id},
               {"token_ids", r_.contexts[i].token_ids},
               {"engine_logits",
                {{"fd", 3 + static_cast<int>(i)}, {"sha256", r_.contexts[i].logits_sha256}}}});
    return Json{{"schema", common::kAuditInput},
                {"model_dir", r_.model_dir},
                {"contexts", std::move(contexts)},
                {"audit", {{"reduction_seeds", r_.reduction_seeds}, {"sdpa", r_.sdpa}}},
                {"execution",
                 {{"device", config_.oracle_device},
                  {"dtype", execution_dtype(r_.model_dir)},
                  {"threads", worker_threads(config_)}}}};
  }

  // The worker measured what was asked: the request's contexts and members, every position, the
  // engine files the request names; every figure finite and >= 0. Returns the per-context sums
  // ({id, positions, engine_sum, member_sums}) added in position order.
  Json check_output(const Json& out) const {
    auto bad = [](const std::string& m) {
      throw Error("worker.audit_output", "assay-hf-worker audit: " + m);
    };
    if (out.value("schema", "") != common::kAuditOutput)
      bad("output.json has schema " + out.value("schema", Json()).dump());
    const std::vector<std::string> names = r_.member_names();
    Json want = Json::array();
    for (const auto& n : names) want.push_back(n);
    if (out.value("member_names", Json()) != want)
      bad("measured members " + out.value("member_names", Json()).dump() + ", not " + want.dump());
    const Json& ctx = out.value("contexts", Json());
    if (!ctx.is_array() || ctx.size() != r_.contexts.size())
      bad("covers " + std::to_string(ctx.is_array() ? ctx.size() : 0) + " contexts, not " +
          std::to_string(r_.contexts.size()));
    auto add = [&](const Json& list, std::size_t n, const std::string& where) {
      if (!list.is_array() || list.size() != n)
        bad(where + " does not hold one figure per position (" + std::to_string(n) + ")");
      double s = 0;
      for (const Json& v : list) {
        if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0)
          bad(where + " holds " + v.dump() + ", not a finite figure >= 0");
        s += v.get<double>();
      }
      return s;
    };
    Json sums = Json::array();
    for (std::size_t i = 0; i < ctx.size(); ++i) {
      const auto& want_ctx = r_.contexts[i];
      const std::string where = "contexts[" + std::to_string(i) + "]";
      const Json& c = ctx[i];
      if (!c.is_object() || c.value("id", Json()) != want_ctx.id)
        bad(where + " is not context \"" + want_ctx.id + "\"");
      if (c.value("engine_file_sha256", Json()) != want_ctx.logits_sha256)
        bad(where + " read the engine file " + c.value("engine_file_sha256", Json()).dump() +
            ", not the request's " + want_ctx.logits_sha256);
      const std::size_t n = want_ctx.token_ids.size();
      if (c.value("positions", Json()) != n) bad(where + ".positions is not " + std::to_string(n));
      if (!c.value("argmax_differs", Json()).is_number_unsigned() ||
          c["argmax_differs"].get<std::uint64_t>() > n)
        bad(where + ".argmax_differs is not a count of its positions");
      const Json& dtype = c.value("engine_dtype", Json());
      if (dtype != "F32" && dtype != "BF16") bad(where + ".engine_dtype is " + dtype.dump());
      const Json& members = c.value("members", Json());
      if (!members.is_array() || members.size() != names.size())
        bad(where + ".members does not hold one list per member");
      Json member_sums = Json::array();
      for (std::size_t m = 0; m < names.size(); ++m)
        member_sums.push_back(add(members[m], n, where + ".members[" + std::to_string(m) + "]"));
      sums.push_back(Json{{"id", want_ctx.id},
                          {"positions", n},
                          {"engine_sum", add(c.value("engine", Json()), n, where + ".engine")},
                          {"member_sums", std::move(member_sums)},
                          {"argmax_differs", c["argmax_differs"]}});
    }
    return sums;
  }

  const Config& config_;
  fs::path job_dir_;
  common::AuditRequest r_;
  std::int64_t vocab_;
  FingerprintRun fingerprint_;
  Json output_, sums_;
  std::optional<contain::Evidence> evidence_;
};

}  // namespace

Admission admit_audit(const Json& document, const SubmitContext& context) {
  common::AuditRequest r = common::validate_audit_request(document);
  check_request_limits(r.limits, context.config);
  if (::access(context.config.hf_worker.c_str(), X_OK) != 0)
    throw Error("request.audit_unavailable",
                "an engine audit needs assay-hf-worker (transformers), which this host does not "
                "have (" +
                    context.config.hf_worker.string() + ")");
  Json opened = Json::array();
  std::string model_dir = check_model_dir(r.model_dir, context.peer, &opened);
  if (model_dir != r.model_dir)
    throw Error("request.bad_model",
                "model_dir \"" + r.model_dir + "\" is not normalised (as " + model_dir + ")");
  const std::int64_t vocab = read_vocab_size(model_dir);
  r.check_vocab(vocab);
  const auto max_positions = read_max_positions(model_dir);
  for (std::size_t i = 0; i < r.contexts.size(); ++i) {
    const auto& c = r.contexts[i];
    const std::string where = "request.engine.logits[" + std::to_string(i) + "]";
    if (max_positions && static_cast<std::int64_t>(c.token_ids.size()) > *max_positions)
      throw Error("request.too_long", "request.panel.contexts[" + std::to_string(i) + "] has " +
                                          std::to_string(c.token_ids.size()) +
                                          " ids, more than the model's max_position_embeddings " +
                                          std::to_string(*max_positions));
    // The engine's file, as the submitter: its header (at most 16 MiB; the data is not read
    // here) must hold the logits of every position of its context.
    Opened f = check_readable_file(c.logits_path, context.peer, "request.bad_logits_file",
                                   where + ".path", &opened);
    common::SafetensorsIndex header;
    try {
      header = common::read_safetensors_header(f.fd.get(), static_cast<std::uint64_t>(f.st.st_size),
                                               16u << 20);
    } catch (const Error& e) {
      throw Error("request.bad_logits_file", where + ".path " + f.path + ": " + e.what());
    }
    const common::TensorView* t = header.find("logits");
    if (!t && header.tensors.size() == 1) t = &header.tensors[0];
    if (!t)
      throw Error("request.bad_logits_file", where + ".path " + f.path + " has " +
                                                 std::to_string(header.tensors.size()) +
                                                 " tensors and none named \"logits\"");
    const std::vector<std::int64_t> want{static_cast<std::int64_t>(c.token_ids.size()), vocab};
    if ((t->dtype != common::Dtype::kF32 && t->dtype != common::Dtype::kBF16) || t->shape != want)
      throw Error("request.bad_logits_file",
                  where + ".path " + f.path + ": tensor \"" + t->name + "\" is " +
                      std::string(common::dtype_name(t->dtype)) + " " + Json(t->shape).dump() +
                      ", not F32 or BF16 " + Json(want).dump() +
                      " (the context's positions by the model's vocab_size)");
  }
  Admission a{
      common::sha256_canonical_id(Json{{"request_sha256", r.request_sha256}, {"kind", "audit"}}),
      r.request_sha256,
      r.schema,
      r.id,
      model_dir,
      std::move(opened)};
  a.accepted_note = "engine audit of " + r.engine + ": " + std::to_string(r.contexts.size()) +
                    " contexts, " + std::to_string(r.positions()) + " positions";
  return a;
}

std::unique_ptr<Pipeline> open_audit(const Config& config, const fs::path& job_dir,
                                     const std::string&) {
  return std::make_unique<AuditPipeline>(config, job_dir);
}

}  // namespace assay::supervisor
