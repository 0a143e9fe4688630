// Trajectory jobs end to end through assayd's socket, with the real workers: constructed
// continuations whose first departures are known, the signed result, the artifact, the
// documents' schemas, and the fingerprint cache of a second job on the same model.
#include <doctest/doctest.h>

#include <cstring>
#include <thread>

#include "common/identity.h"
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

// The argmax of every row of `assay-oracle logits --all-positions` over `ids`.
std::vector<std::int64_t> oracle_argmax(const fs::path& model, const std::vector<std::int64_t>& ids,
                                        const fs::path& out) {
  std::string list;
  for (auto id : ids) list += (list.empty() ? "" : ",") + std::to_string(id);
  std::string r = run_capture(kOracle + " logits --all-positions --model " + model.string() +
                              " --token-ids " + list + " --out " + out.string());
  REQUIRE_MESSAGE(r.rfind("0:", 0) == 0, r);
  auto f = common::SafetensorsFile::open(out);
  const auto* t = f.find("logits");
  REQUIRE(t != nullptr);
  REQUIRE(t->dtype == common::Dtype::kF32);
  std::int64_t rows = t->shape[0], vocab = t->shape[1];
  std::vector<std::int64_t> arg;
  for (std::int64_t r0 = 0; r0 < rows; ++r0) {
    const float* row = reinterpret_cast<const float*>(t->data) + r0 * vocab;
    std::int64_t best = 0;
    for (std::int64_t v = 1; v < vocab; ++v)
      if (row[v] > row[best]) best = v;
    arg.push_back(best);
  }
  return arg;
}

// The reference's greedy continuation of `prompt`, `n` tokens long, computed by the oracle over
// sequences of the final length (the shape every capture of the job uses): fix the first
// position whose token is not the argmax of the row before it, until none is left.
std::vector<std::int64_t> greedy(const fs::path& model, const std::vector<std::int64_t>& prompt,
                                 std::size_t n, const fs::path& tmp) {
  std::vector<std::int64_t> seq = prompt;
  seq.resize(prompt.size() + n, 0);
  for (std::size_t round = 0; round <= n; ++round) {
    auto arg =
        oracle_argmax(model, seq, tmp / ("greedy-" + std::to_string(round) + ".safetensors"));
    std::size_t i = 0;
    while (i < n && seq[prompt.size() + i] == arg[prompt.size() - 1 + i]) ++i;
    if (i == n) return std::vector<std::int64_t>(seq.begin() + prompt.size(), seq.end());
    seq[prompt.size() + i] = arg[prompt.size() - 1 + i];
  }
  FAIL("no greedy fixed point");
  return {};
}

const std::vector<std::int64_t> kPrompt = {72, 101, 108, 108, 111, 44, 32};
constexpr std::size_t kLength = 8;
constexpr std::size_t kDepartAt = 3;

}  // namespace

