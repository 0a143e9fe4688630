// Fidelity jobs end to end through assayd's socket, with the real workers: captures, the
// comparison, the receipt, and the refusals.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>

#include "common/identity.h"
#include "common/result.h"
#include "common/safetensors.h"
#include "common/sign.h"
#include "tests/integration/harness.h"

using namespace assay::test;
namespace common = assay::common;

namespace {

bool have_workers() {
  if (have(kFingerprint) && have(kOracle) && have(kCompare)) return true;
  MESSAGE("skipped: assay-fingerprint, assay-oracle or assay-compare was not built");
  return false;
}

// The reference's logits for every position of `ids`, as `assay-oracle logits` writes them
// ("input_ids" I64 [1, T], "logits" F32 [T, vocab]).
fs::path oracle_logits(const fs::path& model, const std::vector<std::int64_t>& ids,
                       const fs::path& out) {
  std::string list;
  for (auto id : ids) list += (list.empty() ? "" : ",") + std::to_string(id);
  std::string r = run_capture(kOracle + " logits --all-positions --model " + model.string() +
                              " --token-ids " + list + " --out " + out.string());
  REQUIRE_MESSAGE(r.rfind("0:", 0) == 0, r);
  return out;
}

struct Rows {
  std::int64_t n = 0, vocab = 0;
  std::vector<float> data;
};

Rows read_logits(const fs::path& file) {
  auto f = common::SafetensorsFile::open(file);
  const auto* t = f.find("logits");
  REQUIRE(t != nullptr);
  REQUIRE(t->dtype == common::Dtype::kF32);
  Rows r;
  r.n = t->shape[0];
  r.vocab = t->shape[1];
  r.data.resize(static_cast<std::size_t>(t->numel()));
  std::memcpy(r.data.data(), t->data, t->nbytes);
  return r;
}

fs::path write_logits(const fs::path& file, const Rows& r,
                      common::Dtype dtype = common::Dtype::kF32) {
  if (dtype == common::Dtype::kF32) {
    common::write_safetensors(
        file, {{"logits", dtype, {r.n, r.vocab}, std::as_bytes(std::span(r.data))}});
  } else {  // BF16 by truncation, enough for a shape test
    std::vector<std::uint16_t> half(r.data.size());
    for (std::size_t i = 0; i < r.data.size(); ++i) {
      std::uint32_t bits;
      std::memcpy(&bits, &r.data[i], 4);
      half[i] = static_cast<std::uint16_t>(bits >> 16);
    }
    common::write_safetensors(file,
                              {{"logits", dtype, {r.n, r.vocab}, std::as_bytes(std::span(half))}});
  }
  ::chmod(file.c_str(), 0644);
  return file;
}

Json logits_request(const std::string& id, const fs::path& model, const Json& contexts,
                    const std::vector<fs::path>& files) {
  Json logits = Json::array();
  for (const auto& f : files)
    logits.push_back({{"path", f.string()}, {"sha256", common::sha256_file_id(f)}});
  return Json{{"schema", "assay.fidelity-request.v1"},
              {"id", id},
              {"reference", {{"model_dir", model.string()}}},
              {"candidate", {{"logits", logits}, {"label", "test logits"}}},
              {"panel", {{"contexts", contexts}}}};
}

const std::vector<std::int64_t> kIdsA = {72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100};
const std::vector<std::int64_t> kIdsB = {84, 104, 101, 32, 113, 117, 105, 99, 107};

Daemon make_daemon(const TempDir& tmp) {
  return Daemon(tmp.path / "state", tmp.path / "assayd.sock",
                {"--containment", containment(), "--fingerprint-worker", kFingerprint,
                 "--oracle-worker", kOracle, "--compare-worker", kCompare});
}

Json run_job(Daemon& d, const Json& request) {
  auto sub = request_json(d, request);
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  return wait_job(d.socket(), sub.json()["id"], terminal, 300);
}

}  // namespace

