// Spark2.5 (Spark2_5ForCausalLM) as its Hugging Face remote code computes it (modeling_spark.py
// and configuration_spark.py, written for transformers 4.57): an fp32 residual stream; RMSNorm
// in fp32 returning fp32, cast to the weights' dtype by the caller; a fused q_k_v_proj; RoPE per
// layer type on the leading rotary dims with cos/sin and the rotation in fp32, cast back once;
// sliding-window layers; eager attention that subtracts the row max in the model dtype before
// an fp32 softmax; an optional per-head output gate (sigmoid or silu in fp32, cast back); a
// GELU (erf) gated MLP; logits from model.embedding.weight when tied, else lm_head.weight.
// Config defaults are Spark2_5Config's (untied, no gate, no biases, all full attention).
#include <cmath>
#include <map>

#include <ATen/ATen.h>

#include "common/error.h"
#include "worker/layers.h"
#include "worker/model.h"

namespace assay::oracle {
namespace {

using common::Json;

const char* const kSliding = "sliding_attention";
const char* const kFull = "full_attention";

struct Linear {
  at::Tensor weight, bias;  // bias undefined when absent
  at::Tensor operator()(const at::Tensor& x) const { return at::linear(x, weight, bias); }
};

// Spark2_5RMSNorm on the fp32 residual stream: weight_f32 * (x * rsqrt(mean(x^2) + eps)), fp32.
at::Tensor spark_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor h = x.to(at::kFloat);
  at::Tensor variance = h.pow(2).mean({-1}, /*keepdim=*/true);
  h = h * at::rsqrt(variance + eps);
  return (weight.to(at::kFloat) * h).to(x.scalar_type());
}

// apply_rotary_pos_emb: x [1, H, T, D] to fp32, the first cos.size(-1) dims rotated (NeoX
// halves) with fp32 cos/sin [T, rot], the rest passed through, cast back to x's dtype once.
at::Tensor apply_partial_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  int64_t rot = cos.size(-1);
  at::Tensor x32 = x.to(at::kFloat);
  at::Tensor c = cos.unsqueeze(0).unsqueeze(0);
  at::Tensor s = sin.unsqueeze(0).unsqueeze(0);
  at::Tensor result;
  if (x32.size(-1) > rot) {
    at::Tensor x_rot = x32.slice(-1, 0, rot);
    at::Tensor x_pass = x32.slice(-1, rot);
    x_rot = x_rot * c + rotate_half(x_rot) * s;
    result = at::cat({x_rot, x_pass}, -1);
  } else {
    result = x32 * c + rotate_half(x32) * s;
  }
  return result.to(x.scalar_type());
}

struct Layer {
  bool sliding;
  at::Tensor input_norm, post_attention_norm;
  Linear qkv, g, out, gate, up, down;  // g.weight undefined without the output gate
};

struct RopeSpec {
  double theta;
  int64_t rotary_dim;
};

