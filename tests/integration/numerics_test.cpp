// Bug or numerics through assayd: a next-token request with "numerics" gets the envelope's
// members, its class explained, and a record `assay verify` recomputes; on a state shaped like
// Kiln's real dispute (the top two logits two bf16 steps apart).
#include <doctest/doctest.h>

#include <map>

#include "common/audit.h"
#include "common/identity.h"
#include "common/numerics.h"
#include "common/result.h"
#include "tests/integration/harness.h"

namespace assay::test {
namespace {

// A state of `model` whose reference top two are two bf16 steps apart (tests/numerics).
Json two_step_state(const fs::path& model, const fs::path& log) {
  std::string cmd = std::string(ASSAY_PYTHON3) + " " + ASSAY_SOURCE_DIR +
                    "/tests/numerics/two_step_state.py " + model.string() + " 2> " + log.string();
  std::string out = run_capture(cmd);
  REQUIRE_MESSAGE(out.rfind("0:", 0) == 0, out << slurp(log.string()));
  return common::parse_strict(out.substr(out.find('{')));
}

}  // namespace

TEST_CASE(
    "numerics: Kiln's two-step dispute shape gets every member's figures, a class explained in "
    "the result, and a record assay verify recomputes; a resealed other class is caught") {
  if (!have(kFingerprint) || !have(kOracle) || !have(kHfWorker) || !have(kClient)) {
    MESSAGE("skipped: a worker or the client was not built");
    return;
  }
  TempDir tmp;
  fs::path model = fixture_model(tmp.path / "llama-tiny");
  Json state = two_step_state(model, tmp.path / "two_step.log");
  Json request = next_token_request("two-step", model);
  request["input_token_ids"] = state["input_token_ids"];
  request.erase("input_token_ids_sha256");
  request["candidates"] = Json::array(
      {Json{{"engine", "vllm"}, {"token_id", state["top"]}, {"text", state["top_text"]}},
       Json{{"engine", "kiln"}, {"token_id", state["second"]}, {"text", state["second_text"]}}});
  request["numerics"] = Json{{"reduction_seeds", 4}, {"batch_sizes", Json::array({3})}};
  Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
           {"--containment", containment(), "--fingerprint-worker", kFingerprint, "--oracle-worker",
            kOracle, "--hf-worker", kHfWorker});
  REQUIRE_MESSAGE(d.start(), d.log());
  auto sub = request_json(d, request);
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  const std::string id = sub.json()["id"];
  Json job = wait_job(d.socket(), id, terminal, 600);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d.log());
  Json result = request_get(d, "/v1/jobs/" + id + "/result").json();
  const Json& n = result["numerics"];
  CAPTURE(n.dump(2));
  // reference, reduction:0..3, sdpa, kv-cache, batched:3 (the worker's own reference dropped:
  // bitwise the oracle's), and the fp32 fact beside them.
  CHECK(n["transformers_reference_bitwise_equal"] == true);
  std::vector<std::string> names;
  for (const Json& m : n["members"]) names.push_back(m["name"]);
  CHECK(names == std::vector<std::string>{"reference", "reduction:0", "reduction:1", "reduction:2",
                                          "reduction:3", "sdpa", "kv-cache", "batched:3"});
  CHECK(n["members"][0]["logits_sha256"] == result["oracle"]["logits_sha256"]);
  CHECK(n["fp32"]["name"] == "fp32");
  const Json& v = n["verdict"];
  const double step = state["step"];
  CHECK(v["step"] == step);
  CHECK(v["reference_argmax"] == state["top"]);
  // Kiln's token trails the reference argmax by two steps in the reference.
  const Json& kiln =
      v["candidates"][0]["token_id"] == state["second"] ? v["candidates"][0] : v["candidates"][1];
  CHECK(kiln["engines"] == Json::array({"kiln"}));
  CHECK(kiln["gap"]["reference"] == 2 * step);
  const std::string cls = v["class"];
  CHECK((cls == "reference_decides" || cls == "numerically_tied"));
  const std::string why = v["explanation"];
  MESSAGE("class " << cls << ": " << why);
  CHECK(why.find("kiln") != std::string::npos);
  CHECK(why.find("bf16 steps") != std::string::npos);
  // The class follows from the figures by the rule, with the default policy.
  CHECK(n["policy"] == Json{{"spread_factor", 3.0}, {"margin_steps", 1.0}});
  const bool beyond =
      kiln["gap"]["min"].get<double>() > 3.0 * kiln["gap"]["spread"].get<double>() + 1.0 * step;
  CHECK((cls == "reference_decides") == (beyond && v["unanimous_argmax"] == state["top"]));
  // `assay status` says it in words.
  std::string status = run_capture(kClient + " --socket " + d.socket().string() + " status " + id);
  INFO(status);
  CHECK(status.find("numerics:") != std::string::npos);
  CHECK_MESSAGE(status.find(cls + ": ") != std::string::npos, status);

  fs::path dir = tmp.path / "out";
  fs::create_directories(dir);
  spit(dir / "result.json", request_get(d, "/v1/jobs/" + id + "/result").body);
  spit(dir / "result.dsse.json", request_get(d, "/v1/jobs/" + id + "/attestation").body);
  std::string schemas =
      validate_schemas({{"next-token-oracle-result", dir / "result.json"},
                        {"numerics-output", d.state() / "jobs" / id / "numerics" / "output.json"}});
  CHECK_MESSAGE(schemas.rfind("0:", 0) == 0, schemas);
  const std::string pub = (d.state() / "keys" / "host.pub").string();
  std::string ok =
      run_capture(kClient + " verify " + (dir / "result.json").string() + " --pubkey " + pub);
  CHECK_MESSAGE(ok.rfind("0:", 0) == 0, ok);
  CHECK_MESSAGE(ok.find("numerics.verdict") != std::string::npos, ok);

  // The other class, resealed (result_sha256 recomputed): the recomputation catches it.
  Json forged = result;
  forged["numerics"]["verdict"]["class"] =
      cls == "reference_decides" ? "numerically_tied" : "reference_decides";
  forged.erase("result_sha256");
  forged["result_sha256"] = common::compute_result_sha256(forged);
  spit(dir / "forged.json", common::canonical(forged));
  std::string bad =
      run_capture(kClient + " verify " + (dir / "forged.json").string() + " --pubkey " + pub +
                  " --envelope " + (dir / "result.dsse.json").string());
  CHECK_MESSAGE(bad.rfind("0:", 0) != 0, bad);
  CHECK_MESSAGE(bad.find("numerics.verdict") != std::string::npos, bad);
  CHECK_MESSAGE(bad.find("recomputed \"" + cls + "\"") != std::string::npos, bad);
  CHECK(d.stop() == 0);
}