TEST_CASE(
    "trajectory: an engine that follows the reference for k tokens departs at k, one that "
    "follows it throughout never departs; signed, valid, and a second job reuses the "
    "fingerprint cache") {
  if (!have_workers()) return;
  TempDir tmp;
  fs::path model = fixture_model(tmp.path / "llama-tiny");
  std::vector<std::int64_t> ref = greedy(model, kPrompt, kLength, tmp.path);
  // The fingerprint cache keeps no digest of a file changed in the last 2 s.
  std::this_thread::sleep_for(std::chrono::milliseconds(2100));
  std::vector<std::int64_t> departs = ref;
  departs[kDepartAt] = (ref[kDepartAt] + 1) % 100;  // any other token

  Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
           {"--containment", containment(), "--fingerprint-worker", kFingerprint, "--oracle-worker",
            kOracle, "--compare-worker", kCompare});
  REQUIRE_MESSAGE(d.start(), d.log());
  Json request{
      {"schema", "assay.trajectory-request.v1"},
      {"id", "k-then-depart"},
      {"model_dir", model.string()},
      {"prompt_token_ids", kPrompt},
      {"continuations",
       {{{"engine", "kiln"}, {"token_ids", departs}}, {{"engine", "vllm"}, {"token_ids", ref}}}},
      {"block_positions", 3}};
  auto sub = request_json(d, request);
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  std::string id = sub.json()["id"];
  Json job = wait_job(d.socket(), id, terminal, 300);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d.log());
  fs::path dir = d.state() / "jobs" / id;
  auto result_reply = request_get(d, "/v1/jobs/" + id + "/result");
  REQUIRE(result_reply.status == 200);
  Json result = result_reply.json();

  const Json& kiln = result["engines"][0];
  const Json& vllm = result["engines"][1];
  CHECK(kiln["engine"] == "kiln");
  CHECK(kiln["first_departure"] == kDepartAt);
  CHECK(vllm["first_departure"].is_null());
  CHECK(kiln["departure"]["argmax_token_id"] == ref[kDepartAt]);
  CHECK(kiln["departure"]["engine_token_id"] == departs[kDepartAt]);
  CHECK(kiln["departure"]["position"] == kPrompt.size() - 1 + kDepartAt);
  CHECK(kiln["departure"]["top10"].size() == 10);
  CHECK(kiln["departure"]["top10"][0]["token_id"] == ref[kDepartAt]);
  CHECK(kiln["departure"]["margin"].get<double>() >= 0);
  CHECK(result["departed_first"] == Json{{"index", kDepartAt}, {"engines", {"kiln"}}});
  CHECK(result["divergence"]["index"] == kDepartAt);
  CHECK(result["divergence"]["argmax_candidate"] == "vllm");
  // Each capture's logits digest is what the comparison read.
  for (const Json& e : result["engines"])
    CHECK(e["logits_sha256"] == e["capture"]["captures"][0]["logits_sha256"]);
  for (const Json& f : result["model_fingerprint"]["files"]) CHECK(f["source"] == "computed");

  // Signed: the statement names the result and the artifact.
  auto envelope = request_get(d, "/v1/jobs/" + id + "/attestation").json();
  std::string pub = slurp(d.state() / "keys" / "host.pub");
  Json statement =
      common::parse_strict(common::dsse_verify(envelope, common::public_key_raw_from_pem(pub)));
  CHECK(statement["predicateType"] == "https://assay.dev/trajectory/v1");
  CHECK(statement["subject"][0]["digest"]["sha256"] ==
        common::sha256_id(result_reply.body).substr(7));
  CHECK(statement["subject"][1]["name"] == "trajectory.safetensors");
  fs::path artifact = dir / "trajectory.safetensors";
  CHECK(statement["subject"][1]["digest"]["sha256"] == common::sha256_file_id(artifact).substr(7));
  // The API serves the same artifact.
  auto served = request_get(d, "/v1/jobs/" + id + "/artifact");
  CHECK(served.status == 200);
  CHECK(common::sha256_id(served.body) == common::sha256_file_id(artifact));
  auto a = common::SafetensorsFile::open(artifact);
  const auto* argmax = a.find("engine1.argmax");
  REQUIRE(argmax != nullptr);
  std::vector<std::int64_t> got(kLength);
  std::memcpy(got.data(), argmax->data, argmax->nbytes);
  CHECK(got == ref);

  std::string validate = validate_schemas({{"trajectory-result", (dir / "result.json")}});
  CHECK_MESSAGE(validate.rfind("0:", 0) == 0, validate);
  validate = validate_schemas({{"trajectory-request", (dir / "request.json")}});
  CHECK_MESSAGE(validate.rfind("0:", 0) == 0, validate);
  validate = validate_schemas({{"fingerprint-output", (dir / "fingerprint" / "output.json")}});
  CHECK_MESSAGE(validate.rfind("0:", 0) == 0, validate);

  for (const auto& [schema, doc] : std::vector<std::pair<std::string, fs::path>>{
           {"compare-trajectory-input", dir / "compare" / "input.json"},
           {"compare-trajectory-output", dir / "compare" / "output.json"},
           {"oracle-capture-input", dir / "capture-0" / "input.json"},
           {"oracle-capture-output", dir / "capture-1" / "output.json"},
           {"fingerprint-input", dir / "fingerprint" / "input.json"}}) {
    validate = validate_schemas({{schema, doc}});
    CHECK_MESSAGE(validate.rfind("0:", 0) == 0, schema << ": " << validate);
  }

  if (have(kClient)) {
    std::string show =
        run_capture(kClient + " --socket " + d.socket().string() + " trajectory show " + id);
    CHECK_MESSAGE(show.rfind("0:", 0) == 0, show);
    CHECK(show.find("first departure at index 3") != std::string::npos);
    CHECK(show.find("departed first: kiln") != std::string::npos);
    spit(tmp.path / "result.json", result_reply.body);
    spit(tmp.path / "result.dsse.json", envelope.dump());
    std::string v = run_capture(kClient + " verify " + (tmp.path / "result.json").string() +
                                " --pubkey " + (d.state() / "keys" / "host.pub").string() +
                                " --artifact " + artifact.string());
    CHECK_MESSAGE(v.rfind("0:", 0) == 0, v);
  }

  // A second job on the model takes every shard's digest from the cache, naming the first job;
  // config, tokenizer and chat template are hashed afresh every time. (A new file at the top
  // keeps the whole fingerprint of the unchanged directory from being reused without a worker.)
  spit(model / "README.md", "notes\n");
  request["id"] = "again";
  auto sub2 = request_json(d, request);
  REQUIRE_MESSAGE(sub2.status == 201, sub2.body);
  Json job2 = wait_job(d.socket(), sub2.json()["id"], terminal, 300);
  REQUIRE_MESSAGE(job2["state"] == "succeeded", job2.dump(2) << "\n" << d.log());
  Json result2 = request_get(d, "/v1/jobs/" + job2["id"].get<std::string>() + "/result").json();
  CHECK(result2["model_identity"] == result["model_identity"]);
  REQUIRE(result2["model_fingerprint"]["files"].size() >= 3);
  for (const Json& f : result2["model_fingerprint"]["files"]) {
    CAPTURE(f.dump());
    bool shard = f["name"].get<std::string>().ends_with(".safetensors");
    CHECK(f["source"] == (shard ? "cache" : "computed"));
    if (shard) CHECK(f["job"] == id);
  }
  CHECK(result2["engines"][0]["first_departure"] == kDepartAt);
  fs::path input2 =
      d.state() / "jobs" / job2["id"].get<std::string>() / "fingerprint" / "input.json";
  // Entries are kept for shards only (the small files are hashed in every job anyway).
  const Json passed = common::parse_strict(slurp(input2))["cache"];
  CHECK(passed.size() >= 1);
  for (const Json& e : passed) CHECK(e["name"].get<std::string>().ends_with(".safetensors"));
  validate = validate_schemas({{"fingerprint-input", input2}});
  CHECK_MESSAGE(validate.rfind("0:", 0) == 0, validate);
}