TEST_CASE("fidelity: a 4-bit copy of the reference, with reproduction confirmation") {
  if (!have_workers()) return;
  TempDir tmp;
  fs::path model = fixture_model(tmp.path / "llama-tiny");
  fs::path quant = tmp.path / "llama-tiny-q4";
  std::string q = run_capture(std::string(ASSAY_PYTHON3) + " " + ASSAY_SOURCE_DIR +
                              "/tests/fixtures/quantize_fixture.py --in " + model.string() +
                              " --out " + quant.string() + " --bits 4");
  REQUIRE_MESSAGE(q.rfind("0:", 0) == 0, q);
  Daemon d = make_daemon(tmp);
  REQUIRE_MESSAGE(d.start(), d.log());
  Json request{{"schema", "assay.fidelity-request.v1"},
               {"id", "q4-vs-bf16"},
               {"reference", {{"model_dir", model.string()}}},
               {"candidate", {{"model_dir", quant.string()}, {"label", "fake int4"}}},
               {"panel",
                {{"contexts",
                  {{{"id", "hello"}, {"token_ids", kIdsA}},
                   {{"id", "fox"}, {"token_ids", kIdsB}, {"positions", {{1, 3}, {5, 9}}}}}}}},
               {"reproduction_confirmation", true},
               {"block_positions", 3}};
  Json job = run_job(d, request);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d.log());
  std::string id = job["id"];
  fs::path dir = d.state() / "jobs" / id;

  auto result_reply = request_get(d, "/v1/jobs/" + id + "/result");
  REQUIRE(result_reply.status == 200);
  Json result = result_reply.json();
  CHECK(common::canonical(result) == result_reply.body);
  CHECK_NOTHROW(common::verify_result_sha256(result));
  CHECK(result["schema"] == "assay.fidelity-result.v1");
  CHECK(result["request"]["sha256"] == common::sha256_canonical_id(request));
  CHECK(result["request"]["panel_sha256"] == common::sha256_canonical_id(request["panel"]));
  CHECK(result["panel"]["scored_positions"] == 12 + 6);
  // Both model identities, and a capture digest per context on both sides.
  CHECK(common::is_identity(
      result["reference"]["model_identity"]["content_sha256"].get<std::string>()));
  CHECK(common::is_identity(
      result["candidate"]["model_identity"]["content_sha256"].get<std::string>()));
  CHECK(result["reference"]["model_identity"]["content_sha256"] !=
        result["candidate"]["model_identity"]["content_sha256"]);
  for (const char* side : {"reference", "candidate"}) {
    const Json& caps = result[side]["capture"]["captures"];
    REQUIRE(caps.size() == 2);
    for (const Json& c : caps) CHECK(common::is_identity(c["logits_sha256"].get<std::string>()));
    CHECK(result[side]["capture"]["process"].is_object());
    CHECK(result[side]["model_fingerprint"]["process"].is_object());
  }
  // The reproduction run gave the same bytes, so exactly 0 and 1.
  const Json& rep = result["reproduction"];
  CHECK(rep["confirmed"] == true);
  CHECK(rep["digests_equal"] == true);
  CHECK(rep["kl"]["max"].get<double>() == 0.0);
  CHECK(rep["top1_agreement"].get<double>() == 1.0);
  for (std::size_t i = 0; i < 2; ++i)
    CHECK(rep["capture"]["captures"][i]["logits_sha256"] ==
          result["reference"]["capture"]["captures"][i]["logits_sha256"]);
  // The quantized copy differs: positive KL, every statistic ordered.
  const Json& kl = result["comparison"]["metrics"]["kl"];
  CHECK(kl["mean"].get<double>() > 0);
  CHECK(kl["median"].get<double>() <= kl["p95"].get<double>());
  CHECK(kl["p95"].get<double>() <= kl["p99"].get<double>());
  CHECK(kl["p99"].get<double>() <= kl["p99_9"].get<double>());
  CHECK(kl["p99_9"].get<double>() <= kl["max"].get<double>());
  double top1 = result["comparison"]["metrics"]["top1_agreement"].get<double>();
  CHECK((top1 > 0.0 && top1 <= 1.0));
  CHECK(result["comparison"]["process"].is_object());

  // The KL vector: its digest is in the receipt and in the signed statement.
  auto artifact = request_get(d, "/v1/jobs/" + id + "/artifact");
  REQUIRE(artifact.status == 200);
  CHECK(common::sha256_id(artifact.body) == result["kl_artifact"]["sha256"]);
  auto envelope = request_get(d, "/v1/jobs/" + id + "/attestation").json();
  std::string pub = slurp(d.state() / "keys" / "host.pub");
  Json statement =
      common::parse_strict(common::dsse_verify(envelope, common::public_key_raw_from_pem(pub)));
  CHECK(statement["predicateType"] == "https://assay.dev/fidelity/v1");
  CHECK(statement["subject"][0]["digest"]["sha256"] ==
        common::sha256_id(result_reply.body).substr(7));
  CHECK(statement["subject"][1]["name"] == "kl.safetensors");
  CHECK(statement["subject"][1]["digest"]["sha256"] == common::sha256_id(artifact.body).substr(7));

  // An independent computation: Python's reference forward of both checkpoints and numpy's
  // fp64 KL agree with the artifact to 1e-12 relative.
  spit(tmp.path / "kl.safetensors", artifact.body);
  spit(tmp.path / "request.json", request.dump());
  std::string check = run_capture(std::string(ASSAY_PYTHON3) + " " + ASSAY_SOURCE_DIR +
                                  "/tests/integration/independent_fidelity.py --request " +
                                  (tmp.path / "request.json").string() + " --kl " +
                                  (tmp.path / "kl.safetensors").string() + " --result " +
                                  (dir / "result.json").string());
  CHECK_MESSAGE(check.rfind("0:", 0) == 0, check);

  if (have(kClient)) {
    spit(tmp.path / "result.json", result_reply.body);
    spit(tmp.path / "result.dsse.json", envelope.dump());
    std::string v = run_capture(kClient + " verify " + (tmp.path / "result.json").string() +
                                " --pubkey " + (d.state() / "keys" / "host.pub").string() +
                                " --artifact " + (tmp.path / "kl.safetensors").string());
    CHECK_MESSAGE(v.rfind("0:", 0) == 0, v);
    std::string show =
        run_capture(kClient + " --socket " + d.socket().string() + " fidelity show " + id);
    CHECK_MESSAGE(show.rfind("0:", 0) == 0, show);
    CHECK(show.find("p99.9") != std::string::npos);
    CHECK(show.find("reproduction: confirmed") != std::string::npos);
    CHECK(show.find("histogram") != std::string::npos);
    CHECK(show.find("fake int4") != std::string::npos);
  }

  // Every document of the job validates against its schema.
  std::string validate =
      validate_schemas({{"fidelity-result", (dir / "result.json")},
                        {"fidelity-request", (dir / "request.json")},
                        {"oracle-capture-input", (dir / "capture-reference" / "input.json")},
                        {"oracle-capture-output", (dir / "capture-candidate" / "output.json")},
                        {"compare-input", (dir / "compare" / "input.json")},
                        {"compare-output", (dir / "compare" / "output.json")},
                        {"process-containment", (dir / "compare" / "evidence.json")}});
  CHECK_MESSAGE(validate.rfind("0:", 0) == 0, validate);

  // The captures were scratch: no logits are left in the workspaces.
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.path().extension() == ".safetensors")
      CHECK_MESSAGE(e.path().filename() == "kl.safetensors", e.path());
}

