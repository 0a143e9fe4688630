// Layer- and operator-level boundaries of a layer-attribution job (common/layers.h): names,
// widths and order per architecture, what an engine's rows file may hold, and the rows that
// would narrow a departure.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/layers.h"
#include "common/safetensors.h"

using namespace assay::common;

namespace {

Json config(const std::string& type) {
  return Json{{"model_type", type},       {"num_hidden_layers", 2},   {"hidden_size", 64},
              {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 16},
              {"intermediate_size", 128}};
}

std::vector<std::string> names(const std::vector<Boundary>& bs) {
  std::vector<std::string> out;
  for (const auto& b : bs) out.push_back(b.name);
  return out;
}

LayerRequest request(const char* rows) {
  return validate_layer_request(
      Json{{"schema", "assay.layer-attribution-request.v1"},
           {"id", "t"},
           {"model_dir", "/m"},
           {"input_token_ids", {1, 2, 3}},
           {"rows", rows},
           {"engine",
            {{"name", "e"},
             {"rows_file",
              {{"path", "/r.safetensors"}, {"sha256", "sha256:" + std::string(64, 'a')}}}}}});
}

SafetensorsIndex header(const std::vector<std::pair<std::string, std::vector<std::int64_t>>>& ts) {
  SafetensorsIndex index;
  for (const auto& [name, shape] : ts) {
    index.tensors.push_back(TensorView{name, Dtype::kF32, shape, nullptr, 0});
  }
  return index;
}

}  // namespace

TEST_CASE("model_boundaries: Qwen3's operators inside their blocks, in transformers' order") {
  auto bs = model_boundaries(config("qwen3"), 64);
  auto n = names(bs);
  REQUIRE(bs.size() == 12 + 2 * (9 + 5));
  std::vector<std::string> layer0(n.begin() + 1, n.begin() + 20);
  CHECK(layer0 ==
        std::vector<std::string>{
            "layers.0.input_layernorm", "layers.0.self_attn.q_proj", "layers.0.self_attn.q_norm",
            "layers.0.self_attn.k_proj", "layers.0.self_attn.k_norm", "layers.0.self_attn.v_proj",
            "layers.0.self_attn.q_rotary", "layers.0.self_attn.k_rotary",
            "layers.0.self_attn.attention", "layers.0.self_attn.o_proj", "layers.0.self_attn",
            "layers.0.post_attention_layernorm", "layers.0.mlp.gate_proj", "layers.0.mlp.act_fn",
            "layers.0.mlp.up_proj", "layers.0.mlp.product", "layers.0.mlp.down_proj",
            "layers.0.mlp", "layers.0"});
  auto width = [&](const std::string& name) {
    for (const auto& b : bs)
      if (b.name == name) return b.width;
    return std::int64_t{-1};
  };
  CHECK(width("layers.1.self_attn.q_rotary") == 64);
  CHECK(width("layers.1.self_attn.k_norm") == 32);
  CHECK(width("layers.1.mlp.product") == 128);
  CHECK(width("layers.1.mlp.down_proj") == 64);
  CHECK(width("norm") == 64);
  // Without the operators: exactly layer_boundaries.
  CHECK(names(job_boundaries(bs, {})) == layer_boundaries(config("qwen3")));
  CHECK(job_boundaries(bs, {"layers.1.mlp.act_fn"}).size() == 13);
}

