#include "client/verify.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "client/kiln_export.h"
#include "common/audit.h"
#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/json_schema.h"
#include "common/kiln_schemas.h"
#include "common/layers.h"
#include "common/numerics.h"
#include "common/protocol.h"
#include "common/request.h"
#include "common/result.h"
#include "common/safetensors.h"
#include "common/sign.h"
#include "common/trajectory.h"

namespace assay::client {

namespace {

using common::Json;

constexpr std::size_t kMaxDocumentBytes = 64 * 1024 * 1024;

std::string strip_sha256_prefix(std::string s) {
  if (s.rfind("sha256:", 0) == 0) s.erase(0, 7);
  return s;
}

// The string at a path of object keys, or nullopt when any step is missing or not a string.
std::optional<std::string> string_at(const Json& doc, std::initializer_list<const char*> keys) {
  const Json* cur = &doc;
  for (const char* k : keys) {
    if (!cur->is_object() || !cur->contains(k)) return std::nullopt;
    cur = &(*cur)[k];
  }
  if (!cur->is_string()) return std::nullopt;
  return cur->get<std::string>();
}

// What each kind of result looks like to the verifier.
struct ResultKind {
  std::string_view schema, predicate_type;
  const char* artifact_key;  // the result's member naming the artifact {name, bytes, sha256}
};
constexpr ResultKind kKinds[] = {
    {protocol::kNextTokenResult, protocol::kResultPredicateType, "reference_artifact"},
    {protocol::kFidelityResult, protocol::kFidelityPredicateType, "kl_artifact"},
    {common::kTrajectoryResult, common::kTrajectoryPredicateType, "trajectory_artifact"},
    {protocol::kNextTokenBatchResult, protocol::kBatchPredicateType, "states_artifact"},
    {common::kLayerResult, common::kLayerPredicateType, "layers_artifact"},
    {common::kAuditResult, common::kAuditPredicateType, "audit_artifact"},
};

const ResultKind* kind_of(const std::optional<std::string>& schema) {
  for (const ResultKind& k : kKinds)
    if (schema && *schema == k.schema) return &k;
  return nullptr;
}

class Checks {
 public:
  void add(std::string name, bool ok, std::string detail) {
    report_.checks.push_back({std::move(name), ok, std::move(detail)});
  }
  VerifyReport take() { return std::move(report_); }

