// assay-oracle against the independent Python reference (tests/reference/reference.py) on
// fixtures from tests/fixtures/make_fixture.py: bitwise equality, determinism, and the errors
// hostile checkpoints and inputs must produce. Runs the real binary and the real Python.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/fs.h"
#include "common/identity.h"
#include "common/json.h"
#include "common/safetensors.h"
#include "worker/tokenizer.h"

namespace fs = std::filesystem;
using assay::common::Json;

namespace {

const fs::path kSource = ASSAY_SOURCE_DIR;
const std::string kOracle = ASSAY_ORACLE_BIN;
const std::string kPython = ASSAY_PYTHON3;

struct Result {
  int status = -1;
  std::string err;
};

// Runs `command` through the shell, stderr captured.
Result run(const std::string& command, const fs::path& scratch) {
  fs::path err = scratch / "stderr.txt";
  int rc = std::system((command + " 2>" + err.string()).c_str());
  Result r;
  r.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
  std::ifstream in(err);
  std::stringstream ss;
  ss << in.rdbuf();
  r.err = ss.str();
  return r;
}

fs::path scratch_root() {
  static const fs::path root = [] {
    std::string tmpl = (fs::temp_directory_path() / "assay-oracle-test-XXXXXX").string();
    if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    return fs::path(tmpl);
  }();
  return root;
}

// A fixture directory per (arch, shards, seed), made once per test process.
fs::path fixture(const std::string& arch, int shards = 1, int seed = 7) {
  static std::map<std::string, fs::path> made;
  std::string key =
      arch + "-" + std::to_string(shards) + (seed == 7 ? "" : "-s" + std::to_string(seed));
  if (auto it = made.find(key); it != made.end()) return it->second;
  fs::path dir = scratch_root() / ("fixture-" + key);
  Result r = run(kPython + " " + (kSource / "tests/fixtures/make_fixture.py").string() +
                     " --arch " + arch + " --size tiny --seed " + std::to_string(seed) +
                     " --shards " + std::to_string(shards) + " --out " + dir.string(),
                 scratch_root());
  REQUIRE_MESSAGE(r.status == 0, r.err);
  made[key] = dir;
  return dir;
}

// A fresh copy of a fixture to damage.
fs::path copy_fixture(const std::string& arch, const std::string& name, int shards = 1) {
  fs::path dir = scratch_root() / name;
  fs::remove_all(dir);
  fs::copy(fixture(arch, shards), dir);
  return dir;
}

std::string ids_string(const std::vector<std::int64_t>& ids) {
  std::string s;
  for (std::size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

std::vector<std::int64_t> token_ids(std::size_t n, std::int64_t vocab, std::uint32_t seed = 1) {
  std::vector<std::int64_t> ids;
  std::uint32_t x = seed * 2654435761u + 12345u;
  for (std::size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    ids.push_back(static_cast<std::int64_t>((x >> 8) % static_cast<std::uint32_t>(vocab)));
  }
  return ids;
}

std::int64_t vocab_of(const fs::path& model) {
  Json c = assay::common::parse_strict(assay::common::read_file(model / "config.json", 1 << 20));
  return c.contains("text_config") ? c["text_config"]["vocab_size"].get<std::int64_t>()
                                   : c["vocab_size"].get<std::int64_t>();
}

struct Logits {
  std::vector<std::int64_t> shape;
  std::vector<float> values;
  std::string bytes;  // raw little-endian F32
};

Logits read_logits(const fs::path& file) {
  auto st = assay::common::SafetensorsFile::open(file);
  const auto* t = st.find("logits");
  REQUIRE(t != nullptr);
  REQUIRE(t->dtype == assay::common::Dtype::kF32);
  Logits l;
  l.shape = t->shape;
  l.bytes.assign(reinterpret_cast<const char*>(t->data), t->nbytes);
  l.values.resize(t->nbytes / sizeof(float));
  std::memcpy(l.values.data(), t->data, t->nbytes);
  return l;
}

std::string oracle_cmd(const fs::path& model, const std::vector<std::int64_t>& ids,
                       const fs::path& out, const std::string& extra = "--all-positions") {
  return kOracle + " logits --model " + model.string() + " --token-ids " + ids_string(ids) +
         " --out " + out.string() + " " + extra;
}

Logits oracle(const fs::path& model, const std::vector<std::int64_t>& ids,
              const std::string& extra = "--all-positions") {
  static int n = 0;
  fs::path out = scratch_root() / ("oracle-" + std::to_string(n++) + ".safetensors");
  Result r = run(oracle_cmd(model, ids, out, extra), scratch_root());
  REQUIRE_MESSAGE(r.status == 0, r.err);
  return read_logits(out);
}

Logits reference(const fs::path& model, const std::vector<std::int64_t>& ids,
                 const std::string& extra = "--all-positions") {
  static int n = 0;
  fs::path out = scratch_root() / ("reference-" + std::to_string(n++) + ".safetensors");
  Result r = run(kPython + " " + (kSource / "tests/reference/reference.py").string() + " --model " +
                     model.string() + " --token-ids " + ids_string(ids) + " --out " + out.string() +
                     " " + extra,
                 scratch_root());
  REQUIRE_MESSAGE(r.status == 0, r.err);
  return read_logits(out);
}

std::vector<std::string> architectures() {
  std::vector<std::string> archs{"llama", "qwen2", "qwen3", "spark2_5"};
  // Qwen3.5 joins once its three files exist (the binary then registers it).
  if (fs::exists(kSource / "worker/qwen3_5.cpp") &&
      fs::exists(kSource / "tests/reference/ref_qwen3_5.py") &&
      fs::exists(kSource / "tests/fixtures/arch_qwen3_5.py")) {
    archs.push_back("qwen3_5");
  }
  return archs;
}

std::size_t first_difference(const Logits& a, const Logits& b) {
  for (std::size_t i = 0; i < a.values.size() && i < b.values.size(); ++i) {
    if (std::memcmp(&a.values[i], &b.values[i], sizeof(float)) != 0) return i;
  }
  return a.values.size() == b.values.size() ? std::string::npos : 0;
}

// Expects the oracle to fail with `code` in its message and `needle` named, writing nothing.
void expect_error(const std::string& command, const fs::path& out, const std::string& code,
                  const std::string& needle) {
  fs::remove(out);
  Result r = run(command, scratch_root());
  CHECK_MESSAGE(r.status == 2, r.err);
  CHECK_MESSAGE(r.err.find("[" + code + "]") != std::string::npos, r.err);
  CHECK_MESSAGE(r.err.find(needle) != std::string::npos, r.err);
  CHECK_FALSE(fs::exists(out));
}

void rewrite_safetensors(
    const fs::path& file,
    const std::function<void(std::vector<assay::common::TensorToWrite>&)>& edit) {
  std::string image = assay::common::read_file(file, 1 << 30);
  auto index = assay::common::parse_safetensors(std::as_bytes(std::span(image)));
  std::vector<assay::common::TensorToWrite> tensors;
  for (const auto& t : index.tensors) {
    tensors.push_back({t.name, t.dtype, t.shape, {t.data, t.nbytes}});
  }
  edit(tensors);
  std::string out = assay::common::serialize_safetensors(tensors);
  assay::common::atomic_write_file(file, out);
}

void edit_config(const fs::path& model, const std::function<void(Json&)>& edit) {
  Json c = assay::common::parse_strict(assay::common::read_file(model / "config.json", 1 << 20));
  edit(c);
  assay::common::atomic_write_file(model / "config.json", c.dump(2));
}

}  // namespace

TEST_CASE("oracle logits equal the Python reference bitwise at every position") {
  // Lengths around the sliding window (32) and one Gated DeltaNet chunk (64).
  for (const std::string& arch : architectures()) {
    fs::path model = fixture(arch);
    std::int64_t vocab = vocab_of(model);
    for (std::size_t len : {1, 7, 33, 70}) {
      CAPTURE(arch);
      CAPTURE(len);
      auto ids = token_ids(len, vocab, static_cast<std::uint32_t>(len));
      Logits a = oracle(model, ids);
      Logits b = reference(model, ids);
      REQUIRE(a.shape == std::vector<std::int64_t>{static_cast<std::int64_t>(len), vocab});
      REQUIRE(b.shape == a.shape);
      CHECK_MESSAGE(first_difference(a, b) == std::string::npos,
                    "first differing logit at flat index " << first_difference(a, b));
    }
  }
}

TEST_CASE("float32 execution equals the reference bitwise") {
  for (const std::string arch : {"llama", "spark2_5"}) {
    CAPTURE(arch);
    fs::path model = fixture(arch);
    auto ids = token_ids(40, vocab_of(model), 3);
    Logits a = oracle(model, ids, "--all-positions --dtype float32");
    Logits b = reference(model, ids, "--all-positions --dtype float32");
    CHECK(first_difference(a, b) == std::string::npos);
    Logits bf16 = oracle(model, ids);
    CHECK(first_difference(a, bf16) != std::string::npos);  // the dtype really changed
  }
}

TEST_CASE("a sharded checkpoint gives the same logits as the single file") {
  auto ids = token_ids(20, vocab_of(fixture("llama")), 5);
  Logits single = oracle(fixture("llama"), ids);
  Logits sharded = oracle(fixture("llama", 3), ids);
  CHECK(fs::exists(fixture("llama", 3) / "model.safetensors.index.json"));
  CHECK(single.bytes == sharded.bytes);
}

TEST_CASE("the last-position logits are the last row of the all-positions logits") {
  for (const std::string arch : {"qwen3", "spark2_5"}) {
    CAPTURE(arch);
    fs::path model = fixture(arch);
    std::int64_t vocab = vocab_of(model);
    auto ids = token_ids(45, vocab, 9);
    Logits all = oracle(model, ids);
    Logits last = oracle(model, ids, "");
    REQUIRE(last.shape == std::vector<std::int64_t>{vocab});
    CHECK(last.bytes == all.bytes.substr(all.bytes.size() - last.bytes.size()));
  }
}

TEST_CASE("the same input gives the same bits run to run and with 1 or 2 threads") {
  for (const std::string arch : {"qwen2", "spark2_5"}) {
    CAPTURE(arch);
    fs::path model = fixture(arch);
    auto ids = token_ids(50, vocab_of(model), 11);
    Logits one = oracle(model, ids, "--all-positions --threads 1");
    Logits again = oracle(model, ids, "--all-positions --threads 1");
    Logits two = oracle(model, ids, "--all-positions --threads 2");
    CHECK(one.bytes == again.bytes);
    CHECK(one.bytes == two.bytes);
  }
}

TEST_CASE("a prefix's logits agree with the longer sequence's first rows") {
  // Not bitwise: kernels may reduce a longer row in a different order. Close and same argmax.
  for (const std::string arch : {"llama", "spark2_5"}) {
    CAPTURE(arch);
    fs::path model = fixture(arch);
    std::int64_t vocab = vocab_of(model);
    auto ids = token_ids(60, vocab, 13);
    std::vector<std::int64_t> prefix(ids.begin(), ids.begin() + 25);
    Logits full = oracle(model, ids);
    Logits part = oracle(model, prefix);
    double worst = 0;
    int argmax_differs = 0;
    for (std::int64_t row = 0; row < 25; ++row) {
      std::int64_t best_full = 0, best_part = 0;
      for (std::int64_t v = 0; v < vocab; ++v) {
        float a = full.values[row * vocab + v], b = part.values[row * vocab + v];
        worst = std::max(worst, static_cast<double>(std::abs(a - b)));
        if (a > full.values[row * vocab + best_full]) best_full = v;
        if (b > part.values[row * vocab + best_part]) best_part = v;
      }
      argmax_differs += best_full != best_part;
    }
    CHECK(worst < 0.1);
    CHECK(argmax_differs == 0);
  }
}

TEST_CASE("hostile inputs and checkpoints give a clear error naming the offender") {
  fs::path out = scratch_root() / "hostile.safetensors";
  auto ids = std::vector<std::int64_t>{1, 2, 3};

  SUBCASE("token id outside the vocabulary") {
    expect_error(oracle_cmd(fixture("llama"), {1, 272, 3}, out), out, "request.invalid_token_id",
                 "272");
    expect_error(kOracle + " logits --model " + fixture("llama").string() +
                     " --token-ids 1,x,3 --out " + out.string(),
                 out, "request.invalid_token_id", "\"x\"");
  }
  SUBCASE("missing tensor") {
    fs::path m = copy_fixture("llama", "missing-tensor");
    rewrite_safetensors(m / "model.safetensors", [](auto& ts) {
      std::erase_if(ts,
                    [](const auto& t) { return t.name == "model.layers.1.mlp.up_proj.weight"; });
    });
    expect_error(oracle_cmd(m, ids, out), out, "model.missing_tensor",
                 "model.layers.1.mlp.up_proj.weight");
  }
  SUBCASE("tensor of the wrong shape") {
    fs::path m = copy_fixture("spark2_5", "wrong-shape");
    rewrite_safetensors(m / "model.safetensors", [](auto& ts) {
      for (auto& t : ts) {
        if (t.name == "model.layers.2.self_attn.g_proj.weight") {
          t.shape = {8, 32};
        }
      }
    });
    expect_error(oracle_cmd(m, ids, out), out, "model.bad_shape",
                 "model.layers.2.self_attn.g_proj.weight");
  }
  SUBCASE("tensor stored as integers") {
    fs::path m = copy_fixture("qwen3", "int-tensor");
    rewrite_safetensors(m / "model.safetensors", [](auto& ts) {
      for (auto& t : ts) {
        if (t.name == "model.norm.weight") t.dtype = assay::common::Dtype::kI16;
      }
    });
    expect_error(oracle_cmd(m, ids, out), out, "model.bad_dtype", "model.norm.weight");
  }
  SUBCASE("truncated shard") {
    fs::path m = copy_fixture("llama", "truncated", 3);
    fs::path shard = m / "model-00002-of-00003.safetensors";
    fs::resize_file(shard, fs::file_size(shard) - 100);
    expect_error(oracle_cmd(m, ids, out), out, "safetensors.invalid",
                 "model-00002-of-00003.safetensors");
  }
  SUBCASE("config that does not match the weights") {
    fs::path m = copy_fixture("qwen2", "mismatch");
    edit_config(m, [](Json& c) { c["intermediate_size"] = 96; });
    expect_error(oracle_cmd(m, ids, out), out, "model.bad_shape", "expected [96, 64]");
  }
  SUBCASE("unknown extra tensor") {
    fs::path m = copy_fixture("llama", "extra-tensor");
    rewrite_safetensors(m / "model.safetensors", [](auto& ts) {
      static const float kOne = 1.0f;
      ts.push_back({"mtp.layers.0.weight",
                    assay::common::Dtype::kF32,
                    {1},
                    std::as_bytes(std::span(&kOne, 1))});
    });
    expect_error(oracle_cmd(m, ids, out), out, "model.unexpected_tensor", "mtp.layers.0.weight");
  }
  SUBCASE("rotary inv_freq buffers are ignored by rule") {
    fs::path m = copy_fixture("llama", "inv-freq");
    rewrite_safetensors(m / "model.safetensors", [](auto& ts) {
      static const float kFreq[8] = {};
      ts.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq",
                    assay::common::Dtype::kF32,
                    {8},
                    std::as_bytes(std::span(kFreq))});
    });
    Result r = run(oracle_cmd(m, ids, out), scratch_root());
    CHECK_MESSAGE(r.status == 0, r.err);
  }
  SUBCASE("unsupported architecture or config value") {
    fs::path m = copy_fixture("llama", "unsupported");
    edit_config(m, [](Json& c) { c["model_type"] = "mixtral"; });
    expect_error(oracle_cmd(m, ids, out), out, "model.unsupported", "mixtral");
    edit_config(m, [](Json& c) {
      c["model_type"] = "llama";
      c["hidden_act"] = "gelu_new";  // transformers has it; assay's Llama has silu and gelu
    });
    expect_error(oracle_cmd(m, ids, out), out, "model.unsupported", "hidden_act");
    edit_config(m, [](Json& c) {
      c["hidden_act"] = "silu";
      c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
    });
    expect_error(oracle_cmd(m, ids, out), out, "model.unsupported", "yarn");
  }
  SUBCASE("no weights at all") {
    fs::path m = copy_fixture("spark2_5", "no-weights");
    fs::remove(m / "model.safetensors");
    expect_error(oracle_cmd(m, ids, out), out, "model.no_weights", m.string());
  }
}