TEST_CASE(
    "fidelity: a candidate equal to the reference gives exactly 0; one perturbed position "
    "shows in max and p99.9") {
  if (!have_workers()) return;
  TempDir tmp;
  fs::path model = fixture_model(tmp.path / "llama-tiny");
  Daemon d = make_daemon(tmp);
  REQUIRE_MESSAGE(d.start(), d.log());
  Rows a = read_logits(oracle_logits(model, kIdsA, tmp.path / "a-all.safetensors"));
  Rows b = read_logits(oracle_logits(model, kIdsB, tmp.path / "b-all.safetensors"));
  fs::path fa = write_logits(tmp.path / "a.safetensors", a);
  fs::path fb = write_logits(tmp.path / "b.safetensors", b);
  Json contexts = {{{"id", "a"}, {"token_ids", kIdsA}}, {{"id", "b"}, {"token_ids", kIdsB}}};

  Json job = run_job(d, logits_request("same", model, contexts, {fa, fb}));
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d.log());
  Json result = request_get(d, "/v1/jobs/" + job["id"].get<std::string>() + "/result").json();
  const Json& m = result["comparison"]["metrics"];
  for (const char* k : {"mean", "median", "p95", "p99", "p99_9", "max"})
    CHECK_MESSAGE(m["kl"][k].get<double>() == 0.0, k << " = " << m["kl"][k]);
  CHECK(m["top1_agreement"].get<double>() == 1.0);
  CHECK(result["candidate"]["kind"] == "logits");
  CHECK(result["candidate"]["logits_files"][0]["file_sha256"] == common::sha256_file_id(fa));
  std::string validate = validate_schemas(
      {{"fidelity-result", (d.state() / "jobs" / job["id"].get<std::string>() / "result.json")}});
  CHECK_MESSAGE(validate.rfind("0:", 0) == 0, validate);
  // The capture and `assay-oracle logits` computed the same bytes.
  CHECK(result["candidate"]["logits_files"][0]["logits_sha256"] ==
        result["reference"]["capture"]["captures"][0]["logits_sha256"]);

  // Perturb one row of context b (position 6): it alone has a KL above 0.
  Rows b2 = b;
  for (std::int64_t v = 0; v < b2.vocab; ++v)
    b2.data[static_cast<std::size_t>(6 * b2.vocab + v)] += static_cast<float>((v % 7) - 3) * 0.5f;
  fs::path fb2 = write_logits(tmp.path / "b-perturbed.safetensors", b2);
  job = run_job(d, logits_request("one-row", model, contexts, {fa, fb2}));
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d.log());
  result = request_get(d, "/v1/jobs/" + job["id"].get<std::string>() + "/result").json();
  const Json& m2 = result["comparison"]["metrics"];
  CHECK(m2["kl"]["max"].get<double>() > 0.0);
  CHECK(m2["kl"]["p99_9"].get<double>() > 0.0);
  CHECK(m2["kl"]["median"].get<double>() == 0.0);
  CHECK(m2["max_at"]["context"] == "b");
  CHECK(m2["max_at"]["position"] == 6);
  CHECK(result["comparison"]["contexts"][0]["kl"]["max"].get<double>() == 0.0);
}

