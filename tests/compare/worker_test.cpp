// The assay-compare binary: worker protocol, its documents and artifact, its refusals, and the
// kl command.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "common/fidelity.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/json.h"
#include "common/safetensors.h"
#include "tests/compare/util.h"

namespace assay::compare::test {
namespace {

using common::Json;

const std::string kBin = ASSAY_COMPARE_BIN;

CommandResult validate(const std::string& schema, const fs::path& doc) {
  return run_command(std::string(ASSAY_PYTHON3) + " " + ASSAY_SOURCE_DIR +
                     "/tests/tools/validate_schema.py " + ASSAY_SOURCE_DIR + "/schemas/" + schema +
                     " " + quote(doc.string()) + " 2>&1");
}

// Runs the worker in `work` (stderr captured with stdout).
CommandResult run_worker(const fs::path& work, const Json& input) {
  common::atomic_write_file(work / "input.json", input.dump(2));
  return run_command("cd " + quote(work.string()) + " && " + kBin +
                     " run --input input.json --workdir . 2>&1");
}

Json read_json(const fs::path& p) {
  return common::parse_strict(common::read_file(p, 64 << 20));
}

Json file_ref(const fs::path& p, Json sha = nullptr) {
  return {{"path", p.string()}, {"sha256", sha}};
}

Json context(const std::string& id, Json positions, const fs::path& ref, const fs::path& cand,
             std::optional<fs::path> repro = std::nullopt) {
  Json c = {{"id", id},
            {"positions", std::move(positions)},
            {"reference", file_ref(ref)},
            {"candidate", file_ref(cand)}};
  if (repro) c["reproduction"] = file_ref(*repro);
  return c;
}

Json input_doc(std::int64_t vocab, Json contexts) {
  return {{"schema", "assay.compare-input.v1"},
          {"vocab_size", vocab},
          {"kl_file", "kl.safetensors"},
          {"contexts", std::move(contexts)}};
}

std::vector<double> f64_tensor(const common::SafetensorsFile& f, const std::string& name) {
  const common::TensorView* t = f.find(name);
  REQUIRE(t);
  REQUIRE(t->dtype == common::Dtype::kF64);
  std::vector<double> v(static_cast<std::size_t>(t->numel()));
  std::memcpy(v.data(), t->data, t->nbytes);
  return v;
}

std::vector<std::int64_t> i64_tensor(const common::SafetensorsFile& f, const std::string& name) {
  const common::TensorView* t = f.find(name);
  REQUIRE(t);
  REQUIRE(t->dtype == common::Dtype::kI64);
  std::vector<std::int64_t> v(static_cast<std::size_t>(t->numel()));
  std::memcpy(v.data(), t->data, t->nbytes);
  return v;
}

std::string tensor_sha(const fs::path& p) {
  auto f = common::SafetensorsFile::open(p);
  const common::TensorView& t = f.tensors().front();
  return common::sha256_id(t.data, t.nbytes);
}

void check_schemas(const fs::path& work) {
  auto in = validate("compare-input.schema.json", work / "input.json");
  INFO(in.out);
  CHECK(in.status == 0);
  auto out = validate("compare-output.schema.json", work / "output.json");
  INFO(out.out);
  CHECK(out.status == 0);
}

constexpr std::size_t kVocab = 1001;

TEST_CASE("a candidate equal to the reference gives exactly 0.0 everywhere and top-1 1.0") {
  for (common::Dtype dtype : {common::Dtype::kF32, common::Dtype::kBF16}) {
    TempDir d;
    fs::create_directory(d / "work");
    auto a = bf16_exact(random_logits(18, kVocab, 1));
    auto b = bf16_exact(random_logits(4, kVocab, 2));
    write_logits(d / "ref0.safetensors", a, 18, kVocab, dtype);
    write_logits(d / "cand0.safetensors", a, 18, kVocab, dtype);
    write_logits(d / "ref1.safetensors", b, 4, kVocab, dtype);
    write_logits(d / "cand1.safetensors", b, 4, kVocab, dtype);
    Json input = input_doc(kVocab, {context("c0", Json::parse("[[0, 17], [40, 41]]"),
                                            d / "ref0.safetensors", d / "cand0.safetensors"),
                                    context("c1", Json::parse("[[3, 7]]"), d / "ref1.safetensors",
                                            d / "cand1.safetensors")});
    auto r = run_worker(d / "work", input);
    INFO(r.out);
    REQUIRE(r.status == 0);
    check_schemas(d / "work");
    Json out = read_json(d / "work" / "output.json");
    CHECK(out["schema"] == "assay.compare-output.v1");
    CHECK(out["positions"] == 22);
    CHECK(out["vocab_size"] == kVocab);
    for (const char* k : {"mean", "median", "p95", "p99", "p99_9", "max", "min"})
      CHECK(out["metrics"]["kl"][k].get<double>() == 0.0);
    CHECK(out["metrics"]["top1_agreement"] == 1.0);
    CHECK(out["metrics"]["top1_agree_count"] == 22);
    CHECK(out["metrics"]["max_at"] == Json{{"context", "c0"}, {"position", 0}});
    CHECK(out["histogram"]["zero"] == 22);
    CHECK(out["reproduction"].is_null());
    const std::string dname = dtype == common::Dtype::kF32 ? "F32" : "BF16";
    CHECK(out["contexts"][0]["candidate_dtype"] == dname);
    CHECK(out["contexts"][1]["positions"] == 4);
    CHECK(out["contexts"][0]["reference_sha256"] == tensor_sha(d / "ref0.safetensors"));
    CHECK(out["contexts"][0]["candidate_sha256"] == out["contexts"][0]["reference_sha256"]);
    // A whole-file digest only for files whose sha256 the input names (none here).
    CHECK(out["contexts"][1]["reference_file_sha256"].is_null());
    CHECK(out["contexts"][1]["candidate_file_sha256"].is_null());
    CHECK(out["kl_file"] == "kl.safetensors");
    CHECK(out["kl_file_sha256"] == common::sha256_file_id(d / "work" / "kl.safetensors"));

    auto kl = common::SafetensorsFile::open(d / "work" / "kl.safetensors");
    CHECK(kl.metadata().at("schema") == "assay.fidelity-kl.v1");
    CHECK(kl.metadata().at("contexts") == R"(["c0","c1"])");
    for (double v : f64_tensor(kl, "kl")) CHECK(v == 0.0);
    CHECK(i64_tensor(kl, "position") == std::vector<std::int64_t>{0,  1,  2,  3,  4,  5,  6,  7,
                                                                  8,  9,  10, 11, 12, 13, 14, 15,
                                                                  16, 40, 3,  4,  5,  6});
    auto ctx = i64_tensor(kl, "context_index");
    CHECK(std::count(ctx.begin(), ctx.end(), 1) == 4);
    CHECK(i64_tensor(kl, "reference_argmax") == i64_tensor(kl, "candidate_argmax"));
    CHECK(kl.find("reproduction_kl") == nullptr);
  }
}

TEST_CASE("one perturbed position is the max and shows in p99.9; every other stays exactly 0") {
  TempDir d;
  fs::create_directory(d / "work");
  auto a = random_logits(300, kVocab, 3);
  auto b = random_logits(200, kVocab, 4);
  auto b_cand = b;
  // Context c1, row 57 = position 100 + 57: a different distribution there.
  for (std::size_t j = 0; j < kVocab; ++j) b_cand[57 * kVocab + j] += 0.1f * (j % 13);
  write_logits(d / "ref0.safetensors", a, 300, kVocab);
  write_logits(d / "cand0.safetensors", a, 300, kVocab, common::Dtype::kF32);
  write_logits(d / "ref1.safetensors", b, 200, kVocab);
  write_logits(d / "cand1.safetensors", b_cand, 200, kVocab);
  Json input = input_doc(kVocab, {context("c0", Json::parse("[[0, 300]]"), d / "ref0.safetensors",
                                          d / "cand0.safetensors"),
                                  context("c1", Json::parse("[[100, 300]]"), d / "ref1.safetensors",
                                          d / "cand1.safetensors")});
  auto r = run_worker(d / "work", input);
  INFO(r.out);
  REQUIRE(r.status == 0);
  check_schemas(d / "work");
  Json out = read_json(d / "work" / "output.json");
  const Json& m = out["metrics"];
  const double max = m["kl"]["max"].get<double>();
  CHECK(max > 1e-3);
  CHECK(m["max_at"] == Json{{"context", "c1"}, {"position", 157}});
  // 500 positions: p99.9 interpolates between the last two sorted values, p99 does not reach.
  CHECK(m["kl"]["p99_9"].get<double>() == doctest::Approx(max * (1 - 0.001 * 499)));
  CHECK(m["kl"]["p99_9"].get<double>() > 0);
  CHECK(m["kl"]["p99"].get<double>() == 0.0);
  CHECK(m["kl"]["median"].get<double>() == 0.0);
  CHECK(m["kl"]["min"].get<double>() == 0.0);
  CHECK(m["kl"]["mean"].get<double>() == doctest::Approx(max / 500).epsilon(1e-12));
  CHECK(out["contexts"][0]["kl"]["max"].get<double>() == 0.0);
  CHECK(out["contexts"][1]["kl"]["max"].get<double>() == max);
  CHECK(out["histogram"]["zero"] == 499);

  auto kl = common::SafetensorsFile::open(d / "work" / "kl.safetensors");
  auto v = f64_tensor(kl, "kl");
  auto pos = i64_tensor(kl, "position");
  auto ctx = i64_tensor(kl, "context_index");
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (ctx[i] == 1 && pos[i] == 157)
      CHECK(v[i] == max);
    else
      CHECK(v[i] == 0.0);
  }
}

TEST_CASE("a reproduction with the same bytes is confirmed; one changed bit is not") {
  TempDir d;
  fs::create_directory(d / "work");
  auto a = random_logits(10, kVocab, 5);
  write_logits(d / "ref.safetensors", a, 10, kVocab);
  write_logits(d / "again.safetensors", a, 10, kVocab);
  auto cand = a;
  for (float& x : cand) x *= 1.01f;
  write_logits(d / "cand.safetensors", cand, 10, kVocab);
  auto input = input_doc(kVocab, {context("c0", Json::parse("[[0, 10]]"), d / "ref.safetensors",
                                          d / "cand.safetensors", d / "again.safetensors")});
  auto r = run_worker(d / "work", input);
  INFO(r.out);
  REQUIRE(r.status == 0);
  check_schemas(d / "work");
  Json out = read_json(d / "work" / "output.json");
  CHECK(out["reproduction"]["confirmed"] == true);
  CHECK(out["reproduction"]["digests_equal"] == true);
  CHECK(out["reproduction"]["kl"]["max"] == 0.0);
  CHECK(out["reproduction"]["top1_agreement"] == 1.0);
  CHECK(out["contexts"][0]["reproduction"]["digest_equal"] == true);
  CHECK(out["contexts"][0]["reproduction"]["sha256"] == out["contexts"][0]["reference_sha256"]);
  CHECK(out["metrics"]["kl"]["min"].get<double>() > 0);
  auto kl = common::SafetensorsFile::open(d / "work" / "kl.safetensors");
  for (double v : f64_tensor(kl, "reproduction_kl")) CHECK(v == 0.0);

  auto changed = a;
  std::uint32_t u;
  std::memcpy(&u, &changed[5 * kVocab + 3], 4);
  u ^= 1;  // one ulp
  std::memcpy(&changed[5 * kVocab + 3], &u, 4);
  write_logits(d / "again.safetensors", changed, 10, kVocab);
  r = run_worker(d / "work", input);
  INFO(r.out);
  REQUIRE(r.status == 0);
  check_schemas(d / "work");
  out = read_json(d / "work" / "output.json");
  CHECK(out["reproduction"]["confirmed"] == false);
  CHECK(out["reproduction"]["digests_equal"] == false);
  CHECK(out["contexts"][0]["reproduction"]["digest_equal"] == false);
}

TEST_CASE("a file with one tensor of another name is read; a matching sha256 is accepted") {
  TempDir d;
  fs::create_directory(d / "work");
  auto a = random_logits(3, kVocab, 6);
  write_logits(d / "ref.safetensors", a, 3, kVocab, common::Dtype::kF32, "output");
  write_logits(d / "cand.safetensors", a, 3, kVocab, common::Dtype::kBF16, "x");
  Json c = context("c0", Json::parse("[[0, 3]]"), d / "ref.safetensors", d / "cand.safetensors");
  c["candidate"]["sha256"] = common::sha256_file_id(d / "cand.safetensors");
  auto r = run_worker(d / "work", input_doc(kVocab, {c}));
  INFO(r.out);
  REQUIRE(r.status == 0);
  Json out = read_json(d / "work" / "output.json");
  CHECK(out["contexts"][0]["candidate_file_sha256"] == c["candidate"]["sha256"]);
  CHECK(out["contexts"][0]["candidate_dtype"] == "BF16");
  CHECK(out["metrics"]["kl"]["max"].get<double>() > 0);  // bf16 rounding of the same values
}

// A refusal: the file set up by `setup` in `d`, the input it returns, the code and the words.
struct Refusal {
  std::string name;
  std::function<Json(const TempDir&)> setup;
  std::string code;
  std::vector<std::string> named;
  // Files in `d` whose sha256 the error must not tell (the submitter may not be allowed to read
  // what the path led to).
  std::vector<std::string> digest_untold = {};
};

std::string header_file(const std::string& header, std::size_t data_bytes) {
  std::string s(8, '\0');
  std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(n >> (8 * i));
  return s + header + std::string(data_bytes, '\0');
}

TEST_CASE("bad inputs fail with exit 2 and a code naming the value, leaving no output behind") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  auto good = random_logits(10, kVocab, 7);
  // Reference and candidate, each [10, kVocab] F32 unless changed by `cand`.
  auto standard = [&](const TempDir& d, const std::function<void(const fs::path&)>& cand) {
    write_logits(d / "ref.safetensors", good, 10, kVocab);
    cand(d / "cand.safetensors");
    return input_doc(kVocab, {context("c0", Json::parse("[[0, 4], [20, 26]]"),
                                      d / "ref.safetensors", d / "cand.safetensors")});
  };
  auto with_values = [&](std::size_t index, float value, common::Dtype dtype) {
    return [=, &good](const fs::path& p) {
      auto v = good;
      v[index] = value;
      if (dtype == common::Dtype::kBF16) {
        std::vector<std::uint16_t> h;
        for (float f : v) h.push_back(to_bf16(f));
        h[index] = 0x7fc0;  // the canonical bf16 NaN
        common::write_safetensors(
            p, {{"logits", dtype, {10, kVocab}, std::as_bytes(std::span<const std::uint16_t>(h))}});
      } else {
        write_logits(p, v, 10, kVocab, dtype);
      }
    };
  };
  const std::vector<Refusal> refusals = {
      {"vocab mismatch",
       [&](const TempDir& d) {
         return standard(
             d, [&](const fs::path& p) { write_logits(p, random_logits(10, 1000, 8), 10, 1000); });
       },
       "compare.vocab_mismatch",
       {"1000 columns", "vocab_size is 1001", "cand.safetensors", "'c0'"}},
      {"wrong row count",
       [&](const TempDir& d) {
         return standard(d, [&](const fs::path& p) {
           write_logits(p, random_logits(9, kVocab, 8), 9, kVocab);
         });
       },
       "compare.bad_shape",
       {"9 rows", "10 positions", "cand.safetensors"}},
      {"rank 1",
       [&](const TempDir& d) {
         return standard(d, [&](const fs::path& p) {
           std::vector<float> v(10 * kVocab, 0.0f);
           common::write_safetensors(p, {{"logits",
                                          common::Dtype::kF32,
                                          {10 * kVocab},
                                          std::as_bytes(std::span<const float>(v))}});
         });
       },
       "compare.bad_shape",
       {"[10010]"}},
      {"sha mismatch",
       [&](const TempDir& d) {
         Json in = standard(d, [&](const fs::path& p) { write_logits(p, good, 10, kVocab); });
         in["contexts"][0]["candidate"]["sha256"] = common::sha256_id("something else");
         return in;
       },
       "compare.sha_mismatch",
       {common::sha256_id("something else"), "cand.safetensors", "differs"},
       {"cand.safetensors"}},
      {"NaN in the candidate",
       [&](const TempDir& d) {
         return standard(d, with_values(3 * kVocab + 17, nan, common::Dtype::kF32));
       },
       "compare.non_finite",
       {"candidate logits", "row 3 (position 3)", "column 17", "NaN", "never clamped"}},
      {"+Inf in the candidate, second range",
       [&](const TempDir& d) {
         return standard(d, with_values(5 * kVocab + 1000, inf, common::Dtype::kF32));
       },
       "compare.non_finite",
       {"row 5 (position 21)", "column 1000", "+Inf"}},
      {"-Inf in the reference",
       [&](const TempDir& d) {
         Json in = standard(d, [&](const fs::path& p) { write_logits(p, good, 10, kVocab); });
         with_values(9 * kVocab, -inf, common::Dtype::kF32)(d / "ref.safetensors");
         return in;
       },
       "compare.non_finite",
       {"reference logits", "row 9 (position 25)", "column 0", "-Inf"}},
      {"BF16 NaN",
       [&](const TempDir& d) {
         return standard(d, with_values(2 * kVocab + 5, 0, common::Dtype::kBF16));
       },
       "compare.non_finite",
       {"row 2 (position 2)", "column 5", "NaN"}},
      {"missing tensor",
       [&](const TempDir& d) {
         return standard(d, [&](const fs::path& p) {
           std::vector<float> v(4, 0.0f);
           auto bytes = std::as_bytes(std::span<const float>(v));
           common::write_safetensors(p, {{"alpha", common::Dtype::kF32, {4}, bytes},
                                         {"beta", common::Dtype::kF32, {4}, bytes}});
         });
       },
       "compare.missing_tensor",
       {"\"logits\"", "\"alpha\"", "\"beta\""}},
      {"F16",
       [&](const TempDir& d) {
         return standard(d, [&](const fs::path& p) {
           std::vector<std::uint16_t> v(10 * kVocab, 0);
           common::write_safetensors(p, {{"logits",
                                          common::Dtype::kF16,
                                          {10, kVocab},
                                          std::as_bytes(std::span<const std::uint16_t>(v))}});
         });
       },
       "compare.bad_dtype",
       {"F16", "not F32 or BF16"}},
      {"I64",
       [&](const TempDir& d) {
         return standard(d, [&](const fs::path& p) {
           std::vector<std::int64_t> v(10 * kVocab, 0);
           common::write_safetensors(p, {{"logits",
                                          common::Dtype::kI64,
                                          {10, kVocab},
                                          std::as_bytes(std::span<const std::int64_t>(v))}});
         });
       },
       "compare.bad_dtype",
       {"I64"}},
      {"truncated file",
       [&](const TempDir& d) {
         return standard(d, [&](const fs::path& p) {
           write_logits(p, good, 10, kVocab);
           fs::resize_file(p, fs::file_size(p) - 4);
         });
       },
       "compare.bad_file",
       {"cand.safetensors", "past the data section"}},
      {"hostile header length",
       [&](const TempDir& d) {
         return standard(d, [&](const fs::path& p) {
           std::string s = header_file("{}", 0);
           s[7] = '\x7f';  // header length ~ 2^63
           common::atomic_write_file(p, s);
         });
       },
       "compare.bad_file",
       {"header length"}},
      {"offsets past the end",
       [&](const TempDir& d) {
         return standard(d, [&](const fs::path& p) {
           common::atomic_write_file(
               p,
               header_file(
                   R"({"logits":{"dtype":"F32","shape":[10,1001],"data_offsets":[0,40040]}})", 16));
         });
       },
       "compare.bad_file",
       {"cand.safetensors"}},
      {"empty file",
       [&](const TempDir& d) {
         return standard(d, [&](const fs::path& p) { common::atomic_write_file(p, ""); });
       },
       "compare.bad_file",
       {"is empty"}},
      {"missing file",
       [&](const TempDir& d) { return standard(d, [](const fs::path&) {}); },
       "compare.bad_file",
       {"cand.safetensors", "cannot open"}},
      {"unknown input field",
       [&](const TempDir& d) {
         Json in = standard(d, [&](const fs::path& p) { write_logits(p, good, 10, kVocab); });
         in["contexts"][0]["temperature"] = 1.0;
         return in;
       },
       "input.invalid",
       {"unknown field \"temperature\""}},
      {"not JSON",
       [&](const TempDir& d) {
         common::atomic_write_file(d / "work" / "input.json", "{\"schema\":");
         return Json();  // input.json as written
       },
       "input.invalid",
       {"input.json"}},
  };
  for (const Refusal& c : refusals) {
    TempDir d;
    fs::create_directory(d / "work");
    Json input = c.setup(d);
    CommandResult r;
    if (input.is_null())
      r = run_command("cd " + quote((d / "work").string()) + " && " + kBin +
                      " run --input input.json --workdir . 2>&1");
    else
      r = run_worker(d / "work", input);
    CAPTURE(c.name);
    CAPTURE(r.out);
    CHECK(r.status == 2);
    CHECK(contains(r.out, "assay-compare: error [" + c.code + "]: "));
    for (const std::string& word : c.named) CHECK(contains(r.out, word));
    for (const std::string& file : c.digest_untold)
      CHECK_FALSE(contains(r.out, common::sha256_file_id(d / file).substr(7)));
    CHECK(!fs::exists(d / "work" / "output.json"));
    CHECK(!fs::exists(d / "work" / "kl.safetensors"));
    std::size_t entries = 0;
    for ([[maybe_unused]] const auto& e : fs::directory_iterator(d / "work")) ++entries;
    CHECK(entries == 1);  // input.json only: no temp files either
  }
}

