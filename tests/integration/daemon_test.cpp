// End-to-end tests of assayd through its real unix socket.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
#include <sched.h>

#include <sys/stat.h>
#include <atomic>

#include "common/identity.h"
#include "common/request.h"
#include "common/result.h"
#include "common/sign.h"
#include "tests/integration/harness.h"

using namespace assay::test;
namespace common = assay::common;

namespace {

// A model directory the daemon can validate requests against (config.json only): enough for
// every check that happens before a job is queued.
fs::path make_config_only_model(const fs::path& dir) {
  fs::create_directories(dir);
  spit(dir / "config.json", R"({"model_type":"llama","vocab_size":260})");
  return dir;
}

}  // namespace

TEST_CASE("assayd answers health, info and metrics on a 0660 unix socket") {
  TempDir tmp;
  Daemon d(tmp.path / "state", tmp.path / "assayd.sock", {"--containment", "none"});
  REQUIRE_MESSAGE(d.start(), d.log());
  struct stat st {};
  REQUIRE(::stat(d.socket().c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0660);
  auto health = request(d.socket(), "GET", "/v1/health");
  CHECK(health.status == 200);
  CHECK(health.json()["status"] == "ok");
  auto info = request(d.socket(), "GET", "/v1/info").json();
  CHECK(info["containment"]["backend"] == "none");
  CHECK(common::is_identity(info["key_id"].get<std::string>()));
  CHECK(info["limits"]["max_body_bytes"].get<long>() > 0);
  // The host key is created on first start, private and 0600.
  REQUIRE(::stat((d.state() / "keys" / "host.key").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  auto metrics = request(d.socket(), "GET", "/metrics");
  CHECK(metrics.status == 200);
  CHECK(metrics.body.find("assay_jobs{state=\"queued\"} 0") != std::string::npos);
  CHECK(metrics.body.find("assay_build_info{") != std::string::npos);
  CHECK(d.stop() == 0);
  CHECK_FALSE(fs::exists(d.socket()));
}

TEST_CASE("bad inputs each get a clear 4xx and the daemon keeps serving") {
  TempDir tmp;
  fs::path model = make_config_only_model(tmp.path / "model");
  fs::create_directory_symlink(model, tmp.path / "model-link");
  spit(tmp.path / "plain-file", "x");
  spit(tmp.path / "config.json",
       R"({"max_body_bytes":65536,"max_header_bytes":4096,"read_timeout_ms":1500})");
  Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
           {"--containment", "none", "--config", (tmp.path / "config.json").string()});
  REQUIRE_MESSAGE(d.start(), d.log());

  Json good = next_token_request("bad-inputs", model);
  auto with = [&](const std::string& pointer, Json value) {
    Json doc = good;
    doc[Json::json_pointer(pointer)] = value;
    return doc.dump();
  };
  auto without = [&](const std::string& key) {
    Json doc = good;
    doc.erase(key);
    return doc.dump();
  };
  Json kiln = kiln_request(fake_identity());
  auto kiln_with = [&](const std::string& pointer, Json value) {
    Json doc = kiln;
    doc[Json::json_pointer(pointer)] = value;
    return doc.dump();
  };
  std::string q = "?model=" + model.string();

  struct Case {
    std::string name, method, target, body;
    int status;
    std::string code;
  };
  std::vector<Case> cases{
      {"malformed JSON", "POST", "/v1/jobs", "{\"schema\":", 400, "json.invalid"},
      {"empty body", "POST", "/v1/jobs", "", 400, "json.invalid"},
      {"duplicate keys", "POST", "/v1/jobs",
       R"({"schema":"assay.next-token-request.v1","schema":"x"})", 400, "json.invalid"},
      {"trailing data", "POST", "/v1/jobs", good.dump() + "x", 400, "json.invalid"},
      {"NaN", "POST", "/v1/jobs", R"({"schema":NaN})", 400, "json.invalid"},
      {"not an object", "POST", "/v1/jobs", "[1,2]", 422, "request.invalid"},
      {"wrong schema", "POST", "/v1/jobs", with("/schema", "assay.next-token-request.v9"), 422,
       "request.unknown_schema"},
      {"unknown field", "POST", "/v1/jobs", with("/surprise", 1), 422, "request.invalid"},
      {"unknown candidate field", "POST", "/v1/jobs", with("/candidates/0/logit", 1.0), 422,
       "request.invalid"},
      {"missing candidates", "POST", "/v1/jobs", without("candidates"), 422, "request.invalid"},
      {"one candidate", "POST", "/v1/jobs",
       with("/candidates", Json::array({good["candidates"][0]})), 422, "request.invalid"},
      {"duplicate engine", "POST", "/v1/jobs", with("/candidates/1/engine", "kiln"), 422,
       "request.invalid"},
      {"empty input ids", "POST", "/v1/jobs", with("/input_token_ids", Json::array()), 422,
       "request.invalid"},
      {"negative token id", "POST", "/v1/jobs", with("/input_token_ids/0", -5), 422,
       "request.invalid_token_id"},
      {"float token id", "POST", "/v1/jobs", with("/input_token_ids/0", 1.5), 422,
       "request.invalid_token_id"},
      {"input token id >= vocab", "POST", "/v1/jobs", with("/input_token_ids/2", 260), 422,
       "request.invalid_token_id"},
      {"candidate token id >= vocab", "POST", "/v1/jobs", with("/candidates/1/token_id", 100000),
       422, "request.invalid_token_id"},
      {"bad input sha", "POST", "/v1/jobs",
       with("/input_token_ids_sha256", "sha256:" + std::string(64, '0')), 422,
       "request.sha_mismatch"},
      {"malformed sha", "POST", "/v1/jobs", with("/input_token_ids_sha256", "sha256:XYZ"), 422,
       "request.invalid"},
      {"bad limits", "POST", "/v1/jobs", with("/limits", Json{{"memory_bytes", 5}}), 422,
       "request.invalid"},
      {"nonexistent model", "POST", "/v1/jobs", with("/model_dir", (tmp.path / "nope").string()),
       422, "request.bad_model"},
      {"symlinked model", "POST", "/v1/jobs",
       with("/model_dir", (tmp.path / "model-link").string()), 422, "request.bad_model"},
      {"symlink inside model path", "POST", "/v1/jobs",
       with("/model_dir", (tmp.path / "model-link" / ".").string()), 422, "request.bad_model"},
      {"model path is a file", "POST", "/v1/jobs",
       with("/model_dir", (tmp.path / "plain-file").string()), 422, "request.bad_model"},
      {"model without config", "POST", "/v1/jobs", with("/model_dir", tmp.path.string()), 422,
       "request.bad_model"},
      {"relative model query", "POST", "/v1/jobs?model=relative/dir", good.dump(), 422,
       "request.bad_model"},
      {"unknown query parameter", "POST", "/v1/jobs?priority=1", good.dump(), 422, "api.bad_query"},
      {"Kiln without a model dir", "POST", "/v1/jobs", kiln.dump(), 422, "request.no_model_dir"},
      {"inconsistent Kiln ids", "POST", "/v1/jobs" + q, kiln_with("/input_token_ids/4", 112), 422,
       "request.inconsistent_token_ids"},
      {"Kiln prompt mismatch", "POST", "/v1/jobs" + q, kiln_with("/prompt/token_ids/0", 73), 422,
       "request.inconsistent_token_ids"},
      {"bad Kiln ids sha", "POST", "/v1/jobs" + q,
       kiln_with("/input_token_ids_sha256", "sha256:" + std::string(64, 'f')), 422,
       "request.sha_mismatch"},
      {"bad Kiln content sha", "POST", "/v1/jobs" + q,
       kiln_with("/model_identity/content_sha256", "sha256:" + std::string(64, 'e')), 422,
       "request.sha_mismatch"},
      {"Kiln unknown field", "POST", "/v1/jobs" + q, kiln_with("/model_dir", model.string()), 422,
       "request.invalid"},
      {"oversize body", "POST", "/v1/jobs", std::string(70000, ' '), 413, "api.body_too_large"},
      {"bad job id", "GET", "/v1/jobs/../../etc/passwd", "", 400, "api.bad_job_id"},
      {"unknown job", "GET", "/v1/jobs/j-000000000000000000000000", "", 404, "api.no_such_job"},
      {"unknown job result", "GET", "/v1/jobs/j-000000000000000000000000/result", "", 404,
       "api.no_such_job"},
      {"cancel unknown job", "DELETE", "/v1/jobs/j-000000000000000000000000", "", 404,
       "api.no_such_job"},
      {"bad state filter", "GET", "/v1/jobs?state=sleeping", "", 400, "api.bad_state"},
      {"unknown route", "GET", "/v2/jobs", "", 404, "api.not_found"},
      {"wrong method", "PUT", "/v1/jobs", "{}", 405, "api.method_not_allowed"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.name);
    auto r = request(d.socket(), c.method, c.target, c.body);
    CHECK(r.status == c.status);
    REQUIRE_MESSAGE(r.status != 0, "daemon stopped answering: " << d.log());
    auto j = r.json();
    CHECK(j["error"]["code"] == c.code);
    CHECK_FALSE(j["error"]["message"].get<std::string>().empty());
  }
  CHECK(cases.size() >= 30);
  // An unknown schema is answered with every schema the endpoint takes.
  std::string unknown = request(d.socket(), "POST", "/v1/jobs", with("/schema", "x.v1")).body;
  for (const char* schema :
       {"assay.next-token-request.v1", "kiln.hf-next-token-request.v1", "assay.fidelity-request.v1",
        "assay.trajectory-request.v1", "assay.layer-attribution-request.v1",
        "assay.engine-audit-request.v1", "assay.next-token-batch-request.v1"})
    CHECK_MESSAGE(unknown.find(schema) != std::string::npos, schema << " not in " << unknown);

  // Header too large, and bytes that are not HTTP.
  auto big = raw_request(
      d.socket(), "GET /v1/health HTTP/1.1\r\nX-Big: " + std::string(8000, 'a') + "\r\n\r\n");
  CHECK(big.status == 431);
  auto garbage = raw_request(d.socket(), "\x01\x02 nonsense\r\n\r\n");
  CHECK(garbage.status == 400);

  // A client that trickles bytes is cut off at the read deadline (1.5 s here).
  int fd = connect_unix(d.socket());
  REQUIRE(fd >= 0);
  auto t0 = std::chrono::steady_clock::now();
  std::string partial = "POST /v1/jobs HTTP/1.1\r\nContent-Length: 100\r\n\r\n{";
  bool cut = false;
  for (int i = 0; i < 60 && !cut; ++i) {
    cut = ::send(fd, partial.data() + (i < (int)partial.size() ? i : 0), 1, MSG_NOSIGNAL) < 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    char c;
    if (::recv(fd, &c, 1, MSG_DONTWAIT) == 0) cut = true;
  }
  double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ::close(fd);
  CHECK(cut);
  CHECK(waited < 4.0);

  // Nothing bad was stored, and the daemon still serves.
  CHECK(request(d.socket(), "GET", "/v1/jobs").json()["jobs"].empty());
  CHECK(request(d.socket(), "GET", "/v1/health").status == 200);
}

TEST_CASE("64 concurrent clients x 100 status requests all succeed") {
  TempDir tmp;
  fs::path model = make_config_only_model(tmp.path / "model");
  // /bin/false as the fingerprint worker: the job fails fast, which is all this test needs.
  Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
           {"--containment", "none", "--fingerprint-worker", "/bin/false"});
  REQUIRE_MESSAGE(d.start(), d.log());
  auto sub =
      request(d.socket(), "POST", "/v1/jobs", next_token_request("status-load", model).dump());
  REQUIRE(sub.status == 201);
  std::string id = sub.json()["id"];
  Json job = wait_job(d.socket(), id, terminal, 30);
  CHECK(job["state"] == "failed");
  CHECK(job["error"]["code"] == "worker.fingerprint_failed");

  std::atomic<int> ok{0}, bad{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < 64; ++c)
    clients.emplace_back([&] {
      for (int i = 0; i < 100; ++i) {
        auto r = request(d.socket(), "GET", "/v1/jobs/" + id);
        (r.status == 200 && r.body.find(id) != std::string::npos ? ok : bad)++;
      }
    });
  for (auto& t : clients) t.join();
  CHECK(ok == 6400);
  CHECK(bad == 0);
}

TEST_CASE("resubmitting an identical request returns the existing job, also after a restart") {
  TempDir tmp;
  fs::path model = make_config_only_model(tmp.path / "model");
  std::vector<std::string> args{"--containment", "none", "--fingerprint-worker", "/bin/false"};
  Daemon d(tmp.path / "state", tmp.path / "assayd.sock", args);
  REQUIRE_MESSAGE(d.start(), d.log());
  std::string body = next_token_request("dedup", model).dump();
  auto first = request(d.socket(), "POST", "/v1/jobs", body);
  REQUIRE(first.status == 201);
  auto again = request(d.socket(), "POST", "/v1/jobs", Json::parse(body).dump(2));
  CHECK(again.status == 200);
  CHECK(again.json()["id"] == first.json()["id"]);
  CHECK(again.json()["duplicate"] == true);
  wait_job(d.socket(), first.json()["id"], terminal, 30);
  d.kill9();
  REQUIRE_MESSAGE(d.start(), d.log());
  auto after = request(d.socket(), "POST", "/v1/jobs", body);
  CHECK(after.status == 200);
  CHECK(after.json()["id"] == first.json()["id"]);
  auto list = request(d.socket(), "GET", "/v1/jobs?state=failed").json();
  CHECK(list["jobs"].size() == 1);
}

TEST_CASE("a job whose model differs from the expected identity fails naming both identities") {
  if (!have(kFingerprint)) {
    MESSAGE("skipped: assay-fingerprint was not built");
    return;
  }
  TempDir tmp;
  fs::path model = make_config_only_model(tmp.path / "model");
  spit(model / "tokenizer.json", R"({"model":{"vocab":{}}})");
  spit(model / "model.safetensors", std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
  Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
           {"--containment", "none", "--fingerprint-worker", kFingerprint});
  REQUIRE_MESSAGE(d.start(), d.log());
  Json doc = kiln_request(fake_identity());
  auto sub = request(d.socket(), "POST", "/v1/jobs?model=" + model.string(), doc.dump());
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  Json job = wait_job(d.socket(), sub.json()["id"], terminal, 60);
  CHECK(job["state"] == "failed");
  std::string message = job["error"]["message"];
  CAPTURE(message);
  if (job["error"]["code"] == "job.identity_mismatch") {
    CHECK(message.find(fake_identity()["content_sha256"].get<std::string>()) != std::string::npos);
  } else {
    // The fingerprint worker refused this hand-made directory; its reason is in the error.
    CHECK(job["error"]["code"] == "worker.fingerprint_failed");
  }
}

TEST_CASE(
    "a reference worker gets every CPU of assayd's affinity by default, worker_threads where "
    "configured; a value past 1024 is refused by name") {
  if (!have(kFingerprint) || !have(kOracle)) {
    MESSAGE("skipped: assay-fingerprint or assay-oracle was not built");
    return;
  }
  TempDir tmp;
  fs::path model = fixture_model(tmp.path / "llama-tiny");
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(::sched_getaffinity(0, sizeof(set), &set) == 0);
  const int cpus = CPU_COUNT(&set);
  auto threads_of_a_job = [&](const std::string& name, const std::string& config) {
    spit(tmp.path / (name + ".json"), config);
    Daemon d(tmp.path / ("state-" + name), tmp.path / (name + ".sock"),
             {"--containment", containment(), "--fingerprint-worker", kFingerprint,
              "--oracle-worker", kOracle, "--config", (tmp.path / (name + ".json")).string()});
    REQUIRE_MESSAGE(d.start(), d.log());
    auto sub = request(d.socket(), "POST", "/v1/jobs", next_token_request(name, model).dump());
    REQUIRE_MESSAGE(sub.status == 201, sub.body);
    Json job = wait_job(d.socket(), sub.json()["id"], terminal, 300);
    REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d.log());
    auto reply = request(d.socket(), "GET", "/v1/jobs/" + job["id"].get<std::string>() + "/result");
    REQUIRE(reply.status == 200);
    return reply.json()["oracle"]["threads"];
  };
  // No core is kept back for assayd: the worker runs SCHED_BATCH at nice 10.
  CHECK(threads_of_a_job("default", "{}") == cpus);
  CHECK(threads_of_a_job("one", R"({"worker_threads": 1})") == 1);

  spit(tmp.path / "bad.json", R"({"worker_threads": 5000})");
  Daemon bad(tmp.path / "state-bad", tmp.path / "bad.sock",
             {"--containment", "none", "--config", (tmp.path / "bad.json").string()});
  CHECK_FALSE(bad.start());
  CHECK_MESSAGE(bad.log().find("config.worker_threads must be 0 (every CPU) to 1024, got 5000") !=
                    std::string::npos,
                bad.log());
}

