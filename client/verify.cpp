#include "client/verify.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "client/verify_checks.h"
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

using namespace verify_detail;

namespace {

using common::Json;

std::string strip_sha256_prefix(std::string s) {
  if (s.rfind("sha256:", 0) == 0) s.erase(0, 7);
  return s;
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

}  // namespace

bool VerifyReport::ok() const {
  return !not_checked_kind && !checks.empty() &&
         std::all_of(checks.begin(), checks.end(), [](const Check& c) { return c.ok; });
}

Json VerifyReport::to_json() const {
  Json list = Json::array();
  for (const Check& c : checks)
    list.push_back({{"name", c.name}, {"ok", c.ok}, {"detail", c.detail}});
  Json out{{"ok", ok()}, {"checks", list}};
  if (not_checked_kind) out["not_checked"] = *not_checked_kind;
  return out;
}

namespace {

using common::member;

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

}  // namespace

namespace verify_detail {

std::optional<std::string> string_at(const Json& doc, std::initializer_list<const char*> keys) {
  const Json* cur = &doc;
  for (const char* k : keys) {
    if (!cur->is_object() || !cur->contains(k)) return std::nullopt;
    cur = &(*cur)[k];
  }
  if (!cur->is_string()) return std::nullopt;
  return cur->get<std::string>();
}

std::optional<double> number_at(const Json& o, const char* key) {
  if (!o.is_object() || !o.contains(key) || !o[key].is_number()) return std::nullopt;
  return o[key].get<double>();
}
std::optional<std::int64_t> int_at(const Json& o, const char* key) {
  if (!o.is_object() || !o.contains(key) || !o[key].is_number_integer()) return std::nullopt;
  return o[key].get<std::int64_t>();
}

// One of Kiln's cross-field rules: two parts of a record name the same value (and it is there).
void check_same(Checks& checks, const char* name, const Json& a, const char* a_name, const Json& b,
                const char* b_name) {
  const bool ok = !a.is_null() && a == b;
  checks.add(
      name, ok,
      std::string(a_name) + " " + a.dump() + (ok ? " = " : " != ") + b_name + " " + b.dump());
}

std::string repr(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  return common::python_float_repr(value);
}

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

}  // namespace verify_detail

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
        const Json& members = member(n, "members");
        const Json& first = members.is_array() && !members.empty() ? members[0] : Json();
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