namespace {

// A copy of the tiny Spark2.5 fixture whose config has `settings` merged in (null drops a field,
// so Spark2_5Config's default applies) and whose weights tests/fixtures/arch_spark2_5.py made
// for that config (lm_head when untied, biases, g_proj only with the gate).
fs::path spark_variant(const std::string& name, const Json& settings) {
  fs::path dir = copy_fixture("spark2_5", name);
  Result r = run(kPython + " " + (kSource / "tests/fixtures/arch_spark2_5.py").string() +
                     " --out " + dir.string() + " --set '" + settings.dump() + "'",
                 scratch_root());
  REQUIRE_MESSAGE(r.status == 0, r.err);
  return dir;
}

}  // namespace

TEST_CASE("Spark2.5 config variants the remote code implements equal the reference bitwise") {
  const std::vector<std::pair<std::string, Json>> variants = {
      {"spark-untied-biases-silu",
       {{"tie_word_embeddings", false},
        {"attention_bias", true},
        {"mlp_bias", true},
        {"gate_attn_act_mode", "silu"}}},
      {"spark-no-gate", {{"headwise_attn_output_gate", false}, {"num_key_value_heads", 2}}},
      // Spark2_5Config's defaults: untied, no gate, no biases, every layer full attention.
      {"spark-defaults",
       {{"tie_word_embeddings", nullptr},
        {"headwise_attn_output_gate", nullptr},
        {"gate_attn_act_mode", nullptr},
        {"attention_bias", nullptr},
        {"mlp_bias", nullptr},
        {"layer_types", nullptr},
        {"sliding_window", nullptr},
        {"head_dim", nullptr}}},
      {"spark-head-dim-256", {{"head_dim", 256}}},
  };
  fs::path base = fixture("spark2_5");
  for (const auto& [name, settings] : variants) {
    CAPTURE(name);
    fs::path model = spark_variant(name, settings);
    auto ids = token_ids(40, vocab_of(model), 21);
    for (const std::string extra : {"--all-positions", "--all-positions --dtype float32"}) {
      CAPTURE(extra);
      Logits a = oracle(model, ids, extra);
      Logits b = reference(model, ids, extra);
      REQUIRE(b.shape == a.shape);
      CHECK_MESSAGE(first_difference(a, b) == std::string::npos,
                    "first differing logit at flat index " << first_difference(a, b));
    }
    CHECK(oracle(model, ids).bytes != oracle(base, ids).bytes);  // the variant really differs
  }
  // The defaults really are untied and ungated: the checkpoint has lm_head and no g_proj.
  auto weights =
      assay::common::SafetensorsFile::open(scratch_root() / "spark-defaults" / "model.safetensors");
  CHECK(weights.find("lm_head.weight") != nullptr);
  CHECK(weights.find("model.layers.0.self_attn.g_proj.weight") == nullptr);
}