TEST_CASE("fidelity: bad inputs each give a clear error and change nothing else") {
  TempDir tmp;
  fs::path model = tmp.path / "cfg-model";
  fs::create_directories(model);
  spit(model / "config.json",
       R"({"model_type":"llama","vocab_size":260,"max_position_embeddings":64})");
  fs::path other = tmp.path / "other-vocab";
  fs::create_directories(other);
  spit(other / "config.json", R"({"model_type":"llama","vocab_size":300})");
  Daemon d(tmp.path / "state", tmp.path / "assayd.sock", {"--containment", "none"});
  REQUIRE_MESSAGE(d.start(), d.log());
  fs::path file = tmp.path / "c.safetensors";
  spit(file, "not a safetensors file");
  ::chmod(file.c_str(), 0644);
  Json contexts = {{{"id", "a"}, {"token_ids", {1, 2, 3}}}};
  Json base = logits_request("bad", model, contexts, {file});

  auto expect = [&](Json req, int status, const std::string& code, const std::string& words) {
    auto r = request_json(d, req);
    CHECK_MESSAGE(r.status == status, req.dump() << " -> " << r.body);
    if (r.status >= 400) {
      Json e = r.json()["error"];
      CHECK_MESSAGE(e["code"] == code, r.body);
      CHECK_MESSAGE(e["message"].get<std::string>().find(words) != std::string::npos, r.body);
    }
  };
  Json r = base;
  r["candidate"] = {{"model_dir", other.string()}};
  expect(r, 422, "request.vocab_mismatch", "300");
  r = base;
  r["candidate"]["logits"].push_back(base["candidate"]["logits"][0]);
  expect(r, 422, "request.invalid", "one file per panel context");
  r = base;
  r["candidate"]["logits"][0]["path"] = "relative.safetensors";
  expect(r, 422, "request.invalid", "not an absolute path");
  r = base;
  r["candidate"]["logits"][0]["path"] = (tmp.path / "missing.safetensors").string();
  expect(r, 422, "request.bad_logits_file", "does not exist");
  r = base;
  r["candidate"]["logits"][0]["sha256"] = "sha256:abc";
  expect(r, 422, "request.invalid", "sha256:abc");
  r = base;
  r["panel"]["contexts"][0]["positions"] = {{0, 2}, {1, 3}};
  expect(r, 422, "request.invalid", "overlaps");
  r = base;
  r["panel"]["contexts"][0]["positions"] = {{0, 4}};
  expect(r, 422, "request.invalid", "[0,4]");
  r = base;
  r["panel"]["contexts"][0]["token_ids"] = {1, 2, 260};
  expect(r, 422, "request.invalid_token_id", "260");
  r = base;
  r["panel"]["contexts"][0]["token_ids"] = Json(std::vector<int>(65, 1));
  expect(r, 422, "request.too_long", "64");
  r = base;
  r["candidate"]["model_dir"] = model.string();
  expect(r, 422, "request.invalid", "exactly one of");
  r = base;
  r["surprise"] = 1;
  expect(r, 422, "request.invalid", "surprise");
  auto q = d.socket();
  auto with_query = request(q, "POST", "/v1/jobs?model_dir=/x", base.dump());
  CHECK(with_query.status == 422);
  CHECK(with_query.body.find("api.bad_query") != std::string::npos);
  // Nothing was queued; the daemon still answers.
  auto list = request(q, "GET", "/v1/jobs").json();
  CHECK(list["jobs"].empty());
  CHECK(request(q, "GET", "/v1/health").status == 200);
}

