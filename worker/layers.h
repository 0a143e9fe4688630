// Small free functions shared by the architecture files, each the same ops in the same
// dtypes as the transformers eager code it is named after (modeling_llama.py).
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include <ATen/core/Tensor.h>

#include "common/json.h"

namespace assay::oracle {

// LlamaRMSNorm: weight * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(x.dtype).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// RoPE inverse frequencies in fp32 for `dim` rotary dims: 1 / theta^(arange(0, dim, 2) / dim),
// then the `rope_type` adjustment ("default", "linear", "llama3") read from `scaling`
// (rope_parameters or rope_scaling; null for default). Throws Error("model.unsupported")
// naming any other rope_type.
at::Tensor rope_inv_freq(double theta, int64_t dim, const common::Json& scaling,
                         const std::string& where);

// LlamaRotaryEmbedding.forward for positions 0..T-1: cos, sin of shape [1, T, dim] in dtype.
std::pair<at::Tensor, at::Tensor> rotary_cos_sin(const at::Tensor& inv_freq, int64_t seq_len,
                                                 c10::ScalarType dtype,
                                                 double attention_scaling = 1.0);

// cat(-x2, x1) over the last dim.
at::Tensor rotate_half(const at::Tensor& x);

// apply_rotary_pos_emb with unsqueeze_dim 1: x [1, H, T, D], cos/sin [1, T, D].
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// repeat_kv: [1, KV, T, D] -> [1, KV * n_rep, T, D].
at::Tensor repeat_kv(const at::Tensor& x, int64_t n_rep);

// transformers' additive eager mask [1, 1, T, T] in dtype: 0 where key k is visible from
// query q (k <= q, and q - window < k when window > 0), finfo(dtype).min elsewhere.
at::Tensor additive_causal_mask(int64_t seq_len, c10::ScalarType dtype, int64_t window = 0);

// eager_attention_forward: softmax(q k^T * scaling + mask) in fp32, cast to q's dtype, times v.
// q [1, H, T, D], k/v [1, KV, T, D]; returns [1, T, H, D] contiguous.
at::Tensor eager_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& mask, double scaling);

// Config helpers: the value or a default, with the type checked; Error("model.bad_config")
// naming the field when it has the wrong type.
int64_t config_int(const common::Json& c, const std::string& key, const std::string& where);
int64_t config_int(const common::Json& c, const std::string& key, int64_t fallback,
                   const std::string& where);
double config_double(const common::Json& c, const std::string& key, double fallback,
                     const std::string& where);
bool config_bool(const common::Json& c, const std::string& key, bool fallback,
                 const std::string& where);
std::string config_string(const common::Json& c, const std::string& key,
                          const std::string& fallback, const std::string& where);
// Error("model.unsupported", "<where>: <key> = <value> is not supported (<why>)").
[[noreturn]] void unsupported(const std::string& where, const std::string& key,
                              const common::Json& value, const std::string& why);

}  // namespace assay::oracle
