// `assay verify --kiln`: a record Kiln wrote (its next-token and layer-attribution results, v1
// and v2), its logits artifact and assay's numerics addendum beside it, checked offline.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "client/kiln_export.h"
#include "client/verify.h"
#include "client/verify_checks.h"
#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/json_schema.h"
#include "common/kiln_schemas.h"
#include "common/request.h"
#include "common/safetensors.h"

namespace assay::client {

namespace {

using common::Json;
using common::member;
using namespace verify_detail;

constexpr std::string_view kKilnNextTokenV1 = "kiln.rocm-hf-next-token-oracle.v1";
constexpr std::string_view kKilnNextTokenV2 = "kiln.rocm-hf-next-token-oracle.v2";
constexpr std::string_view kKilnLayerV1 = "kiln.rocm-hf-layer-attribution-result.v1";
constexpr std::string_view kKilnLayerV2 = "kiln.rocm-hf-layer-attribution-result.v2";

// The facts of a Kiln next-token result that follow from the document itself.
void check_kiln_next_token(const Json& doc, Checks& checks) {
  const Json& oracle = doc.contains("oracle") ? doc["oracle"] : Json();
  const Json& verdict = doc.contains("verdict") ? doc["verdict"] : Json();
  auto argmax = int_at(oracle, "argmax");
  const Json top = oracle.is_object() ? oracle.value("top_tokens", Json::array()) : Json::array();
  const Json candidates =
      oracle.is_object() ? oracle.value("candidate_tokens", Json::array()) : Json::array();

  // The top tokens: by logit, highest first, the argmax first.
  bool ordered = top.is_array() && !top.empty() && top.size() <= 10;
  std::string why = ordered ? "" : "oracle.top_tokens is not a list of 1 to 10 tokens";
  for (std::size_t i = 0; ordered && i < top.size(); ++i) {
    auto logit = number_at(top[i], "logit");
    if (!logit || !int_at(top[i], "token_id")) {
      ordered = false;
      why = "oracle.top_tokens[" + std::to_string(i) + "] has no logit or token_id";
    } else if (i > 0 && *logit > *number_at(top[i - 1], "logit")) {
      ordered = false;
      why = "oracle.top_tokens[" + std::to_string(i) + "] has a higher logit than the one before";
    }
  }
  if (ordered && argmax && int_at(top[0], "token_id") != argmax) {
    ordered = false;
    why = "oracle.top_tokens[0] is token " + top[0]["token_id"].dump() + ", not oracle.argmax " +
          std::to_string(*argmax);
  }
  checks.add("kiln.top_tokens", ordered,
             ordered ? std::to_string(top.size()) + " tokens by logit, the argmax first" : why);

  // The margin: the top logit less the next one.
  auto margin = number_at(oracle, "top_logit_margin");
  if (ordered && top.size() >= 2) {
    double a = *number_at(top[0], "logit"), b = *number_at(top[1], "logit");
    bool ok = margin && (*margin == a - b || *margin == static_cast<double>(static_cast<float>(a) -
                                                                            static_cast<float>(b)));
    checks.add("kiln.top_logit_margin", ok,
               "oracle.top_logit_margin " + (margin ? repr(*margin) : "none") +
                   (ok ? " = " : " != ") + "top_tokens[0].logit - top_tokens[1].logit (" +
                   repr(a - b) + ")");
  }

  // Each candidate: its logit and rank where the top tokens show them.
  bool cands_ok = candidates.is_array() && !candidates.empty();
  std::string cands_why = cands_ok ? "" : "oracle.candidate_tokens is not a non-empty list";
  for (std::size_t i = 0; cands_ok && i < candidates.size(); ++i) {
    const Json& c = candidates[i];
    std::string at = "oracle.candidate_tokens[" + std::to_string(i) + "]";
    auto token = int_at(c, "token_id");
    auto logit = number_at(c, "logit");
    auto rank = int_at(c, "rank");
    if (!token || !logit || !rank || !c.contains("engine")) {
      cands_ok = false;
      cands_why = at + " lacks engine, token_id, logit or rank";
      break;
    }
    if (!ordered) continue;
    std::int64_t above = 0, position = 0;
    for (std::size_t k = 0; k < top.size(); ++k) {
      if (*number_at(top[k], "logit") > *logit) ++above;
      if (int_at(top[k], "token_id") == token) {
        position = static_cast<std::int64_t>(k) + 1;
        if (*number_at(top[k], "logit") != *logit) {
          cands_ok = false;
          cands_why = at + ".logit " + repr(*logit) + " differs from its top_tokens entry";
        }
      }
    }
    bool in_top = position > 0;
    bool rank_ok = in_top ? (*rank == above + 1 || *rank == position)
                          : (*rank > static_cast<std::int64_t>(top.size()) && *rank > above);
    if (cands_ok && !rank_ok) {
      cands_ok = false;
      cands_why =
          at + ".rank " + std::to_string(*rank) + " does not follow from the top tokens (" +
          std::to_string(above) + " have a higher logit" +
          (in_top ? ", it is number " + std::to_string(position) : ", it is not among them") + ")";
    }
  }
  checks.add("kiln.candidate_tokens", cands_ok,
             cands_ok ? std::to_string(candidates.size()) + " candidates, logits and ranks agree"
                      : cands_why);

  // The verdict, by Kiln's rule: an engine's only when its candidate alone is the argmax.
  if (cands_ok && argmax) {
    std::vector<std::string> matching;
    for (const Json& c : candidates)
      if (int_at(c, "token_id") == argmax) matching.push_back(c["engine"].dump());
    std::string want = matching.size() == 1 ? matching.front() : "\"neither\"";
    auto claimed_token = int_at(verdict, "argmax_token_id");
    checks.add("kiln.verdict.argmax_token_id", claimed_token == argmax,
               "verdict.argmax_token_id " +
                   (claimed_token ? std::to_string(*claimed_token) : std::string("missing")) +
                   (claimed_token == argmax ? " = " : " != ") + "oracle.argmax " +
                   std::to_string(*argmax));
    Json claimed = verdict.is_object() ? verdict.value("argmax_candidate", Json()) : Json();
    checks.add("kiln.verdict.argmax_candidate", claimed.dump() == want,
               "verdict.argmax_candidate " + claimed.dump() +
                   (claimed.dump() == want ? "" : ", the candidates give " + want) + " (" +
                   std::to_string(matching.size()) + " candidate(s) hold the argmax)");
    Json complete =
        verdict.is_object() ? verdict.value("candidate_attribution_complete", Json()) : Json();
    bool want_complete = matching.size() == 1;
    checks.add("kiln.verdict.candidate_attribution_complete", complete == Json(want_complete),
               "verdict.candidate_attribution_complete " + complete.dump() +
                   (complete == Json(want_complete)
                        ? ""
                        : ", Kiln's rule gives " + Json(want_complete).dump()));
  } else if (!argmax) {
    checks.add("kiln.verdict", false, "oracle.argmax is not an integer");
  }
}

// Kiln's cross-field rules of a next-token record (rocm_hf_next_token_oracle.py validate_result,
// v1 and v2): what each part says of another must agree, so that a record resealed after one of
// them was changed is refused as Kiln refuses it.
void check_kiln_bindings(const Json& doc, Checks& checks) {
  auto at = [&](const char* part, const char* key) -> const Json& {
    return member(member(doc, part), key);
  };
  auto same = [&](const char* name, const Json& a, const char* a_name, const Json& b,
                  const char* b_name) { check_same(checks, name, a, a_name, b, b_name); };
  same("kiln.request_sha256", at("oracle", "request_sha256"), "oracle.request_sha256",
       at("request", "sha256"), "request.sha256");
  same("kiln.request_id", at("oracle", "request_id"), "oracle.request_id", at("request", "id"),
       "request.id");
  same("kiln.output_bytes", at("reference_artifact", "bytes"), "reference_artifact.bytes",
       at("oracle", "output_bytes"), "oracle.output_bytes");
  same("kiln.origin_main", at("source", "commit"), "source.commit", at("source", "origin_main"),
       "source.origin_main");
  // One interpreter ran the fingerprint and the worker. A v1 record may lack the fingerprint
  // (Kiln's legacy records); where it has one, the rule holds.
  if (doc.contains("model_fingerprint") || doc.value("schema", "") == kKilnNextTokenV2)
    same("kiln.python_sha256", at("model_fingerprint", "python_sha256"),
         "model_fingerprint.python_sha256", at("implementation", "python_sha256"),
         "implementation.python_sha256");
}

// The document against Kiln's own published schema for its "schema" (common/kiln_schemas.h).
void check_kiln_schema(const Json& doc, const std::string& schema, Checks& checks) {
  auto id = common::kiln_schema_id_for(schema);
  if (!id) return;  // kiln.schema already failed
  auto errors = common::kiln_schemas().validate(doc, *id);
  std::string detail = errors.empty() ? "valid against Kiln's " + *id : "";
  for (std::size_t i = 0; i < errors.size() && i < 8; ++i)
    detail += (i ? "; " : "") + (errors[i].pointer.empty() ? "/" : errors[i].pointer) + ": " +
              errors[i].message;
  if (errors.size() > 8) detail += "; and " + std::to_string(errors.size() - 8) + " more";
  checks.add("kiln.schema_valid", errors.empty(), detail);
}

// What Kiln's own reader of a reference artifact requires before it takes the file
// (rocm_hf_path_attribution.rs load_reference): exactly the tensors input_ids (I64) and logits
// (F32, one dimension), and in the metadata Kiln's layout name and the attention and linear
// attention implementations of the run, which must be the record's.
void check_kiln_artifact_layout(const Json& oracle, const common::SafetensorsFile& file,
                                Checks& checks) {
  std::vector<std::string> problems;
  std::vector<std::string> names;
  for (const auto& t : file.tensors()) names.push_back(t.name);
  std::sort(names.begin(), names.end());
  if (names != std::vector<std::string>{"input_ids", "logits"})
    problems.push_back("tensors " + Json(names).dump() +
                       ", not exactly [\"input_ids\",\"logits\"]");
  const common::TensorView* ids = file.find("input_ids");
  if (ids && ids->dtype != common::Dtype::kI64) problems.push_back("input_ids is not I64");
  const common::TensorView* logits = file.find("logits");
  if (logits && (logits->dtype != common::Dtype::kF32 || logits->shape.size() != 1))
    problems.push_back("logits is not a one-dimensional F32 tensor");
  const auto& metadata = file.metadata();
  auto meta = [&](const std::string& key) -> Json {
    auto it = metadata.find(key);
    return it == metadata.end() ? Json() : Json(it->second);
  };
  if (meta("schema") != common::kKilnFullLogitsSchema)
    problems.push_back("metadata schema " + meta("schema").dump() + ", not \"" +
                       std::string(common::kKilnFullLogitsSchema) + "\"");
  for (const char* key : {"attention_implementation", "linear_attention_implementation"})
    if (meta(key).is_null() || meta(key) != member(oracle, key))
      problems.push_back(std::string("metadata ") + key + " " + meta(key).dump() +
                         ", the record's " + member(oracle, key).dump());
  std::string detail;
  for (const auto& p : problems) detail += (detail.empty() ? "" : "; ") + p;
  checks.add("kiln.artifact.layout", problems.empty(),
             problems.empty()
                 ? "input_ids and logits with Kiln's metadata, as Kiln's reader takes them"
                 : detail);
}

// A Kiln next-token record's artifact: the file the record names, its logits tensor (F32, one
// per vocabulary entry, "logits") hashed as oracle.logits_sha256 and its input_ids as
// oracle.input_token_ids_sha256, and the argmax, the top tokens, the candidates' logits and
// ranks recomputed from its values.
void check_kiln_artifact(const Json& doc, const std::filesystem::path& path, Checks& checks) {
  const Json& oracle = doc.contains("oracle") ? doc["oracle"] : Json();
  std::string file_id = common::sha256_file_id(path);
  auto size = static_cast<std::int64_t>(std::filesystem::file_size(path));
  auto claimed_sha = string_at(doc, {"reference_artifact", "sha256"});
  auto claimed_bytes = int_at(member(doc, "reference_artifact"), "bytes");
  bool same =
      claimed_sha == file_id && claimed_bytes == size && int_at(oracle, "output_bytes") == size;
  checks.add("kiln.artifact.file", same,
             path.string() + ": " + file_id + ", " + std::to_string(size) + " bytes" +
                 (same ? " as reference_artifact and oracle.output_bytes say"
                       : "; the record says " + claimed_sha.value_or("no sha256") + ", " +
                             (claimed_bytes ? std::to_string(*claimed_bytes) : "no") +
                             " bytes (oracle.output_bytes " +
                             member(oracle, "output_bytes").dump() + ")"));
  std::optional<common::SafetensorsFile> opened;
  try {
    opened.emplace(common::SafetensorsFile::open(path));
  } catch (const common::Error& e) {
    checks.add("kiln.artifact.logits", false, e.what());
    return;
  }
  const common::SafetensorsFile& file = *opened;
  check_kiln_artifact_layout(oracle, file, checks);
  const common::TensorView* logits = file.find("logits");
  auto vocab = int_at(oracle, "vocab");
  if (!logits || logits->dtype != common::Dtype::kF32 || (vocab && logits->numel() != *vocab)) {
    checks.add("kiln.artifact.logits", false,
               "the artifact has no F32 tensor \"logits\" of oracle.vocab (" +
                   member(oracle, "vocab").dump() + ") values");
    return;
  }
  std::string logits_id = common::sha256_id(logits->data, logits->nbytes);
  auto claimed_logits = string_at(oracle, {"logits_sha256"});
  checks.add("kiln.artifact.logits_sha256", claimed_logits == logits_id,
             "sha256 of the logits tensor's F32 bytes " + logits_id +
                 (claimed_logits == logits_id ? " = " : " != ") + "oracle.logits_sha256 " +
                 claimed_logits.value_or("(missing)"));
  if (const common::TensorView* ids = file.find("input_ids");
      ids && ids->dtype == common::Dtype::kI64) {
    std::vector<std::int64_t> values(static_cast<std::size_t>(ids->numel()));
    std::memcpy(values.data(), ids->data, ids->nbytes);
    std::string ids_id = common::token_ids_sha256(values);
    auto claimed_ids = string_at(oracle, {"input_token_ids_sha256"});
    checks.add("kiln.artifact.input_ids", claimed_ids == ids_id,
               "the artifact's " + std::to_string(values.size()) + " input ids hash to " + ids_id +
                   (claimed_ids == ids_id ? " = " : " != ") + "oracle.input_token_ids_sha256");
  }

  std::vector<float> v(static_cast<std::size_t>(logits->numel()));
  std::memcpy(v.data(), logits->data, logits->nbytes);
  // A NaN has no place in torch.topk's order (an infinity has one) and no JSON number can name
  // it: logits holding one support no argmax, top token or candidate the record claims.
  std::size_t bad = 0, first_bad = 0;
  for (std::size_t i = 0; i < v.size(); ++i)
    if (std::isnan(v[i]) && bad++ == 0) first_bad = i;
  checks.add("kiln.artifact.no_nan", bad == 0,
             bad == 0 ? "none of the " + std::to_string(v.size()) + " logits is NaN"
                      : std::to_string(bad) + " of the " + std::to_string(v.size()) +
                            " logits are NaN, the first at token " + std::to_string(first_bad));
  if (bad != 0) return;
  // torch.topk / argmax order: by value, the lower index first among equals.
  std::vector<std::int64_t> order(v.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<std::int64_t>(i);
  std::size_t k = std::min<std::size_t>(10, order.size());
  std::partial_sort(
      order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
      [&](std::int64_t a, std::int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
  auto argmax = int_at(oracle, "argmax");
  checks.add("kiln.artifact.argmax", argmax == order[0],
             "the logits' argmax is " + std::to_string(order[0]) +
                 (argmax == order[0] ? " = " : " != ") + "oracle.argmax " +
                 member(oracle, "argmax").dump());
  const Json top = oracle.is_object() ? oracle.value("top_tokens", Json::array()) : Json::array();
  bool top_ok = top.is_array() && top.size() == k;
  std::string top_why;
  for (std::size_t i = 0; top_ok && i < k; ++i) {
    double logit = v[static_cast<std::size_t>(order[i])];
    if (int_at(top[i], "token_id") != order[i] || number_at(top[i], "logit") != logit) {
      top_ok = false;
      top_why = "top_tokens[" + std::to_string(i) + "] is " + top[i].dump() + ", the logits give " +
                std::to_string(order[i]) + " at " + repr(logit);
    }
  }
  checks.add("kiln.artifact.top_tokens", top_ok,
             top_ok ? "the " + std::to_string(k) + " highest logits, in order"
                    : (top_why.empty() ? "oracle.top_tokens is not " + std::to_string(k) + " tokens"
                                       : top_why));
  const Json cands =
      oracle.is_object() ? oracle.value("candidate_tokens", Json::array()) : Json::array();
  bool cands_ok = cands.is_array();
  std::string cands_why;
  for (std::size_t i = 0; cands_ok && i < cands.size(); ++i) {
    auto token = int_at(cands[i], "token_id");
    if (!token || *token < 0 || *token >= static_cast<std::int64_t>(v.size())) {
      cands_ok = false;
      cands_why = "candidate_tokens[" + std::to_string(i) + "] has no token id in the vocabulary";
      break;
    }
    float logit = v[static_cast<std::size_t>(*token)];
    std::int64_t rank = 1;
    for (float x : v) rank += x > logit;
    if (number_at(cands[i], "logit") != static_cast<double>(logit) ||
        int_at(cands[i], "rank") != rank) {
      cands_ok = false;
      cands_why = "candidate_tokens[" + std::to_string(i) + "] says logit " +
                  member(cands[i], "logit").dump() + ", rank " + member(cands[i], "rank").dump() +
                  "; the logits give " + repr(logit) + ", rank " + std::to_string(rank);
    }
  }
  checks.add("kiln.artifact.candidates", cands_ok,
             cands_ok ? "each candidate's logit and rank (1 + the tokens above it)" : cands_why);
}

// assay's numerics addendum of a Kiln next-token record: bound to this record by its
// result_sha256, its class recomputed from its members' figures, its reference and candidates
// the record's own.
void check_kiln_numerics(const Json& doc, const std::filesystem::path& path, Checks& checks) {
  Json addendum;
  try {
    addendum = common::parse_strict(common::read_file(path, kMaxDocumentBytes),
                                    {.max_bytes = kMaxDocumentBytes});
  } catch (const common::Error& e) {
    checks.add("kiln.numerics.addendum", false, path.string() + ": " + e.what());
    return;
  }
  const Json& bound = member(addendum, "kiln_record");
  const bool ok = member(addendum, "schema") == kKilnNumericsAddendum &&
                  member(bound, "schema") == member(doc, "schema") &&
                  member(bound, "result_sha256") == member(doc, "result_sha256");
  checks.add("kiln.numerics.addendum", ok,
             path.string() + (ok ? " is " + std::string(kKilnNumericsAddendum) +
                                       " bound to this record's result_sha256"
                                 : ": not an " + std::string(kKilnNumericsAddendum) +
                                       " document bound to this record (it names " +
                                       member(bound, "result_sha256").dump() + ", the record is " +
                                       member(doc, "result_sha256").dump() + ")"));
  if (!ok) return;
  const Json& n = member(addendum, "numerics");
  if (check_envelope_verdict(n, checks, "kiln.numerics.verdict"))
    check_envelope_oracle(n, member(doc, "oracle"), checks, "kiln.numerics.");
}

}  // namespace

VerifyReport verify_kiln(const std::filesystem::path& record,
                         const std::optional<std::filesystem::path>& artifact,
                         const std::optional<std::filesystem::path>& numerics) {
  Checks checks;
  const std::string bytes = common::read_file(record, kMaxDocumentBytes);
  Json doc;
  try {
    doc = common::parse_strict(bytes, {.max_bytes = kMaxDocumentBytes});
  } catch (const common::Error& e) {
    checks.add("kiln.json", false, record.string() + ": " + e.what());
    return checks.take();
  }
  if (!doc.is_object()) {
    checks.add("kiln.json", false, record.string() + " is not a JSON object");
    return checks.take();
  }
  auto schema = string_at(doc, {"schema"});
  bool next_token = schema == kKilnNextTokenV1 || schema == kKilnNextTokenV2;
  bool layer = schema == kKilnLayerV1 || schema == kKilnLayerV2;
  // Another of Kiln's record kinds (its path-attribution results): not a tampered record, but
  // one whose rules assay does not apply; said so, and nothing is checked.
  if (!next_token && !layer && schema && schema->starts_with("kiln.rocm-hf-")) {
    VerifyReport out;
    out.not_checked_kind = *schema;
    return out;
  }
  checks.add("kiln.schema", next_token || layer,
             "schema " + (schema ? "\"" + *schema + "\"" : std::string("missing")) +
                 (next_token || layer ? ""
                                      : ", not one of Kiln's next-token or layer-attribution "
                                        "results (v1, v2)"));
  auto claimed = string_at(doc, {"result_sha256"});
  Json body = doc;
  body.erase("result_sha256");
  std::string recomputed;
  try {
    recomputed = common::sha256_id(common::python_canonical(body));
  } catch (const common::Error& e) {
    recomputed = std::string("(not computable: ") + e.what() + ")";
  }
  checks.add("kiln.result_sha256", claimed == recomputed,
             claimed ? (claimed == recomputed ? recomputed + " (Kiln's canonical form)"
                                              : "claimed " + *claimed + ", recomputed " +
                                                    recomputed + " in Kiln's canonical form")
                     : "record has no result_sha256 string (recomputed " + recomputed + ")");
  if (schema) check_kiln_schema(doc, *schema, checks);
  if (next_token) check_kiln_next_token(doc, checks);
  if (next_token) check_kiln_bindings(doc, checks);
  if (layer) check_kiln_layer(doc, checks);
  if (artifact && next_token) check_kiln_artifact(doc, *artifact, checks);
  if (artifact && !next_token)
    checks.add("kiln.artifact", false, "--artifact applies to a next-token record's logits");
  // assay's numerics envelope beside the record (`assay result --format kiln-v2 -o` writes it).
  std::optional<std::filesystem::path> beside = numerics;
  if (!beside && next_token) {
    // symlink_status: a link there (dangling or not) is reported as refused, not passed over.
    std::error_code ec;
    if (std::filesystem::symlink_status(kiln_numerics_path(record), ec).type() !=
        std::filesystem::file_type::not_found)
      beside = kiln_numerics_path(record);
  }
  if (beside) check_kiln_numerics(doc, *beside, checks);
  return checks.take();
}

}  // namespace assay::client
