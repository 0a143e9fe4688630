// Layer-attribution jobs: where inside the model an engine leaves the reference.
//
// Steps: fingerprint the model; `assay-oracle layers` keeps the reference's rows at every
// boundary (layers.safetensors, the artifact) and, with patching, runs one more forward per
// boundary the engine gave with the engine's rows substituted there (the engine's file is its fd
// 3); its bytes_used is checked against the fingerprint and its boundaries against config.json's;
// then `assay-compare layers` reads the engine's file (fd 3, its sha256 checked against the
// request's) and the reference rows (moved into its workspace) and computes Kiln's metrics per
// boundary in fp64 with the first departures. The result is assay.layer-attribution-result.v1.
#include <algorithm>

#include "common/error.h"
#include "common/identity.h"
#include "common/layers.h"
#include "common/request.h"
#include "common/safetensors.h"
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

constexpr const char* kOracleRole = "layers";
constexpr const char* kCompareRole = "compare";
constexpr const char* kReferenceRows = "reference.safetensors";

class LayersPipeline final : public Pipeline {
 public:
  LayersPipeline(const Config& config, fs::path job_dir)
      : config_(config),
        job_dir_(std::move(job_dir)),
        r_(common::validate_layer_request(read_request(job_dir_))),
        checks_(read_checks(job_dir_)),
        hidden_(read_hidden_size(r_.model_dir)),
        model_(common::model_boundaries(read_model_config(r_.model_dir), hidden_)) {
    const Json& rows = checks_.value("engine_rows", Json());
    if (!rows.is_object() || !rows.contains("given") || !rows["given"].is_array())
      throw Error("job.checks", job_dir_.string() + "/checks.json has no engine_rows.given");
    for (const Json& g : rows["given"]) given_.push_back(g.get<std::string>());
    // Jobs accepted before operator-level rows existed have no engine_rows.operators.
    if (rows.contains("operators") && rows["operators"].is_array())
      for (const Json& g : rows["operators"]) operators_.push_back(g.get<std::string>());
    for (const common::Boundary& b : common::job_boundaries(model_, operators_)) {
      boundaries_.push_back(b.name);
      row_width_ += b.width;
    }
  }

  std::uint64_t required_bytes() override {
    // The forward, every boundary's rows kept in F32, and the engine's rows when patching.
    std::uint64_t rows =
        static_cast<std::uint64_t>(row_width_) * static_cast<std::uint64_t>(r_.row_count()) * 4;
    return estimate_required_bytes(r_.model_dir, r_.input_token_ids.size()) +
           (r_.patching ? 3 : 1) * rows;
  }
  common::RequestLimits limits() const override { return r_.limits; }

  std::vector<Step> plan() override {
    std::string name = r_.model_identity ? (*r_.model_identity)["id"].get<std::string>()
                                         : fs::path(r_.model_dir).filename().string();
    std::vector<Step> steps;
    steps.push_back(fingerprint_step(config_, "fingerprint", r_.model_dir, name, r_.model_identity,
                                     fingerprint_));
    steps.push_back(oracle());
    steps.push_back(compare());
    return steps;
  }