TEST_CASE("a real job runs both contained workers and returns a verifiable signed result") {
  if (!have(kFingerprint) || !have(kOracle)) {
    MESSAGE("skipped: assay-fingerprint or assay-oracle was not built");
    return;
  }
  TempDir tmp;
  fs::path model = fixture_model(tmp.path / "llama-tiny");
  Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
           {"--containment", containment(), "--fingerprint-worker", kFingerprint, "--oracle-worker",
            kOracle});
  REQUIRE_MESSAGE(d.start(), d.log());
  auto sub = request(d.socket(), "POST", "/v1/jobs", next_token_request("e2e", model).dump());
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  std::string id = sub.json()["id"];
  Json job = wait_job(d.socket(), id, terminal, 300);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d.log());

  // The event stream replays every phase and ends with the terminal state.
  auto events = request(d.socket(), "GET", "/v1/jobs/" + id + "/events");
  CHECK(events.status == 200);
  CHECK(events.body.find("\"phase\":\"fingerprint\"") != std::string::npos);
  CHECK(events.body.find("\"phase\":\"oracle\"") != std::string::npos);
  CHECK(events.body.find("\"state\":\"succeeded\"") != std::string::npos);

  auto result_reply = request(d.socket(), "GET", "/v1/jobs/" + id + "/result");
  REQUIRE(result_reply.status == 200);
  Json result = result_reply.json();
  CHECK(common::canonical(result) == result_reply.body);
  CHECK_NOTHROW(common::verify_result_sha256(result));
  CHECK(result["verdict"]["argmax_token_id"] == result["oracle"]["argmax"]);
  std::string winner = result["verdict"]["argmax_candidate"];
  CHECK((winner == "kiln" || winner == "vllm" || winner == "neither"));
  CHECK(result["request"]["sha256"] ==
        common::sha256_canonical_id(next_token_request("e2e", model)));

  auto artifact = request(d.socket(), "GET", "/v1/jobs/" + id + "/artifact");
  CHECK(artifact.status == 200);
  CHECK(common::sha256_id(artifact.body) == result["reference_artifact"]["sha256"]);

  // DSSE: verifies with the published key, subjects match both files.
  auto envelope = request(d.socket(), "GET", "/v1/jobs/" + id + "/attestation").json();
  std::string pub = slurp(d.state() / "keys" / "host.pub");
  Json statement =
      common::parse_strict(common::dsse_verify(envelope, common::public_key_raw_from_pem(pub)));
  CHECK(statement["subject"][0]["digest"]["sha256"] ==
        common::sha256_id(result_reply.body).substr(7));
  CHECK(statement["subject"][1]["digest"]["sha256"] == common::sha256_id(artifact.body).substr(7));

  // ... and with plain openssl over the DSSE pre-authentication encoding.
  spit(tmp.path / "pae.bin",
       common::dsse_pae(envelope["payloadType"].get<std::string>(),
                        common::base64_decode(envelope["payload"].get<std::string>())));
  spit(tmp.path / "sig.bin",
       common::base64_decode(envelope["signatures"][0]["sig"].get<std::string>()));
  std::string openssl =
      run_capture("openssl pkeyutl -verify -pubin -inkey " +
                  (d.state() / "keys" / "host.pub").string() + " -rawin -in " +
                  (tmp.path / "pae.bin").string() + " -sigfile " + (tmp.path / "sig.bin").string());
  CHECK_MESSAGE(openssl.rfind("0:", 0) == 0, openssl);

  // assay verify, when the client was built.
  if (have(kClient)) {
    spit(tmp.path / "result.json", result_reply.body);
    spit(tmp.path / "result.dsse.json", envelope.dump());
    std::string v = run_capture(kClient + " verify " + (tmp.path / "result.json").string() +
                                " --envelope " + (tmp.path / "result.dsse.json").string() +
                                " --pubkey " + (d.state() / "keys" / "host.pub").string());
    CHECK_MESSAGE(v.rfind("0:", 0) == 0, v);
  } else {
    MESSAGE("assay verify not checked: the client was not built");
  }

  // Every document the daemon wrote validates against its schema.
  fs::path dir = d.state() / "jobs" / id;
  std::string validate =
      validate_schemas({{"next-token-oracle-result", (dir / "result.json")},
                        {"next-token-request", (dir / "request.json")},
                        {"fingerprint-input", (dir / "fingerprint" / "input.json")},
                        {"oracle-input", (dir / "oracle" / "input.json")},
                        {"process-containment", (dir / "oracle" / "evidence.json")}});
  CHECK_MESSAGE(validate.rfind("0:", 0) == 0, validate);

  // Kiln v2's evidence, measured: the source tree, the bytes of every executable and of the
  // LibTorch the oracle mapped, the enforced configuration, and normalised memory counters.
  const Json& source = result["source"];
  CHECK((source["git_commit"].is_string() ? source["reason"].is_null()
                                          : source["reason"].is_string()));
  const Json& impl = result["implementation"];
  CHECK(impl["executables"]["assay-oracle"]["sha256"] == common::sha256_file_id(kOracle));
  CHECK(impl["executables"]["assay-oracle"]["sha256"] == result["oracle"]["executable_sha256"]);
  CHECK(impl["executables"]["assay-fingerprint"]["sha256"] ==
        result["model_fingerprint"]["implementation_sha256"]);
  bool libtorch = false;
  for (const Json& l : impl["libraries"]) {
    CHECK(l["sha256"] == common::sha256_file_id(l["path"].get<std::string>()));
    libtorch = libtorch || l["path"].get<std::string>().find("libtorch_cpu") != std::string::npos;
  }
  CHECK(libtorch);
  CHECK(result["oracle"]["configuration_sha256"] ==
        common::sha256_canonical_id(result["oracle"]["configuration"]));
  CHECK(result["oracle"]["configuration"]["deterministic_algorithms"] == true);
  CHECK(result["oracle"]["runtime"]["gpu"].is_null());
  CHECK(!result["oracle"]["runtime"]["show_config"].get<std::string>().empty());
  const Json& n = result["oracle"]["process"]["normalised"];
  CHECK(n["memory_peak_bytes"] == result["oracle"]["process"]["memory"]["peak_bytes"]);
  CHECK(n["exit_code"] == 0);
  CHECK(n["memory_oom_kill_events"] == 0);
  CHECK(n["elapsed_seconds"].get<double>() > 0);

  auto metrics = request(d.socket(), "GET", "/metrics").body;
  CHECK(metrics.find("assay_jobs{state=\"succeeded\"} 1") != std::string::npos);
}