TEST_CASE(
    "fidelity: a candidate file with a wrong digest, NaN or the wrong shape fails the job "
    "naming it") {
  if (!have_workers()) return;
  TempDir tmp;
  fs::path model = fixture_model(tmp.path / "llama-tiny");
  Daemon d = make_daemon(tmp);
  REQUIRE_MESSAGE(d.start(), d.log());
  Rows a = read_logits(oracle_logits(model, kIdsA, tmp.path / "a-all.safetensors"));
  Json contexts = {{{"id", "a"}, {"token_ids", kIdsA}}};

  auto expect_failure = [&](const Json& req, const std::string& code, const std::string& words) {
    Json job = run_job(d, req);
    CHECK_MESSAGE(job["state"] == "failed", job.dump(2));
    std::string message = job["error"].value("message", std::string());
    CHECK_MESSAGE(message.find(code) != std::string::npos, message);
    CHECK_MESSAGE(message.find(words) != std::string::npos, message);
  };
  fs::path good = write_logits(tmp.path / "good.safetensors", a);
  Json r = logits_request("sha", model, contexts, {good});
  r["candidate"]["logits"][0]["sha256"] = "sha256:" + std::string(64, '0');
  expect_failure(r, "compare.sha_mismatch", good.string());

  Rows nan = a;
  nan.data[static_cast<std::size_t>(3 * a.vocab + 17)] = std::nanf("");
  expect_failure(
      logits_request("nan", model, contexts, {write_logits(tmp.path / "nan.safetensors", nan)}),
      "compare.non_finite", "nan.safetensors");

  Rows short_rows = a;
  short_rows.n -= 1;
  short_rows.data.resize(static_cast<std::size_t>(short_rows.n * a.vocab));
  expect_failure(logits_request("rows", model, contexts,
                                {write_logits(tmp.path / "rows.safetensors", short_rows)}),
                 "compare.bad_shape", "rows.safetensors");

  // The daemon goes on: a good file still works afterwards, in BF16 too.
  Json job = run_job(
      d, logits_request("bf16", model, contexts,
                        {write_logits(tmp.path / "bf16.safetensors", a, common::Dtype::kBF16)}));
  CHECK_MESSAGE(job["state"] == "succeeded", job.dump(2));
}

