// Spark2.5 (Spark2_5ForCausalLM), from the description in issue 5: an fp32 residual stream,
// RMSNorm computed in fp32 with a plain weight, fused q_k_v_proj, one sigmoid gate per head,
// RoPE per layer type on the leading rotary dims, sliding-window layers, eager attention that
// subtracts the row max in the model dtype before an fp32 softmax, a GELU (erf) gated MLP and
// logits from the tied embedding.
#include <ATen/ATen.h>

#include "common/error.h"
#include "worker/layers.h"
#include "worker/model.h"

namespace assay::oracle {
namespace {

using common::Json;

const char* const kSliding = "sliding_attention";
const char* const kFull = "full_attention";

// (x_f32 * rsqrt(mean(x_f32^2) + eps) * w_f32).to(dtype); x is the fp32 residual stream.
at::Tensor spark_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                      c10::ScalarType dtype) {
  at::Tensor variance = x.pow(2).mean({-1}, /*keepdim=*/true);
  return (x * at::rsqrt(variance + eps) * weight.to(at::kFloat)).to(dtype);
}

// Rotates the first cos.size(-1) dims of x [1, H, T, D] (NeoX halves), passes the rest.
at::Tensor apply_partial_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  int64_t rot = cos.size(-1);
  at::Tensor x_rot = x.slice(-1, 0, rot);
  at::Tensor x_pass = x.slice(-1, rot);
  x_rot = x_rot * cos + rotate_half(x_rot) * sin;
  return at::cat({x_rot, x_pass}, -1);
}

struct Layer {
  bool sliding;
  at::Tensor attn_norm, qkv, g, o, mlp_norm, gate, up, down;
};

struct RopeSpec {
  double theta;
  int64_t rotary_dim;
};

