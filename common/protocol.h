// Schema ids and the worker protocol's fixed names, shared by every binary.
#pragma once

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

// Worker protocol: WORKER <mode> --input input.json --workdir DIR; writes output.json, exit 0.
inline constexpr std::string_view kInputFile = "input.json";
inline constexpr std::string_view kOutputFile = "output.json";
inline constexpr std::string_view kStdoutFile = "stdout.log";
inline constexpr std::string_view kStderrFile = "stderr.log";

}  // namespace assay::protocol