TEST_CASE(
    "trajectory: one engine, a token id past the vocabulary and an unknown field are "
    "refused at submission") {
  TempDir tmp;
  fs::path model = tmp.path / "m";
  fs::create_directories(model);
  spit(model / "config.json", R"({"model_type":"llama","vocab_size":100})");
  Daemon d(tmp.path / "state", tmp.path / "assayd.sock", {"--containment", "none"});
  REQUIRE_MESSAGE(d.start(), d.log());
  Json ok{{"schema", "assay.trajectory-request.v1"},
          {"id", "r"},
          {"model_dir", model.string()},
          {"prompt_token_ids", {1, 2}},
          {"continuations",
           {{{"engine", "a"}, {"token_ids", {3}}}, {{"engine", "b"}, {"token_ids", {4}}}}}};
  Json one = ok;
  one["continuations"].erase(1);
  auto r = request_json(d, one);
  CHECK(r.status == 422);
  CHECK(r.body.find("request.invalid") != std::string::npos);
  Json big = ok;
  big["continuations"][1]["token_ids"][0] = 100;
  r = request_json(d, big);
  CHECK(r.status == 422);
  CHECK(r.body.find("request.continuations[1].token_ids[0]") != std::string::npos);
  Json extra = ok;
  extra["surprise"] = true;
  r = request_json(d, extra);
  CHECK(r.status == 422);
  CHECK(r.body.find("surprise") != std::string::npos);
}

