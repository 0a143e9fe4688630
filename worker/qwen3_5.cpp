// Qwen3.5 text model (Gated DeltaNet + gated attention), as transformers' eager forward runs it.
//
// Op for op after transformers' models/qwen3_5/modeling_qwen3_5.py: same ops, order, dtypes and
// [1, T, ...] shapes, so the logits are bitwise those of the Python reference on the same ATen
// build. Config -> weights -> forward, top to bottom.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/json.h"
#include "worker/model.h"

namespace assay::oracle {
namespace {

using at::Tensor;
using common::Error;
using common::Json;

constexpr int64_t kChunkSize = 64;  // transformers' torch_chunk_gated_delta_rule default

// ---------------------------------------------------------------------------------------------
// Config

struct Config {
  std::string architecture;
  std::string prefix;  // "model.language_model." (qwen3_5) or "model." (qwen3_5_text)
  int64_t vocab = 0, hidden = 0, intermediate = 0;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  int64_t k_heads = 0, v_heads = 0, k_dim = 0, v_dim = 0, conv_kernel = 0;
  double eps = 1e-6;
  double rope_theta = 0;
  double partial_rotary_factor = 1.0;
  bool attention_bias = false;
  bool tie_word_embeddings = false;
  std::vector<bool> linear_layer;  // per layer: true = linear_attention, false = full_attention
};

[[noreturn]] void unsupported(const std::string& what) {
  throw Error("model.unsupported", what);
}

double require_number(const Json& object, const char* key, const std::string& where) {
  const Json& v = common::require(object, key, where);
  if (!v.is_number()) {
    throw Error("json.wrong_type", where + "." + key + " must be a number, got " + v.dump());
  }
  return v.get<double>();
}

int64_t require_positive(const Json& object, const char* key, const std::string& where) {
  int64_t v = common::require_int(object, key, where);
  if (v <= 0) unsupported(where + "." + key + " = " + std::to_string(v) + " (must be positive)");
  return v;
}

bool optional_bool(const Json& object, const char* key, bool fallback, const std::string& where) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) {
    throw Error("json.wrong_type", where + "." + key + " must be a boolean, got " + it->dump());
  }
  return it->get<bool>();
}