TEST_CASE("fidelity: kill -9 of assayd during the comparison loses nothing: the job is re-run") {
  if (!have_workers()) return;
  TempDir tmp;
  fs::path model = fixture_model(tmp.path / "llama-tiny");
  fs::path slow = slow_wrapper(tmp.path, kCompare, 3);
  Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
           {"--containment", containment(), "--fingerprint-worker", kFingerprint, "--oracle-worker",
            kOracle, "--compare-worker", slow.string()});
  REQUIRE_MESSAGE(d.start(), d.log());
  Json request{{"schema", "assay.fidelity-request.v1"},
               {"id", "crash"},
               {"reference", {{"model_dir", model.string()}}},
               {"candidate", {{"model_dir", model.string()}}},
               {"panel", {{"contexts", {{{"token_ids", kIdsA}}}}}}};
  auto sub = request_json(d, request);
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  std::string id = sub.json()["id"];
  Json job = wait_job(
      d.socket(), id, [](const Json& j) { return j["phase"] == "compare"; }, 120);
  REQUIRE_MESSAGE(job["phase"] == "compare", job.dump(2) << "\n" << d.log());
  d.kill9();
  // The captures sat in the comparison's workspace; the restart runs the pipeline again.
  REQUIRE_MESSAGE(d.start(), d.log());
  job = wait_job(d.socket(), id, terminal, 300);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d.log());
  CHECK(job["attempts"] == 2);
  // The same checkpoint on both sides: exactly 0 everywhere.
  Json result = request_get(d, "/v1/jobs/" + id + "/result").json();
  CHECK(result["comparison"]["metrics"]["kl"]["max"].get<double>() == 0.0);
  CHECK(result["comparison"]["metrics"]["top1_agreement"].get<double>() == 1.0);
  // A resubmission is answered with the finished job.
  auto again = request_json(d, request);
  CHECK(again.status == 200);
  CHECK(again.json()["id"] == id);
}

namespace {

// The Spark2.5-shaped fixture of the issue-16 support record: hidden 64, intermediate 128,
// 4 layers (3 sliding + 1 full), 4 heads, 1 KV head, head_dim 16, window 32, vocab 260, tied.
fs::path spark_fixture(const fs::path& dir) {
  std::string r = run_capture(std::string(ASSAY_PYTHON3) + " " + ASSAY_SOURCE_DIR +
                              "/tests/fixtures/make_fixture.py --arch spark2_5 --size tiny --out " +
                              dir.string());
  REQUIRE_MESSAGE(r.rfind("0:", 0) == 0, r);
  Json c = common::parse_strict(slurp(dir / "config.json"));
  CHECK(c["model_type"] == "spark2_5");
  CHECK(c["hidden_size"] == 64);
  CHECK(c["intermediate_size"] == 128);
  CHECK(c["num_hidden_layers"] == 4);
  CHECK(c["layer_types"] ==
        Json({"sliding_attention", "sliding_attention", "sliding_attention", "full_attention"}));
  CHECK(c["num_attention_heads"] == 4);
  CHECK(c["num_key_value_heads"] == 1);
  CHECK(c["head_dim"] == 16);
  CHECK(c["sliding_window"] == 32);
  CHECK(c["vocab_size"] == 260);
  CHECK(c["tie_word_embeddings"] == true);
  // Tied: the embedding is the only [vocab, hidden] matrix; there is no separate output head.
  auto weights = common::SafetensorsFile::open(dir / "model.safetensors");
  const auto* embedding = weights.find("model.embedding.weight");
  REQUIRE(embedding != nullptr);
  CHECK(embedding->shape == std::vector<std::int64_t>{260, 64});
  CHECK(weights.find("lm_head.weight") == nullptr);
  return dir;
}

// Contexts longer than the sliding window (32), so the sliding layers mask something.
std::vector<std::int64_t> spark_ids(std::int64_t n, std::int64_t seed) {
  std::vector<std::int64_t> ids;
  for (std::int64_t i = 0; i < n; ++i) ids.push_back((seed + 37 * i) % 260);
  return ids;
}

std::string validate_result(const fs::path& result) {
  return validate_schemas({{"fidelity-result", result}});
}

const Json* threshold_gate(const Json& gates, const std::string& name) {
  for (const Json& g : gates["thresholds"])
    if (g["name"] == name) return &g;
  return nullptr;
}

}  // namespace