TEST_CASE("Spark2.5 refuses config values it does not implement, naming field and value") {
  fs::path out = scratch_root() / "spark-refused.safetensors";
  auto ids = std::vector<std::int64_t>{1, 2, 3};
  auto refused = [&](const std::string& name, const Json& settings, const std::string& code,
                     const std::string& needle) {
    CAPTURE(name);
    fs::path m = spark_variant(name, settings);
    expect_error(oracle_cmd(m, ids, out), out, code, needle);
  };
  refused("spark-gate-relu", {{"gate_attn_act_mode", "relu"}}, "model.unsupported",
          "gate_attn_act_mode = \"relu\"");
  refused("spark-act-silu", {{"hidden_act", "silu"}}, "model.unsupported", "hidden_act = \"silu\"");
  refused("spark-linear-layer",
          {{"layer_types",
            {"sliding_attention", "linear_attention", "sliding_attention", "full_attention"}}},
          "model.unsupported", "layer_types[1] = \"linear_attention\"");
  refused("spark-yarn",
          {{"rope_parameters",
            {{"sliding_attention", {{"rope_theta", 10000}}},
             {"full_attention", {{"rope_theta", 5000000}, {"rope_type", "yarn"}}}}}},
          "model.unsupported", "rope_type = \"yarn\"");
  refused("spark-odd-rotary",
          {{"rope_parameters",
            {{"sliding_attention", {{"partial_rotary_factor", 0.0625}}},
             {"full_attention", {{"partial_rotary_factor", 0.25}}}}}},
          "model.unsupported", "partial_rotary_factor = 0.0625");
  refused("spark-no-window", {{"sliding_window", nullptr}}, "model.bad_config", "sliding_window");
  refused("spark-layer-count", {{"layer_types", Json::array({"full_attention"})}},
          "model.bad_config", "layer_types must list 4");

  // Weights that disagree with the config's fields are refused by tensor name.
  fs::path m = copy_fixture("spark2_5", "spark-untied-without-head");
  edit_config(m, [](Json& c) { c["tie_word_embeddings"] = false; });
  expect_error(oracle_cmd(m, ids, out), out, "model.missing_tensor", "lm_head.weight");
  edit_config(m, [](Json& c) {
    c["tie_word_embeddings"] = true;
    c["attention_bias"] = true;
  });
  expect_error(oracle_cmd(m, ids, out), out, "model.missing_tensor",
               "model.layers.0.self_attn.q_k_v_proj.bias");
  edit_config(m, [](Json& c) {
    c["attention_bias"] = false;
    c["headwise_attn_output_gate"] = false;
  });
  expect_error(oracle_cmd(m, ids, out), out, "model.unexpected_tensor", "self_attn.g_proj.weight");

  // As in the remote code, gate_attn_act_mode is only read when the gate exists.
  fs::path ungated = spark_variant(
      "spark-ungated-relu", {{"headwise_attn_output_gate", false}, {"gate_attn_act_mode", "relu"}});
  Result r = run(oracle_cmd(ungated, ids, out), scratch_root());
  CHECK_MESSAGE(r.status == 0, r.err);
}

