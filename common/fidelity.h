// Fidelity requests `assay.fidelity-request.v1` (schemas/fidelity-request.schema.json): how far
// a candidate (a second checkpoint, or logits the user supplies) is from the reference over a
// panel of contexts. Parsed strictly and checked offline, like common/request.h; nothing here
// touches a model directory or a logits file.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/json.h"
#include "common/request.h"

namespace assay::common {

inline constexpr std::size_t kMaxPanelContexts = 4096;
inline constexpr std::size_t kMaxPanelTokens = 4'000'000;  // over all contexts
inline constexpr std::int64_t kMaxBlockPositions = 4096;
inline constexpr std::int64_t kDefaultBlockPositions = 64;

// Half-open [begin, end) ranges of positions, sorted, disjoint, non-empty.
using PositionRanges = std::vector<std::pair<std::int64_t, std::int64_t>>;

// `value` is "all" or an array of [begin, end) pairs inside [0, length), sorted and disjoint.
// Throws Error(code) naming `where` and the offending range.
PositionRanges parse_position_ranges(const Json& value, std::int64_t length, std::string_view where,
                                     std::string_view code = "request.invalid");
std::int64_t count_positions(const PositionRanges& ranges);
// [[b, e], ...] as JSON.
Json position_ranges_json(const PositionRanges& ranges);

struct PanelContext {
  std::string id;
  std::vector<std::int64_t> token_ids;
  PositionRanges positions;  // "all" expanded to [[0, T]]
  std::int64_t scored = 0;   // count_positions(positions)
};

struct CandidateLogitsFile {
  std::string path;    // absolute
  std::string sha256;  // of the whole file, "sha256:<hex>"
};

struct ModelSide {
  std::string model_dir;            // absolute
  std::optional<Json> model_identity;  // expected identity, content_sha256 re-checked
};

struct FidelityRequest {
  std::string schema;  // protocol::kFidelityRequest
  std::string id;
  ModelSide reference;
  std::string candidate_label;           // free text shown in the receipt ("" when absent)
  std::optional<ModelSide> candidate_model;  // exactly one of candidate_model and
  std::vector<CandidateLogitsFile> candidate_logits;  // candidate_logits (one per context)
  std::vector<PanelContext> panel;
  bool reproduction_confirmation = false;
  std::int64_t block_positions = kDefaultBlockPositions;
  RequestLimits limits;
  std::string request_sha256;  // canonical form of the whole document
  std::string panel_sha256;    // canonical form of the "panel" member
  Json document;

  std::int64_t scored_positions() const;
  // Throws Error("request.invalid_token_id") naming the context and index of the first token
  // id >= vocab_size.
  void check_vocab(std::int64_t vocab_size) const;
  // Throws Error("request.too_long") naming the first context longer than max_positions.
  void check_context_length(std::int64_t max_positions) const;
};

// Parses strictly (size, duplicate keys) and validates; errors as common/request.h, with
// Error("request.sha_mismatch") for a model_identity whose content_sha256 is not its own.
FidelityRequest parse_fidelity_request(std::string_view text);
FidelityRequest validate_fidelity_request(const Json& document);

}  // namespace assay::common