 private:
  VerifyReport report_;
};

}  // namespace

bool VerifyReport::ok() const {
  return !checks.empty() &&
         std::all_of(checks.begin(), checks.end(), [](const Check& c) { return c.ok; });
}

Json VerifyReport::to_json() const {
  Json list = Json::array();
  for (const Check& c : checks)
    list.push_back({{"name", c.name}, {"ok", c.ok}, {"detail", c.detail}});
  return {{"ok", ok()}, {"checks", list}};
}

namespace {

constexpr std::string_view kKilnNextTokenV1 = "kiln.rocm-hf-next-token-oracle.v1";
constexpr std::string_view kKilnNextTokenV2 = "kiln.rocm-hf-next-token-oracle.v2";
constexpr std::string_view kKilnLayerV1 = "kiln.rocm-hf-layer-attribution-result.v1";
constexpr std::string_view kKilnLayerV2 = "kiln.rocm-hf-layer-attribution-result.v2";

// The member `key` of `o`, or null when `o` is not an object or has no such member: unlike
// Json::value, it never throws, whatever the document holds.
const Json& member(const Json& o, const char* key) {
  static const Json kNull;
  if (!o.is_object()) return kNull;
  auto it = o.find(key);
  return it == o.end() ? kNull : *it;
}

// The number at `key` of an object, or nullopt.
std::optional<double> number_at(const Json& o, const char* key) {
  if (!o.is_object() || !o.contains(key) || !o[key].is_number()) return std::nullopt;
  return o[key].get<double>();
}
std::optional<std::int64_t> int_at(const Json& o, const char* key) {
  if (!o.is_object() || !o.contains(key) || !o[key].is_number_integer()) return std::nullopt;
  return o[key].get<std::int64_t>();
}

// A number as Python's repr writes it, for a check's detail. Unlike python_float_repr it never
// throws: an artifact's logit, or the difference of two huge JSON numbers, may not be finite.
std::string repr(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  return common::python_float_repr(value);
}

// A numerics envelope's class recomputed from its members' figures (common/numerics.h), as the
// check `name`; false when the envelope could not be read at all.
bool check_envelope_verdict(const Json& n, Checks& checks, const std::string& name) {
  try {
    if (!n.is_object()) throw common::Error("numerics.invalid", "numerics is not an object");
    Json again = common::numerics_verdict(
        member(n, "members"), member(n, "candidates"), member(n, "fp32"),
        common::numerics_policy(n.contains("policy") ? n["policy"] : Json::object(),
                                "numerics.policy"));
    const Json& claimed = member(n, "verdict");
    checks.add(name, again == claimed,
               again == claimed
                   ? "class " + again["class"].get<std::string>() + " recomputed from " +
                         std::to_string(member(n, "members").size()) + " members' figures"
                   : "claimed class " + member(claimed, "class").dump() + ", recomputed " +
                         again["class"].dump() + " (or another figure of the verdict differs)");
    return true;
  } catch (const common::Error& e) {
    checks.add(name, false, std::string(e.what()) + " [" + e.code() + "]");
    return false;
  }
}

// The envelope's first member is the oracle's reference (its logits and argmax) and its
// candidates are the engines' tokens the oracle names: an assay next-token result's oracle or a
// Kiln record's, which share these fields. Checks PREFIX + "reference" and "candidates".
void check_envelope_oracle(const Json& n, const Json& oracle, Checks& checks,
                           const std::string& prefix) {
  const Json& members = member(n, "members");
  const Json& first = members.is_array() && !members.empty() ? members[0] : Json();
  const Json& sha = member(oracle, "logits_sha256");
  const bool same = member(first, "name") == "reference" && sha.is_string() &&
                    member(first, "logits_sha256") == sha &&
                    member(first, "argmax") == member(oracle, "argmax");
  checks.add(
      prefix + "reference", same,
      same ? "the envelope's reference is the oracle's (logits " + sha.get<std::string>() + ")"
           : "the envelope's first member is not the record's reference");
  Json want = Json::array();
  const Json& oracle_cands = member(oracle, "candidate_tokens");
  if (oracle_cands.is_array())
    for (const Json& c : oracle_cands)
      want.push_back(Json{{"engine", member(c, "engine")}, {"token_id", member(c, "token_id")}});
  const Json& cands = member(n, "candidates");
  checks.add(prefix + "candidates", want == cands,
             want == cands ? "the envelope classifies the oracle's candidates"
                           : "the envelope's candidates " + cands.dump() +
                                 " are not the oracle's " + want.dump());
}

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

// An engine audit's statistic, recomputed (common/audit.h); with the artifact (the worker's
// per-position figures), the per-context sums the statistic starts from, re-added in order.
void check_audit(const Json& result, const VerifyInputs& in, Checks& checks) {
  try {
    const Json& policy = member(member(member(result, "request"), "audit"), "policy");
    Json again = common::audit_statistics(member(result, "members"), member(result, "contexts"),
                                          common::audit_policy(policy, "request.audit.policy"));
    const Json& claimed = member(result, "statistics");
    checks.add("audit.statistics", again == claimed,
               again == claimed ? again["class"].get<std::string>() + ", " +
                                      again["explanation"].get<std::string>()
                                : "claimed " + member(claimed, "class").dump() + " at ratio " +
                                      member(claimed, "ratio").dump() + ", recomputed " +
                                      again["class"].dump() + " at " + again["ratio"].dump());
  } catch (const common::Error& e) {
    checks.add("audit.statistics", false, std::string(e.what()) + " [" + e.code() + "]");
  }
  if (!in.artifact) return;
  try {
    Json figures = common::parse_strict(common::read_file(*in.artifact, 512u << 20),
                                        {.max_bytes = 512u << 20, .exact_integers = false});
    const Json& got = member(figures, "contexts");
    const Json& want = member(result, "contexts");
    bool same = got.is_array() && want.is_array() && got.size() == want.size();
    std::string detail = "the artifact's per-position figures add up to the record's sums";
    for (std::size_t c = 0; same && c < got.size(); ++c) {
      auto add = [](const Json& list) {
        double s = 0;
        if (list.is_array())
          for (const Json& v : list) s += v.is_number() ? v.get<double>() : NAN;
        return s;
      };
      Json sums = Json::array();
      const Json& members = member(got[c], "members");
      if (members.is_array())
        for (const Json& m : members) sums.push_back(add(m));
      same = member(got[c], "id") == member(want[c], "id") &&
             Json(add(member(got[c], "engine"))) == member(want[c], "engine_sum") &&
             sums == member(want[c], "member_sums");
      if (!same)
        detail = "context " + member(want[c], "id").dump() +
                 ": the artifact's figures do not add up to the record's sums";
    }
    if (!got.is_array() || !want.is_array() || got.size() != want.size())
      detail = "the artifact's contexts are not the record's";
    checks.add("audit.sums", same, detail);
  } catch (const common::Error& e) {
    checks.add("audit.sums", false, in.artifact->string() + ": " + e.what());
  }
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
  if (artifact && next_token) check_kiln_artifact(doc, *artifact, checks);
  if (artifact && !next_token)
    checks.add("kiln.artifact", false, "--artifact applies to a next-token record's logits");
  // assay's numerics envelope beside the record (`assay result --format kiln-v2 -o` writes it).
  std::optional<std::filesystem::path> beside = numerics;
  if (!beside && next_token) {
    std::error_code ec;
    if (std::filesystem::exists(kiln_numerics_path(record), ec))
      beside = kiln_numerics_path(record);
  }
  if (beside) check_kiln_numerics(doc, *beside, checks);
  return checks.take();
}

std::filesystem::path default_envelope_path(const std::filesystem::path& result) {
  return result.parent_path() / (result.stem().string() + ".dsse.json");
}

VerifyReport verify_result(const VerifyInputs& in) {
  Checks checks;
  const std::string result_bytes = common::read_file(in.result, kMaxDocumentBytes);
  const std::string result_file_hex = strip_sha256_prefix(common::sha256_id(result_bytes));

  // 1. The result document itself.
  Json result;
  try {
    result = common::parse_strict(result_bytes, {.max_bytes = kMaxDocumentBytes});
  } catch (const common::Error& e) {
    checks.add("result.json", false, in.result.string() + ": " + e.what());
  }
  bool have_result = result.is_object();
  if (!result.is_null() && !have_result)
    checks.add("result.json", false, in.result.string() + " is not a JSON object");
  // Unknown schemas are checked as next-token results (and fail result.schema).
  const ResultKind* kind = &kKinds[0];
  if (have_result) {
    auto schema = string_at(result, {"schema"});
    const ResultKind* known = kind_of(schema);
    if (known) kind = known;
    checks.add("result.schema", known != nullptr,
               "schema " + (schema ? "\"" + *schema + "\"" : std::string("missing")) +
                   (known ? ""
                          : ", expected \"" + std::string(protocol::kNextTokenResult) + "\", \"" +
                                std::string(protocol::kFidelityResult) + "\", \"" +
                                std::string(common::kTrajectoryResult) + "\", \"" +
                                std::string(protocol::kNextTokenBatchResult) + "\" or \"" +
                                std::string(common::kLayerResult) + "\""));
    std::string canon = common::canonical(result);
    checks.add("result.canonical", result_bytes == canon,
               result_bytes == canon ? "file bytes are the RFC 8785 canonical form"
                                     : "file bytes differ from the canonical form (" +
                                           std::to_string(result_bytes.size()) + " vs " +
                                           std::to_string(canon.size()) + " bytes)");
    auto claimed = string_at(result, {"result_sha256"});
    std::string recomputed = common::compute_result_sha256(result);
    checks.add("result_sha256", claimed == recomputed,
               claimed
                   ? (claimed == recomputed ? recomputed
                                            : "claimed " + *claimed + ", recomputed " + recomputed)
                   : "result has no result_sha256 string (recomputed " + recomputed + ")");
  }

  // Bug or numerics: the class and its statistics recomputed from the record's own figures, and
  // the envelope's first member is the record's reference.
  if (have_result && result.contains("numerics")) {
    const Json& n = result["numerics"];
    if (check_envelope_verdict(n, checks, "numerics.verdict")) {
      const Json& members = member(n, "members");
      const Json& first = members.is_array() && !members.empty() ? members[0] : Json();
      if (kind->schema == common::kTrajectoryResult) {
        // A trajectory's envelope is of the divergence state; its candidates are the engines'
        // tokens there, and its reference the worker's own eager forward (the first member).
        const Json& tokens = member(member(result, "divergence"), "tokens");
        const Json& cands = member(n, "candidates");
        std::size_t given = 0;
        if (tokens.is_object())
          for (const auto& [engine, token] : tokens.items()) given += !token.is_null();
        bool same = cands.is_array() && cands.size() == given && given >= 2;
        if (same)
          for (const Json& c : cands) {
            const Json& engine = member(c, "engine");
            same = same && engine.is_string() &&
                   member(tokens, engine.get_ref<const std::string&>().c_str()) ==
                       member(c, "token_id") &&
                   tokens.contains(engine.get_ref<const std::string&>());
          }
        checks.add("numerics.candidates", same,
                   same ? "the envelope classifies the engines' tokens at the divergence"
                        : "the envelope's candidates " + cands.dump() +
                              " are not the divergence's tokens " + tokens.dump());
        checks.add("numerics.reference", member(first, "name") == "reference",
                   "the envelope's first member is " + member(first, "name").dump());
      } else {
        check_envelope_oracle(n, member(result, "oracle"), checks, "numerics.");
      }
    }
  }

  // An engine audit: the statistic recomputed from the record's per-context sums, and with the
  // artifact, those sums re-added from the worker's per-position figures.
  if (have_result && kind->schema == common::kAuditResult) check_audit(result, in, checks);

  // 2. The signature and the key it is made with.
  std::string raw_key;
  try {
    raw_key =
        in.public_key.size() == 32 ? in.public_key : common::public_key_raw_from_pem(in.public_key);
  } catch (const common::Error& e) {
    checks.add("public_key", false, std::string("cannot read the public key: ") + e.what());
  }
  std::string key_id = raw_key.empty() ? "" : common::sha256_id(raw_key);
  if (have_result && !key_id.empty()) {
    auto claimed = string_at(result, {"supervisor", "key_id"});
    checks.add("key_id", claimed == key_id,
               claimed ? (claimed == key_id ? key_id
                                            : "result names key " + *claimed +
                                                  ", the given public key is " + key_id)
                       : "result has no supervisor.key_id (given key " + key_id + ")");
  }

  std::optional<Json> statement;
  if (!in.envelope) {
    checks.add("signature", false, "no envelope given (--envelope)");
  } else {
    std::string env_text = common::read_file(*in.envelope, kMaxDocumentBytes);
    try {
      Json env = common::parse_strict(env_text, {.max_bytes = kMaxDocumentBytes});
      auto type = string_at(env, {"payloadType"});
      checks.add("envelope.payload_type", type == std::string(common::kInTotoPayloadType),
                 "payloadType " + (type ? "\"" + *type + "\"" : std::string("missing")));
      if (!raw_key.empty()) {
        common::VerifiedEnvelope opened = common::dsse_open(env, raw_key);
        std::string detail;
        for (const auto& sig : opened.signatures)
          detail += (detail.empty() ? "" : "; ") + std::string("signatures[") +
                    std::to_string(sig.index) + "] verifies with key " + sig.key_id +
                    (sig.keyid.empty() ? " (no keyid)" : " (keyid names it)");
        checks.add("signature", true, "Ed25519 DSSE: " + detail);
        statement = common::parse_strict(opened.payload, {.max_bytes = kMaxDocumentBytes});
      } else {
        checks.add("signature", false, "no usable public key");
      }
    } catch (const common::Error& e) {
      checks.add("signature", false,
                 in.envelope->string() + ": " + e.what() + " [" + e.code() + "]");
    }
  }

  // 3. The signed statement: its subjects are the result file and the logits artifact.
  if (statement) {
    auto type = string_at(*statement, {"_type"});
    auto ptype = string_at(*statement, {"predicateType"});
    checks.add(
        "statement.type",
        type == std::string(common::kInTotoStatementType) &&
            ptype == std::string(kind->predicate_type),
        "_type " + type.value_or("missing") + ", predicateType " + ptype.value_or("missing"));
    std::vector<std::pair<std::string, std::string>> subjects;  // name, hex
    if (statement->contains("subject") && (*statement)["subject"].is_array())
      for (const Json& s : (*statement)["subject"])
        subjects.emplace_back(string_at(s, {"name"}).value_or(""),
                              string_at(s, {"digest", "sha256"}).value_or(""));
    auto result_subject = std::find_if(subjects.begin(), subjects.end(),
                                       [&](const auto& s) { return s.second == result_file_hex; });
    checks.add("subject.result", result_subject != subjects.end(),
               result_subject != subjects.end()
                   ? "subject \"" + result_subject->first + "\" is sha256 " + result_file_hex
                   : "no subject has the result file's sha256 " + result_file_hex);

    if (have_result) {
      auto art_id = string_at(result, {kind->artifact_key, "sha256"});
      std::string art_hex = art_id ? strip_sha256_prefix(*art_id) : "";
      auto art_subject = std::find_if(subjects.begin(), subjects.end(), [&](const auto& s) {
        return !art_hex.empty() && s.second == art_hex;
      });
      checks.add("subject.artifact", art_subject != subjects.end(),
                 !art_id ? "result has no " + std::string(kind->artifact_key) + ".sha256"
                 : art_subject != subjects.end()
                     ? "subject \"" + art_subject->first + "\" is the result's " +
                           kind->artifact_key + " " + *art_id
                     : "no subject has the result's " + std::string(kind->artifact_key) +
                           " sha256 " + *art_id);
    }
  }

  // 4. The artifact file, when given: its bytes are the ones the result (and statement) name.
  if (in.artifact) {
    std::string file_id = common::sha256_file_id(*in.artifact);
    std::uintmax_t size = std::filesystem::file_size(*in.artifact);
    const char* key = kind->artifact_key;
    auto art_id = have_result ? string_at(result, {key, "sha256"}) : std::nullopt;
    const Json* bytes = have_result && result.contains(key) && result[key].is_object() &&
                                result[key].contains("bytes")
                            ? &result[key]["bytes"]
                            : nullptr;
    bool same_hash = art_id && strip_sha256_prefix(*art_id) == strip_sha256_prefix(file_id);
    bool same_size = bytes && bytes->is_number_unsigned() && bytes->get<std::uintmax_t>() == size;
    checks.add("artifact.file", same_hash && same_size,
               in.artifact->string() + ": " + file_id + ", " + std::to_string(size) +
                   " bytes; result names " + art_id.value_or("no sha256") + ", " +
                   (bytes ? bytes->dump() : std::string("no")) + " bytes");
  }
  return checks.take();
}

}  // namespace assay::client