TEST_CASE(
    "trajectory: with numerics, the divergence state's envelope classifies the engines' tokens "
    "there and assay verify recomputes it; equal continuations say there is nothing to classify") {
  if (!have_workers() || !have(kHfWorker) || !have(kClient)) return;
  TempDir tmp;
  fs::path model = fixture_model(tmp.path / "llama-tiny");
  std::vector<std::int64_t> ref = greedy(model, kPrompt, kLength, tmp.path);
  std::vector<std::int64_t> departs = ref;
  departs[kDepartAt] = (ref[kDepartAt] + 1) % 100;
  Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
           {"--containment", containment(), "--fingerprint-worker", kFingerprint, "--oracle-worker",
            kOracle, "--compare-worker", kCompare, "--hf-worker", kHfWorker});
  REQUIRE_MESSAGE(d.start(), d.log());
  const Json spec{{"reduction_seeds", 2}, {"batch_sizes", Json::array({2})}};
  Json request{
      {"schema", "assay.trajectory-request.v1"},
      {"id", "numerics-at-divergence"},
      {"model_dir", model.string()},
      {"prompt_token_ids", kPrompt},
      {"continuations",
       {{{"engine", "kiln"}, {"token_ids", departs}}, {{"engine", "vllm"}, {"token_ids", ref}}}},
      {"block_positions", 3},
      {"numerics", spec}};
  auto sub = request_json(d, request);
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  std::string id = sub.json()["id"];
  Json job = wait_job(d.socket(), id, terminal, 300);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d.log());
  Json result = request_get(d, "/v1/jobs/" + id + "/result").json();
  const Json& n = result["numerics"];
  CAPTURE(n.dump(2));
  CHECK(n["candidates"] == Json::array({Json{{"engine", "kiln"}, {"token_id", departs[kDepartAt]}},
                                        Json{{"engine", "vllm"}, {"token_id", ref[kDepartAt]}}}));
  CHECK(n["members"][0]["name"] == "reference");
  // The envelope's reference at the divergence state is the trajectory's reference argmax.
  CHECK(n["members"][0]["argmax"] == result["divergence"]["argmax_by_capture"]["vllm"]);
  CHECK(n["verdict"]["reference_argmax"] == ref[kDepartAt]);
  // The state measured is the prompt and the shared prefix.
  Json input = common::parse_strict(slurp(d.state() / "jobs" / id / "numerics" / "input.json"));
  std::vector<std::int64_t> state(kPrompt.begin(), kPrompt.end());
  state.insert(state.end(), ref.begin(), ref.begin() + kDepartAt);
  CHECK(input["states"][0]["input_token_ids"] == Json(state));
  const std::string cls = n["verdict"]["class"];
  MESSAGE("divergence class " << cls << ": " << n["verdict"]["explanation"].get<std::string>());
  fs::path dir = tmp.path / "out";
  fs::create_directories(dir);
  spit(dir / "result.json", request_get(d, "/v1/jobs/" + id + "/result").body);
  spit(dir / "result.dsse.json", request_get(d, "/v1/jobs/" + id + "/attestation").body);
  std::string schemas =
      validate_schemas({{"trajectory-result", dir / "result.json"},
                        {"trajectory-request", d.state() / "jobs" / id / "request.json"}});
  CHECK_MESSAGE(schemas.rfind("0:", 0) == 0, schemas);
  const std::string pub = (d.state() / "keys" / "host.pub").string();
  std::string ok =
      run_capture(kClient + " verify " + (dir / "result.json").string() + " --pubkey " + pub +
                  " --envelope " + (dir / "result.dsse.json").string());
  CHECK_MESSAGE(ok.rfind("0:", 0) == 0, ok);
  CHECK_MESSAGE(ok.find("numerics.verdict") != std::string::npos, ok);
  CHECK_MESSAGE(ok.find("numerics.candidates") != std::string::npos, ok);

  // Equal continuations: nothing diverges, nothing is measured, and the result says why.
  Json same = request;
  same["id"] = "numerics-no-divergence";
  same["continuations"][0]["token_ids"] = ref;
  sub = request_json(d, same);
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  job = wait_job(d.socket(), sub.json()["id"], terminal, 300);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2));
  result = request_get(d, "/v1/jobs/" + job["id"].get<std::string>() + "/result").json();
  CHECK(result["numerics"]["reason"].get<std::string>().find("all equal") != std::string::npos);
  CHECK_FALSE(fs::exists(d.state() / "jobs" / job["id"].get<std::string>() / "numerics"));
  CHECK(d.stop() == 0);
}