TEST_CASE("kill -9 of assayd while a job runs loses nothing: the job is re-run after restart") {
  if (!have(kFingerprint) || !have(kOracle)) {
    MESSAGE("skipped: assay-fingerprint or assay-oracle was not built");
    return;
  }
  TempDir tmp;
  fs::path model = fixture_model(tmp.path / "llama-tiny");
  fs::path slow = slow_wrapper(tmp.path, kOracle, 3);
  Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
           {"--containment", containment(), "--fingerprint-worker", kFingerprint, "--oracle-worker",
            slow.string()});
  REQUIRE_MESSAGE(d.start(), d.log());
  auto running = request(d.socket(), "POST", "/v1/jobs", next_token_request("crash", model).dump());
  auto queued =
      request(d.socket(), "POST", "/v1/jobs", next_token_request("crash-2", model).dump());
  REQUIRE(running.status == 201);
  REQUIRE(queued.status == 201);
  std::string id = running.json()["id"], id2 = queued.json()["id"];
  Json job = wait_job(
      d.socket(), id, [](const Json& j) { return j["phase"] == "oracle"; }, 120);
  REQUIRE(job["phase"] == "oracle");
  d.kill9();
  Json on_disk = common::parse_strict(slurp(d.state() / "jobs" / id / "job.json"));
  CHECK(on_disk["state"] == "running");

  REQUIRE_MESSAGE(d.start(), d.log());
  job = wait_job(d.socket(), id, terminal, 300);
  CHECK_MESSAGE(job["state"] == "succeeded", job.dump(2));
  CHECK(job["attempts"] == 2);
  Json job2 = wait_job(d.socket(), id2, terminal, 300);
  CHECK(job2["state"] == "succeeded");

  // A finished result is served unchanged after another crash.
  std::string before = request(d.socket(), "GET", "/v1/jobs/" + id + "/result").body;
  d.kill9();
  REQUIRE_MESSAGE(d.start(), d.log());
  CHECK(request(d.socket(), "GET", "/v1/jobs/" + id + "/result").body == before);
}

