// config.json's sizes against the checkpoint's tensor shapes, before anything is built from
// them. Both backends size what they allocate from config.json (transformers builds every
// module from it before a weight is compared); a config that claims a hidden size, a vocabulary,
// a layer count or head counts its weights do not have is refused here, by name, from the
// safetensors headers alone.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/json.h"

namespace assay::common {

using TensorShapes = std::map<std::string, std::vector<std::int64_t>>;

// Throws Error(code) naming the config key, its value and the tensor whose shape contradicts it.
// Checks, where config.json (or its text_config) has the key and the checkpoint has the tensor:
//   vocab_size, hidden_size        the embedding (<P>embed_tokens.weight or <P>embedding.weight)
//   num_hidden_layers              the number of <P>layers.N. blocks stored
//   intermediate_size              <P>layers.N.mlp.{gate,up}_proj.weight rows
//   num_attention_heads, head_dim  self_attn.q_proj rows (heads x head_dim, or twice that where
//                                  the architecture gates attention's output), or a fused
//                                  q_k_v_proj with num_key_value_heads
//   num_key_value_heads            self_attn.k_proj rows
//   linear_*                       a Gated DeltaNet block's A_log, conv1d, norm and in_proj_qkv
// A key that is not a number, or a tensor that is not there, is left to the backend, which
// refuses what it cannot build. `label` names the config file in the error.
void check_config_shapes(const Json& config, const TensorShapes& shapes, const std::string& label,
                         const std::string& code);

}  // namespace assay::common