  Sealed assemble(const RunFacts& facts) override {
    // A copy: operator[] on a key the worker left out is null here, not undefined behaviour
    // (const operator[]; fuzz_worker_output found it).
    Json cmp = compare_output_;
    fs::path artifact = job_dir_ / common::kLayerArtifactFileName;
    // The oracle's rows went into the comparison's workspace; the comparison hashed what it read.
    std::string artifact_sha =
        take_reported_artifact(job_dir_ / kCompareRole / kReferenceRows, artifact,
                               cmp.value("reference_file_sha256", Json()), "the reference rows");
    Json output = oracle_output_;
    for (const char* k : {"schema", "rows_file"}) output.erase(k);
    Json patching = nullptr;
    if (r_.patching) patching = patching_section(output["patching"]);
    output.erase("patching");
    std::vector<std::string> omitted;
    for (const auto& b : boundaries_)
      if (std::find(given_.begin(), given_.end(), b) == given_.end()) omitted.push_back(b);
    Json result{
        {"schema", common::kLayerResult},
        {"created_at_utc", common::now_rfc3339()},
        {"duration_seconds", common::now_unix() - facts.started_unix},
        {"job_id", facts.job_id},
        {"supervisor", {{"version", ASSAY_VERSION}, {"key_id", facts.key_id}}},
        {"request",
         {{"schema", r_.schema},
          {"id", r_.id},
          {"sha256", r_.request_sha256},
          {"model_dir", r_.model_dir},
          {"input_length", r_.input_token_ids.size()},
          {"input_token_ids_sha256", common::token_ids_sha256(r_.input_token_ids)},
          {"rows", common::layer_rows_name(r_.rows)},
          {"tolerance", {{"relative_rmse", r_.tolerance}}},
          {"patching", r_.patching},
          {"patch_search", r_.patch_search}}},
        {"model_identity", fingerprint_.identity()},
        {"model_fingerprint", fingerprint_section(fingerprint_)},
        {"engine",
         {{"name", r_.engine},
          {"next_token_id", r_.next_token_id ? Json(*r_.next_token_id) : Json(nullptr)},
          {"rows_file",
           {{"path", r_.rows_path},
            {"sha256", r_.rows_sha256},
            {"bytes", cmp["engine_file_bytes"]}}},
          {"boundaries_given", given_.size()},
          {"operators_given", operators_.size()},
          {"omitted", omitted}}},
        {"reference",
         {{"argmax_token_id", oracle_output_["argmax_token_id"]},
          {"argmax_logit", oracle_output_["argmax_logit"]},
          {"logits_sha256", oracle_output_["logits_sha256"]},
          {"hidden_size", hidden_},
          {"boundary_count", boundaries_.size()},
          {"rows_sha256", artifact_sha},
          {"output", std::move(output)},
          {"process", oracle_evidence_->to_json()}}},
        {"boundaries", cmp["boundaries"]},
        {"first_non_bitwise", cmp["first_non_bitwise"]},
        {"narrow_with", narrow_with(cmp["first_non_bitwise"])},
        {"first_over_tolerance", cmp["first_over_tolerance"]},
        {"largest_growth", cmp["largest_growth"]},
        {"patching", patching},
        {"comparison", {{"seconds", cmp["seconds"]}, {"process", compare_evidence_->to_json()}}},
        {"containment",
         {{"host_memory", facts.host_memory},
          {"backend", facts.backend},
          {"network",
           oracle_evidence_->network ? oracle_evidence_->network->to_json() : Json("host")}}},
        {"layers_artifact",
         {{"name", common::kLayerArtifactFileName},
          {"bytes", fs::file_size(artifact)},
          {"sha256", artifact_sha}}}};
    auto name_of = [](const Json& at) {
      return at.is_null() ? std::string("none") : at["name"].get<std::string>();
    };
    std::string message = "succeeded: first non-bitwise boundary " +
                          name_of(cmp["first_non_bitwise"]) + ", first over tolerance " +
                          name_of(cmp["first_over_tolerance"]);
    if (!patching.is_null())
      message +=
          ", patching flips to the engine's token first at " + name_of(patching["first_flip"]);
    return Sealed{std::move(result),
                  artifact,
                  artifact_sha,
                  std::string(common::kLayerArtifactFileName),
                  std::string(common::kLayerPredicateType),
                  message};
  }

 private:
  Json oracle_input() const {
    // Rows that say which model they came from must come from this one.
    const Json& said = checks_["engine_rows"].value("model_content_sha256", Json());
    const Json& is = fingerprint_.identity()["content_sha256"];
    if (said.is_string() && said != is)
      throw Error("request.bad_layer_rows",
                  "the engine's rows file says __metadata__.model_content_sha256 " +
                      said.get<std::string>() + ", but " + r_.model_dir + " has content identity " +
                      is.dump() + ": rows from another model");
    Json in{{"schema", common::kOracleLayersInput},
            {"model_dir", r_.model_dir},
            {"token_ids", r_.input_token_ids},
            {"rows", common::layer_rows_name(r_.rows)},
            {"execution",
             {{"device", config_.oracle_device},
              {"dtype", execution_dtype(r_.model_dir)},
              {"threads", worker_threads(config_)}}}};
    if (!operators_.empty()) in["operators"] = operators_;
    // Step::open_files come first: the engine's file is fd 3.
    if (r_.patching)
      in["patch"] = Json{{"fd", 3},
                         {"boundaries", given_},
                         {"candidate_token_id", *r_.next_token_id},
                         {"sha256", r_.rows_sha256},
                         {"search", r_.patch_search}};
    return in;
  }