TEST_CASE("cancelling a running job kills its worker and keeps the evidence") {
  if (!have(kFingerprint) || !have(kOracle)) {
    MESSAGE("skipped: assay-fingerprint or assay-oracle was not built");
    return;
  }
  TempDir tmp;
  fs::path model = fixture_model(tmp.path / "llama-tiny");
  fs::path slow = slow_wrapper(tmp.path, kOracle, 30);
  Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
           {"--containment", containment(), "--fingerprint-worker", kFingerprint, "--oracle-worker",
            slow.string()});
  REQUIRE_MESSAGE(d.start(), d.log());
  std::string id =
      request(d.socket(), "POST", "/v1/jobs", next_token_request("cancel", model).dump())
          .json()["id"];
  Json job = wait_job(
      d.socket(), id, [](const Json& j) { return j["phase"] == "oracle"; }, 120);
  REQUIRE(job["phase"] == "oracle");
  auto t0 = std::chrono::steady_clock::now();
  CHECK(request(d.socket(), "DELETE", "/v1/jobs/" + id).status == 202);
  job = wait_job(d.socket(), id, terminal, 20);
  CHECK(job["state"] == "cancelled");
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
  CHECK(fs::exists(d.state() / "jobs" / id / "oracle" / "evidence.json"));
  CHECK(request(d.socket(), "GET", "/v1/jobs/" + id + "/result").status == 409);
}