namespace {

fs::path write_input(const fs::path& workdir, const fs::path& model,
                     const std::vector<std::int64_t>& ids, const Json& candidates,
                     int threads = 1) {
  fs::create_directories(workdir);
  Json in = {{"schema", "assay.oracle-input.v1"},
             {"model_dir", model.string()},
             {"input_token_ids", ids},
             {"candidate_tokens", candidates},
             {"execution", {{"device", "cpu"}, {"dtype", "bfloat16"}, {"threads", threads}}}};
  assay::common::atomic_write_file(workdir / "input.json", in.dump());
  return workdir / "input.json";
}

// Python's json + jsonschema (Debian's python3-jsonschema) as the independent validator.
Result validate(const fs::path& document, const std::string& schema) {
  std::string script =
      "import json,sys,jsonschema; jsonschema.Draft202012Validator(json.load(open(sys.argv[1])))"
      ".validate(json.load(open(sys.argv[2])))";
  return run(kPython + " -c '" + script + "' " + (kSource / "schemas" / schema).string() + " " +
                 document.string(),
             scratch_root());
}

}  // namespace

TEST_CASE("next-token writes output.json and logits.safetensors that agree with the reference") {
  fs::path model = fixture("spark2_5");
  auto ids = token_ids(12, vocab_of(model), 17);
  Logits ref = reference(model, ids, "");
  std::int64_t best = 0;
  for (std::size_t v = 0; v < ref.values.size(); ++v) {
    if (ref.values[v] > ref.values[best]) best = static_cast<std::int64_t>(v);
  }
  std::string best_text = assay::oracle::load_tokenizer(model).decode_one(best);
  Json cands = {{{"engine", "kiln"}, {"token_id", best}, {"text", best_text + "x"}},
                {{"engine", "vllm"}, {"token_id", 104}, {"text", "h"}}};
  fs::path work = scratch_root() / "next-token";
  fs::path input = write_input(work, model, ids, cands);
  Result r = run(kOracle + " next-token --input " + input.string() + " --workdir " + work.string(),
                 scratch_root());
  CHECK(r.status == 2);
  CHECK_MESSAGE(r.err.find("[request.candidate_text_mismatch]") != std::string::npos, r.err);
  CHECK(r.err.find("kiln") != std::string::npos);
  CHECK_FALSE(fs::exists(work / "output.json"));

  cands[0]["text"] = best_text;
  write_input(work, model, ids, cands);
  r = run(kOracle + " next-token --input " + input.string() + " --workdir " + work.string(),
          scratch_root());
  REQUIRE_MESSAGE(r.status == 0, r.err);

  Json out = assay::common::parse_strict(assay::common::read_file(work / "output.json", 1 << 20));
  Result valid = validate(work / "output.json", "oracle-output.schema.json");
  CHECK_MESSAGE(valid.status == 0, valid.err);
  Result valid_in = validate(input, "oracle-input.schema.json");
  CHECK_MESSAGE(valid_in.status == 0, valid_in.err);

  Logits logits = read_logits(work / "logits.safetensors");
  CHECK(logits.bytes == ref.bytes);
  CHECK(out["argmax"] == best);
  CHECK(out["logits_sha256"] == assay::common::sha256_id(logits.bytes));
  CHECK(out["input_token_count"] == 12);
  CHECK(out["input_token_ids_sha256"] == assay::common::sha256_canonical_id(Json(ids)));
  CHECK(out["candidate_tokens"][0]["rank"] == 1);
  CHECK(out["candidate_tokens"][0]["is_argmax"] == true);
  CHECK(out["candidate_tokens"][1]["text"] == "h");
  CHECK(out["candidate_tokens"][1]["logit"] == static_cast<double>(ref.values[104]));
  std::int64_t greater = 0;
  for (float v : ref.values) greater += v > ref.values[104];
  CHECK(out["candidate_tokens"][1]["rank"] == 1 + greater);
  CHECK(out["top_tokens"].size() == 10);
  CHECK(out["top_tokens"][0]["token_id"] == best);
  for (std::size_t k = 1; k < out["top_tokens"].size(); ++k) {
    CHECK(out["top_tokens"][k - 1]["logit"].get<double>() >=
          out["top_tokens"][k]["logit"].get<double>());
  }
  CHECK(out["deterministic_algorithms"] == true);
  CHECK(out["tf32_allowed"] == false);
  CHECK(out["architecture"] == "Spark2_5ForCausalLM");
  CHECK(out["executable_sha256"] == assay::common::sha256_file_id(kOracle));

  // The file's metadata as Kiln's reference writer puts it, each value a fact of this run: the
  // torch label and HIP version as the same torch's Python package reports them.
  fs::path said = scratch_root() / "torch-label.txt";
  Result py =
      run(kPython + " -c 'import torch; print(torch.__version__); print(torch.version.hip)' >" +
              said.string(),
          scratch_root());
  REQUIRE_MESSAGE(py.status == 0, py.err);
  std::istringstream lines(assay::common::read_file(said, 4096));
  std::string label, hip;
  std::getline(lines, label);
  std::getline(lines, hip);
  auto file = assay::common::SafetensorsFile::open(work / "logits.safetensors");
  const auto& meta = file.metadata();
  auto value = [&](const std::string& key) {
    auto it = meta.find(key);
    return it == meta.end() ? std::string("(absent)") : it->second;
  };
  CHECK(value("schema") == "kiln.qwen35-hf-full-logits.v1");
  CHECK(value("attention_implementation") == "eager");
  CHECK(value("linear_attention_implementation") == out["linear_attention_implementation"]);
  CHECK(value("device_name") == out["device_name"]);
  CHECK(value("input_token_ids") == Json(ids).dump());
  CHECK(value("torch_version") == label);
  CHECK(value("torch_hip_version") == hip);
  CHECK(value("torch_commit") == out["runtime"]["torch"]["git_commit"]);
  CHECK(value("transformers_version") == "(absent)");  // no transformers ran
  CHECK(out["runtime"]["torch"]["hip_version"] == (hip == "None" ? Json() : Json(hip)));
}

