// Qwen3.5 architecture: bitwise parity with the Python reference (tests/reference/ref_qwen3_5.py)
// on the same ATen build, with transformers 5.13.1's Gated DeltaNet rule, and the errors a bad
// checkpoint or config gets.
#include <ATen/ATen.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/fs.h"
#include "common/json.h"
#include "common/safetensors.h"
#include "worker/loader.h"
#include "worker/model.h"

#include <doctest/doctest.h>

namespace fs = std::filesystem;
using assay::common::Error;
using assay::common::Json;
using assay::oracle::ExecOptions;
using assay::oracle::Model;
using assay::oracle::Weights;

namespace {

// The case directory written once per process by make_case.py (see its docstring).
class Case {
 public:
  static const Case& get() {
    static Case instance;
    return instance;
  }
  ~Case() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  fs::path dir;

 private:
  Case() {
    char tmpl[] = "/tmp/assay-qwen3_5-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) throw std::runtime_error("mkdtemp failed");
    dir = tmpl;
    const std::string command = std::string(ASSAY_PYTHON3) + " " + ASSAY_TESTS_DIR +
                                "/oracle/qwen3_5/make_case.py --out " + dir.string();
    if (std::system(command.c_str()) != 0) throw std::runtime_error("failed: " + command);
  }
};

using assay::oracle::read_config;

struct Loaded {
  std::unique_ptr<Weights> weights;  // owns the mappings the model's tensors point into
  std::unique_ptr<Model> model;
};

// The checkpoint's weights through the oracle's loader, with `config` in place of config.json.
Loaded load_with(const fs::path& model_dir, const Json& config) {
  ExecOptions options;
  Loaded out;
  out.weights = assay::oracle::open_weights(model_dir, options);
  out.model = assay::oracle::qwen3_5_architecture().make(config, *out.weights, options);
  return out;
}

// What assay-oracle runs: registry by model_type, weights, then the unused-tensor rule.
Loaded load(const fs::path& model_dir) {
  ExecOptions options;
  auto loaded = assay::oracle::load_model(model_dir, options);
  return {std::move(loaded.weights), std::move(loaded.model)};
}

// Reference tensors of one sequence length, copied out of the mapping.
std::map<std::string, at::Tensor> reference(int64_t length) {
  auto file = assay::common::SafetensorsFile::open(
      Case::get().dir / ("ref_T" + std::to_string(length) + ".safetensors"));
  std::map<std::string, at::Tensor> out;
  for (const auto& t : file.tensors()) {
    auto dtype = t.dtype == assay::common::Dtype::kI64 ? at::kLong : at::kFloat;
    out[t.name] =
        at::from_blob(const_cast<std::byte*>(t.data), t.shape, at::TensorOptions().dtype(dtype))
            .clone();
  }
  return out;
}

// Logits [T, V] as F32, the layout of the reference file.
at::Tensor logits(Model& model, const at::Tensor& input_ids) {
  at::Tensor out = model.forward(input_ids);
  REQUIRE(out.dim() == 3);
  REQUIRE(
      (out.scalar_type() == at::kBFloat16));  // parenthesised: c10::toString clashes with doctest
  return out[0].to(at::kFloat);
}

// Bitwise equality, reporting the first differing position when it fails.
void check_bitwise(const at::Tensor& got, const at::Tensor& want) {
  REQUIRE(got.sizes().equals(want.sizes()));
  at::Tensor differs = (got != want).any(-1);
  int64_t bad = differs.sum().item<int64_t>();
  if (bad > 0) {
    int64_t first = differs.nonzero()[0][0].item<int64_t>();
    FAIL_CHECK("logits differ at " << bad << " of " << got.size(0) << " positions, first " << first
                                   << ", max |diff| " << (got - want).abs().max().item<float>());
  }
  CHECK(bad == 0);
}

std::string error_code_of(const std::function<void()>& f, std::string* message) {
  try {
    f();
  } catch (const Error& e) {
    *message = e.what();
    return e.code();
  }
  return "no error";
}

void write_config(const fs::path& dir, const Json& config) {
  fs::create_directories(dir);
  assay::common::atomic_write_file(dir / "config.json", config.dump(), 0644);
}

}  // namespace

// The reference's "legacy" rule is transformers 5.13.1's torch_chunk_gated_delta_rule (the
// "current" one, after PR #47625 that 5.13.1 does not have, stays in the Python reference only as
// a cross-check of the math;
// tests/hf_parity compares the oracle with transformers itself).
TEST_CASE("qwen3_5 logits equal the Python reference bit for bit at every position") {
  Loaded m = load(Case::get().dir / "nested");
  for (int64_t length : {37, 64, 150}) {  // shorter than, exactly, and over two GDN chunks
    CAPTURE(length);
    auto ref = reference(length);
    check_bitwise(logits(*m.model, ref["input_ids"]), ref["legacy_chunk"]);
  }
}