  // The oracle computed what was asked, over the model's own boundaries, with the bytes the
  // fingerprint hashed, and patched each boundary the engine gave, in order.
  void check_oracle_output(const Json& out) {
    auto bad = [](const std::string& m) {
      throw Error("worker.layers_output", "assay-oracle layers: " + m);
    };
    if (out.value("schema", "") != common::kOracleLayersOutput)
      bad("output.json has schema " + out.value("schema", Json()).dump());
    if (out.value("input_token_ids_sha256", "") != common::token_ids_sha256(r_.input_token_ids) ||
        out.value("rows", "") != common::layer_rows_name(r_.rows) ||
        out.value("hidden_size", std::int64_t{-1}) != hidden_)
      bad("the output does not describe the request's ids, rows and hidden size");
    const Json& bs = common::require(out, "boundaries", "layers output");
    if (!bs.is_array() || bs.size() != boundaries_.size())
      bad("reports " + std::to_string(bs.size()) + " boundaries; config.json gives " +
          std::to_string(boundaries_.size()));
    // Every value below is read with member(): the worker's document is not trusted to have the
    // shape the checks ask about (fuzz_worker_output: a null patching, a boundary that is a
    // number).
    using common::member;
    for (std::size_t i = 0; i < bs.size(); ++i)
      if (member(bs[i], "name") != boundaries_[i] || !member(bs[i], "sha256").is_string() ||
          !common::is_identity(member(bs[i], "sha256").get<std::string>()))
        bad("boundary " + std::to_string(i) + " is " + member(bs[i], "name").dump() +
            ", config.json gives \"" + boundaries_[i] + "\"");
    for (const char* k : {"logits_sha256"})
      if (!common::is_identity(out.value(k, ""))) bad(std::string(k) + " is not a digest");
    if (!out.contains("argmax_token_id") || !out["argmax_token_id"].is_number_integer())
      bad("no argmax_token_id");
    const Json& p = out.value("patching", Json());
    if (r_.patching) {
      if (member(p, "file_sha256") != r_.rows_sha256)
        bad("the patching read " + member(p, "file_sha256").dump() +
            ", not the engine's file of the request " + r_.rows_sha256);
      if (member(p, "search") != r_.patch_search)
        bad("the patching searched " + member(p, "search").dump() + ", not \"" + r_.patch_search +
            "\"");
      const Json& done = member(p, "boundaries");
      bool every = r_.patch_search == "every";
      if (!done.is_array() || (every && done.size() != given_.size()))
        bad("the patching covers " + std::to_string(done.is_array() ? done.size() : 0) +
            " boundaries, not " + std::to_string(given_.size()));
      // "every": each boundary given, in order, each computed; "bisect": some of them, in order,
      // and as many forwards as rows computed.
      std::size_t next = 0;
      std::int64_t computed = 0;
      for (std::size_t i = 0; i < done.size(); ++i) {
        const Json& name = member(done[i], "name");
        while (next < given_.size() && name != given_[next] && !every) ++next;
        if (next == given_.size() || name != given_[next] ||
            !member(done[i], "argmax_token_id").is_number_integer() ||
            !member(done[i], "computed").is_boolean() ||
            (every && !member(done[i], "computed").get<bool>()))
          bad("patched boundary " + std::to_string(i) + " (" + name.dump().substr(0, 80) +
              ") is not one the engine gave, in order");
        computed += member(done[i], "computed").get<bool>();
        ++next;
      }
      if (member(p, "forwards") != computed)
        bad("the patching reports " + member(p, "forwards").dump() + " forwards for " +
            std::to_string(computed) + " computed boundaries");
    } else if (!p.is_null()) {
      bad("patched although the request did not ask for it");
    }
  }

  Step oracle() {
    std::vector<std::string> files;
    if (r_.patching) files.push_back(r_.rows_path);
    return Step{kOracleRole,
                config_.oracle_worker,
                "layers",
                r_.model_dir,
                files,
                [this] { return oracle_input(); },
                {},
                [this](Json output, const contain::Evidence& evidence) {
                  check_oracle_output(output);
                  check_bytes_used(output, fingerprint_, kOracleRole);
                  check_configuration(output, kOracleRole);
                  oracle_output_ = std::move(output);
                  oracle_evidence_ = evidence;
                }};
  }