TEST_CASE("kl compares two files directly and prints the same metrics as the worker") {
  TempDir d;
  fs::create_directory(d / "work");
  auto a = random_logits(12, kVocab, 9);
  auto b = a;
  for (std::size_t i = 0; i < b.size(); i += 7) b[i] += 1.0f;
  write_logits(d / "ref.safetensors", a, 12, kVocab);
  write_logits(d / "cand.safetensors", b, 12, kVocab, common::Dtype::kBF16);
  auto w = run_worker(
      d / "work", input_doc(kVocab, {context("c0", Json::parse("[[0, 12]]"), d / "ref.safetensors",
                                             d / "cand.safetensors")}));
  REQUIRE(w.status == 0);
  Json worker = read_json(d / "work" / "output.json");

  auto r = run_command(kBin + " kl --reference " + quote((d / "ref.safetensors").string()) +
                       " --candidate " + quote((d / "cand.safetensors").string()) +
                       " --json --kl-file " + quote((d / "k.safetensors").string()) + " 2>&1");
  INFO(r.out);
  REQUIRE(r.status == 0);
  Json out = common::parse_strict(r.out);
  CHECK(out["metrics"] == worker["metrics"]);
  CHECK(out["contexts"][0]["kl"] == worker["contexts"][0]["kl"]);
  CHECK(out["kl_file"] == (d / "k.safetensors").string());
  CHECK(out["kl_file_sha256"] == worker["kl_file_sha256"]);
  CHECK(common::sha256_file_id(d / "k.safetensors") == worker["kl_file_sha256"]);
  common::atomic_write_file(d / "kl.json", r.out);
  auto v = validate("compare-output.schema.json", d / "kl.json");
  INFO(v.out);
  CHECK(v.status == 0);

  auto human = run_command(kBin + " kl --reference " + quote((d / "ref.safetensors").string()) +
                           " --candidate " + quote((d / "cand.safetensors").string()) + " 2>&1");
  CHECK(human.status == 0);
  CHECK(contains(human.out, "positions 12, vocab 1001"));
  CHECK(contains(human.out, "top-1 agreement"));
  CHECK(contains(human.out, "p99_9"));

  auto nod = run_command(kBin + " kl --no-digests --json --reference " +
                         quote((d / "ref.safetensors").string()) + " --candidate " +
                         quote((d / "cand.safetensors").string()) + " 2>&1");
  REQUIRE(nod.status == 0);
  Json no_digests = common::parse_strict(nod.out);
  CHECK(no_digests["contexts"][0]["reference_sha256"].is_null());
  CHECK(no_digests["metrics"] == worker["metrics"]);

  auto bad = run_command(kBin + " kl --reference " + quote((d / "missing").string()) +
                         " --candidate " + quote((d / "cand.safetensors").string()) + " 2>&1");
  CHECK(bad.status == 2);
  CHECK(contains(bad.out, "[compare.bad_file]"));
}

