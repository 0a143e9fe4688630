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
  std::string model_dir;               // absolute
  std::optional<Json> model_identity;  // expected identity, content_sha256 re-checked
};

// A caller-supplied bound on one statistic of the comparison; it becomes a gate of the receipt.
// Names and the statistic each bounds (paths into assay.compare-output's "statistics"):
//   max_mean_kl kl.mean, max_kl_p99 kl.p99, max_kl_p99_9 kl.p99_9, max_kl_max kl.max,
//   min_top1_agreement same_top.fraction, max_rms_delta_p delta_p_next.rms,
//   max_abs_mean_delta_p delta_p_next.mean (absolute value), max_ppl_ratio perplexity.ratio.value,
//   min_ln_ppl_correlation perplexity.ln_ppl_correlation.
// max_* pass when observed <= bound, min_* when observed >= bound; a statistic that was not
// measured (null) fails its gate.
struct Threshold {
  std::string name;
  double bound = 0;
};
// `value`: an object {name: finite number >= 0}; unknown names are refused with Error(code)
// naming `where` and the key. Sorted by name.
std::vector<Threshold> parse_thresholds(const Json& value, std::string_view where,
                                        std::string_view code = "request.invalid");
Json thresholds_json(const std::vector<Threshold>& thresholds);

// Gates of a fidelity receipt (schemas/fidelity-result.schema.json#/properties/gates):
// {"status", "failed", "reproduction", "thresholds"}. The reproduction gates are booleans or
// null (not decided yet: assay-compare cannot know capture_content_digest_equal or
// weights_identity_equal, the supervisor fills them).
// The threshold gates, evaluated against an assay.compare-output "statistics" object.
Json evaluate_thresholds(const std::vector<Threshold>& thresholds, const Json& statistics);
// Recomputes "status" and "failed" from the gates: "failed" (some gate false; "failed" lists
// them, reproduction gates first by name, then thresholds), else "incomplete" (some gate still
// null), else "passed" (at least one gate), else "none". Returns the updated object.
Json finalize_gates(Json gates);

// The statistics object (assay.compare-output "statistics") as llama.cpp's
// `llama-perplexity --kl-divergence` prints its summary, line for line and with its format
// strings, so numbers can be compared with a llama.cpp run; Δp is of the actual next token where
// known (llama.cpp's), and of the reference's top token otherwise (said so). Standard errors that
// are undefined (n < 2) print as n/a.
std::string llama_cpp_block(const Json& statistics);
// The gates object as text: the status, then one line per gate.
std::string gates_text(const Json& gates);

struct FidelityRequest {
  std::string schema;  // protocol::kFidelityRequest
  std::string id;
  ModelSide reference;
  std::string candidate_label;               // free text shown in the receipt ("" when absent)
  std::optional<ModelSide> candidate_model;  // exactly one of candidate_model and
  std::vector<CandidateLogitsFile> candidate_logits;  // candidate_logits (one per context)
  std::vector<PanelContext> panel;
  bool reproduction_confirmation = false;
  std::int64_t block_positions = kDefaultBlockPositions;
  std::vector<Threshold> thresholds;  // from "thresholds" (absent: none)
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
