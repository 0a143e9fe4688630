#include "common/result.h"

#include "common/error.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "common/sign.h"

namespace assay::common {

std::string compute_result_sha256(const Json& result) {
  if (!result.is_object()) throw Error("result.invalid", "a result must be a JSON object");
  Json copy = result;
  copy.erase("result_sha256");
  return sha256_canonical_id(copy);
}

std::string seal_result(Json& result) {
  result["result_sha256"] = compute_result_sha256(result);
  return canonical(result);
}

void verify_result_sha256(const Json& result) {
  auto it = result.is_object() ? result.find("result_sha256") : result.end();
  if (!result.is_object() || it == result.end() || !it->is_string())
    throw Error("result.sha_mismatch", "result has no result_sha256 string");
  auto recomputed = compute_result_sha256(result);
  if (*it != recomputed)
    throw Error("result.sha_mismatch", "result_sha256 is " + it->get<std::string>() +
                                           " but the result hashes to " + recomputed);
}

Json make_result_statement(std::string_view result_bytes, std::string_view artifact_sha256) {
  return make_statement(protocol::kResultPredicateType, result_bytes, kArtifactFileName,
                        artifact_sha256);
}

Json make_statement(std::string_view predicate_type, std::string_view result_bytes,
                    std::string_view artifact_name, std::string_view artifact_sha256) {
  if (!is_identity(artifact_sha256))
    throw Error("result.invalid",
                "artifact sha256 \"" + std::string(artifact_sha256) + "\" is not an identity");
  std::vector<Subject> subjects{
      {std::string(kResultFileName), sha256_id(result_bytes).substr(7)},
      {std::string(artifact_name), std::string(artifact_sha256.substr(7))}};
  return intoto_statement(subjects, predicate_type,
                          Json{{"result_sha256", parse_strict(result_bytes)["result_sha256"]}});
}

}  // namespace assay::common
