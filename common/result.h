// The oracle result `assay.next-token-oracle-result.v1`: its self-hash and its DSSE envelope
// (an in-toto Statement whose subjects are the result file and the logits artifact).
#pragma once

#include <string>
#include <string_view>

#include "common/json.h"

namespace assay::common {

inline constexpr std::string_view kResultFileName = "result.json";
inline constexpr std::string_view kEnvelopeFileName = "result.dsse.json";
inline constexpr std::string_view kArtifactFileName = "logits.safetensors";
inline constexpr std::string_view kKlArtifactFileName = "kl.safetensors";  // fidelity jobs
// Batch jobs: one line per state, {index, job_id, state, result_sha256 | error}, in index order.
inline constexpr std::string_view kBatchArtifactFileName = "states.jsonl";

// sha256 of the canonical form of `result` without its "result_sha256" field.
std::string compute_result_sha256(const Json& result);
// Sets result["result_sha256"] and returns the canonical bytes to write as result.json.
std::string seal_result(Json& result);
// Throws Error("result.sha_mismatch") naming both values when result_sha256 is missing or wrong.
void verify_result_sha256(const Json& result);

// The DSSE envelope over the in-toto Statement for a sealed result.
// subjects: {name: "result.json", sha256 of result_bytes}, {name: "logits.safetensors",
// sha256 hex = artifact_sha256 without "sha256:"}.
Json make_result_statement(std::string_view result_bytes, std::string_view artifact_sha256);
// The same for any sealed result: subjects result.json and `artifact_name`, `predicate_type`.
Json make_statement(std::string_view predicate_type, std::string_view result_bytes,
                    std::string_view artifact_name, std::string_view artifact_sha256);

}  // namespace assay::common