TEST_CASE("fidelity: a self-comparison on the Spark2.5-shaped fixture passes every gate") {
  if (!have_workers()) return;
  TempDir tmp;
  fs::path model = spark_fixture(tmp.path / "spark2_5-tiny");
  Daemon d = make_daemon(tmp);
  REQUIRE_MESSAGE(d.start(), d.log());
  Json request{
      {"schema", "assay.fidelity-request.v1"},
      {"id", "spark-self"},
      {"reference", {{"model_dir", model.string()}}},
      {"candidate", {{"model_dir", model.string()}, {"label", "the same checkpoint"}}},
      {"panel",
       {{"contexts",
         {{{"id", "long"}, {"token_ids", spark_ids(48, 3)}},
          {{"id", "short"}, {"token_ids", spark_ids(20, 101)}, {"positions", {{2, 19}}}}}}}},
      {"reproduction_confirmation", true},
      {"thresholds", {{"max_mean_kl", 0.0}, {"max_kl_max", 0.0}, {"min_top1_agreement", 1.0}}},
      {"block_positions", 16}};
  Json job = run_job(d, request);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d.log());
  std::string id = job["id"];
  Json result = request_get(d, "/v1/jobs/" + id + "/result").json();
  CHECK(result["comparison_kind"] == "reproduction_confirmation");
  CHECK(result["panel"]["scored_positions"] == 48 + 17);
  CHECK(result["reference"]["model_identity"]["content_sha256"] ==
        result["candidate"]["model_identity"]["content_sha256"]);
  CHECK(result["comparison"]["metrics"]["kl"]["max"].get<double>() == 0.0);
  CHECK(result["comparison"]["metrics"]["top1_agreement"].get<double>() == 1.0);
  CHECK(result["reproduction"]["confirmed"] == true);

  const Json& gates = result["gates"];
  CHECK(gates["status"] == "passed");
  CHECK(gates["failed"] == Json::array());
  const Json& rep = gates["reproduction"];
  REQUIRE(rep.is_object());
  for (const char* g : {"asserted_exact_zero", "head_digest_equal", "capture_content_digest_equal",
                        "weights_identity_equal"})
    CHECK_MESSAGE(rep[g] == true, g << " = " << rep[g]);
  REQUIRE(gates["thresholds"].size() == 3);
  for (const Json& g : gates["thresholds"]) CHECK_MESSAGE(g["passed"] == true, g.dump());
  CHECK((*threshold_gate(gates, "max_kl_max"))["observed"].get<double>() == 0.0);
  CHECK((*threshold_gate(gates, "min_top1_agreement"))["observed"].get<double>() == 1.0);

  std::string validate = validate_result(d.state() / "jobs" / id / "result.json");
  CHECK_MESSAGE(validate.rfind("0:", 0) == 0, validate);
  if (have(kClient)) {
    std::string show =
        run_capture(kClient + " --socket " + d.socket().string() + " fidelity show " + id);
    CHECK_MESSAGE(show.rfind("0:", 0) == 0, show);
    CHECK(show.find("passed") != std::string::npos);
  }
}