TEST_CASE("next-token refuses a wrong candidate text before it reads the weights") {
  // Weights that cannot load: only a check made before the load can name the text.
  fs::path model = copy_fixture("llama", "unloadable");
  rewrite_safetensors(model / "model.safetensors", [](auto& ts) {
    std::erase_if(ts, [](const auto& t) { return t.name == "model.norm.weight"; });
  });
  auto ids = token_ids(6, vocab_of(model), 3);
  Json cands = {{{"engine", "kiln"}, {"token_id", 104}, {"text", "x"}},
                {{"engine", "vllm"}, {"token_id", 105}, {"text", "i"}}};
  fs::path work = scratch_root() / "text-before-load";
  fs::path input = write_input(work, model, ids, cands);
  Result r = run(kOracle + " next-token --input " + input.string() + " --workdir " + work.string(),
                 scratch_root());
  CHECK(r.status == 2);
  CHECK_MESSAGE(r.err.find("[request.candidate_text_mismatch]") != std::string::npos, r.err);
  CHECK(r.err.find("candidate_tokens[0] (kiln)") != std::string::npos);
  // The texts right: the load is reached, and fails on the weights.
  cands[0]["text"] = "h";
  write_input(work, model, ids, cands);
  r = run(kOracle + " next-token --input " + input.string() + " --workdir " + work.string(),
          scratch_root());
  CHECK(r.status == 2);
  CHECK_MESSAGE(r.err.find("[model.missing_tensor]") != std::string::npos, r.err);
}