class Spark2_5 final : public Model {
 public:
  Spark2_5(const Json& c, Weights& w, const ExecOptions&) {
    const std::string where = "config.json (spark2_5)";
    // Spark2_5Config's defaults where a field is absent or null.
    hidden_ = config_int(c, "hidden_size", 4096, where);
    intermediate_ = config_int(c, "intermediate_size", 11008, where);
    int64_t n_layers = config_int(c, "num_hidden_layers", 32, where);
    heads_ = config_int(c, "num_attention_heads", 32, where);
    kv_heads_ = config_int(c, "num_key_value_heads", heads_, where);
    vocab_ = config_int(c, "vocab_size", 32000, where);
    eps_ = config_double(c, "rms_norm_eps", 1e-6, where);
    if (hidden_ <= 0 || intermediate_ <= 0 || n_layers <= 0 || heads_ <= 0 || kv_heads_ <= 0 ||
        vocab_ <= 0 || heads_ % kv_heads_ != 0) {
      throw common::Error("model.bad_config",
                          where + ": sizes must be positive and num_attention_heads (" +
                              std::to_string(heads_) + ") a multiple of num_key_value_heads (" +
                              std::to_string(kv_heads_) + ")");
    }
    head_dim_ = config_int(c, "head_dim", hidden_ / heads_, where);
    if (head_dim_ <= 0) {
      throw common::Error("model.bad_config", where + ": head_dim must be positive");
    }
    std::string act = config_string(c, "hidden_act", "gelu", where);
    if (act != "gelu") unsupported(where, "hidden_act", act, "Spark2_5MLP accepts only gelu");
    tied_ = config_bool(c, "tie_word_embeddings", false, where);
    bool attention_bias = config_bool(c, "attention_bias", false, where);
    bool mlp_bias = config_bool(c, "mlp_bias", false, where);
    bool gated = config_bool(c, "headwise_attn_output_gate", false, where);
    if (gated) {
      // Read only when the gate exists, as the remote code does.
      std::string mode = config_string(c, "gate_attn_act_mode", "sigmoid", where);
      if (mode == "sigmoid") {
        gate_act_ = GateAct::kSigmoid;
      } else if (mode == "silu") {
        gate_act_ = GateAct::kSilu;
      } else {
        unsupported(where, "gate_attn_act_mode", mode, "sigmoid or silu");
      }
    }

    Json types = c.contains("layer_types") ? c["layer_types"] : Json();
    if (types.is_null()) types = Json(std::vector<std::string>(n_layers, kFull));
    if (!types.is_array() || static_cast<int64_t>(types.size()) != n_layers) {
      throw common::Error("model.bad_config", where + ": layer_types must list " +
                                                  std::to_string(n_layers) + " layer types");
    }
    bool any_sliding = false;
    for (std::size_t i = 0; i < types.size(); ++i) {
      if (types[i] == kSliding) {
        any_sliding = true;
      } else if (types[i] != kFull) {
        unsupported(where, "layer_types[" + std::to_string(i) + "]", types[i],
                    "sliding_attention or full_attention");
      }
    }
    if (any_sliding) {
      // transformers' sliding-window mask refuses a config without one.
      window_ = config_int(c, "sliding_window", 0, where);
      if (window_ <= 0) {
        throw common::Error("model.bad_config",
                            where + ": sliding_attention layers need a positive sliding_window");
      }
    }

    // Spark2_5Config.get_rope_theta / get_partial_rotary_factor: rope_parameters[layer_type],
    // a missing entry or key taking 10000 and 1.0. rope_type is not read by the remote code;
    // anything but default is refused rather than silently ignored.
    const Json& rope = c.contains("rope_parameters") ? c["rope_parameters"] : Json();
    if (!rope.is_object()) {
      throw common::Error("model.bad_config", where + ": rope_parameters must be an object");
    }
    for (const char* type : {kSliding, kFull}) {
      std::string rw = where + " rope_parameters." + type;
      const Json& p = rope.contains(type) ? rope[type] : Json::object();
      if (!p.is_object()) throw common::Error("model.bad_config", rw + ": must be an object");
      std::string rope_type = config_string(p, "rope_type", "default", rw);
      if (rope_type != "default") unsupported(rw, "rope_type", rope_type, "only default");
      double factor = config_double(p, "partial_rotary_factor", 1.0, rw);
      auto rot = static_cast<int64_t>(static_cast<double>(head_dim_) * factor);
      if (rot <= 0 || rot > head_dim_ || rot % 2 != 0) {
        unsupported(rw, "partial_rotary_factor", factor,
                    "rotary dims must be even and in (0, head_dim]");
      }
      rope_[type] = {config_double(p, "rope_theta", 10000.0, rw), rot};
    }

    auto linear = [&](const std::string& name, int64_t out, int64_t in, bool bias) {
      Linear l{w.get(name + ".weight", {out, in}), {}};
      if (bias) l.bias = w.get(name + ".bias", {out});
      return l;
    };
    embedding_ = w.get("model.embedding.weight", {vocab_, hidden_});
    int64_t q_dim = heads_ * head_dim_;
    int64_t kv_dim = kv_heads_ * head_dim_;
    for (int64_t i = 0; i < n_layers; ++i) {
      std::string p = "model.layers." + std::to_string(i) + ".";
      Layer l;
      l.sliding = types[i] == kSliding;
      l.input_norm = w.get(p + "input_layernorm.weight", {hidden_});
      l.qkv = linear(p + "self_attn.q_k_v_proj", q_dim + 2 * kv_dim, hidden_, attention_bias);
      if (gated) l.g = linear(p + "self_attn.g_proj", heads_, hidden_, attention_bias);
      l.out = linear(p + "self_attn.out_proj", hidden_, q_dim, attention_bias);
      l.post_attention_norm = w.get(p + "post_attention_layernorm.weight", {hidden_});
      l.gate = linear(p + "mlp.gate_proj", intermediate_, hidden_, mlp_bias);
      l.up = linear(p + "mlp.up_proj", intermediate_, hidden_, mlp_bias);
      l.down = linear(p + "mlp.down_proj", hidden_, intermediate_, mlp_bias);
      layers_.push_back(std::move(l));
    }
    norm_ = w.get("model.norm.weight", {hidden_});
    output_ = tied_ ? embedding_ : w.get("lm_head.weight", {vocab_, hidden_});
  }

  at::Tensor embed(const at::Tensor& input_ids) override {
    return at::embedding(embedding_, input_ids);
  }