Config parse_config(const Json& root) {
  Config c;
  const std::string model_type = common::require_string(root, "model_type", "config.json");
  const Json* text = &root;
  std::string where = "config.json";
  if (model_type == "qwen3_5") {
    text = &common::require(root, "text_config", "config.json");
    if (!text->is_object())
      throw Error("json.wrong_type", "config.json text_config must be an object");
    where = "config.json text_config";
    c.prefix = "model.language_model.";
    c.architecture = "Qwen3_5ForConditionalGeneration";
  } else if (model_type == "qwen3_5_text") {
    c.prefix = "model.";
    c.architecture = "Qwen3_5ForCausalLM";
  } else {
    unsupported("config.json model_type \"" + model_type + "\" is not qwen3_5 or qwen3_5_text");
  }
  const Json& t = *text;

  c.vocab = require_positive(t, "vocab_size", where);
  c.hidden = require_positive(t, "hidden_size", where);
  c.intermediate = require_positive(t, "intermediate_size", where);
  const int64_t layers = require_positive(t, "num_hidden_layers", where);
  c.heads = require_positive(t, "num_attention_heads", where);
  c.kv_heads = require_positive(t, "num_key_value_heads", where);
  c.head_dim = t.contains("head_dim") && !t["head_dim"].is_null()
                   ? require_positive(t, "head_dim", where)
                   : c.hidden / c.heads;
  c.k_heads = require_positive(t, "linear_num_key_heads", where);
  c.v_heads = require_positive(t, "linear_num_value_heads", where);
  c.k_dim = require_positive(t, "linear_key_head_dim", where);
  c.v_dim = require_positive(t, "linear_value_head_dim", where);
  c.conv_kernel = require_positive(t, "linear_conv_kernel_dim", where);
  c.eps = require_number(t, "rms_norm_eps", where);
  if (c.heads % c.kv_heads != 0) {
    unsupported(where + ": num_attention_heads " + std::to_string(c.heads) +
                " is not a multiple of num_key_value_heads " + std::to_string(c.kv_heads));
  }
  if (c.v_heads % c.k_heads != 0) {
    unsupported(where + ": linear_num_value_heads " + std::to_string(c.v_heads) +
                " is not a multiple of linear_num_key_heads " + std::to_string(c.k_heads));
  }

  const std::string act = t.contains("hidden_act") ? common::require_string(t, "hidden_act", where)
                                                   : std::string("silu");
  if (act != "silu") unsupported(where + ".hidden_act \"" + act + "\" (only silu)");
  if (!optional_bool(t, "attn_output_gate", true, where)) {
    unsupported(where + ".attn_output_gate = false (transformers always gates Qwen3.5 attention)");
  }
  c.attention_bias = optional_bool(t, "attention_bias", false, where);
  // The nested config carries the flag at the top level; transformers reads it there.
  c.tie_word_embeddings = root.contains("tie_word_embeddings")
                              ? optional_bool(root, "tie_word_embeddings", false, "config.json")
                              : optional_bool(t, "tie_word_embeddings", false, where);

  // RoPE: rope_parameters (transformers >= 5) or the older top-level fields.
  if (t.contains("rope_parameters") && !t["rope_parameters"].is_null()) {
    const Json& rope = t["rope_parameters"];
    const std::string rwhere = where + ".rope_parameters";
    if (!rope.is_object()) throw Error("json.wrong_type", rwhere + " must be an object");
    std::string type = rope.contains("rope_type")
                           ? common::require_string(rope, "rope_type", rwhere)
                           : std::string("default");
    if (type != "default") unsupported(rwhere + ".rope_type \"" + type + "\" (only default)");
    c.rope_theta = require_number(rope, "rope_theta", rwhere);
    if (rope.contains("partial_rotary_factor")) {
      c.partial_rotary_factor = require_number(rope, "partial_rotary_factor", rwhere);
    }
  } else {
    if (t.contains("rope_scaling") && !t["rope_scaling"].is_null()) {
      unsupported(where + ".rope_scaling " + t["rope_scaling"].dump() + " (only default RoPE)");
    }
    c.rope_theta = require_number(t, "rope_theta", where);
    if (t.contains("partial_rotary_factor")) {
      c.partial_rotary_factor = require_number(t, "partial_rotary_factor", where);
    }
  }
  const auto rotary_dim =
      static_cast<int64_t>(static_cast<double>(c.head_dim) * c.partial_rotary_factor);
  if (c.partial_rotary_factor <= 0 || c.partial_rotary_factor > 1 || rotary_dim % 2 != 0) {
    unsupported(where + ": partial_rotary_factor " + std::to_string(c.partial_rotary_factor) +
                " gives rotary dim " + std::to_string(rotary_dim) + " (must be even, 0 < f <= 1)");
  }

  if (t.contains("layer_types") && !t["layer_types"].is_null()) {
    const Json& types = t["layer_types"];
    if (!types.is_array() || static_cast<int64_t>(types.size()) != layers) {
      unsupported(where + ".layer_types must list " + std::to_string(layers) +
                  " layer types, got " + types.dump());
    }
    for (const Json& type : types) {
      if (type == "linear_attention") {
        c.linear_layer.push_back(true);
      } else if (type == "full_attention") {
        c.linear_layer.push_back(false);
      } else {
        unsupported(where + ".layer_types entry " + type.dump());
      }
    }
  } else {
    // transformers' default: every full_attention_interval-th layer is full attention.
    int64_t interval = t.contains("full_attention_interval")
                           ? require_positive(t, "full_attention_interval", where)
                           : 4;
    for (int64_t i = 0; i < layers; ++i) c.linear_layer.push_back((i + 1) % interval != 0);
  }
  return c;
}

// ---------------------------------------------------------------------------------------------
// Shared pieces