// bytes_used: the digests of exactly the bytes the forward computed with.
namespace {

const std::string kFingerprint = ASSAY_FINGERPRINT_BIN;
const std::string kRunWithFds = ASSAY_RUN_WITH_FDS_BIN;

// {file name: [bytes, "sha256:..."]} of every file in `dir`, by Python's hashlib.
Json python_digests(const fs::path& dir) {
  fs::path out = scratch_root() / "digests.json";
  Result r = run(kPython +
                     " -c 'import hashlib,json,os,sys; d=sys.argv[1]; "
                     "print(json.dumps({n: [os.path.getsize(os.path.join(d, n)), \"sha256:\" + "
                     "hashlib.sha256(open(os.path.join(d, n), \"rb\").read()).hexdigest()] "
                     "for n in os.listdir(d)}))' " +
                     dir.string() + " >" + out.string(),
                 scratch_root());
  REQUIRE_MESSAGE(r.status == 0, r.err);
  return assay::common::parse_strict(assay::common::read_file(out, 1 << 20));
}

// bytes_used as the Python digests say it must be: every *.safetensors, sorted by name.
Json expected_bytes_used(const fs::path& dir, bool tokenizer) {
  Json d = python_digests(dir);
  Json weights = Json::array();
  for (const auto& [name, v] : d.items()) {  // nlohmann::json iterates keys sorted
    if (name.ends_with(".safetensors"))
      weights.push_back({{"path", name}, {"bytes", v[0]}, {"sha256", v[1]}});
  }
  return {{"weight_files", weights},
          {"config_hash", d["config.json"][1]},
          {"tokenizer_hash", tokenizer ? d["tokenizer.json"][1] : Json(nullptr)}};
}

Result validate_with_tool(const fs::path& document, const std::string& schema) {
  return run(kPython + " " + (kSource / "tests/tools/validate_schema.py").string() + " " +
                 (kSource / "schemas" / schema).string() + " " + document.string(),
             scratch_root());
}

Json read_json(const fs::path& p) {
  return assay::common::parse_strict(assay::common::read_file(p, 1 << 24));
}

Json two_candidates(const fs::path& model) {
  auto tok = assay::oracle::load_tokenizer(model);
  return {{{"engine", "kiln"}, {"token_id", 5}, {"text", tok.decode_one(5)}},
          {{"engine", "vllm"}, {"token_id", 6}, {"text", tok.decode_one(6)}}};
}

struct NextToken {
  Json out;
  std::string logits;  // raw F32 bytes of logits.safetensors' "logits"
};

// next-token on `model`, optionally through `prefix` (e.g. run_with_fds ... --); a fresh workdir.
Result next_token_run(const fs::path& work, const Json& input, const std::string& prefix = "") {
  fs::create_directories(work);
  assay::common::atomic_write_file(work / "input.json", input.dump());
  return run(prefix + kOracle + " next-token --input " + (work / "input.json").string() +
                 " --workdir " + work.string(),
             scratch_root());
}

Json next_token_input(const fs::path& model, const std::vector<std::int64_t>& ids) {
  return {{"schema", "assay.oracle-input.v1"},
          {"model_dir", model.string()},
          {"input_token_ids", ids},
          {"candidate_tokens", two_candidates(model)},
          {"execution", {{"device", "cpu"}, {"dtype", "bfloat16"}, {"threads", 1}}}};
}

Json capture_input(const fs::path& model, const std::vector<std::int64_t>& ids) {
  return {{"schema", "assay.oracle-capture-input.v1"},
          {"model_dir", model.string()},
          {"contexts", {{{"id", "c0"}, {"token_ids", ids}, {"positions", "all"}}}},
          {"block_positions", 4},
          {"execution", {{"device", "cpu"}, {"dtype", "bfloat16"}, {"threads", 1}}}};
}

NextToken next_token(const fs::path& model, const std::vector<std::int64_t>& ids,
                     const std::string& name) {
  fs::path work = scratch_root() / name;
  fs::remove_all(work);
  Result r = next_token_run(work, next_token_input(model, ids));
  REQUIRE_MESSAGE(r.status == 0, r.err);
  return {read_json(work / "output.json"), read_logits(work / "logits.safetensors").bytes};
}

}  // namespace

