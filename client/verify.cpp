#include "client/verify.h"

#include <algorithm>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "common/result.h"
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
                                std::string(common::kTrajectoryResult) + "\" or \"" +
                                std::string(protocol::kNextTokenBatchResult) + "\""));
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