// Qwen3_5RMSNorm: zero-centred weight; (x * (1 + w)) in fp32, then cast.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  Tensor out = x.to(at::kFloat);
  out = out * at::rsqrt(out.pow(2).mean({-1}, true) + eps);
  out = out * (weight.to(at::kFloat) + 1.0);
  return out.to(x.scalar_type());
}

// Qwen3_5RMSNormGated: norm before gate, plain weight, SiLU gate in fp32.
Tensor rms_norm_gated(const Tensor& x, const Tensor& gate, const Tensor& weight, double eps) {
  const auto input_dtype = x.scalar_type();
  Tensor h = x.to(at::kFloat);
  Tensor variance = h.pow(2).mean({-1}, true);
  h = h * at::rsqrt(variance + eps);
  h = weight * h.to(input_dtype);
  h = h * at::silu(gate.to(at::kFloat));
  return h.to(input_dtype);
}

Tensor dense(const Tensor& x, const Tensor& weight, const Tensor& bias = {}) {
  return at::linear(x, weight, bias.defined() ? c10::optional<Tensor>(bias) : c10::nullopt);
}

Tensor rotate_half(const Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

// The lowest finite value of the dtype, as transformers' eager mask uses it.
Tensor lowest_value(c10::ScalarType dtype, const at::TensorOptions& options) {
  switch (dtype) {
    case at::kBFloat16:
      return at::scalar_tensor(static_cast<float>(std::numeric_limits<c10::BFloat16>::lowest()),
                               options.dtype(dtype));
    case at::kHalf:
      return at::scalar_tensor(static_cast<float>(std::numeric_limits<c10::Half>::lowest()),
                               options.dtype(dtype));
    case at::kFloat:
      return at::scalar_tensor(std::numeric_limits<float>::lowest(), options.dtype(dtype));
    default:
      unsupported(std::string("execution dtype ") + c10::toString(dtype));
  }
}

Tensor l2norm(const Tensor& x) {
  Tensor inv_norm = at::rsqrt((x * x).sum({-1}, true) + 1e-6);
  return x * inv_norm;
}

// ---------------------------------------------------------------------------------------------
// Gated delta rule. Inputs [1, T, heads, dim]; output [1, T, v_heads, v_dim] in q's dtype.

// transformers 5.13.1's torch_chunk_gated_delta_rule (with use_qk_l2norm_in_kernel): l2norm on
// the model-dtype q/k (already repeated to the value heads by the caller), then fp32, forward
// substitution within each chunk, decays applied inside the chunk loop.
Tensor chunk_gated_delta_rule(Tensor query, Tensor key, Tensor value, Tensor g, Tensor beta) {
  const auto initial_dtype = query.scalar_type();
  query = l2norm(query);
  key = l2norm(key);
  auto to_f32 = [](const Tensor& x) { return x.transpose(1, 2).contiguous().to(at::kFloat); };
  query = to_f32(query);
  key = to_f32(key);
  value = to_f32(value);
  beta = to_f32(beta);
  g = to_f32(g);
  const int64_t batch = key.size(0), heads = key.size(1), seq_len = key.size(2);
  const int64_t k_dim = key.size(3), v_dim = value.size(-1);
  const int64_t pad = (kChunkSize - seq_len % kChunkSize) % kChunkSize;
  query = at::constant_pad_nd(query, {0, 0, 0, pad});
  key = at::constant_pad_nd(key, {0, 0, 0, pad});
  value = at::constant_pad_nd(value, {0, 0, 0, pad});
  beta = at::constant_pad_nd(beta, {0, pad});
  g = at::constant_pad_nd(g, {0, pad});
  const int64_t total = seq_len + pad;
  query = query * (1.0 / std::pow(static_cast<double>(query.size(-1)), 0.5));

  Tensor v_beta = value * beta.unsqueeze(-1);
  Tensor k_beta = key * beta.unsqueeze(-1);
  auto chunked = [](const Tensor& x) {
    return x.reshape({x.size(0), x.size(1), -1, kChunkSize, x.size(-1)});
  };
  query = chunked(query);
  key = chunked(key);
  value = chunked(value);
  k_beta = chunked(k_beta);
  v_beta = chunked(v_beta);
  g = g.reshape({g.size(0), g.size(1), -1, kChunkSize});
  const auto bool_options = query.options().dtype(at::kBool);
  Tensor mask = at::ones({kChunkSize, kChunkSize}, bool_options).triu(0);

  g = g.cumsum(-1);
  Tensor decay_mask = (g.unsqueeze(-1) - g.unsqueeze(-2)).tril().exp().to(at::kFloat).tril();
  Tensor attn = -(at::matmul(k_beta, key.transpose(-1, -2)) * decay_mask).masked_fill(mask, 0);
  for (int64_t i = 1; i < kChunkSize; ++i) {
    Tensor row = attn.select(-2, i).slice(-1, 0, i).clone();
    Tensor sub = attn.slice(-2, 0, i).slice(-1, 0, i).clone();
    attn.select(-2, i).slice(-1, 0, i).copy_(row + (row.unsqueeze(-1) * sub).sum({-2}));
  }
  attn = attn + at::eye(kChunkSize, attn.options());
  value = at::matmul(attn, v_beta);
  Tensor k_cumdecay = at::matmul(attn, k_beta * g.exp().unsqueeze(-1));
  Tensor state = at::zeros({batch, heads, k_dim, v_dim}).to(value);
  Tensor out = at::zeros_like(value);
  for (int64_t i = 0; i < total / kChunkSize; ++i) {
    Tensor q_i = query.select(2, i), k_i = key.select(2, i), v_i = value.select(2, i);
    Tensor g_i = g.select(2, i);
    // transformers masks nothing here: decay_mask is already zero above the diagonal.
    Tensor attn_i = at::matmul(q_i, k_i.transpose(-1, -2)) * decay_mask.select(2, i);
    Tensor v_prime = at::matmul(k_cumdecay.select(2, i), state);
    Tensor v_new = v_i - v_prime;
    Tensor attn_inter = at::matmul(q_i * g_i.unsqueeze(-1).exp(), state);
    out.select(2, i).copy_(attn_inter + at::matmul(attn_i, v_new));
    Tensor g_last = g_i.select(-1, -1);
    state = state * g_last.unsqueeze(-1).unsqueeze(-1).exp() +
            at::matmul((k_i * (g_last.unsqueeze(-1) - g_i).exp().unsqueeze(-1)).transpose(-1, -2),
                       v_new);
  }
  out = out.reshape({out.size(0), out.size(1), -1, out.size(-1)}).slice(2, 0, seq_len);
  return out.transpose(1, 2).contiguous().to(initial_dtype);
}

// ---------------------------------------------------------------------------------------------
// Layers

struct FullAttention {
  Tensor q_proj, k_proj, v_proj, o_proj;
  Tensor q_bias, k_bias, v_bias, o_bias;  // undefined without attention_bias
  Tensor q_norm, k_norm;
};

struct GatedDeltaNet {
  Tensor in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, dt_bias, a_log, norm, out_proj;
};

struct Layer {
  bool linear = false;
  FullAttention attn;
  GatedDeltaNet gdn;
  Tensor input_layernorm, post_attention_layernorm;
  Tensor gate_proj, up_proj, down_proj;
};

class Qwen3_5Model final : public Model {
 public:
  Qwen3_5Model(Config config, Weights& w, const ExecOptions& options)
      : c_(std::move(config)), options_(options) {
    const std::string& p = c_.prefix;
    const int64_t h = c_.hidden;
    embed_tokens_ = w.get(p + "embed_tokens.weight", {c_.vocab, h});
    for (size_t i = 0; i < c_.linear_layer.size(); ++i) {
      const std::string lp = p + "layers." + std::to_string(i) + ".";
      Layer layer;
      layer.linear = c_.linear_layer[i];
      layer.input_layernorm = w.get(lp + "input_layernorm.weight", {h});
      layer.post_attention_layernorm = w.get(lp + "post_attention_layernorm.weight", {h});
      if (layer.linear) {
        const std::string a = lp + "linear_attn.";
        const int64_t key_dim = c_.k_heads * c_.k_dim, value_dim = c_.v_heads * c_.v_dim;
        const int64_t conv_dim = 2 * key_dim + value_dim;
        GatedDeltaNet& g = layer.gdn;
        g.in_proj_qkv = w.get(a + "in_proj_qkv.weight", {conv_dim, h});
        g.in_proj_z = w.get(a + "in_proj_z.weight", {value_dim, h});
        g.in_proj_b = w.get(a + "in_proj_b.weight", {c_.v_heads, h});
        g.in_proj_a = w.get(a + "in_proj_a.weight", {c_.v_heads, h});
        g.conv1d = w.get(a + "conv1d.weight", {conv_dim, 1, c_.conv_kernel});
        g.dt_bias = w.get(a + "dt_bias", {c_.v_heads});
        g.a_log = w.get(a + "A_log", {c_.v_heads});
        g.norm = w.get(a + "norm.weight", {c_.v_dim});
        g.out_proj = w.get(a + "out_proj.weight", {h, value_dim});
      } else {
        const std::string a = lp + "self_attn.";
        const int64_t q_out = c_.heads * c_.head_dim, kv_out = c_.kv_heads * c_.head_dim;
        FullAttention& f = layer.attn;
        f.q_proj = w.get(a + "q_proj.weight", {2 * q_out, h});
        f.k_proj = w.get(a + "k_proj.weight", {kv_out, h});
        f.v_proj = w.get(a + "v_proj.weight", {kv_out, h});
        f.o_proj = w.get(a + "o_proj.weight", {h, q_out});
        if (c_.attention_bias) {
          f.q_bias = w.get(a + "q_proj.bias", {2 * q_out});
          f.k_bias = w.get(a + "k_proj.bias", {kv_out});
          f.v_bias = w.get(a + "v_proj.bias", {kv_out});
          f.o_bias = w.get(a + "o_proj.bias", {h});
        }
        f.q_norm = w.get(a + "q_norm.weight", {c_.head_dim});
        f.k_norm = w.get(a + "k_norm.weight", {c_.head_dim});
      }
      layer.gate_proj = w.get(lp + "mlp.gate_proj.weight", {c_.intermediate, h});
      layer.up_proj = w.get(lp + "mlp.up_proj.weight", {c_.intermediate, h});
      layer.down_proj = w.get(lp + "mlp.down_proj.weight", {h, c_.intermediate});
      layers_.push_back(std::move(layer));
    }
    norm_ = w.get(p + "norm.weight", {h});
    if (c_.tie_word_embeddings) {
      lm_head_ = embed_tokens_;
      // A tied checkpoint may still store lm_head.weight; transformers replaces it by the tie.
      if (w.has("lm_head.weight")) w.get("lm_head.weight", {c_.vocab, h});
    } else {
      lm_head_ = w.get("lm_head.weight", {c_.vocab, h});
    }
  }

  Tensor embed(const Tensor& input_ids) override {
    c10::InferenceMode guard;
    if (input_ids.dim() != 2 || input_ids.size(0) != 1 || input_ids.scalar_type() != at::kLong ||
        input_ids.size(1) == 0) {
      throw Error("model.bad_input", "input_ids must be a non-empty int64 [1, T] tensor, got " +
                                         std::string(c10::toString(input_ids.scalar_type())) +
                                         " of shape " + c10::str(input_ids.sizes()));
    }
    const int64_t lo = input_ids.min().item<int64_t>(), hi = input_ids.max().item<int64_t>();
    if (lo < 0 || hi >= c_.vocab) {
      throw Error("model.bad_input", "token id " + std::to_string(lo < 0 ? lo : hi) +
                                         " is outside the vocabulary [0, " +
                                         std::to_string(c_.vocab) + ")");
    }
    return at::embedding(embed_tokens_, input_ids);
  }

  Tensor hidden_states_from(int64_t first, const Tensor& input, Probe* probe) override {
    c10::InferenceMode guard;
    Tensor h = input;
    const int64_t seq_len = h.size(1);
    auto [cos, sin] = rotary(seq_len, h.scalar_type());
    Tensor mask = causal_mask(seq_len, h.scalar_type());
    for (auto i = static_cast<std::size_t>(first); i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      auto name = [i](const char* part) {
        return [i, part] { return "layers." + std::to_string(i) + part; };
      };
      Tensor residual = h;
      Tensor x =
          probed(probe, name(".input_layernorm"), rms_norm(h, layer.input_layernorm, c_.eps));
      const std::string layer_name = "layers." + std::to_string(i);
      x = layer.linear
              ? probed(probe, name(".linear_attn"),
                       gated_delta_net(layer.gdn, x, probe, layer_name + ".linear_attn."))
              : probed(probe, name(".self_attn"),
                       attention(layer.attn, x, cos, sin, mask, probe, layer_name + ".self_attn."));
      h = residual + x;
      residual = h;
      x = probed(probe, name(".post_attention_layernorm"),
                 rms_norm(h, layer.post_attention_layernorm, c_.eps));
      h = probed(
          probe, name(""),
          residual + probed(probe, name(".mlp"), mlp(layer, x, probe, layer_name + ".mlp.")));
    }
    return probed(
        probe, [] { return "norm"; }, rms_norm(h, norm_, c_.eps));
  }

  Tensor lm_head(const Tensor& hidden) const override {
    c10::InferenceMode guard;
    return dense(hidden, lm_head_);
  }

  int64_t vocab_size() const override { return c_.vocab; }
  int64_t hidden_size() const override { return c_.hidden; }
  int64_t layer_count() const override { return static_cast<int64_t>(layers_.size()); }
  std::string architecture() const override { return c_.architecture; }
  std::string attention_implementation() const override { return "eager"; }
  std::string linear_attention_implementation() const override {
    return "torch_chunk_gated_delta_rule";
  }

 private:
  // Qwen3_5TextRotaryEmbedding for text-only positions: the three M-RoPE rows are equal, so the
  // interleave leaves row 0 unchanged.
  std::pair<Tensor, Tensor> rotary(int64_t seq_len, c10::ScalarType dtype) const {
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(options_.device);
    const auto dim =
        static_cast<int64_t>(static_cast<double>(c_.head_dim) * c_.partial_rotary_factor);
    Tensor exponent = at::arange(0, dim, 2, f32.dtype(at::kLong)).to(at::kFloat) / dim;
    // Python's `base ** t` is torch.tensor(base) ** t; `1.0 / t` is t.reciprocal() * 1.0.
    Tensor inv_freq = at::pow(at::scalar_tensor(c_.rope_theta, f32), exponent).reciprocal() * 1.0;
    Tensor position_ids =
        at::arange(seq_len, f32.dtype(at::kLong)).view({1, 1, -1}).expand({3, 1, -1});
    Tensor inv_freq_expanded =
        inv_freq.unsqueeze(0).unsqueeze(0).unsqueeze(-1).to(at::kFloat).expand({3, 1, -1, 1});
    Tensor position_ids_expanded = position_ids.unsqueeze(2).to(at::kFloat);
    Tensor freqs =
        at::matmul(inv_freq_expanded.to(at::kFloat), position_ids_expanded.to(at::kFloat))
            .transpose(2, 3)
            .select(0, 0);
    Tensor emb = at::cat({freqs, freqs}, -1);
    Tensor cos = emb.cos() * 1.0;
    Tensor sin = emb.sin() * 1.0;
    return {cos.to(dtype), sin.to(dtype)};
  }

  Tensor causal_mask(int64_t seq_len, c10::ScalarType dtype) const {
    const auto options = at::TensorOptions().device(options_.device);
    Tensor allowed = at::ones({seq_len, seq_len}, options.dtype(at::kBool)).tril();
    Tensor mask = at::where(allowed, at::scalar_tensor(0.0, options.dtype(dtype)),
                            lowest_value(dtype, options));
    return mask.unsqueeze(0).unsqueeze(0);
  }

  // Qwen3_5Attention with eager_attention_forward. Operators (docs/operators.md) are probed as
  // `at` + their name, each as [1, T, ...].
  Tensor attention(const FullAttention& a, const Tensor& h, const Tensor& cos, const Tensor& sin,
                   const Tensor& mask, Probe* probe, const std::string& prefix) const {
    auto op = [&](const char* name) { return [&prefix, name] { return prefix + name; }; };
    const int64_t batch = h.size(0), seq_len = h.size(1), hd = c_.head_dim;
    std::vector<int64_t> hidden_shape = {batch, seq_len, -1, hd};
    auto q_and_gate = at::chunk(probed(probe, op("q_proj"), dense(h, a.q_proj, a.q_bias))
                                    .view({batch, seq_len, -1, hd * 2}),
                                2, -1);
    Tensor query = q_and_gate[0];
    Tensor gate = q_and_gate[1].reshape({batch, seq_len, -1});
    query = probed(probe, op("q_norm"), rms_norm(query.view(hidden_shape), a.q_norm, c_.eps))
                .transpose(1, 2);
    Tensor key =
        probed(
            probe, op("k_norm"),
            rms_norm(probed(probe, op("k_proj"), dense(h, a.k_proj, a.k_bias)).view(hidden_shape),
                     a.k_norm, c_.eps))
            .transpose(1, 2);
    Tensor value = probed(probe, op("v_proj"), dense(h, a.v_proj, a.v_bias))
                       .view(hidden_shape)
                       .transpose(1, 2);

    // apply_rotary_pos_emb with partial rotary: rotate the first cos.size(-1) dims only.
    Tensor cos_u = cos.unsqueeze(1), sin_u = sin.unsqueeze(1);
    const int64_t rotary_dim = cos_u.size(-1);
    Tensor q_rot = query.slice(-1, 0, rotary_dim), q_pass = query.slice(-1, rotary_dim);
    Tensor k_rot = key.slice(-1, 0, rotary_dim), k_pass = key.slice(-1, rotary_dim);
    Tensor q_embed = (q_rot * cos_u) + (rotate_half(q_rot) * sin_u);
    Tensor k_embed = (k_rot * cos_u) + (rotate_half(k_rot) * sin_u);
    query = probed(probe, op("q_rotary"), at::cat({q_embed, q_pass}, -1).transpose(1, 2))
                .transpose(1, 2);
    key = probed(probe, op("k_rotary"), at::cat({k_embed, k_pass}, -1).transpose(1, 2))
              .transpose(1, 2);

    const int64_t n_rep = c_.heads / c_.kv_heads;
    auto repeat_kv = [&](const Tensor& x) {
      if (n_rep == 1) return x;
      return x.unsqueeze(2)
          .expand({x.size(0), x.size(1), n_rep, x.size(2), x.size(3)})
          .reshape({x.size(0), x.size(1) * n_rep, x.size(2), x.size(3)});
    };
    key = repeat_kv(key);
    value = repeat_kv(value);
    Tensor scores =
        at::matmul(query, key.transpose(2, 3)) * std::pow(static_cast<double>(hd), -0.5);
    scores = scores + mask;
    Tensor probs = at::softmax(scores, -1, at::kFloat).to(query.scalar_type());
    Tensor out =
        probed(probe, op("attention"), at::matmul(probs, value).transpose(1, 2).contiguous());
    out = out.reshape({batch, seq_len, -1}).contiguous();
    out = probed(probe, op("output_gate"), out * at::sigmoid(gate));
    return probed(probe, op("o_proj"), dense(out, a.o_proj, a.o_bias));
  }

  // Qwen3_5GatedDeltaNet without cache (prefill), its operators probed as in attention().
  Tensor gated_delta_net(const GatedDeltaNet& g, const Tensor& h, Probe* probe,
                         const std::string& prefix) const {
    auto op = [&](const char* name) { return [&prefix, name] { return prefix + name; }; };
    const int64_t batch = h.size(0), seq_len = h.size(1);
    const int64_t key_dim = c_.k_heads * c_.k_dim, value_dim = c_.v_heads * c_.v_dim;
    Tensor mixed_qkv = probed(probe, op("in_proj_qkv"), dense(h, g.in_proj_qkv)).transpose(1, 2);
    Tensor z = probed(probe, op("in_proj_z"), dense(h, g.in_proj_z))
                   .reshape({batch, seq_len, -1, c_.v_dim});
    Tensor b = probed(probe, op("in_proj_b"), dense(h, g.in_proj_b));
    Tensor a = probed(probe, op("in_proj_a"), dense(h, g.in_proj_a));

    // causal_conv1d_fn's torch fallback: depthwise conv, left padding kernel - 1, SiLU.
    Tensor conv_weight = g.conv1d.squeeze(1).unsqueeze(1);
    mixed_qkv = at::conv1d(mixed_qkv.to(conv_weight.scalar_type()), conv_weight, {}, {1},
                           {conv_weight.size(-1) - 1}, {1}, mixed_qkv.size(1))
                    .slice(2, 0, seq_len);
    mixed_qkv = probed(probe, op("conv"), at::silu(mixed_qkv).to(h.scalar_type()).transpose(1, 2));
    auto parts = at::split_with_sizes(mixed_qkv, {key_dim, key_dim, value_dim}, -1);
    Tensor query = parts[0].reshape({batch, seq_len, -1, c_.k_dim});
    Tensor key = parts[1].reshape({batch, seq_len, -1, c_.k_dim});
    Tensor value = parts[2].reshape({batch, seq_len, -1, c_.v_dim});

    Tensor beta = probed(probe, op("beta"), b.sigmoid());
    // A_log and the softplus argument in fp32 (transformers: fp16 would overflow exp(A_log)).
    Tensor decay = probed(
        probe, op("g"), -g.a_log.to(at::kFloat).exp() * at::softplus(a.to(at::kFloat) + g.dt_bias));
    const int64_t rep = c_.v_heads / c_.k_heads;
    if (rep > 1) {
      query = query.repeat_interleave(rep, 2);
      key = key.repeat_interleave(rep, 2);
    }
    Tensor core =
        probed(probe, op("recurrent"), chunk_gated_delta_rule(query, key, value, decay, beta));
    core = core.reshape({-1, c_.v_dim});
    z = z.reshape({-1, c_.v_dim});
    core = probed(probe, op("norm"),
                  rms_norm_gated(core, z, g.norm, c_.eps).reshape({batch, seq_len, -1}));
    return probed(probe, op("out_proj"), dense(core, g.out_proj));
  }

  Tensor mlp(const Layer& l, const Tensor& x, Probe* probe, const std::string& prefix) const {
    auto op = [&](const char* name) { return [&prefix, name] { return prefix + name; }; };
    Tensor act = probed(probe, op("act_fn"),
                        at::silu(probed(probe, op("gate_proj"), dense(x, l.gate_proj))));
    Tensor product =
        probed(probe, op("product"), act * probed(probe, op("up_proj"), dense(x, l.up_proj)));
    return probed(probe, op("down_proj"), dense(product, l.down_proj));
  }

  Config c_;
  ExecOptions options_;
  Tensor embed_tokens_, norm_, lm_head_;
  std::vector<Layer> layers_;
};

}  // namespace

ArchitectureEntry qwen3_5_architecture() {
  ArchitectureEntry entry;
  entry.model_types = {"qwen3_5", "qwen3_5_text"};
  entry.make = [](const Json& config, Weights& weights, const ExecOptions& options) {
    return std::unique_ptr<Model>(new Qwen3_5Model(parse_config(config), weights, options));
  };
  // Vision tower and multi-token-prediction head: in the checkpoint, not in the text forward
  // (transformers' _keys_to_ignore_on_load_unexpected for Qwen3_5ForCausalLM).
  entry.ignored_prefixes = {"model.visual.", "mtp."};
  return entry;
}

}  // namespace assay::oracle