TEST_CASE(
    "fidelity: a perturbed candidate on the Spark2.5-shaped fixture fails its threshold "
    "gate by name") {
  if (!have_workers()) return;
  TempDir tmp;
  fs::path model = spark_fixture(tmp.path / "spark2_5-tiny");
  Daemon d = make_daemon(tmp);
  REQUIRE_MESSAGE(d.start(), d.log());
  const auto ids = spark_ids(40, 7);
  Rows rows = read_logits(oracle_logits(model, ids, tmp.path / "all.safetensors"));
  REQUIRE(rows.vocab == 260);
  REQUIRE(rows.n == 40);
  // One position (35, past the sliding window) is negated (the reference's top token becomes
  // the candidate's least likely); the other 39 stay the reference's bytes.
  for (std::int64_t v = 0; v < rows.vocab; ++v)
    rows.data[static_cast<std::size_t>(35 * rows.vocab + v)] *= -1.0f;
  fs::path file = write_logits(tmp.path / "perturbed.safetensors", rows);
  Json request =
      logits_request("spark-perturbed", model, {{{"id", "c"}, {"token_ids", ids}}}, {file});
  request["reproduction_confirmation"] = true;
  request["thresholds"] = {
      {"max_mean_kl", 10.0}, {"max_kl_max", 1e-3}, {"min_top1_agreement", 0.5}};
  Json job = run_job(d, request);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d.log());
  std::string id = job["id"];
  Json result = request_get(d, "/v1/jobs/" + id + "/result").json();
  const Json& m = result["comparison"]["metrics"];
  CHECK(m["kl"]["max"].get<double>() > 1e-3);
  CHECK(m["kl"]["median"].get<double>() == 0.0);
  CHECK(m["max_at"]["position"] == 35);

  const Json& gates = result["gates"];
  CHECK(gates["status"] == "failed");
  CHECK(gates["failed"] == Json::array({"max_kl_max"}));
  const Json* g = threshold_gate(gates, "max_kl_max");
  REQUIRE(g != nullptr);
  CHECK((*g)["passed"] == false);
  CHECK((*g)["bound"].get<double>() == 1e-3);
  CHECK((*g)["observed"].get<double>() == m["kl"]["max"].get<double>());
  CHECK((*threshold_gate(gates, "max_mean_kl"))["passed"] == true);
  CHECK((*threshold_gate(gates, "min_top1_agreement"))["passed"] == true);
  // The reference reproduced itself: only the threshold failed.
  REQUIRE(gates["reproduction"].is_object());
  for (const char* r : {"asserted_exact_zero", "head_digest_equal", "capture_content_digest_equal",
                        "weights_identity_equal"})
    CHECK_MESSAGE(gates["reproduction"][r] == true, r);

  std::string validate = validate_result(d.state() / "jobs" / id / "result.json");
  CHECK_MESSAGE(validate.rfind("0:", 0) == 0, validate);
  if (have(kClient)) {
    std::string show =
        run_capture(kClient + " --socket " + d.socket().string() + " fidelity show " + id);
    CHECK(show.find("max_kl_max") != std::string::npos);
    CHECK(show.find("failed") != std::string::npos);
    // A failed gate is exit 11 (CI gates on it), as text and as JSON, from show and from wait.
    CHECK_MESSAGE(show.rfind("11:", 0) == 0, show);
    for (const char* args : {" --json fidelity show ", " wait ", " --json wait "}) {
      std::string out = run_capture(kClient + " --socket " + d.socket().string() + args + id);
      CHECK_MESSAGE(out.rfind("11:", 0) == 0, args << out);
    }
  }
}

TEST_CASE("fidelity: a comparison whose output.json is not compare output fails the job by code") {
  if (!have_workers()) return;
  TempDir tmp;
  fs::path model = fixture_model(tmp.path / "llama-tiny");
  // A stand-in comparison that exits 0 with a document of another schema.
  fs::path liar = tmp.path / "lying-compare";
  spit(liar, "#!/bin/sh\necho '{\"schema\":\"assay.something-else.v1\"}' > output.json\n");
  ::chmod(liar.c_str(), 0755);
  Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
           {"--containment", containment(), "--fingerprint-worker", kFingerprint, "--oracle-worker",
            kOracle, "--compare-worker", liar.string()});
  REQUIRE_MESSAGE(d.start(), d.log());
  Json request{{"schema", "assay.fidelity-request.v1"},
               {"id", "liar"},
               {"reference", {{"model_dir", model.string()}}},
               {"candidate", {{"model_dir", model.string()}}},
               {"panel", {{"contexts", {{{"token_ids", kIdsA}}}}}}};
  Json job = run_job(d, request);
  CHECK(job["state"] == "failed");
  CHECK(job["error"]["code"] == "worker.compare_output");
  CHECK(job["error"]["message"].get<std::string>().find("assay.something-else.v1") !=
        std::string::npos);
}