TEST_CASE(
    "numerics: an engine audit over a panel calls a gross bug beyond_legitimate and a held-out "
    "legitimate engine within_legitimate, in signed records assay verify recomputes; a changed "
    "engine file and a wrong-shaped one are refused by name") {
  if (!have(kFingerprint) || !have(kHfWorker) || !have(kClient)) {
    MESSAGE("skipped: a worker or the client was not built");
    return;
  }
  TempDir tmp;
  fs::path model = fixture_model(tmp.path / "llama-tiny");
  // The engines' logits come from tests/numerics/engines.py (never the product's numerics code):
  // flash-style online softmax (legitimate, not a member of the envelope) and the last token's
  // position id one too large (a gross bug).
  auto panel = [&](const std::string& engine) {
    fs::path out = tmp.path / ("panel-" + engine);
    std::string cmd = std::string(ASSAY_PYTHON3) + " " + ASSAY_SOURCE_DIR +
                      "/tests/numerics/audit_panel.py " + model.string() + " " + out.string() +
                      " --engine " + engine + " --contexts 12 --length 24 --reduction-seeds 3 > " +
                      out.string() + ".log 2>&1";
    REQUIRE_MESSAGE(std::system(cmd.c_str()) == 0, slurp(out.string() + ".log"));
    return common::parse_strict(slurp((out / "request.json").string()));
  };
  Json flash = panel("flash"), position = panel("position");
  Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
           {"--containment", containment(), "--fingerprint-worker", kFingerprint, "--hf-worker",
            kHfWorker});
  REQUIRE_MESSAGE(d.start(), d.log());
  const std::string pub = (d.state() / "keys" / "host.pub").string();
  auto run = [&](const Json& request) {
    auto sub = request_json(d, request);
    REQUIRE_MESSAGE(sub.status == 201, sub.body);
    return wait_job(d.socket(), sub.json()["id"], terminal, 600);
  };
  std::map<std::string, Json> results;
  for (const Json* request : {&flash, &position}) {
    Json job = run(*request);
    REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d.log());
    const std::string id = job["id"];
    Json result = request_get(d, "/v1/jobs/" + id + "/result").json();
    const Json& s = result["statistics"];
    CAPTURE(s.dump(2));
    CHECK(result["members"] ==
          Json::array({"reference", "reduction:0", "reduction:1", "reduction:2", "sdpa"}));
    CHECK(s["positions"] == 12 * 24);
    CHECK(s["contexts"] == 12);
    CHECK(s["test"]["alpha"] == 0.01);
    fs::path dir = tmp.path / ("out-" + id);
    fs::create_directories(dir);
    spit(dir / "result.json", request_get(d, "/v1/jobs/" + id + "/result").body);
    spit(dir / "result.dsse.json", request_get(d, "/v1/jobs/" + id + "/attestation").body);
    spit(dir / "audit.json", request_get(d, "/v1/jobs/" + id + "/artifact").body);
    std::string schemas = validate_schemas(
        {{"engine-audit-result", dir / "result.json"},
         {"engine-audit-request", d.state() / "jobs" / id / "request.json"},
         {"audit-input", d.state() / "jobs" / id / "audit" / "input.json"},
         {"audit-output", dir / "audit.json"},
         {"process-containment", d.state() / "jobs" / id / "audit" / "evidence.json"}});
    CHECK_MESSAGE(schemas.rfind("0:", 0) == 0, schemas);
    std::string ok =
        run_capture(kClient + " verify " + (dir / "result.json").string() + " --pubkey " + pub +
                    " --envelope " + (dir / "result.dsse.json").string() + " --artifact " +
                    (dir / "audit.json").string());
    CHECK_MESSAGE(ok.rfind("0:", 0) == 0, ok);
    CHECK_MESSAGE(ok.find("audit.statistics") != std::string::npos, ok);
    CHECK_MESSAGE(ok.find("audit.sums") != std::string::npos, ok);
    results[result["engine"]["name"]] = result;
    // `assay status` says the class in words, with its figures.
    std::string status =
        run_capture(kClient + " --socket " + d.socket().string() + " status " + id);
    CHECK_MESSAGE(status.find("audit:") != std::string::npos, status);
    CHECK_MESSAGE(status.find(s["class"].get<std::string>() + ": The engine") != std::string::npos,
                  status);
    CHECK_MESSAGE(status.find("x the legitimate spread") != std::string::npos, status);
    if (result["engine"]["name"] != "position") continue;

    // The other class, resealed (result_sha256 recomputed): the recomputation catches it; a sum
    // changed in the record no longer adds up from the artifact.
    Json forged = result;
    forged["statistics"]["class"] = "within_legitimate";
    forged.erase("result_sha256");
    forged["result_sha256"] = common::compute_result_sha256(forged);
    spit(dir / "forged.json", common::canonical(forged));
    std::string bad =
        run_capture(kClient + " verify " + (dir / "forged.json").string() + " --pubkey " + pub);
    CHECK_MESSAGE(bad.rfind("0:", 0) != 0, bad);
    CHECK_MESSAGE(bad.find("audit.statistics") != std::string::npos, bad);
    forged = result;
    forged["contexts"][0]["engine_sum"] = forged["contexts"][0]["engine_sum"].get<double>() * 0.5;
    forged["statistics"] =
        common::audit_statistics(forged["members"], forged["contexts"], common::AuditPolicy{});
    forged.erase("result_sha256");
    forged["result_sha256"] = common::compute_result_sha256(forged);
    spit(dir / "forged.json", common::canonical(forged));
    bad = run_capture(kClient + " verify " + (dir / "forged.json").string() + " --pubkey " + pub +
                      " --artifact " + (dir / "audit.json").string());
    CHECK_MESSAGE(bad.rfind("0:", 0) != 0, bad);
    CHECK_MESSAGE(bad.find("figures do not add up to the record") != std::string::npos, bad);
  }
  const Json& gross = results["position"]["statistics"];
  CHECK(gross["class"] == "beyond_legitimate");
  CHECK(gross["ci95"][0].get<double>() > 2.0);
  CHECK(gross["test"]["p_value"].get<double>() < 1e-6);
  CHECK(results["position"]["engine"]["argmax_differs_from_reference"].get<int>() > 0);
  const Json& legit = results["flash"]["statistics"];
  CHECK(legit["class"] == "within_legitimate");
  CHECK(legit["ratio"].get<double>() < 1.1);
  MESSAGE("flash: " << legit["explanation"].get<std::string>());
  MESSAGE("position: " << gross["explanation"].get<std::string>());

  // A file that changed after submission: the worker checks every digest before it builds the
  // model, and the job fails naming the file.
  Json changed = flash;
  changed["id"] = "audit-changed";
  const std::string path = changed["engine"]["logits"][3]["path"];
  std::string bytes = slurp(path);
  bytes[bytes.size() - 1] ^= 1;
  spit(path, bytes);
  Json job = run(changed);
  CHECK(job["state"] == "failed");
  CHECK(job["error"]["message"].get<std::string>().find(
            "[job.bytes_mismatch]: the engine's logits file of contexts[3] (c3) has sha256:") !=
        std::string::npos);

  // A file of the wrong shape is refused at submission, naming the tensor and what it must be.
  Json wrong = position;
  wrong["id"] = "audit-wrong-shape";
  wrong["panel"]["contexts"][1]["token_ids"].erase(0);
  auto sub = request_json(d, wrong);
  CHECK(sub.status == 422);
  CHECK_MESSAGE(sub.body.find("request.bad_logits_file") != std::string::npos, sub.body);
  CHECK_MESSAGE(sub.body.find("request.engine.logits[1].path") != std::string::npos, sub.body);
  CHECK_MESSAGE(sub.body.find("is F32 [24,272], not F32 or BF16 [23,272]") != std::string::npos,
                sub.body);
  CHECK(d.stop() == 0);
}

