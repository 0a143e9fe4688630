// common/model_shapes: config.json's sizes against the tensor shapes (issue 36, defect 3).
#include <doctest/doctest.h>

#include <string>

#include "common/error.h"
#include "common/model_shapes.h"

using assay::common::check_config_shapes;
using assay::common::Error;
using assay::common::Json;
using assay::common::TensorShapes;

namespace {

// A llama-shaped checkpoint: vocab 256, hidden 64, 2 layers, 4 heads of 16, 2 kv heads,
// intermediate 128, under `prefix`.
TensorShapes llama(const std::string& prefix = "model.", int layers = 2) {
  TensorShapes s;
  s[prefix + "embed_tokens.weight"] = {256, 64};
  s[prefix + "norm.weight"] = {64};
  s["lm_head.weight"] = {256, 64};
  for (int i = 0; i < layers; ++i) {
    std::string p = prefix + "layers." + std::to_string(i) + ".";
    s[p + "input_layernorm.weight"] = {64};
    s[p + "self_attn.q_proj.weight"] = {64, 64};
    s[p + "self_attn.k_proj.weight"] = {32, 64};
    s[p + "self_attn.v_proj.weight"] = {32, 64};
    s[p + "self_attn.o_proj.weight"] = {64, 64};
    s[p + "mlp.gate_proj.weight"] = {128, 64};
    s[p + "mlp.up_proj.weight"] = {128, 64};
    s[p + "mlp.down_proj.weight"] = {64, 128};
  }
  return s;
}

Json llama_config() {
  return Json{{"model_type", "llama"},   {"vocab_size", 256},        {"hidden_size", 64},
              {"num_hidden_layers", 2},  {"num_attention_heads", 4}, {"num_key_value_heads", 2},
              {"intermediate_size", 128}};
}

// The refusal's message, or "" when the config passes.
std::string refusal(const Json& config, const TensorShapes& shapes) {
  try {
    check_config_shapes(config, shapes, "config.json", "request.bad_model");
  } catch (const Error& e) {
    CHECK(e.code() == "request.bad_model");
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("model shapes: a config that matches its checkpoint passes") {
  CHECK(refusal(llama_config(), llama()) == "");
  // Keys a config leaves out are the backend's defaults, not contradictions.
  Json sparse{{"model_type", "llama"}, {"hidden_size", 64}};
  CHECK(refusal(sparse, llama()) == "");
  // JSON's 64.0 is the size 64.
  Json floats = llama_config();
  floats["hidden_size"] = 64.0;
  CHECK(refusal(floats, llama()) == "");
  // An architecture it does not know (no embedding it can find) is left to the backend.
  TensorShapes gpt2{{"transformer.wte.weight", {256, 64}}, {"transformer.h.0.attn.weight", {64}}};
  CHECK(refusal(Json{{"n_embd", 1e9}}, gpt2) == "");
  CHECK(refusal(Json::array(), llama()) == "");
}

TEST_CASE("model shapes: each size that contradicts the weights is refused by name") {
  struct Case {
    const char* key;
    Json value;
    const char* says;
  };
  for (const Case& c : {Case{"hidden_size", 1e9, "model.embed_tokens.weight"},
                        Case{"vocab_size", 1e12, "model.embed_tokens.weight"},
                        Case{"num_hidden_layers", 1000000, "stores 2 blocks"},
                        Case{"intermediate_size", 1e9, "mlp.gate_proj.weight"},
                        Case{"num_attention_heads", 1e9, "self_attn.q_proj.weight"},
                        Case{"num_key_value_heads", 1000, "self_attn.k_proj.weight"},
                        Case{"head_dim", 1 << 20, "self_attn.q_proj.weight"},
                        Case{"num_hidden_layers", -1, "stores 2 blocks"},
                        Case{"hidden_size", 65, "model.embed_tokens.weight"}}) {
    CAPTURE(c.key);
    Json config = llama_config();
    config[c.key] = c.value;
    std::string message = refusal(config, llama());
    CHECK_MESSAGE(message.find(std::string(c.key) + " = " + c.value.dump()) != std::string::npos,
                  message);
    CHECK_MESSAGE(message.find(c.says) != std::string::npos, message);
  }
}

TEST_CASE("model shapes: a multimodal config's text part is checked against its language model") {
  TensorShapes s = llama("model.language_model.");
  s["model.visual.blocks.0.attn.qkv.weight"] = {192, 64};
  s["mtp.layers.0.mlp.gate_proj.weight"] = {128, 64};  // not one of the model's blocks
  Json config{{"model_type", "qwen3_5"}, {"text_config", llama_config()}};
  CHECK(refusal(config, s) == "");
  config["text_config"]["num_hidden_layers"] = 1000000;
  std::string message = refusal(config, s);
  CHECK_MESSAGE(
      message.find("config.json text_config num_hidden_layers = 1000000") != std::string::npos,
      message);
  CHECK_MESSAGE(message.find("model.language_model.layers.1") != std::string::npos, message);
}

TEST_CASE("model shapes: gated attention, a fused q_k_v_proj and Gated DeltaNet blocks") {
  // Qwen3.5: q_proj holds the output gate's rows too; layer 0 is a Gated DeltaNet block.
  TensorShapes s = llama();
  s["model.layers.0.self_attn.q_proj.weight"] = {128, 64};
  s["model.layers.1.self_attn.q_proj.weight"] = {128, 64};
  s["model.layers.0.linear_attn.A_log"] = {4};
  s["model.layers.0.linear_attn.conv1d.weight"] = {96, 1, 4};
  s["model.layers.0.linear_attn.norm.weight"] = {16};
  s["model.layers.0.linear_attn.in_proj_qkv.weight"] = {96, 64};  // 2*2*8 + 4*16
  Json config = llama_config();
  config.update(Json{{"linear_num_value_heads", 4},
                     {"linear_num_key_heads", 2},
                     {"linear_key_head_dim", 8},
                     {"linear_value_head_dim", 16},
                     {"linear_conv_kernel_dim", 4}});
  CHECK(refusal(config, s) == "");
  for (const char* key : {"linear_num_value_heads", "linear_conv_kernel_dim",
                          "linear_value_head_dim", "linear_key_head_dim"}) {
    CAPTURE(key);
    Json bad = config;
    bad[key] = 1e9;
    CHECK_MESSAGE(refusal(bad, s).find(std::string(key) + " = ") != std::string::npos,
                  refusal(bad, s));
  }
  // Spark2.5: one q_k_v_proj of (heads + 2 x kv heads) x head_dim rows, and "embedding".
  TensorShapes spark;
  spark["model.embedding.weight"] = {256, 64};
  spark["model.layers.0.self_attn.q_k_v_proj.weight"] = {128, 64};
  Json sc{{"hidden_size", 64},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"num_hidden_layers", 1},
          {"vocab_size", 256}};
  CHECK(refusal(sc, spark) == "");
  sc["num_key_value_heads"] = 1e6;
  CHECK_MESSAGE(refusal(sc, spark).find("q_k_v_proj") != std::string::npos, refusal(sc, spark));
}