TEST_CASE(
    "model_boundaries: Llama has no q_norm; Qwen3.5's Gated DeltaNet and gated attention; "
    "Spark2.5 names none; sizes checked") {
  auto llama = names(model_boundaries(config("llama"), 64));
  CHECK(llama.size() == 12 + 2 * (7 + 5));
  CHECK(std::find(llama.begin(), llama.end(), "layers.0.self_attn.q_norm") == llama.end());
  Json qwen3_5{{"model_type", "qwen3_5"},
               {"text_config",
                {{"model_type", "qwen3_5_text"},
                 {"num_hidden_layers", 2},
                 {"hidden_size", 64},
                 {"num_attention_heads", 4},
                 {"num_key_value_heads", 2},
                 {"head_dim", 16},
                 {"intermediate_size", 128},
                 {"linear_num_key_heads", 2},
                 {"linear_key_head_dim", 16},
                 {"linear_num_value_heads", 4},
                 {"linear_value_head_dim", 16},
                 {"layer_types", {"linear_attention", "full_attention"}}}}};
  auto q35 = model_boundaries(qwen3_5, 64);
  CHECK(q35.size() == 12 + 10 + 10 + 2 * 5);
  CHECK(q35[2].name == "layers.0.linear_attn.in_proj_qkv");
  CHECK(q35[2].width == 2 * 32 + 64);
  CHECK(q35[8].name == "layers.0.linear_attn.g");
  CHECK(q35[8].width == 4);
  auto q35_names = names(q35);
  auto gate = std::find(q35_names.begin(), q35_names.end(), "layers.1.self_attn.output_gate");
  REQUIRE(gate != q35_names.end());
  CHECK(*(gate + 1) == "layers.1.self_attn.o_proj");
  CHECK(q35[static_cast<std::size_t>(gate - q35_names.begin()) - 8].width == 128);  // q_proj
  CHECK(names(model_boundaries(config("spark2_5"), 64)) == layer_boundaries(config("spark2_5")));
  Json bad = config("qwen3");
  bad["intermediate_size"] = "big";
  CHECK_THROWS_WITH_AS(model_boundaries(bad, 64), doctest::Contains("intermediate_size"), Error);
}

TEST_CASE("check_engine_rows: operator rows at their own width, at any granularity") {
  auto model = model_boundaries(config("qwen3"), 64);
  auto rows = check_engine_rows(
      header({{"layers.1.self_attn.k_rotary", {3, 32}}, {"layers.1.mlp", {3, 64}}}), model,
      request("all"));
  CHECK(rows.given == std::vector<std::string>{"layers.1.self_attn.k_rotary", "layers.1.mlp"});
  CHECK(rows.operators_given == std::vector<std::string>{"layers.1.self_attn.k_rotary"});
  CHECK(rows.omitted.size() == 11);  // layer-level only
  CHECK_THROWS_WITH_AS(
      check_engine_rows(header({{"layers.1.self_attn.k_rotary", {3, 64}}}), model, request("all")),
      doctest::Contains("[3, 32] (32 values per position"), Error);
  CHECK_NOTHROW(
      check_engine_rows(header({{"layers.0.mlp.act_fn", {128}}}), model, request("last")));
  CHECK_THROWS_WITH_AS(check_engine_rows(header({{"layers.0.mlp.act_fn", {3, 128}}}),
                                         model_boundaries(config("spark2_5"), 64), request("all")),
                       doctest::Contains("not a boundary of this model"), Error);
}

TEST_CASE("block_operators: the rows that narrow a block, none elsewhere") {
  auto model = model_boundaries(config("llama"), 64);
  auto attn = block_operators(model, "layers.1.self_attn");
  CHECK(attn.size() == 7);
  CHECK(attn.front() == "layers.1.self_attn.q_proj");
  CHECK(block_operators(model, "layers.1.mlp.product").size() == 5);
  CHECK(block_operators(model, "layers.1.input_layernorm").empty());
  CHECK(block_operators(model, "norm").empty());
}

TEST_CASE("validate_layer_request: patch_search") {
  Json r{{"schema", "assay.layer-attribution-request.v1"},
         {"id", "t"},
         {"model_dir", "/m"},
         {"input_token_ids", {1}},
         {"engine",
          {{"name", "e"},
           {"rows_file", {{"path", "/r"}, {"sha256", "sha256:" + std::string(64, 'a')}}}}}};
  CHECK(validate_layer_request(r).patch_search == "bisect");
  r["patch_search"] = "every";
  CHECK(validate_layer_request(r).patch_search == "every");
  r["patch_search"] = "binary";
  CHECK_THROWS_WITH_AS(
      validate_layer_request(r),
      doctest::Contains("patch_search must be \"bisect\" or \"every\", got \"binary\""), Error);
}