// A fingerprint worker that first writes `mib` MiB through its own page cache (synchronously, so
// that every page can be reclaimed): in a cgroup whose memory.max is below that, the kernel
// counts charges that hit the limit (v1 memory.failcnt, v2 memory.events max) and the worker
// still succeeds. Real memory pressure, on a real worker.
fs::path pressing_wrapper(const fs::path& dir, const std::string& real, int mib) {
  fs::path p = dir / "pressing-fingerprint";
  spit(p, "#!/bin/sh\ndd if=/dev/zero of=ballast bs=1M count=" + std::to_string(mib) +
              " oflag=dsync status=none || exit 9\nrm -f ballast\nexec " + real + " \"$@\"\n");
  ::chmod(p.c_str(), 0755);
  return p;
}

TEST_CASE(
    "memory_events: record keeps a worker's memory pressure as evidence, reject fails the job "
    "naming the counter, and a Kiln request rejects by default") {
  if (!have(kFingerprint) || !have(kOracle)) {
    MESSAGE("skipped: assay-fingerprint or assay-oracle was not built");
    return;
  }
  if (containment() == "none") {
    MESSAGE("skipped: without a cgroup there is no memory counter to see pressure in");
    return;
  }
  TempDir tmp;
  fs::path model = fixture_model(tmp.path / "llama-tiny");
  constexpr std::uint64_t kLimit = 768ull << 20;
  // Every job runs the (pressing) fingerprint worker: without the cache, none reuses an earlier
  // job's fingerprint of the unchanged model.
  spit(tmp.path / "assayd.json", R"({"fingerprint_cache": false})");
  Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
           {"--containment", containment(), "--config", (tmp.path / "assayd.json").string(),
            "--fingerprint-worker", pressing_wrapper(tmp.path, kFingerprint, 1024).string(),
            "--oracle-worker", kOracle});
  REQUIRE_MESSAGE(d.start(), d.log());

  // The configured policy (record): the job succeeds and its evidence shows the counter.
  Json doc = next_token_request("pressure-recorded", model);
  doc["limits"] = {{"memory_bytes", kLimit}};
  auto sub = request_json(d, doc);
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  std::string id = sub.json()["id"];
  Json job = wait_job(d.socket(), id, terminal, 300);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d.log());
  Json evidence = common::parse_strict(
      slurp((d.state() / "jobs" / id / "fingerprint" / "evidence.json").string()));
  CAPTURE(evidence["normalised"].dump());
  CHECK(evidence["normalised"]["memory_max_events"].get<std::uint64_t>() > 0);
  Json result = request_get(d, "/v1/jobs/" + id + "/result").json();

  // The same dispute asking reject: the job fails at the fingerprint, naming the counter.
  doc["id"] = "pressure-rejected";
  doc["limits"]["memory_events"] = "reject";
  job = wait_job(d.socket(), request_json(d, doc).json()["id"], terminal, 300);
  CHECK(job["state"] == "failed");
  CHECK(job["error"]["code"] == "worker.memory_pressure");
  std::string message = job["error"]["message"];
  CAPTURE(message);
  CHECK(message.find("fingerprint worker saw memory pressure (") == 0);
  CHECK((message.find("memory.failcnt = ") != std::string::npos ||
         message.find("memory.events:max = ") != std::string::npos));

  // A Kiln request of that model, with no memory_events: Kiln's rule, reject.
  Json kiln = kiln_request(result["model_identity"]);
  kiln["limits"] = {{"memory_bytes", kLimit}};
  auto ksub = request(d.socket(), "POST", "/v1/jobs?model_dir=" + model.string(), kiln.dump());
  REQUIRE_MESSAGE(ksub.status == 201, ksub.body);
  job = wait_job(d.socket(), ksub.json()["id"], terminal, 300);
  CHECK(job["error"]["code"] == "worker.memory_pressure");
}