TEST_CASE(
    "kl takes the shape from the reference's header; a reference it cannot use fails by name") {
  TempDir d;
  auto a = random_logits(3, 40, 21);
  auto b = random_logits(3, 40, 22);
  write_logits(d / "cand.safetensors", b, 3, 40);
  auto kl = [&](const fs::path& ref) {
    return run_command(kBin + " kl --json --no-digests --reference " + quote(ref.string()) +
                       " --candidate " + quote((d / "cand.safetensors").string()) + " 2>&1");
  };
  // "logits" among other tensors (the header names several): that one is compared.
  std::vector<float> other(7, 1.0f);
  common::write_safetensors(
      d / "several.safetensors",
      {{"logits", common::Dtype::kF32, {3, 40}, std::as_bytes(std::span<const float>(a))},
       {"zeta", common::Dtype::kF32, {7}, std::as_bytes(std::span<const float>(other))}});
  write_logits(d / "plain.safetensors", a, 3, 40);
  auto several = kl(d / "several.safetensors");
  auto plain = kl(d / "plain.safetensors");
  INFO(several.out);
  REQUIRE(several.status == 0);
  REQUIRE(plain.status == 0);
  Json s = common::parse_strict(several.out), p = common::parse_strict(plain.out);
  CHECK(s["positions"] == 3);
  CHECK(s["vocab_size"] == 40);
  CHECK(s["metrics"] == p["metrics"]);

  // A header that reads well but data cut short: the full validation still refuses it.
  std::string image = common::read_file(d / "plain.safetensors", 1 << 20);
  common::atomic_write_file(d / "short.safetensors", image.substr(0, image.size() - 4));
  auto cut = kl(d / "short.safetensors");
  CHECK(cut.status == 2);
  CHECK(contains(cut.out, "[compare.bad_file]"));
  CHECK(contains(cut.out, "reference logits"));
  // Three dimensions, two tensors and no "logits", a header that is no JSON: as without the probe.
  common::write_safetensors(
      d / "cube.safetensors",
      {{"logits", common::Dtype::kF32, {3, 4, 10}, std::as_bytes(std::span<const float>(a))}});
  auto cube = kl(d / "cube.safetensors");
  CHECK(cube.status == 2);
  CHECK(contains(cube.out, "[compare.bad_shape]"));
  CHECK(contains(cube.out, "has shape [3, 4, 10], expected [positions >= 1, vocab in 1..2^24]"));
  common::write_safetensors(
      d / "two.safetensors",
      {{"x", common::Dtype::kF32, {3, 40}, std::as_bytes(std::span<const float>(a))},
       {"y", common::Dtype::kF32, {7}, std::as_bytes(std::span<const float>(other))}});
  auto two = kl(d / "two.safetensors");
  CHECK(two.status == 2);
  CHECK(contains(two.out, "[compare.missing_tensor]"));
  std::string garbled = image;
  garbled[8] = '[';
  common::atomic_write_file(d / "garbled.safetensors", garbled);
  auto g = kl(d / "garbled.safetensors");
  CHECK(g.status == 2);
  CHECK(contains(g.out, "[compare.bad_file]"));
}

