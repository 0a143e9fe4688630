// Trajectory requests `assay.trajectory-request.v1` (schemas/trajectory-request.schema.json): a
// prompt and each engine's greedy continuation of it; the job finds where each engine first
// left the reference's argmax. Parsed strictly and checked offline, like common/request.h.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/json.h"
#include "common/request.h"

namespace assay::common {

inline constexpr std::string_view kTrajectoryRequest = "assay.trajectory-request.v1";
inline constexpr std::string_view kTrajectoryResult = "assay.trajectory-result.v1";
inline constexpr std::string_view kTrajectoryPredicateType = "https://assay.dev/trajectory/v1";
inline constexpr std::string_view kCompareTrajectoryInput = "assay.compare-trajectory-input.v1";
inline constexpr std::string_view kCompareTrajectoryOutput = "assay.compare-trajectory-output.v1";
// The artifact: argmax, margin, the engine's token, its rank and logit per scored position.
inline constexpr std::string_view kTrajectoryArtifactFileName = "trajectory.safetensors";
inline constexpr std::size_t kMaxTrajectoryEngines = 16;
inline constexpr std::size_t kMaxTrajectoryTokens = 1'000'000;  // prompt + one continuation
inline constexpr int kTrajectoryTopK = 10;

struct Continuation {
  std::string engine;                   // unique within a request; "neither" is reserved
  std::vector<std::int64_t> token_ids;  // up to and including the first end-of-sequence
};

struct TrajectoryRequest {
  std::string schema;  // kTrajectoryRequest
  std::string id;
  std::string model_dir;               // absolute, trailing slashes removed
  std::optional<Json> model_identity;  // expected identity, content_sha256 re-checked
  std::vector<std::int64_t> prompt_token_ids;
  std::vector<Continuation> continuations;  // two or more
  std::int64_t block_positions = 64;        // the captures' block size
  RequestLimits limits;
  // request.numerics (NextTokenRequest::numerics), or null: the envelope of the state where the
  // continuations first differ.
  Json numerics = nullptr;
  std::string request_sha256;  // RFC 8785 of the whole document
  Json document;

  // Where the continuations first differ (as assay-compare trajectory finds it: the first index
  // where they are not all equal, or where one ended): that index, the state before it (prompt
  // plus the shared prefix) and each engine's token there ({engine, token_id}, in request order;
  // an engine whose continuation ended is left out). Null when the continuations are all equal.
  struct Divergence {
    std::size_t index = 0;
    std::vector<std::int64_t> input_token_ids;
    Json candidates;
  };
  std::optional<Divergence> divergence() const;

  // Scored positions of continuation i: [P - 1, P - 1 + C_i), position p predicting token p + 1.
  std::int64_t first_scored() const {
    return static_cast<std::int64_t>(prompt_token_ids.size()) - 1;
  }
  // prompt + continuations[i].
  std::vector<std::int64_t> sequence(std::size_t i) const;
  // Throws Error("request.invalid_token_id") naming the first id >= vocab_size.
  void check_vocab(std::int64_t vocab_size) const;
  // Throws Error("request.too_long") when a sequence exceeds the model's context length.
  void check_context_length(std::int64_t max_positions) const;
};

// Throws Error with request.unknown_schema, request.invalid (naming the field and value),
// request.invalid_token_id, request.sha_mismatch (model_identity.content_sha256).
TrajectoryRequest validate_trajectory_request(const Json& document);

}  // namespace assay::common
