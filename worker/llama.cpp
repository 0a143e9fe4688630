// Llama, Qwen2 and Qwen3: transformers' LlamaForCausalLM / Qwen2ForCausalLM /
// Qwen3ForCausalLM eager forward. Differences: Qwen2 has q/k/v biases, Qwen3 normalises q and
// k per head (q_norm/k_norm) before RoPE.
#include <ATen/ATen.h>

#include "common/error.h"
#include "worker/layers.h"
#include "worker/model.h"

namespace assay::oracle {
namespace {

using common::Json;

struct Linear {
  at::Tensor weight, bias;  // bias undefined when absent
  at::Tensor operator()(const at::Tensor& x) const { return at::linear(x, weight, bias); }
};

struct Layer {
  at::Tensor input_norm, post_attention_norm, q_norm, k_norm;
  Linear q, k, v, o, gate, up, down;
};

class LlamaFamily final : public Model {
 public:
  LlamaFamily(const Json& c, Weights& w, const ExecOptions& options) {
    model_type_ = c.at("model_type").get<std::string>();
    const std::string where = "config.json (" + model_type_ + ")";
    architecture_ = model_type_ == "qwen2"   ? "Qwen2ForCausalLM"
                    : model_type_ == "qwen3" ? "Qwen3ForCausalLM"
                                             : "LlamaForCausalLM";
    hidden_ = config_int(c, "hidden_size", where);
    intermediate_ = config_int(c, "intermediate_size", where);
    layers_n_ = config_int(c, "num_hidden_layers", where);
    heads_ = config_int(c, "num_attention_heads", where);
    kv_heads_ = config_int(c, "num_key_value_heads", heads_, where);
    vocab_ = config_int(c, "vocab_size", where);
    if (hidden_ <= 0 || intermediate_ <= 0 || layers_n_ <= 0 || heads_ <= 0 || kv_heads_ <= 0 ||
        vocab_ <= 0 || heads_ % kv_heads_ != 0) {
      throw common::Error("model.bad_config",
                          where + ": sizes must be positive and num_attention_heads (" +
                              std::to_string(heads_) + ") a multiple of num_key_value_heads (" +
                              std::to_string(kv_heads_) + ")");
    }
    head_dim_ = config_int(c, "head_dim", hidden_ / heads_, where);
    eps_ = config_double(c, "rms_norm_eps", 1e-6, where);
    act_ = config_string(c, "hidden_act", "silu", where);
    if (act_ != "silu" && act_ != "gelu" && act_ != "gelu_pytorch_tanh")
      unsupported(where, "hidden_act", act_, "only silu, gelu and gelu_pytorch_tanh");
    if (config_int(c, "pretraining_tp", 1, where) != 1) {
      unsupported(where, "pretraining_tp", c["pretraining_tp"], "only 1");
    }
    if (config_bool(c, "use_sliding_window", false, where)) {
      unsupported(where, "use_sliding_window", true, "sliding windows are not implemented");
    }
    if (c.contains("layer_types") && c["layer_types"].is_array()) {
      for (const Json& t : c["layer_types"]) {
        if (t != "full_attention") unsupported(where, "layer_types[]", t, "only full_attention");
      }
    }
    // Qwen2 always has q/k/v biases and no o bias; Llama and Qwen3 follow attention_bias.
    bool attention_bias = config_bool(c, "attention_bias", false, where);
    bool qkv_bias = model_type_ == "qwen2" || attention_bias;
    bool o_bias = model_type_ != "qwen2" && attention_bias;
    bool mlp_bias = config_bool(c, "mlp_bias", false, where);
    qk_norm_ = model_type_ == "qwen3";

    // RoPE: rope_parameters (newer transformers) or rope_theta + rope_scaling.
    Json scaling = c.contains("rope_parameters") ? c["rope_parameters"]
                   : c.contains("rope_scaling")  ? c["rope_scaling"]
                                                 : Json();
    double theta = c.contains("rope_parameters") && c["rope_parameters"].is_object()
                       ? config_double(c["rope_parameters"], "rope_theta", 10000.0, where)
                       : config_double(c, "rope_theta", 10000.0, where);
    if (scaling.is_object() && scaling.contains("partial_rotary_factor") &&
        config_double(scaling, "partial_rotary_factor", 1.0, where) != 1.0) {
      unsupported(where, "partial_rotary_factor", scaling["partial_rotary_factor"], "only 1.0");
    }
    inv_freq_ = rope_inv_freq(theta, head_dim_, scaling, where);

    auto linear = [&](const std::string& name, int64_t out, int64_t in, bool bias) {
      Linear l{w.get(name + ".weight", {out, in}), {}};
      if (bias) l.bias = w.get(name + ".bias", {out});
      return l;
    };
    embed_ = w.get("model.embed_tokens.weight", {vocab_, hidden_});
    int64_t q_dim = heads_ * head_dim_, kv_dim = kv_heads_ * head_dim_;
    for (int64_t i = 0; i < layers_n_; ++i) {
      std::string p = "model.layers." + std::to_string(i) + ".";
      Layer l;
      l.input_norm = w.get(p + "input_layernorm.weight", {hidden_});
      l.q = linear(p + "self_attn.q_proj", q_dim, hidden_, qkv_bias);
      l.k = linear(p + "self_attn.k_proj", kv_dim, hidden_, qkv_bias);
      l.v = linear(p + "self_attn.v_proj", kv_dim, hidden_, qkv_bias);
      l.o = linear(p + "self_attn.o_proj", hidden_, q_dim, o_bias);
      if (qk_norm_) {
        l.q_norm = w.get(p + "self_attn.q_norm.weight", {head_dim_});
        l.k_norm = w.get(p + "self_attn.k_norm.weight", {head_dim_});
      }
      l.post_attention_norm = w.get(p + "post_attention_layernorm.weight", {hidden_});
      l.gate = linear(p + "mlp.gate_proj", intermediate_, hidden_, mlp_bias);
      l.up = linear(p + "mlp.up_proj", intermediate_, hidden_, mlp_bias);
      l.down = linear(p + "mlp.down_proj", hidden_, intermediate_, mlp_bias);
      layers_.push_back(std::move(l));
    }
    norm_ = w.get("model.norm.weight", {hidden_});
    bool tied = config_bool(c, "tie_word_embeddings", false, where);
    // transformers ties a stored lm_head.weight to the embedding; check its shape, then drop it.
    if (tied && w.has("lm_head.weight")) w.get("lm_head.weight", {vocab_, hidden_});
    lm_head_ = tied ? embed_ : w.get("lm_head.weight", {vocab_, hidden_});
    (void)options;
  }