TEST_CASE("qwen3_5_text flat checkpoint gives the same logits as the nested qwen3_5 one") {
  Loaded m = load(Case::get().dir / "flat");
  CHECK(m.model->architecture() == "Qwen3_5ForCausalLM");
  auto ref = reference(37);
  check_bitwise(logits(*m.model, ref["input_ids"]), ref["legacy_chunk"]);
  CHECK(m.weights->unused().empty());
}

TEST_CASE("qwen3_5 uses every text tensor and leaves vision and mtp tensors to the ignore rule") {
  Loaded m = load_with(Case::get().dir / "nested", read_config(Case::get().dir / "nested"));
  CHECK(m.model->architecture() == "Qwen3_5ForConditionalGeneration");
  CHECK(m.model->vocab_size() == 260);
  CHECK(m.model->attention_implementation() == "eager");
  CHECK(m.model->linear_attention_implementation() == "torch_chunk_gated_delta_rule");
  const auto prefixes = assay::oracle::qwen3_5_architecture().ignored_prefixes;
  const auto unused = m.weights->unused();
  CHECK(unused.size() == 2);
  for (const auto& name : unused) {
    CAPTURE(name);
    bool ignored = false;
    for (const auto& p : prefixes) ignored = ignored || name.rfind(p, 0) == 0;
    CHECK(ignored);
  }
}

TEST_CASE("qwen3_5 names a missing tensor") {
  const fs::path src = Case::get().dir / "nested";
  const fs::path dir = Case::get().dir / "missing";
  const std::string victim = "model.language_model.layers.2.linear_attn.A_log";
  {
    auto file = assay::common::SafetensorsFile::open(src / "model.safetensors");
    std::vector<assay::common::TensorToWrite> keep;
    for (const auto& t : file.tensors()) {
      if (t.name != victim) keep.push_back({t.name, t.dtype, t.shape, {t.data, t.nbytes}});
    }
    write_config(dir, read_config(src));
    assay::common::write_safetensors(dir / "model.safetensors", keep);
  }
  std::string message;
  CHECK(error_code_of([&] { load(dir); }, &message) == "model.missing_tensor");
  CHECK(message.find(victim) != std::string::npos);
}

TEST_CASE("qwen3_5 names the tensor whose shape disagrees with the config") {
  Json config = read_config(Case::get().dir / "nested");
  config["text_config"]["intermediate_size"] = 96;
  std::string message;
  CHECK(error_code_of([&] { load_with(Case::get().dir / "nested", config); }, &message) ==
        "model.bad_shape");
  CHECK(message.find("model.language_model.layers.0.mlp.gate_proj.weight") != std::string::npos);
}

TEST_CASE("qwen3_5 rejects config values it does not implement, naming them") {
  const Json base = read_config(Case::get().dir / "nested");
  struct Bad {
    const char* field;
    Json value;
    const char* expect_in_message;
  };
  const std::vector<Bad> cases = {
      {"hidden_act", "gelu", "hidden_act \"gelu\""},
      {"attn_output_gate", false, "attn_output_gate"},
      {"layer_types", Json::array({"linear_attention"}), "layer_types"},
  };
  for (const auto& bad : cases) {
    CAPTURE(bad.field);
    Json config = base;
    config["text_config"][bad.field] = bad.value;
    std::string message;
    CHECK(error_code_of([&] { load_with(Case::get().dir / "nested", config); }, &message) ==
          "model.unsupported");
    CHECK(message.find(bad.expect_in_message) != std::string::npos);
  }
  Json yarn = base;
  yarn["text_config"]["rope_parameters"]["rope_type"] = "yarn";
  std::string message;
  CHECK(error_code_of([&] { load_with(Case::get().dir / "nested", yarn); }, &message) ==
        "model.unsupported");
  CHECK(message.find("\"yarn\"") != std::string::npos);
}

TEST_CASE("qwen3_5 rejects a token id outside the vocabulary") {
  Loaded m = load(Case::get().dir / "nested");
  at::Tensor ids = at::tensor(std::vector<int64_t>{1, 2, 260}, at::kLong).view({1, 3});
  std::string message;
  CHECK(error_code_of([&] { m.model->forward(ids); }, &message) == "model.bad_input");
  CHECK(message.find("260") != std::string::npos);
}