  Json compare_input(std::vector<std::pair<fs::path, std::string>>* move_in) const {
    if (move_in)
      move_in->emplace_back(job_dir_ / kOracleRole / common::kLayerArtifactFileName,
                            kReferenceRows);
    Json bs = Json::array();
    for (const Json& b : oracle_output_["boundaries"])
      bs.push_back(Json{{"name", b["name"]}, {"sha256", b["sha256"]}});
    return Json{{"schema", common::kCompareLayersInput},
                {"reference", kReferenceRows},
                {"engine", {{"fd", 3}, {"path", r_.rows_path}, {"sha256", r_.rows_sha256}}},
                {"boundaries", std::move(bs)},
                {"tolerance", r_.tolerance}};
  }

  Step compare() {
    return compare_step(
        config_, "layers", {r_.rows_path}, [this](auto* move_in) { return compare_input(move_in); },
        [this](const Json& output) { check_compare_output(output); }, compare_output_,
        compare_evidence_);
  }

  // The comparison read the request's engine file and the reference rows the oracle reported.
  void check_compare_output(const Json& out) const {
    auto bad = [](const std::string& m) { throw Error("worker.compare_output", m); };
    if (out.value("schema", "") != common::kCompareLayersOutput)
      bad("compare output.json has schema " + out.value("schema", Json()).dump());
    if (out.value("engine_file_sha256", "") != r_.rows_sha256)
      bad("the comparison read the engine file " + out.value("engine_file_sha256", Json()).dump() +
          ", not the request's " + r_.rows_sha256);
    const Json& bs = common::require(out, "boundaries", "compare output");
    if (!bs.is_array() || bs.size() != boundaries_.size())
      bad("compare output covers " + std::to_string(bs.size()) + " boundaries, not " +
          std::to_string(boundaries_.size()));
    for (std::size_t i = 0; i < bs.size(); ++i) {
      const Json& want = oracle_output_["boundaries"][i]["sha256"];
      bool present = std::find(given_.begin(), given_.end(), boundaries_[i]) != given_.end();
      if (bs[i].value("name", "") != boundaries_[i] ||
          bs[i].value("reference_sha256", Json()) != want ||
          bs[i].value("present", !present) != present)
        bad("boundary " + std::to_string(i) + " (" + boundaries_[i] +
            ") of the comparison is not the oracle's or the engine's");
    }
  }

  // first_flip: the first boundary whose substitution makes the argmax the engine's token;
  // last_hold: the last before it where the argmax stays the reference's.
  Json patching_section(Json p) {
    Json first_flip = nullptr, last_hold = nullptr;
    // The worker's figures, read without trusting their shape (fuzz_worker_output: a boundary
    // without becomes_candidate).
    if (!p.is_object() || !p["boundaries"].is_array())
      throw Error("worker.layers_output", "the patching output has no list of boundaries");
    for (Json b : p["boundaries"]) {  // copies: operator[] on a missing key gives null
      if (!b.is_object())
        throw Error("worker.layers_output", "a patching boundary is not an object");
      Json at{{"index", b["index"]}, {"name", b["name"]}};
      if (!b["becomes_candidate"].is_boolean())
        throw Error("worker.layers_output",
                    "patching boundary " + b["index"].dump() + " has no boolean becomes_candidate");
      // The rows a forward the search skipped would have substituted must all be bitwise equal
      // in the comparison, which read the engine's file on its own.
      if (b["computed"] == false) {
        bool bitwise = b["substituted"].is_array() && !b["substituted"].empty();
        for (const Json& name : b["substituted"].is_array() ? b["substituted"] : Json::array()) {
          bool found = false;
          for (const Json& c : compare_output_.value("boundaries", Json::array()))
            if (c.value("name", Json()) == name)
              found = c.value("bitwise_equal", Json()) == Json(true);
          bitwise = bitwise && found;
        }
        if (!bitwise || b["argmax_token_id"] != oracle_output_["argmax_token_id"])
          throw Error("worker.layers_output",
                      "the patching skipped boundary " + b["name"].dump().substr(0, 80) +
                          " as the reference's own rows, but the comparison finds them not "
                          "bitwise equal (or the argmax it gives is not the reference's)");
      }
      if (b["becomes_candidate"].get<bool>()) {
        first_flip = std::move(at);
        break;
      }
      if (b["argmax_token_id"] == oracle_output_["argmax_token_id"]) last_hold = std::move(at);
    }
    return Json{{"candidate_token_id", p["candidate_token_id"]},
                {"reference_argmax_token_id", oracle_output_["argmax_token_id"]},
                {"search", p["search"]},
                {"forwards", p["forwards"]},
                {"seconds", p["seconds"]},
                {"boundaries", p["boundaries"]},
                {"first_flip", std::move(first_flip)},
                {"last_hold", std::move(last_hold)}};
  }