TEST_CASE("--help works everywhere and a usage error exits 2") {
  for (const char* args : {" --help", " run --help", " kl --help"}) {
    auto r = run_command(kBin + args + " 2>&1");
    CAPTURE(args);
    CHECK(r.status == 0);
    CHECK(contains(r.out, "Usage"));
  }
  CHECK(run_command(kBin + " run --input x.json 2>&1").status == 2);  // no --workdir
  CHECK(run_command(kBin + " 2>&1").status == 2);
}

TEST_CASE(
    "a self-comparison with a reproduction: every statistic exact, gates decided by compare hold") {
  TempDir d;
  fs::create_directory(d / "work");
  auto a = random_logits(12, kVocab, 7);
  write_logits(d / "ref.safetensors", a, 12, kVocab);
  write_logits(d / "cand.safetensors", a, 12, kVocab);
  write_logits(d / "again.safetensors", a, 12, kVocab);
  Json c = context("c0", Json::parse("[[0, 12]]"), d / "ref.safetensors", d / "cand.safetensors",
                   d / "again.safetensors");
  std::vector<std::int64_t> tokens;
  for (std::int64_t i = 0; i < 12; ++i) tokens.push_back((i * 97) % 1001);
  c["token_ids"] = tokens;
  Json input = input_doc(kVocab, {c});
  input["thresholds"] = {{"max_mean_kl", 0.0}, {"min_top1_agreement", 1.0}, {"max_ppl_ratio", 1.0}};
  auto r = run_worker(d / "work", input);
  INFO(r.out);
  REQUIRE(r.status == 0);
  check_schemas(d / "work");
  Json out = read_json(d / "work" / "output.json");
  CHECK(out["comparison_kind"] == "reproduction_confirmation");
  CHECK(out["metric"]["name"] == "mean_tokenwise_kld");
  CHECK(out["metric"]["value"] == 0.0);
  CHECK(out["scope"]["next_token_positions"] == 11);  // the last position's next token is unknown
  CHECK(out["scope"]["position_filter"] == "all");
  CHECK(out["comparator"]["estimator_sha256"] == common::sha256_file_id(ASSAY_COMPARE_BIN));
  const Json& s = out["statistics"];
  for (const char* k : {"mean", "standard_error", "max", "p99_9", "median", "p0_1", "min"})
    CHECK(s["kl"][k] == 0.0);
  CHECK(s["same_top"] ==
        Json{{"n", 12}, {"count", 12}, {"fraction", 1.0}, {"standard_error", 0.0}});
  for (const char* side : {"delta_p_top", "delta_p_next"}) {
    CHECK(s[side]["mean"] == 0.0);
    CHECK(s[side]["rms"] == 0.0);
    CHECK(s[side]["rms_standard_error"].is_null());  // undefined at rms 0
    CHECK(s[side]["max"] == 0.0);
    CHECK(s[side]["min"] == 0.0);
  }
  CHECK(s["delta_p_next"]["n"] == 11);
  const Json& ppl = s["perplexity"];
  CHECK(ppl["tokens"] == 11);
  CHECK(ppl["reference"] == ppl["candidate"]);
  CHECK(ppl["ln_ratio"] == Json{{"value", 0.0}, {"standard_error", 0.0}});
  CHECK(ppl["ratio"] == Json{{"value", 1.0}, {"standard_error", 0.0}});
  CHECK(ppl["difference"]["value"] == 0.0);
  CHECK(ppl["ln_ppl_correlation"] == 1.0);
  const Json& g = out["gates"];
  CHECK(g["reproduction"]["asserted_exact_zero"] == true);
  CHECK(g["reproduction"]["head_digest_equal"] == true);
  CHECK(g["reproduction"]["capture_content_digest_equal"].is_null());
  CHECK(g["status"] == "incomplete");  // until the supervisor decides the other two gates
  CHECK(g["failed"] == Json::array());
  for (const Json& t : g["thresholds"]) CHECK(t["passed"] == true);

  // The supervisor's part: filled in, the status is passed; one false gate fails by name.
  Json filled = g;
  filled["reproduction"]["capture_content_digest_equal"] = true;
  filled["reproduction"]["weights_identity_equal"] = true;
  CHECK(common::finalize_gates(filled)["status"] == "passed");
  filled["reproduction"]["weights_identity_equal"] = false;
  Json failed = common::finalize_gates(filled);
  CHECK(failed["status"] == "failed");
  CHECK(failed["failed"] == Json::array({"weights_identity_equal"}));
}