  // The residual stream is fp32: layer 0's input is the embedding widened (exactly).
  at::Tensor hidden_states_from(int64_t first, const at::Tensor& input, Probe* probe) override {
    at::Tensor h = input.to(at::kFloat);
    int64_t t = h.size(1);
    auto dtype = embedding_.scalar_type();
    auto device = embedding_.device();

    struct Tables {
      at::Tensor cos, sin, mask;
    };
    std::map<std::string, Tables> tables;
    for (const auto& [type, spec] : rope_) {
      // compute_rope_cos_sin: frequencies on the CPU, positions and cos/sin fp32 on the device.
      at::Tensor inv_freq =
          rope_inv_freq(spec.theta, spec.rotary_dim, Json(), "spark2_5").to(device);
      at::Tensor pos =
          at::arange(t, at::TensorOptions().dtype(at::kLong).device(device)).to(at::kFloat);
      at::Tensor freqs = at::outer(pos, inv_freq);
      at::Tensor emb = at::cat({freqs, freqs}, -1);
      // The mask is built in the embeddings' dtype (before the residual stream goes fp32).
      tables[type] = {emb.cos(), emb.sin(),
                      additive_causal_mask(t, dtype, type == kSliding ? window_ : 0).to(device)};
    }

    double scaling = 1.0 / std::sqrt(static_cast<double>(head_dim_));
    int64_t n_rep = heads_ / kv_heads_;
    int64_t q_dim = heads_ * head_dim_;
    int64_t kv_dim = kv_heads_ * head_dim_;
    for (auto i = static_cast<std::size_t>(first); i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      auto name = [i](const char* part) {
        return [i, part] { return "layers." + std::to_string(i) + part; };
      };
      const Tables& tab = tables[l.sliding ? kSliding : kFull];
      // The remote code's norms return fp32 and the caller casts: the boundary is the fp32 output.
      at::Tensor x =
          probed(probe, name(".input_layernorm"), spark_norm(h, l.input_norm, eps_)).to(dtype);
      at::Tensor qkv = l.qkv(x);
      at::Tensor q = qkv.slice(-1, 0, q_dim).view({1, t, heads_, head_dim_}).transpose(1, 2);
      at::Tensor k =
          qkv.slice(-1, q_dim, q_dim + kv_dim).view({1, t, kv_heads_, head_dim_}).transpose(1, 2);
      at::Tensor v =
          qkv.slice(-1, q_dim + kv_dim).view({1, t, kv_heads_, head_dim_}).transpose(1, 2);
      at::Tensor gate_score;  // [1, H, T, 1]
      if (l.g.weight.defined()) gate_score = l.g(x).view({1, t, heads_, 1}).transpose(1, 2);
      q = apply_partial_rope(q, tab.cos, tab.sin);
      k = apply_partial_rope(k, tab.cos, tab.sin);

      // eager_attention_forward, without the transpose: [1, H, T, D].
      at::Tensor keys = repeat_kv(k, n_rep);
      at::Tensor values = repeat_kv(v, n_rep);
      at::Tensor scores = at::matmul(q, keys.transpose(2, 3)) * scaling;
      scores = scores + tab.mask.slice(3, 0, keys.size(-2));
      scores = scores - std::get<0>(scores.max(-1, /*keepdim=*/true));
      at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
      at::Tensor o = at::matmul(probs, values);
      if (gate_score.defined()) {
        at::Tensor g32 = gate_score.to(at::kFloat);
        at::Tensor gate = gate_act_ == GateAct::kSigmoid ? at::sigmoid(g32) : at::silu(g32);
        o = o * gate.to(o.scalar_type());
      }
      o = probed(probe, name(".self_attn"), l.out(o.transpose(1, 2).contiguous().view({1, t, -1})));
      h = h + o;

      x = probed(probe, name(".post_attention_layernorm"),
                 spark_norm(h, l.post_attention_norm, eps_))
              .to(dtype);
      h = probed(probe, name(""),
                 h + probed(probe, name(".mlp"), l.down(at::gelu(l.gate(x)) * l.up(x))));
    }
    return probed(
               probe, [] { return "norm"; }, spark_norm(h, norm_, eps_))
        .to(dtype);
  }

  at::Tensor lm_head(const at::Tensor& hidden) const override {
    return at::linear(hidden, output_);
  }

  int64_t vocab_size() const override { return vocab_; }
  int64_t hidden_size() const override { return hidden_; }
  int64_t layer_count() const override { return static_cast<int64_t>(layers_.size()); }
  std::string architecture() const override { return "Spark2_5ForCausalLM"; }
  std::string attention_implementation() const override { return "eager"; }

 private:
  enum class GateAct { kSigmoid, kSilu };
  int64_t hidden_, intermediate_, heads_, kv_heads_, head_dim_, vocab_, window_ = 0;
  double eps_;
  bool tied_;
  GateAct gate_act_ = GateAct::kSigmoid;
  std::map<std::string, RopeSpec> rope_;
  at::Tensor embedding_, norm_, output_;
  std::vector<Layer> layers_;
};

}  // namespace

ArchitectureEntry spark2_5_architecture() {
  return {{"spark2_5"},
          [](const Json& config, Weights& weights, const ExecOptions& options) {
            return std::make_unique<Spark2_5>(config, weights, options);
          },
          {}};
}

}  // namespace assay::oracle