TEST_CASE("under memory_events reject a request may not ask record, and a bad policy is named") {
  TempDir tmp;
  fs::path model = make_config_only_model(tmp.path / "model");
  spit(tmp.path / "assayd.json", R"({"memory_events": "reject"})");
  Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
           {"--containment", "none", "--config", (tmp.path / "assayd.json").string()});
  REQUIRE_MESSAGE(d.start(), d.log());
  Json doc = next_token_request("weaker", model);
  doc["limits"] = {{"memory_events", "record"}};
  auto weaker = request_json(d, doc);
  CHECK(weaker.status == 422);
  CHECK(weaker.body.find("request.limit_above_max") != std::string::npos);
  CHECK(weaker.body.find("memory_events \\\"record\\\" is weaker than the configured") !=
        std::string::npos);
  doc["limits"] = {{"memory_events", "ignore"}};
  auto bad = request_json(d, doc);
  CHECK(bad.status == 422);
  CHECK(bad.body.find("request.limits.memory_events must be \\\"record\\\" or \\\"reject\\\", "
                      "got \\\"ignore\\\"") != std::string::npos);

  spit(tmp.path / "bad.json", R"({"memory_events": "sometimes"})");
  Daemon bad_config(tmp.path / "state2", tmp.path / "assayd2.sock",
                    {"--containment", "none", "--config", (tmp.path / "bad.json").string()});
  CHECK_FALSE(bad_config.start());
  CHECK(bad_config.log().find("config.memory_events must be \"record\" or \"reject\", got "
                              "\"sometimes\"") != std::string::npos);
}