  // The rows that would narrow the first non-bitwise boundary, when the engine gave it at a
  // coarser granularity than the model offers: the operators of its block (self_attn or mlp),
  // or for a layer's output every boundary inside that layer; none the engine gave.
  Json narrow_with(const Json& first) const {
    Json out = Json::array();
    if (!first.is_object() || !first["name"].is_string()) return out;
    const std::string name = first["name"].get<std::string>();
    std::vector<std::string> inside = common::block_operators(model_, name);
    if (name.starts_with("layers.") && name.find('.', 7) == std::string::npos)
      for (const common::Boundary& b : model_)
        if (b.name.starts_with(name + ".")) inside.push_back(b.name);
    for (const common::Boundary& b : model_)  // in forward order
      if (std::find(inside.begin(), inside.end(), b.name) != inside.end() &&
          std::find(given_.begin(), given_.end(), b.name) == given_.end())
        out.push_back(b.name);
    return out;
  }

  const Config& config_;
  fs::path job_dir_;
  common::LayerRequest r_;
  Json checks_;
  std::int64_t hidden_;
  std::vector<common::Boundary> model_;
  std::vector<std::string> boundaries_, given_, operators_;
  std::int64_t row_width_ = 0;  // values per position over every boundary the job computes
  FingerprintRun fingerprint_;
  Json oracle_output_;
  std::optional<contain::Evidence> oracle_evidence_;
  Json compare_output_;
  std::optional<contain::Evidence> compare_evidence_;
};

}  // namespace

Admission admit_layers(const Json& document, const SubmitContext& context) {
  common::LayerRequest r = common::validate_layer_request(document);
  check_request_limits(r.limits, context.config);
  Json opened = Json::array();
  std::string model_dir = check_model_dir(r.model_dir, context.peer, &opened);
  if (model_dir != r.model_dir)
    throw Error("request.bad_model",
                "model_dir \"" + r.model_dir + "\" is not normalised (as " + model_dir + ")");
  r.check_vocab(read_vocab_size(model_dir));
  if (auto max_positions = read_max_positions(model_dir))
    if (static_cast<std::int64_t>(r.input_token_ids.size()) > *max_positions)
      throw Error("request.too_long", "request.input_token_ids has " +
                                          std::to_string(r.input_token_ids.size()) +
                                          " ids, more than the model's max_position_embeddings " +
                                          std::to_string(*max_positions));
  // The engine's file, as the submitter: its header (at most 64 MiB of it; the data is not read
  // here) names the boundaries it holds.
  Opened rows = check_readable_file(r.rows_path, context.peer, "request.bad_layer_rows_file",
                                    "request.engine.rows_file.path", &opened);
  common::SafetensorsIndex header;
  try {
    header = common::read_safetensors_header(
        rows.fd.get(), static_cast<std::uint64_t>(rows.st.st_size), 64u << 20);
  } catch (const Error& e) {
    throw Error("request.bad_layer_rows",
                "request.engine.rows_file.path " + rows.path + ": " + e.what());
  }
  common::EngineRows given = common::check_engine_rows(
      header, common::model_boundaries(read_model_config(model_dir), read_hidden_size(model_dir)),
      r, r.model_identity ? (*r.model_identity)["content_sha256"].get<std::string>() : "");
  Admission a{common::sha256_canonical_id(
                  Json{{"request_sha256", r.request_sha256}, {"kind", "layer-attribution"}}),
              r.request_sha256,
              r.schema,
              r.id,
              model_dir,
              std::move(opened)};
  a.checks =
      Json{{"engine_rows",
            {{"given", given.given},
             {"omitted", given.omitted},
             {"operators", given.operators_given},
             {"model_content_sha256",
              given.model_content_sha256 ? Json(*given.model_content_sha256) : Json(nullptr)}}}};
  a.accepted_note =
      "engine rows: " + std::to_string(given.given.size() - given.operators_given.size()) + " of " +
      std::to_string(given.given.size() - given.operators_given.size() + given.omitted.size()) +
      " layer-level boundaries, " + std::to_string(given.operators_given.size()) +
      " operator-level";
  return a;
}

std::unique_ptr<Pipeline> open_layers(const Config& config, const fs::path& job_dir,
                                      const std::string&) {
  return std::make_unique<LayersPipeline>(config, job_dir);
}

}  // namespace assay::supervisor