  at::Tensor embed(const at::Tensor& input_ids) override {
    return at::embedding(embed_, input_ids);
  }

  at::Tensor hidden_states_from(int64_t first, const at::Tensor& input, Probe* probe) override {
    at::Tensor h = input;
    int64_t t = h.size(1);
    auto dtype = h.scalar_type();
    auto [cos, sin] = rotary_cos_sin(inv_freq_.to(h.device()), t, dtype);
    at::Tensor mask = additive_causal_mask(t, dtype).to(h.device());
    double scaling = std::pow(static_cast<double>(head_dim_), -0.5);
    for (auto i = static_cast<std::size_t>(first); i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      auto name = [i](const char* part) {
        return [i, part] { return "layers." + std::to_string(i) + part; };
      };
      at::Tensor residual = h;
      at::Tensor x = probed(probe, name(".input_layernorm"), rms_norm(h, l.input_norm, eps_));
      // The operators in transformers' order (q, its norm, k, its norm, v), each seen as
      // [1, T, ...] (docs/operators.md); a probe that returns its value changes no stride.
      at::Tensor q = probed(probe, name(".self_attn.q_proj"), l.q(x)).view({1, t, -1, head_dim_});
      if (qk_norm_) q = probed(probe, name(".self_attn.q_norm"), rms_norm(q, l.q_norm, eps_));
      at::Tensor k = probed(probe, name(".self_attn.k_proj"), l.k(x)).view({1, t, -1, head_dim_});
      if (qk_norm_) k = probed(probe, name(".self_attn.k_norm"), rms_norm(k, l.k_norm, eps_));
      at::Tensor v = probed(probe, name(".self_attn.v_proj"), l.v(x)).view({1, t, -1, head_dim_});
      q = probed(probe, name(".self_attn.q_rotary"),
                 apply_rotary(q.transpose(1, 2), cos, sin).transpose(1, 2))
              .transpose(1, 2);
      k = probed(probe, name(".self_attn.k_rotary"),
                 apply_rotary(k.transpose(1, 2), cos, sin).transpose(1, 2))
              .transpose(1, 2);
      at::Tensor o = eager_attention(q, k, v.transpose(1, 2), mask, scaling);
      o = probed(probe, name(".self_attn.attention"), o.reshape({1, t, -1}).contiguous());
      o = probed(probe, name(".self_attn"), probed(probe, name(".self_attn.o_proj"), l.o(o)));
      h = residual + o;

      residual = h;
      x = probed(probe, name(".post_attention_layernorm"),
                 rms_norm(h, l.post_attention_norm, eps_));
      at::Tensor gate = probed(probe, name(".mlp.gate_proj"), l.gate(x));
      at::Tensor act = probed(probe, name(".mlp.act_fn"), activation(gate));
      at::Tensor product =
          probed(probe, name(".mlp.product"), act * probed(probe, name(".mlp.up_proj"), l.up(x)));
      h = residual +
          probed(probe, name(".mlp"), probed(probe, name(".mlp.down_proj"), l.down(product)));
      h = probed(probe, name(""), h);
    }
    return probed(
        probe, [] { return "norm"; }, rms_norm(h, norm_, eps_));
  }

  at::Tensor lm_head(const at::Tensor& hidden) const override {
    return at::linear(hidden, lm_head_);
  }

  // transformers' ACT2FN: nn.SiLU, GELUActivation (F.gelu), PytorchGELUTanh.
  at::Tensor activation(const at::Tensor& x) const {
    if (act_ == "silu") return at::silu(x);
    return at::gelu(x, act_ == "gelu" ? "none" : "tanh");
  }

  int64_t vocab_size() const override { return vocab_; }
  int64_t hidden_size() const override { return hidden_; }
  int64_t layer_count() const override { return static_cast<int64_t>(layers_.size()); }
  std::string architecture() const override { return architecture_; }
  std::string attention_implementation() const override { return "eager"; }

 private:
  std::string model_type_, architecture_, act_;
  int64_t hidden_, intermediate_, layers_n_, heads_, kv_heads_, vocab_, head_dim_;
  double eps_;
  bool qk_norm_;
  at::Tensor inv_freq_, embed_, norm_, lm_head_;
  std::vector<Layer> layers_;
};

}  // namespace

ArchitectureEntry llama_family_architecture() {
  return {{"llama", "qwen2", "qwen3"},
          [](const Json& config, Weights& weights, const ExecOptions& options) {
            return std::make_unique<LlamaFamily>(config, weights, options);
          },
          {}};
}

}  // namespace assay::oracle
