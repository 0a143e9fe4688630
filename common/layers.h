// Layer-attribution requests `assay.layer-attribution-request.v1`
// (schemas/layer-attribution-request.schema.json): an engine's hidden-state rows at named
// boundaries, compared with the reference's; optionally, which boundary's departure decides the
// token (activation patching). Parsed strictly and checked offline, like common/trajectory.h.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/json.h"
#include "common/request.h"
#include "common/safetensors.h"

namespace assay::common {

inline constexpr std::string_view kLayerRequest = "assay.layer-attribution-request.v1";
inline constexpr std::string_view kLayerResult = "assay.layer-attribution-result.v1";
inline constexpr std::string_view kLayerPredicateType = "https://assay.dev/layer-attribution/v1";
inline constexpr std::string_view kOracleLayersInput = "assay.oracle-layers-input.v1";
inline constexpr std::string_view kOracleLayersOutput = "assay.oracle-layers-output.v1";
inline constexpr std::string_view kCompareLayersInput = "assay.compare-layers-input.v1";
inline constexpr std::string_view kCompareLayersOutput = "assay.compare-layers-output.v1";
// The artifact: the reference's rows, one F32 tensor [R, hidden] per boundary.
inline constexpr std::string_view kLayerArtifactFileName = "layers.safetensors";
inline constexpr double kDefaultRelativeRmseTolerance = 0.01;
inline constexpr std::size_t kMaxLayerTokens = 1'000'000;

enum class LayerRows { kLast, kAll };
std::string_view layer_rows_name(LayerRows r);  // "last", "all"

struct LayerRequest {
  std::string schema;  // kLayerRequest
  std::string id;
  std::string model_dir;               // absolute, trailing slashes removed
  std::optional<Json> model_identity;  // expected identity
  std::vector<std::int64_t> input_token_ids;
  std::string engine;
  std::string rows_path;    // absolute
  std::string rows_sha256;  // "sha256:<hex>" of the whole file
  std::optional<std::int64_t> next_token_id;
  LayerRows rows = LayerRows::kLast;
  double tolerance = kDefaultRelativeRmseTolerance;  // relative RMSE
  bool patching = false;
  // "bisect" (the default): the boundaries whose rows equal the reference's need no forward and
  // a binary search finds the first flip; "every": one forward per boundary the engine gave.
  std::string patch_search = "bisect";
  RequestLimits limits;
  std::string request_sha256;  // RFC 8785 of the whole document
  Json document;

  std::int64_t row_count() const {
    return rows == LayerRows::kLast ? 1 : static_cast<std::int64_t>(input_token_ids.size());
  }
  // Throws Error("request.invalid_token_id") naming the first id (or next_token_id) >= vocab.
  void check_vocab(std::int64_t vocab_size) const;
};

// Throws Error with request.unknown_schema, request.invalid (naming the field and value; a
// patching request without rows "all" or engine.next_token_id is refused here).
LayerRequest validate_layer_request(const Json& document);

// The boundaries of a model, in forward order, named as transformers' modules under `model.`
// are: embedding; per layer input_layernorm, self_attn (linear_attn for a Gated DeltaNet layer),
// post_attention_layernorm, mlp, the layer; norm. `config` is config.json (a text_config inside
// it is used when present). Throws Error("request.bad_model") when the layer count is missing.
std::vector<std::string> layer_boundaries(const Json& config);

// A boundary of the model: its name and how many values it holds per position. Layer-level
// boundaries (those of layer_boundaries) hold hidden_size values; operator-level ones, inside a
// block, hold their operator's output (docs/operators.md names them and their layout).
struct Boundary {
  std::string name;
  std::int64_t width = 0;
  bool operator_level = false;
};

// Every boundary of a model in forward order: the layer-level ones of layer_boundaries with the
// operators of each block among them, for the architectures whose operators are named
// (docs/operators.md). model_type llama, qwen2, qwen3: q_proj, q_norm, k_proj, k_norm, v_proj,
// q_rotary, k_rotary, attention, o_proj inside self_attn; qwen3_5(_text): the same with
// output_gate before o_proj, and in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv, beta, g,
// recurrent, norm, out_proj inside linear_attn; all of them gate_proj, act_fn, up_proj, product,
// down_proj inside mlp. Throws Error("request.bad_model") naming a size config.json lacks or has
// invalid.
std::vector<Boundary> model_boundaries(const Json& config, std::int64_t hidden_size);

// The boundaries a job computes: every layer-level one and the operator-level ones in `wanted`.
std::vector<Boundary> job_boundaries(const std::vector<Boundary>& model,
                                     const std::vector<std::string>& wanted);

// The operator-level boundaries inside the block a boundary belongs to ("layers.N.self_attn" or
// "layers.N.mlp", or one of their operators): the rows that would narrow a departure there. Empty
// for any other boundary, or when the model names no operators.
std::vector<std::string> block_operators(const std::vector<Boundary>& model,
                                         const std::string& boundary);

// What an engine's rows file holds, from its header: per boundary name (in the model's order)
// the tensor's dtype, checked against the model's boundaries (layer- or operator-level), each
// one's width and the rows asked for. Throws Error("request.bad_layer_rows") naming the tensor:
// a name that is not a boundary, a dtype other than F32/BF16, a shape other than [width] /
// [1, width] (rows last) or [T, width] (rows all), no tensor at all, or __metadata__
// input_token_ids_sha256 / model_content_sha256 that differ from the expected ones (an empty
// expected content digest skips that check).
struct EngineRows {
  std::vector<std::string> given;    // boundaries present, in the model's order
  std::vector<std::string> omitted;  // the model's layer-level boundaries absent from the file
  std::vector<std::string> operators_given;         // the operator-level ones among `given`
  std::optional<std::string> model_content_sha256;  // from __metadata__, when present
};
EngineRows check_engine_rows(const SafetensorsIndex& index, const std::vector<Boundary>& model,
                             const LayerRequest& request,
                             const std::string& expected_content_sha256 = "");

}  // namespace assay::common