TEST_CASE(
    "Kiln's prompt check: ids that are the chat template's rendering pass and the job runs; one "
    "altered id fails the job with request.prompt_mismatch before the oracle runs") {
  if (!have(kFingerprint) || !have(kOracle) || !have(kHfWorker)) {
    MESSAGE("skipped: assay-fingerprint, assay-oracle or assay-hf-worker was not built");
    return;
  }
  TempDir tmp;
  // A tiny Qwen3 (transformers' class, random weights) with Qwen3's real tokenizer and chat
  // template, and a Kiln request whose ids are transformers' rendering of its messages.
  auto fixture = [&](const std::string& extra) {
    std::string cmd = std::string(ASSAY_PYTHON3) + " " + ASSAY_SOURCE_DIR +
                      "/tests/hf/kiln_chat_fixture.py " + (tmp.path / "chat").string() + extra +
                      " > " + (tmp.path / "fixture.log").string() + " 2>&1";
    REQUIRE_MESSAGE(std::system(cmd.c_str()) == 0, slurp((tmp.path / "fixture.log").string()));
    return common::parse_strict(slurp((tmp.path / "chat" / "request.json").string()));
  };
  Json good = fixture("");
  Json altered = fixture(" --alter-index 14");
  fs::path model = tmp.path / "chat" / "model";
  Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
           {"--containment", containment(), "--fingerprint-worker", kFingerprint, "--oracle-worker",
            kOracle, "--hf-worker", kHfWorker});
  REQUIRE_MESSAGE(d.start(), d.log());
  auto submit = [&](const Json& doc) {
    auto sub = request(d.socket(), "POST", "/v1/jobs?model_dir=" + model.string(), doc.dump());
    REQUIRE_MESSAGE(sub.status == 201, sub.body);
    return wait_job(d.socket(), sub.json()["id"], terminal, 300);
  };

  Json job = submit(good);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d.log());
  std::string id = job["id"];
  Json result = request_get(d, "/v1/jobs/" + id + "/result").json();
  const Json& check = result["request"]["prompt_check"];
  CAPTURE(check.dump(2));
  CHECK(check["checked"] == true);
  CHECK(check["token_count"] == good["prompt"]["token_count"]);
  CHECK(check["token_ids_sha256"] ==
        common::token_ids_sha256(good["prompt"]["token_ids"].get<std::vector<long>>()));
  CHECK(check["chat_template_sha256"] == good["model_identity"]["chat_template_hash"]);
  CHECK(check["files"]["tokenizer.json"]["sha256"] == good["model_identity"]["tokenizer_hash"]);
  CHECK(check["renderer"]["transformers_version"] == "5.13.1");
  // The transformers worker ran contained as the C++ workers do.
  Json evidence =
      common::parse_strict(slurp((d.state() / "jobs" / id / "prompt" / "evidence.json").string()));
  CHECK(evidence["spawn"]["capabilities"]["effective"] == "0000000000000000");
  CHECK(evidence["spawn"]["capabilities"]["permitted"] == "0000000000000000");
  CHECK(evidence["spawn"]["uid"] != 0);
  CHECK(evidence["spawn"]["no_new_privs"] == true);
  CHECK(evidence["spawn"]["seccomp"]["policy_sha256"].get<std::string>().starts_with("sha256:"));
  if (containment() != "none") {
    CHECK(evidence["network"]["namespace"] == "private");
    CHECK(evidence["network"]["interfaces"] == Json::array({"lo"}));
  }

  // Every document of the job validates against its schema.
  fs::path dir = d.state() / "jobs" / id;
  std::string validate =
      validate_schemas({{"next-token-oracle-result", (dir / "result.json")},
                        {"kiln-next-token-request", (dir / "request.json")},
                        {"prompt-check-input", (dir / "prompt" / "input.json")},
                        {"prompt-check-output", (dir / "prompt" / "output.json")},
                        {"process-containment", (dir / "prompt" / "evidence.json")}});
  CHECK_MESSAGE(validate.rfind("0:", 0) == 0, validate);

  // The same Kiln request through both backends: the prompt check passes, both oracles run on
  // the template's ids, and their logits agree bit for bit (both use this torch on this CPU).
  Json both = good;
  both["oracle"] = {{"backend", "both"}};
  job = submit(both);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d.log());
  Json both_result = request_get(d, "/v1/jobs/" + job["id"].get<std::string>() + "/result").json();
  CHECK(both_result["request"]["prompt_check"]["checked"] == true);
  CHECK(both_result["backends"]["logits_bitwise_equal"] == true);
  CHECK(both_result["backends"]["argmax_equal"] == true);
  CHECK(both_result["backends"]["transformers"]["backend"] == "transformers");
  CHECK(both_result["backends"]["transformers"]["transformers"]["modeling_file"] ==
        "modeling_qwen3.py");
  CHECK(both_result["oracle"]["logits_sha256"] ==
        both_result["backends"]["transformers"]["logits_sha256"]);
  CHECK(both_result["implementation"]["executables"].contains("assay-oracle"));
  CHECK(both_result["implementation"]["executables"].contains("assay-hf-worker"));
  fs::path both_dir = d.state() / "jobs" / job["id"].get<std::string>();
  std::string both_valid =
      validate_schemas({{"next-token-oracle-result", (both_dir / "result.json")},
                        {"oracle-output", (both_dir / "oracle-transformers" / "output.json")}});
  CHECK_MESSAGE(both_valid.rfind("0:", 0) == 0, both_valid);

  job = submit(altered);
  CHECK(job["state"] == "failed");
  CHECK(job["error"]["code"] == "request.prompt_mismatch");
  std::string message = job["error"]["message"];
  CAPTURE(message);
  CHECK(message.find("at index 14: the request has 1879 (\" world\"), the rendering 840 "
                     "(\"Ex\")") != std::string::npos);
  CHECK_FALSE(fs::exists(d.state() / "jobs" / job["id"].get<std::string>() / "oracle"));

  // A host without the transformers worker still runs the dispute and says what it did not do.
  d.stop();
  Daemon bare(tmp.path / "state-bare", tmp.path / "bare.sock",
              {"--containment", containment(), "--fingerprint-worker", kFingerprint,
               "--oracle-worker", kOracle, "--hf-worker", (tmp.path / "no-hf-worker").string()});
  REQUIRE_MESSAGE(bare.start(), bare.log());
  auto sub = request(bare.socket(), "POST", "/v1/jobs?model_dir=" + model.string(), good.dump());
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  job = wait_job(bare.socket(), sub.json()["id"], terminal, 300);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2));
  result = request_get(bare, "/v1/jobs/" + job["id"].get<std::string>() + "/result").json();
  CHECK(result["request"]["prompt_check"]["checked"] == false);
  CHECK(result["request"]["prompt_check"]["reason"].get<std::string>().find(
            "assay-hf-worker (transformers) is not installed on this host") == 0);
}

TEST_CASE(
    "a chat template that loops is stopped at prompt_render_timeout_seconds, not the job's "
    "timeout, and the job fails naming that limit before the oracle runs") {
  if (!have(kFingerprint) || !have(kOracle) || !have(kHfWorker)) {
    MESSAGE("skipped: assay-fingerprint, assay-oracle or assay-hf-worker was not built");
    return;
  }
  TempDir tmp;
  std::string cmd = std::string(ASSAY_PYTHON3) + " " + ASSAY_SOURCE_DIR +
                    "/tests/hf/kiln_chat_fixture.py " + (tmp.path / "loop").string() +
                    " --looping-template > " + (tmp.path / "fixture.log").string() + " 2>&1";
  REQUIRE_MESSAGE(std::system(cmd.c_str()) == 0, slurp((tmp.path / "fixture.log").string()));
  Json doc = common::parse_strict(slurp((tmp.path / "loop" / "request.json").string()));
  fs::path model = tmp.path / "loop" / "model";
  // The job's own timeout stays the default 600 s: only the render step's limit may stop it.
  spit(tmp.path / "config.json", R"({"prompt_render_timeout_seconds": 20})");
  Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
           {"--containment", containment(), "--fingerprint-worker", kFingerprint, "--oracle-worker",
            kOracle, "--hf-worker", kHfWorker, "--config", (tmp.path / "config.json").string()});
  REQUIRE_MESSAGE(d.start(), d.log());
  CHECK(request_get(d, "/v1/info").json()["limits"]["prompt_render_timeout_seconds"] == 20);
  auto started = std::chrono::steady_clock::now();
  auto sub = request(d.socket(), "POST", "/v1/jobs?model_dir=" + model.string(), doc.dump());
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  std::string id = sub.json()["id"];
  Json job = wait_job(d.socket(), id, terminal, 240);
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  CAPTURE(job.dump(2));
  CHECK(job["state"] == "failed");
  CHECK(job["error"]["code"] == "worker.prompt_failed");
  std::string message = job["error"]["message"];
  CHECK(message.find("prompt worker timed out and was killed after 20 s, the limit "
                     "prompt_render_timeout_seconds sets for this step") != std::string::npos);
  CHECK(took < 200);  // far below the job's 600 s: the render step was stopped at its own limit
  Json evidence =
      common::parse_strict(slurp((d.state() / "jobs" / id / "prompt" / "evidence.json").string()));
  CHECK(evidence["timed_out"] == true);
  CHECK(evidence["limits"]["timeout_ms"] == 20000);
  CHECK_FALSE(fs::exists(d.state() / "jobs" / id / "oracle"));

  // The same model with a job timeout below the cap: the job's own limit applies, and the message
  // does not blame the render limit.
  Json quick = doc;
  quick["id"] = "kiln-chat-looping-quick";
  quick["limits"] = {{"timeout_seconds", 10}};
  sub = request(d.socket(), "POST", "/v1/jobs?model_dir=" + model.string(), quick.dump());
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  job = wait_job(d.socket(), sub.json()["id"], terminal, 240);
  CHECK(job["state"] == "failed");
  CHECK(job["error"]["message"].get<std::string>().find("prompt_render_timeout_seconds") ==
        std::string::npos);
}