TEST_CASE("numerics: a bad numerics spec is refused at submission, naming the field") {
  TempDir tmp;
  fs::path model = tmp.path / "model";
  fs::create_directories(model);
  spit(model / "config.json", R"({"model_type":"llama","vocab_size":260})");
  Daemon d(
      tmp.path / "state", tmp.path / "assayd.sock",
      {"--containment", "none", "--fingerprint-worker", "/bin/false", "--hf-worker", kHfWorker});
  REQUIRE_MESSAGE(d.start(), d.log());
  for (const auto& [spec, field] : std::vector<std::pair<Json, std::string>>{
           {Json{{"reduction_seeds", 65}}, "request.numerics.reduction_seeds"},
           {Json{{"batch_sizes", Json::array({1})}}, "request.numerics.batch_sizes"},
           {Json{{"spread_factor", 0.5}}, "request.numerics.spread_factor"},
           {Json{{"sdpa", "yes"}}, "request.numerics.sdpa"},
           {Json{{"seeds", 4}}, "seeds"},
           {Json::array(), "request.numerics"}}) {
    Json r = next_token_request("bad-numerics", model);
    r["numerics"] = spec;
    auto sub = request_json(d, r);
    CHECK_MESSAGE(sub.status == 422, sub.body);
    CHECK_MESSAGE(sub.body.find(field) != std::string::npos, field << ": " << sub.body);
  }
  CHECK(d.stop() == 0);
}

}  // namespace assay::test
