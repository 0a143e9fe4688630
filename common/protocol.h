// Schema ids and the worker protocol's fixed names, shared by every binary.
#pragma once

#include <array>
#include <cstddef>
#include <string_view>

namespace assay::protocol {

inline constexpr std::string_view kNextTokenRequest = "assay.next-token-request.v1";
inline constexpr std::string_view kKilnNextTokenRequest = "kiln.hf-next-token-request.v1";
inline constexpr std::string_view kNextTokenResult = "assay.next-token-oracle-result.v1";
inline constexpr std::string_view kProcessContainment = "assay.process-containment.v1";
inline constexpr std::string_view kModelIdentity = "assay.model-identity.v1";
inline constexpr std::string_view kFingerprintInput = "assay.fingerprint-input.v1";
inline constexpr std::string_view kFingerprintOutput = "assay.fingerprint-output.v1";
inline constexpr std::string_view kOracleInput = "assay.oracle-input.v1";
inline constexpr std::string_view kOracleOutput = "assay.oracle-output.v1";
inline constexpr std::string_view kResultPredicateType = "https://assay.dev/next-token-oracle/v1";
inline constexpr std::string_view kFidelityRequest = "assay.fidelity-request.v1";
inline constexpr std::string_view kFidelityResult = "assay.fidelity-result.v1";
inline constexpr std::string_view kFidelityPredicateType = "https://assay.dev/fidelity/v1";
inline constexpr std::string_view kOracleCaptureInput = "assay.oracle-capture-input.v1";
inline constexpr std::string_view kOracleCaptureOutput = "assay.oracle-capture-output.v1";
inline constexpr std::string_view kCompareInput = "assay.compare-input.v1";
inline constexpr std::string_view kCompareOutput = "assay.compare-output.v1";
// Batch jobs: many next-token states on one model, one oracle worker.
inline constexpr std::string_view kNextTokenBatchRequest = "assay.next-token-batch-request.v1";
inline constexpr std::string_view kNextTokenBatchResult = "assay.next-token-batch-result.v1";
inline constexpr std::string_view kBatchPredicateType = "https://assay.dev/next-token-batch/v1";
inline constexpr std::string_view kOracleServeInput = "assay.oracle-serve-input.v1";
inline constexpr std::string_view kOracleServeLoaded = "assay.oracle-serve-loaded.v1";
inline constexpr std::string_view kOracleBatchInput = "assay.oracle-batch-input.v1";
inline constexpr std::string_view kOracleBatchOutput = "assay.oracle-batch-output.v1";

// Worker protocol: WORKER <mode> --input input.json --workdir DIR; writes output.json, exit 0.
inline constexpr std::string_view kInputFile = "input.json";
inline constexpr std::string_view kOutputFile = "output.json";
inline constexpr std::string_view kStdoutFile = "stdout.log";
inline constexpr std::string_view kStderrFile = "stderr.log";

// The files of a model directory that say how text becomes ids, and the model's config: read
// whole and parsed by every worker (tokenizer.json's parse takes many times its bytes), so each
// is bounded, at admission and again by the workers (worker/tokenizer.cpp, the transformers
// worker's SMALL_FILE_LIMIT). A real tokenizer.json is 2-35 MB.
inline constexpr std::array<std::string_view, 11> kSmallModelFiles = {"tokenizer.json",
                                                                      "tokenizer_config.json",
                                                                      "special_tokens_map.json",
                                                                      "added_tokens.json",
                                                                      "chat_template.jinja",
                                                                      "chat_template.json",
                                                                      "vocab.json",
                                                                      "merges.txt",
                                                                      "tokenizer.model",
                                                                      "config.json",
                                                                      "generation_config.json"};
inline constexpr std::size_t kMaxSmallModelFileBytes = 64u << 20;

}  // namespace assay::protocol