TEST_CASE("bytes_used equals Python's sha256 of the files and assay-fingerprint's identity") {
  for (int shards : {1, 3}) {
    CAPTURE(shards);
    fs::path model = fixture("llama", shards);
    auto ids = token_ids(9, vocab_of(model), 21);
    Json expected = expected_bytes_used(model, true);
    REQUIRE(expected["weight_files"].size() == static_cast<std::size_t>(shards));

    NextToken nt = next_token(model, ids, "bytes-next-token-" + std::to_string(shards));
    CHECK(nt.out["bytes_used"] == expected);
    fs::path work = scratch_root() / ("bytes-next-token-" + std::to_string(shards));
    Result valid = validate_with_tool(work / "output.json", "oracle-output.schema.json");
    CHECK_MESSAGE(valid.status == 0, valid.err);

    Result fp = run(kFingerprint + " --model " + model.string() + " --id m --out " +
                        (scratch_root() / "fp.json").string(),
                    scratch_root());
    REQUIRE_MESSAGE(fp.status == 0, fp.err);
    Json identity = read_json(scratch_root() / "fp.json")["model_identity"];
    for (const char* field : {"weight_files", "config_hash", "tokenizer_hash"}) {
      CAPTURE(field);
      CHECK(nt.out["bytes_used"][field] == identity[field]);
    }

    fs::path cap = scratch_root() / ("bytes-capture-" + std::to_string(shards));
    fs::remove_all(cap);
    fs::create_directories(cap);
    assay::common::atomic_write_file(cap / "input.json", capture_input(model, ids).dump());
    Result r = run(kOracle + " capture --input " + (cap / "input.json").string() + " --workdir " +
                       cap.string(),
                   scratch_root());
    REQUIRE_MESSAGE(r.status == 0, r.err);
    Json out = read_json(cap / "output.json");
    CHECK(out["bytes_used"] == expected_bytes_used(model, false));  // capture reads no tokenizer
    CHECK(out["bytes_used"]["weight_files"] == identity["weight_files"]);
    valid = validate_with_tool(cap / "output.json", "oracle-capture-output.schema.json");
    CHECK_MESSAGE(valid.status == 0, valid.err);
  }
}

TEST_CASE("a model.safetensors swapped in between runs: digests and logits both follow the bytes") {
  fs::path a = copy_fixture("llama", "swap-a");
  fs::path b = fixture("llama", 1, 8);  // same architecture and config, other weights
  auto ids = token_ids(11, vocab_of(a), 23);
  NextToken on_a = next_token(a, ids, "swap-run-a");
  NextToken on_b = next_token(b, ids, "swap-run-b");
  REQUIRE(on_a.out["bytes_used"]["weight_files"] != on_b.out["bytes_used"]["weight_files"]);
  REQUIRE(on_a.logits != on_b.logits);

  fs::copy_file(b / "model.safetensors", a / "incoming.tmp");
  fs::rename(a / "incoming.tmp", a / "model.safetensors");
  NextToken swapped = next_token(a, ids, "swap-run-a-again");
  CHECK(swapped.out["bytes_used"]["weight_files"] == on_b.out["bytes_used"]["weight_files"]);
  CHECK(swapped.out["bytes_used"]["config_hash"] == on_a.out["bytes_used"]["config_hash"]);
  CHECK(swapped.logits == on_b.logits);
  CHECK(swapped.out["logits_sha256"] == on_b.out["logits_sha256"]);
  CHECK(swapped.out["argmax"] == on_b.out["argmax"]);
}