TEST_CASE("a perturbed candidate fails a threshold gate by name; unknown thresholds are refused") {
  TempDir d;
  fs::create_directory(d / "work");
  auto a = random_logits(6, kVocab, 8);
  auto b = a;
  for (std::size_t i = 0; i < b.size(); i += 3) b[i] += 0.5f;
  write_logits(d / "ref.safetensors", a, 6, kVocab);
  write_logits(d / "cand.safetensors", b, 6, kVocab);
  Json input = input_doc(kVocab, {context("c0", Json::parse("[[0, 6]]"), d / "ref.safetensors",
                                          d / "cand.safetensors")});
  input["thresholds"] = {{"max_mean_kl", 1e-6}, {"max_kl_max", 100.0}, {"max_rms_delta_p", 0.1}};
  auto r = run_worker(d / "work", input);
  INFO(r.out);
  REQUIRE(r.status == 0);
  check_schemas(d / "work");
  Json out = read_json(d / "work" / "output.json");
  CHECK(out["comparison_kind"] == "candidate_comparison");
  CHECK(out["statistics"]["perplexity"].is_null());  // no token ids: no next tokens
  CHECK(out["scope"]["next_token_positions"].is_null());
  const Json& g = out["gates"];
  CHECK(g["status"] == "failed");
  // max_rms_delta_p bounds the next-token Δp, which was not measured: that fails too.
  CHECK(g["failed"] == Json::array({"max_mean_kl", "max_rms_delta_p"}));
  CHECK(g["reproduction"].is_null());
  CHECK(g["thresholds"][0]["name"] == "max_kl_max");
  CHECK(g["thresholds"][0]["passed"] == true);
  CHECK(g["thresholds"][1]["observed"] == out["statistics"]["kl"]["mean"]);
  CHECK(g["thresholds"][2]["observed"].is_null());

  input["thresholds"] = {{"max_mean_kld", 0.1}};
  r = run_worker(d / "work", input);
  CHECK(r.status == 2);
  CHECK(contains(r.out, "input.invalid"));
  CHECK(contains(r.out, "max_mean_kld is not a known threshold"));
}

}  // namespace
}  // namespace assay::compare::test