TEST_CASE(
    "transformers backend: Mistral- and Gemma3-class tiny models get signed verdicts through the "
    "contained assay-hf-worker that assay verify accepts; on the llama fixture its logits are "
    "libtorch's, bit for bit") {
  if (!have(kFingerprint) || !have(kOracle) || !have(kHfWorker)) {
    MESSAGE("skipped: assay-fingerprint, assay-oracle or assay-hf-worker was not built");
    return;
  }
  TempDir tmp;
  for (const char* arch : {"mistral", "gemma3"}) {
    std::string cmd = std::string(ASSAY_PYTHON3) + " " + ASSAY_SOURCE_DIR +
                      "/tests/hf/make_hf_model.py " + arch + " " + (tmp.path / arch).string() +
                      " > " + (tmp.path / "make.log").string() + " 2>&1";
    REQUIRE_MESSAGE(std::system(cmd.c_str()) == 0, slurp(tmp.path / "make.log"));
  }
  fs::path llama = fixture_model(tmp.path / "llama-tiny");
  Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
           {"--containment", containment(), "--fingerprint-worker", kFingerprint, "--oracle-worker",
            kOracle, "--hf-worker", kHfWorker});
  REQUIRE_MESSAGE(d.start(), d.log());
  auto run_job = [&](const std::string& id, const fs::path& model, const std::string& backend) {
    Json doc = next_token_request(id, model);
    doc["oracle"] = {{"backend", backend}};
    auto sub = request_json(d, doc);
    REQUIRE_MESSAGE(sub.status == 201, sub.body);
    Json job = wait_job(d.socket(), sub.json()["id"], terminal, 300);
    REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d.log());
    return job["id"].get<std::string>();
  };

  for (const auto& [arch, modeling] :
       {std::pair{"mistral", "modeling_mistral.py"}, std::pair{"gemma3", "modeling_gemma3.py"}}) {
    CAPTURE(arch);
    std::string id = run_job(std::string("hf-") + arch, tmp.path / arch, "transformers");
    auto result_reply = request_get(d, "/v1/jobs/" + id + "/result");
    Json result = result_reply.json();
    CHECK(result["oracle"]["backend"] == "transformers");
    CHECK(result["oracle"]["transformers"]["version"] == "5.13.1");
    CHECK(result["oracle"]["transformers"]["modeling_file"] == modeling);
    CHECK(result["oracle"]["attention_implementation"] == "eager");
    CHECK(result["oracle"]["configuration"]["deterministic_algorithms"] == true);
    CHECK(result["oracle"]["configuration"]["tf32_cublas"] == false);
    CHECK(result["implementation"]["executables"].contains("assay-hf-worker"));
    CHECK_FALSE(result["implementation"]["executables"].contains("assay-oracle"));
    // Contained as assay-oracle is.
    const Json& process = result["oracle"]["process"];
    CHECK(process["spawn"]["uid"] != 0);
    CHECK(process["spawn"]["capabilities"]["effective"] == "0000000000000000");
    CHECK(process["spawn"]["no_new_privs"] == true);
    if (containment() != "none") CHECK(process["network"]["namespace"] == "private");
    // The signed record verifies offline.
    if (have(kClient)) {
      auto envelope = request(d.socket(), "GET", "/v1/jobs/" + id + "/attestation").json();
      spit(tmp.path / "result.json", result_reply.body);
      spit(tmp.path / "result.dsse.json", envelope.dump());
      std::string v = run_capture(kClient + " verify " + (tmp.path / "result.json").string() +
                                  " --pubkey " + (d.state() / "keys" / "host.pub").string());
      CHECK_MESSAGE(v.rfind("0:", 0) == 0, v);
    }
    fs::path dir = d.state() / "jobs" / id;
    std::string validate = validate_schemas({{"next-token-oracle-result", (dir / "result.json")},
                                             {"next-token-request", (dir / "request.json")},
                                             {"oracle-input", (dir / "oracle" / "input.json")},
                                             {"oracle-output", (dir / "oracle" / "output.json")}});
    CHECK_MESSAGE(validate.rfind("0:", 0) == 0, validate);
  }

  // The same dispute on an architecture both backends run: the same logits, bit for bit.
  Json by_torch =
      request_get(d, "/v1/jobs/" + run_job("port", llama, "libtorch") + "/result").json();
  Json by_hf =
      request_get(d, "/v1/jobs/" + run_job("hf", llama, "transformers") + "/result").json();
  CHECK(by_hf["oracle"]["backend"] == "transformers");
  CHECK_FALSE(by_torch["oracle"].contains("backend"));
  CHECK(by_hf["oracle"]["logits_sha256"] == by_torch["oracle"]["logits_sha256"]);
  CHECK(by_hf["oracle"]["argmax"] == by_torch["oracle"]["argmax"]);
  CHECK(by_hf["verdict"] == by_torch["verdict"]);
}