TEST_CASE("renames racing the oracle never give one checkpoint's digest with another's logits") {
  fs::path a = copy_fixture("llama", "race");
  fs::path b = fixture("llama", 1, 8);
  auto ids = token_ids(11, vocab_of(a), 23);
  NextToken on_a = next_token(a, ids, "race-a");
  NextToken on_b = next_token(b, ids, "race-b");
  fs::path store = scratch_root() / "race-store";
  fs::create_directories(store);
  fs::copy_file(a / "model.safetensors", store / "a", fs::copy_options::overwrite_existing);
  fs::copy_file(b / "model.safetensors", store / "b", fs::copy_options::overwrite_existing);

  std::atomic<bool> stop{false};
  std::thread swapper([&] {
    for (int i = 0; !stop; ++i) {
      fs::path tmp = a / "incoming.tmp";
      fs::remove(tmp);
      fs::create_hard_link(store / (i % 2 ? "a" : "b"), tmp);
      fs::rename(tmp, a / "model.safetensors");
    }
  });
  int as_a = 0, as_b = 0;
  for (int run_index = 0; run_index < 4; ++run_index) {
    NextToken r = next_token(a, ids, "race-run");
    const Json& w = r.out["bytes_used"]["weight_files"];
    if (w == on_a.out["bytes_used"]["weight_files"]) {
      ++as_a;
      CHECK(r.logits == on_a.logits);
    } else {
      ++as_b;
      CHECK(w == on_b.out["bytes_used"]["weight_files"]);
      CHECK(r.logits == on_b.logits);
    }
  }
  stop = true;
  swapper.join();
  MESSAGE("racing runs: " << as_a << " computed with A, " << as_b << " with B");
}

namespace {

// A root-only (0700) copy of a fixture inside a directory others may traverse, and a workdir
// owned by uid 65534.
struct RootOnlyModel {
  fs::path top, model, work;
  std::vector<std::string> names;  // every file of the model, the order the fds are placed in
  explicit RootOnlyModel(const std::string& name, int shards) {
    top = scratch_root().parent_path() /
          ("assay-oracle-fds-" + std::to_string(::getpid()) + "-" + name);
    fs::remove_all(top);
    fs::create_directories(top);
    fs::permissions(top, fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec);
    model = top / "model";
    fs::copy(fixture("llama", shards), model);
    fs::permissions(model, fs::perms::owner_all);
    for (const auto& e : fs::directory_iterator(model)) names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
    work = top / "work";
    fs::create_directories(work);
    REQUIRE(::chown(work.c_str(), 65534, 65534) == 0);
  }
  ~RootOnlyModel() { fs::remove_all(top); }
  Json model_fds(const std::string& except = "") const {
    Json fds = Json::array();
    int fd = 3;
    for (const auto& n : names)
      if (n != except) fds.push_back({{"name", n}, {"fd", fd++}});
    return fds;
  }
  // run_with_fds as uid 65534 with the files of `model_fds` opened in its order.
  std::string as_nobody(const Json& fds) const {
    std::string cmd = kRunWithFds + " --uid 65534 --gid 65534";
    for (const auto& f : fds) cmd += " --open " + (model / f["name"].get<std::string>()).string();
    return cmd + " -- ";
  }
};

}  // namespace

TEST_CASE("the oracle reads a root-only model through passed fds as nobody, and fails by path") {
  if (::geteuid() != 0) {
    MESSAGE("skipped: needs root to make a root-only directory and to drop to uid 65534");
    return;
  }
  RootOnlyModel m("next-token", 3);
  auto ids = token_ids(9, vocab_of(m.model), 21);
  NextToken by_root = next_token(m.model, ids, "fds-by-root");

  Json input = next_token_input(m.model, ids);
  input["model_fds"] = m.model_fds();
  Result r = next_token_run(m.work, input, m.as_nobody(input["model_fds"]));
  REQUIRE_MESSAGE(r.status == 0, r.err);
  Json out = read_json(m.work / "output.json");
  CHECK(out["bytes_used"] == by_root.out["bytes_used"]);
  CHECK(read_logits(m.work / "logits.safetensors").bytes == by_root.logits);
  Result valid = validate_with_tool(m.work / "input.json", "oracle-input.schema.json");
  CHECK_MESSAGE(valid.status == 0, valid.err);

  // Capture mode through the same kind of descriptors.
  Json cap = capture_input(m.model, ids);
  cap["model_fds"] = m.model_fds();
  assay::common::atomic_write_file(m.work / "capture.json", cap.dump());
  r = run(m.as_nobody(cap["model_fds"]) + kOracle + " capture --input " +
              (m.work / "capture.json").string() + " --workdir " + m.work.string(),
          scratch_root());
  REQUIRE_MESSAGE(r.status == 0, r.err);
  CHECK(read_json(m.work / "output.json")["bytes_used"]["weight_files"] ==
        by_root.out["bytes_used"]["weight_files"]);
  valid = validate_with_tool(m.work / "capture.json", "oracle-capture-input.schema.json");
  CHECK_MESSAGE(valid.status == 0, valid.err);

  // Without model_fds the oracle has to open the paths, which nobody cannot.
  fs::remove(m.work / "output.json");
  input.erase("model_fds");
  r = next_token_run(m.work, input, m.as_nobody(Json::array()));
  CHECK(r.status == 2);
  CHECK_MESSAGE(r.err.find("[fs.open]: open directory " + m.model.string() +
                           ": Permission denied") != std::string::npos,
                r.err);
  CHECK_FALSE(fs::exists(m.work / "output.json"));

  // A needed file that was not passed is an error naming it.
  input["model_fds"] = m.model_fds("model-00002-of-00003.safetensors");
  r = next_token_run(m.work, input, m.as_nobody(input["model_fds"]));
  CHECK(r.status == 2);
  CHECK_MESSAGE(r.err.find("[model.missing_fd]") != std::string::npos, r.err);
  CHECK_MESSAGE(r.err.find("model-00002-of-00003.safetensors") != std::string::npos, r.err);
  CHECK_FALSE(fs::exists(m.work / "output.json"));
}