class Spark2_5 final : public Model {
 public:
  Spark2_5(const Json& c, Weights& w, const ExecOptions&) {
    const std::string where = "config.json (spark2_5)";
    hidden_ = config_int(c, "hidden_size", where);
    intermediate_ = config_int(c, "intermediate_size", where);
    int64_t n_layers = config_int(c, "num_hidden_layers", where);
    heads_ = config_int(c, "num_attention_heads", where);
    kv_heads_ = config_int(c, "num_key_value_heads", where);
    head_dim_ = config_int(c, "head_dim", where);
    vocab_ = config_int(c, "vocab_size", where);
    window_ = config_int(c, "sliding_window", where);
    eps_ = config_double(c, "rms_norm_eps", 1e-6, where);
    if (hidden_ <= 0 || intermediate_ <= 0 || n_layers <= 0 || heads_ <= 0 || kv_heads_ <= 0 ||
        head_dim_ <= 0 || vocab_ <= 0 || window_ <= 0 || heads_ % kv_heads_ != 0) {
      throw common::Error("model.bad_config",
                          where +
                              ": sizes and sliding_window must be positive and "
                              "num_attention_heads a multiple of num_key_value_heads");
    }
    std::string act = config_string(c, "hidden_act", "gelu", where);
    if (act != "gelu") unsupported(where, "hidden_act", act, "only gelu (erf)");
    if (!config_bool(c, "tie_word_embeddings", true, where)) {
      unsupported(where, "tie_word_embeddings", false, "Spark2.5 ties the output matrix");
    }
    const Json& types = c.contains("layer_types") ? c["layer_types"] : Json();
    if (!types.is_array() || static_cast<int64_t>(types.size()) != n_layers) {
      throw common::Error("model.bad_config", where + ": layer_types must list " +
                                                  std::to_string(n_layers) + " layer types");
    }
    const Json& rope = c.contains("rope_parameters") ? c["rope_parameters"] : Json();
    for (const char* type : {kSliding, kFull}) {
      std::string rw = where + " rope_parameters." + type;
      if (!rope.is_object() || !rope.contains(type) || !rope[type].is_object()) {
        throw common::Error("model.bad_config", rw + ": missing");
      }
      const Json& p = rope[type];
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

    embedding_ = w.get("model.embedding.weight", {vocab_, hidden_});
    int64_t qkv_out = (heads_ + 2 * kv_heads_) * head_dim_;
    for (int64_t i = 0; i < n_layers; ++i) {
      std::string p = "model.layers." + std::to_string(i) + ".";
      Layer l;
      if (types[i] == kSliding) {
        l.sliding = true;
      } else if (types[i] == kFull) {
        l.sliding = false;
      } else {
        unsupported(where, "layer_types[" + std::to_string(i) + "]", types[i],
                    "sliding_attention or full_attention");
      }
      l.attn_norm = w.get(p + "attn_norm.weight", {hidden_});
      l.qkv = w.get(p + "attention.q_k_v_proj.weight", {qkv_out, hidden_});
      l.g = w.get(p + "attention.g_proj.weight", {heads_, hidden_});
      l.o = w.get(p + "attention.o_proj.weight", {hidden_, heads_ * head_dim_});
      l.mlp_norm = w.get(p + "mlp_norm.weight", {hidden_});
      l.gate = w.get(p + "mlp.gate_proj.weight", {intermediate_, hidden_});
      l.up = w.get(p + "mlp.up_proj.weight", {intermediate_, hidden_});
      l.down = w.get(p + "mlp.down_proj.weight", {hidden_, intermediate_});
      layers_.push_back(std::move(l));
    }
    norm_ = w.get("model.norm.weight", {hidden_});
  }

  at::Tensor hidden_states(const at::Tensor& input_ids) override {
    int64_t t = input_ids.size(1);
    auto dtype = embedding_.scalar_type();
    auto device = embedding_.device();
    at::Tensor h = at::embedding(embedding_, input_ids).to(at::kFloat);

    struct Tables {
      at::Tensor cos, sin, mask;
    };
    std::map<std::string, Tables> tables;
    for (const auto& [type, spec] : rope_) {
      // Frequencies on the CPU (as a module's buffers are made), the rest on the device.
      at::Tensor inv_freq =
          rope_inv_freq(spec.theta, spec.rotary_dim, Json(), "spark2_5").to(device);
      at::Tensor pos =
          at::arange(t, at::TensorOptions().dtype(at::kLong).device(device)).to(at::kFloat);
      at::Tensor freqs = at::outer(pos, inv_freq);
      at::Tensor emb = at::cat({freqs, freqs}, -1);
      tables[type] = {emb.cos().to(dtype), emb.sin().to(dtype),
                      additive_causal_mask(t, dtype, type == kSliding ? window_ : 0)
                          .squeeze(0)
                          .squeeze(0)
                          .to(device)};
    }

    double scaling = std::pow(static_cast<double>(head_dim_), -0.5);
    int64_t n_rep = heads_ / kv_heads_;
    for (const Layer& l : layers_) {
      const Tables& tab = tables[l.sliding ? kSliding : kFull];
      at::Tensor x = spark_norm(h, l.attn_norm, eps_, dtype);
      at::Tensor qkv = at::linear(x, l.qkv);
      auto parts = qkv.split_with_sizes(
          {heads_ * head_dim_, kv_heads_ * head_dim_, kv_heads_ * head_dim_}, -1);
      at::Tensor q = parts[0].reshape({1, t, heads_, head_dim_}).transpose(1, 2);
      at::Tensor k = parts[1].reshape({1, t, kv_heads_, head_dim_}).transpose(1, 2);
      at::Tensor v = parts[2].reshape({1, t, kv_heads_, head_dim_}).transpose(1, 2);
      at::Tensor gate = at::sigmoid(at::linear(x, l.g));  // [1, T, H]
      q = apply_partial_rope(q, tab.cos, tab.sin);
      k = apply_partial_rope(k, tab.cos, tab.sin);
      k = at::repeat_interleave(k, n_rep, 1);
      v = at::repeat_interleave(v, n_rep, 1);
      at::Tensor scores = at::matmul(q, k.transpose(-1, -2)) * scaling;
      scores = scores + tab.mask;
      scores = scores - scores.amax({-1}, /*keepdim=*/true);
      at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(dtype);
      at::Tensor o = at::matmul(probs, v).transpose(1, 2);  // [1, T, H, D]
      o = o * gate.unsqueeze(-1);
      o = at::linear(o.reshape({1, t, heads_ * head_dim_}), l.o);
      h = h + o.to(at::kFloat);

      x = spark_norm(h, l.mlp_norm, eps_, dtype);
      at::Tensor g = at::gelu(at::linear(x, l.gate));
      at::Tensor u = at::linear(x, l.up);
      h = h + at::linear(g * u, l.down).to(at::kFloat);
    }
    return spark_norm(h, norm_, eps_, dtype);
  }

  at::Tensor lm_head(const at::Tensor& hidden) const override {
    return at::linear(hidden, embedding_);
  }

  int64_t vocab_size() const override { return vocab_; }
  std::string architecture() const override { return "Spark2_5ForCausalLM"; }
  std::string attention_implementation() const override { return "eager"; }

 private:
  int64_t hidden_, intermediate_, heads_, kv_heads_, head_dim_, vocab_, window_;
  double eps_;
  std::map<std::string, RopeSpec> rope_;
  at::Tensor embedding_, norm_;
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
