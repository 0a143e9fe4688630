// The `assay` CLI against a real `assayd serve --containment none` on a temporary socket and
// state directory: connection handling, error mapping and job following end to end. The full
// happy path with real workers is in tests/integration/ (the supervisor's end-to-end tests).
#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <thread>

#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/identity.h"
#include "common/protocol.h"
#include "common/sign.h"
#include "support.h"

namespace {

using assay::common::Json;
namespace common = assay::common;
using assay::client::test::run;
using assay::client::test::TempDir;

class Daemon {
 public:
  explicit Daemon(std::vector<std::string> extra_args = {}) {
    socket_ = (dir_ / "assayd.sock").string();
    args_ = {ASSAY_DAEMON_BIN,          "serve",         "--socket", socket_,       "--state-dir",
             (dir_ / "state").string(), "--containment", "none",     "--log-level", "warn"};
#ifdef ASSAY_FINGERPRINT_BIN
    if (std::find(extra_args.begin(), extra_args.end(), "--fingerprint-worker") == extra_args.end())
      args_.insert(args_.end(), {"--fingerprint-worker", ASSAY_FINGERPRINT_BIN});
#endif
    args_.insert(args_.end(), extra_args.begin(), extra_args.end());
    start();
  }
  ~Daemon() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    int status;
    ::waitpid(pid_, &status, 0);
  }
  // Starts assayd on the same socket and state directory and waits until it answers.
  void start() {
    std::string log = (dir_ / "assayd.log").string();
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      std::vector<char*> argv;
      for (auto& a : args_) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    for (int i = 0; i < 300; ++i) {  // up to 30 s on a loaded machine
      if (run({"health"}, env()).status == 0) return;
      int status;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        FAIL("assayd exited during start-up: " << common::read_file(log, 1 << 16));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    FAIL("assayd did not answer on " << socket_ << ": " << common::read_file(log, 1 << 16));
  }
  void kill9() {
    ::kill(pid_, SIGKILL);
    int status;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }
  assay::client::Environment env() const {
    return {.socket = socket_};
  }
  const TempDir& dir() const {
    return dir_;
  }

 private:
  TempDir dir_;
  std::string socket_;
  std::vector<std::string> args_;
  pid_t pid_ = -1;
};

Json request_doc(const std::string& id) {
  return Json{{"schema", std::string(assay::protocol::kNextTokenRequest)},
              {"id", id},
              {"input_token_ids", {1, 2, 3}},
              {"candidates", Json::array({{{"engine", "kiln"}, {"token_id", 5}, {"text", "a"}},
                                          {{"engine", "vllm"}, {"token_id", 9}, {"text", "b"}}})}};
}

// A model directory the request parses against (vocab 100) but no worker can run: the job is
// accepted and then fails inside the pipeline.
std::string broken_model(const TempDir& dir) {
  std::filesystem::create_directories(dir / "model");
  dir.write("model/config.json",
            R"({"architectures":["LlamaForCausalLM"],"model_type":"llama","vocab_size":100})");
  return (dir / "model").string();
}

// The oracle worker: $ASSAY_ORACLE_BIN, else the one in this build tree (built with LibTorch).
std::string oracle_bin() {
  const char* env = std::getenv("ASSAY_ORACLE_BIN");
  std::string path = env ? env : ASSAY_ORACLE_BIN_DEFAULT;
  return ::access(path.c_str(), X_OK) == 0 ? path : "";
}

// The transformers worker (its wrapper in the build), or "" where it was not built.
std::string hf_worker_bin() {
  return ::access(ASSAY_HF_WORKER_DEFAULT, X_OK) == 0 ? ASSAY_HF_WORKER_DEFAULT : "";
}

}  // namespace

TEST_CASE("health, info and keys read a running assayd") {
  Daemon d;
  auto health = run({"health"}, d.env());
  CHECK(health.status == 0);
  CHECK(health.out.find("status:") != std::string::npos);
  CHECK(health.out.find("ok") != std::string::npos);

  auto keys = run({"keys", "--json", "-o", (d.dir() / "pub.pem").string()}, d.env());
  REQUIRE(keys.status == 0);
  std::string pem = common::read_file(d.dir() / "pub.pem", 4096);
  Json k = common::parse_strict(keys.out);
  CHECK(k["public_key_pem"] == pem);
  CHECK(k["key_id"] == common::sha256_id(common::public_key_raw_from_pem(pem)));

  auto info = run({"info", "--json"}, d.env());
  CHECK(info.status == 0);
  CHECK(common::parse_strict(info.out)["key_id"] == k["key_id"]);
}

TEST_CASE("assayd's refusals exit 4 and carry the daemon's error code") {
  Daemon d;
  auto r = run({"status", "j-000000000000000000000000"}, d.env());
  CHECK(r.status == 4);
  CHECK(r.err.find("HTTP 404 api.no_such_job") != std::string::npos);

  r = run({"status", "not-a-job"}, d.env());
  CHECK(r.status == 4);
  CHECK(r.err.find("api.bad_job_id") != std::string::npos);

  r = run({"list", "--state", "sleeping"}, d.env());
  CHECK(r.status == 4);
  CHECK(r.err.find("sleeping") != std::string::npos);

  std::string req = d.dir().write("req.json", request_doc("no-model").dump());
  r = run({"submit", req, "--model", (d.dir() / "missing").string()}, d.env());
  CHECK(r.status == 4);
  CHECK(r.err.find((d.dir() / "missing").string()) != std::string::npos);

  r = run({"submit", req}, d.env());  // no model_dir in the request and no --model
  CHECK(r.status == 4);
  CHECK(r.err.find("request.no_model_dir") != std::string::npos);
  CHECK(r.err.find("give --model DIR") != std::string::npos);

  r = run({"list"}, d.env());
  CHECK(r.status == 0);
  CHECK(r.out == "no jobs\n");
}

TEST_CASE("a job that fails in the pipeline: wait follows it and exits 5, resubmit finds it") {
  Daemon d;
  std::string model = broken_model(d.dir());
  std::string req = d.dir().write("req.json", request_doc("broken").dump());

  auto submitted = run({"submit", req, "--model", model, "--json"}, d.env());
  REQUIRE(submitted.status == 0);
  Json job = common::parse_strict(submitted.out);
  std::string id = job["id"];
  CHECK(job["state"] == "queued");

  // Not a TTY: one plain line per event, then the final status.
  auto waited = run({"wait", id, "--wait-timeout", "120"}, d.env());
  CHECK(waited.status == 5);
  CHECK(waited.out.find("job " + id + "  queued") != std::string::npos);
  CHECK(waited.out.find("job " + id + "  failed") != std::string::npos);
  CHECK(waited.out.find("state:") != std::string::npos);
  CHECK(waited.out.find("error:") != std::string::npos);

  // On a TTY: one line rewritten in place, cleared before the final status.
  auto tty_env = d.env();
  tty_env.stdout_is_tty = true;
  auto live = run({"wait", id}, tty_env);
  CHECK(live.status == 5);
  CHECK(live.out.find("\r\033[Kjob " + id + "  failed") != std::string::npos);
  CHECK(live.out.find("\njob " + id) == std::string::npos);

  auto again = run({"submit", req, "--model", model}, d.env());
  CHECK(again.status == 0);
  CHECK(again.out.find("existing job " + id + " (failed)") == 0);
  CHECK(again.err.find("an identical request already failed as " + id +
                       "; resubmit with --retry to run it again") != std::string::npos);

  auto status = run({"status", id, "--json"}, d.env());
  CHECK(status.status == 0);
  Json s = common::parse_strict(status.out);
  CHECK(s["state"] == "failed");
  CHECK(s["error"]["code"].is_string());

  auto listed = run({"list", "--state", "failed"}, d.env());
  CHECK(listed.out.find(id) != std::string::npos);
  CHECK(run({"list", "--state", "running"}, d.env()).out == "no jobs\n");

  CHECK(run({"result", id}, d.env()).status == 4);
  auto cancel = run({"cancel", id}, d.env());
  CHECK(cancel.status == 4);
  CHECK(cancel.err.find("api.already_finished") != std::string::npos);

  auto waited_json = run({"submit", req, "--model", model, "--wait", "--json"}, d.env());
  CHECK(waited_json.status == 5);
  CHECK(common::parse_strict(waited_json.out)["id"] == id);

  // --retry runs the failed job again under the same id; it fails again the same way.
  auto retried = run({"submit", req, "--model", model, "--retry", "--json"}, d.env());
  REQUIRE(retried.status == 0);
  Json rj = common::parse_strict(retried.out);
  CHECK(rj["id"] == id);
  CHECK(rj["retried"] == true);
  CHECK(rj["state"] != "failed");
  CHECK(retried.err.empty());
  CHECK(run({"wait", id, "--wait-timeout", "120"}, d.env()).status == 5);
  auto plain = run({"submit", req, "--model", model, "--retry"}, d.env());
  CHECK(plain.status == 0);
  CHECK(plain.out.find("resubmitted job " + id + " (") == 0);
  CHECK(run({"wait", id, "--wait-timeout", "120"}, d.env()).status == 5);
}

TEST_CASE("wait follows a job through a kill -9 and restart of assayd") {
  // A fingerprint "worker" that runs for 2 s and fails: the job is running when assayd dies,
  // is re-run after the restart, and fails again; wait must see it end.
  TempDir tools;
  std::string slow = tools.write("slow-worker", "#!/bin/sh\nsleep 2\nexit 3\n");
  // Workers run as an unprivileged user: it must be able to reach and run the stand-in.
  std::filesystem::permissions(std::filesystem::path(slow).parent_path(),
                               std::filesystem::perms(0755));
  std::filesystem::permissions(slow, std::filesystem::perms(0755));
  Daemon d({"--fingerprint-worker", slow});
  std::string model = broken_model(d.dir());
  std::string req = d.dir().write("req.json", request_doc("restart").dump());
  auto submitted = run({"submit", req, "--model", model, "--json"}, d.env());
  REQUIRE(submitted.status == 0);
  std::string id = common::parse_strict(submitted.out)["id"];

  assay::client::test::Run waited;
  std::thread waiter([&] { waited = run({"wait", id, "--wait-timeout", "120"}, d.env()); });
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  d.kill9();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  d.start();
  waiter.join();
  CHECK(waited.status == 5);
  CHECK(waited.out.find("started attempt 2") != std::string::npos);
  CHECK(waited.out.find("job " + id + "  failed") != std::string::npos);
}

TEST_CASE("a real job end to end: submit --wait, fetch result/envelope/artifact/key, verify") {
  std::string oracle = oracle_bin();
  if (oracle.empty()) {
    MESSAGE("skipped: assay-oracle was not built (" ASSAY_ORACLE_BIN_DEFAULT ")");
    return;
  }
  Daemon d({"--oracle-worker", oracle});
  std::string model = (d.dir() / "model").string();
  std::string make = std::string(ASSAY_PYTHON3) + " '" ASSAY_FIXTURES_DIR "/make_fixture.py' " +
                     "--arch llama --size tiny --out '" + model + "' >/dev/null";
  REQUIRE(std::system(make.c_str()) == 0);
  // "Hello" and two candidates whose texts are their byte-level decodings in the fixture.
  Json doc = request_doc("happy");
  doc["input_token_ids"] = {72, 101, 108, 108, 111};
  doc["candidates"] = Json::array({{{"engine", "kiln"}, {"token_id", 44}, {"text", ","}},
                                   {{"engine", "vllm"}, {"token_id", 33}, {"text", "!"}}});
  std::string req = d.dir().write("req.json", doc.dump());

  auto submitted =
      run({"submit", req, "--model", model, "--wait", "--wait-timeout", "300"}, d.env());
  REQUIRE_MESSAGE(submitted.status == 0, submitted.out << submitted.err);
  CHECK(submitted.out.find("  succeeded") != std::string::npos);
  CHECK(submitted.out.find("verdict:") != std::string::npos);
  CHECK(submitted.out.find("result_sha256:") != std::string::npos);
  std::string id = common::parse_strict(run({"list", "--json"}, d.env()).out)["jobs"][0]["id"];

  std::filesystem::create_directories(d.dir() / "out");
  auto out = [&](const char* name) { return (d.dir() / "out" / name).string(); };
  REQUIRE(run({"result", id, "-o", out("result.json")}, d.env()).status == 0);
  REQUIRE(run({"artifact", id, "-o", out("logits.safetensors")}, d.env()).status == 0);
  REQUIRE(run({"keys", "-o", out("pubkey.pem")}, d.env()).status == 0);
  // `result` without -o gives the same bytes.
  CHECK(run({"result", id}, d.env()).out == common::read_file(out("result.json"), 1 << 24));

  auto verified = run({"verify", out("result.json"), "--pubkey", out("pubkey.pem"), "--artifact",
                       out("logits.safetensors"), "--json"},
                      {.socket = "/nonexistent/assayd.sock"});
  CHECK(verified.status == 0);
  Json report = common::parse_strict(verified.out);
  CHECK(report["ok"] == true);
  CHECK(report["checks"].size() == 10);

  std::string openssl = "cd '" + (d.dir() / "out").string() +
                        "' && sh '" ASSAY_CLIENT_TEST_DIR "/openssl_verify.sh' >/dev/null 2>&1";
  CHECK(std::system(openssl.c_str()) == 0);

  // One flipped byte in the artifact: the record no longer matches it.
  std::string logits = common::read_file(out("logits.safetensors"), 1 << 24);
  logits.back() ^= 1;
  d.dir().write("out/logits.safetensors", logits);
  auto tampered = run({"verify", out("result.json"), "--pubkey", out("pubkey.pem"), "--artifact",
                       out("logits.safetensors")},
                      {.socket = "/nonexistent/assayd.sock"});
  CHECK(tampered.status == 6);
  CHECK(tampered.out.find("FAIL  artifact.file") != std::string::npos);
}

namespace {

const std::string kReceiptStem = "20260718t232632-rocm-strix-halo-greedy-c1-divergence-v1";

// A directory with copies of Kiln's two real receipts, as their request names them.
std::string receipts_copy(const TempDir& dir, const std::string& name) {
  std::filesystem::create_directories(dir / name);
  for (const char* engine : {"kiln", "vllm"}) {
    std::string file = kReceiptStem + "." + engine + ".json";
    dir.write(name + "/" + file,
              common::read_file(ASSAY_CLIENT_TEST_DIR "/fixtures/kiln/receipts/" + file, 1 << 20));
  }
  return (dir / name).string();
}

// A model directory whose config.json admits Kiln's real token ids (Qwen3.5's vocabulary): the
// admission checks run; the 9 GB model itself is not here, so the job fails in its fingerprint.
std::string qwen_sized_config(const TempDir& dir) {
  std::filesystem::create_directories(dir / "qwen");
  dir.write("qwen/config.json", R"({"model_type":"qwen3_5","vocab_size":248320})");
  return (dir / "qwen").string();
}

Json kiln_real_request() {
  return common::parse_strict(
      common::read_file(ASSAY_CLIENT_TEST_DIR "/fixtures/kiln-request-v1.json", 1 << 20));
}

}  // namespace

// Kiln's real request (tests/client/fixtures/kiln-request-v1.json) with its model, prompt, prefix
// and candidates moved onto the fixture model: every other field is as Kiln wrote it.
TEST_CASE("a Kiln request in Kiln's own format runs end to end on a fixture model") {
  std::string oracle = oracle_bin();
  if (oracle.empty()) {
    MESSAGE("skipped: assay-oracle was not built (" ASSAY_ORACLE_BIN_DEFAULT ")");
    return;
  }
  std::vector<std::string> args{"--oracle-worker", oracle};
  const std::string hf = hf_worker_bin();
  if (!hf.empty()) args.insert(args.end(), {"--hf-worker", hf});
  Daemon d(args);
  std::string model = (d.dir() / "model").string();
  std::string make = std::string(ASSAY_PYTHON3) + " '" ASSAY_FIXTURES_DIR "/make_fixture.py' " +
                     "--arch llama --size tiny --out '" + model + "' >/dev/null";
  REQUIRE(std::system(make.c_str()) == 0);
  // The model identity as Kiln computes it, without assay code.
  std::string identity_file = (d.dir() / "identity.json").string();
  std::string ident = std::string(ASSAY_PYTHON3) +
                      " '" ASSAY_CLIENT_TEST_DIR "/../fingerprint/independent_identity.py' '" +
                      model + "' fixture-tiny-llama > '" + identity_file + "'";
  REQUIRE(std::system(ident.c_str()) == 0);

  Json doc = common::parse_strict(
      common::read_file(ASSAY_CLIENT_TEST_DIR "/fixtures/kiln-request-v1.json", 1 << 20));
  doc["model_identity"] = common::parse_strict(common::read_file(identity_file, 1 << 20));
  // "Hell" + forced "o", then "," or "!" (byte-level tokens of the fixture's tokenizer).
  doc["prompt"]["messages"][0]["content"] = "Hell";
  doc["prompt"]["utf8_sha256"] = common::sha256_id("Hell");
  doc["prompt"]["token_ids"] = {72, 101, 108, 108};
  doc["prompt"]["token_count"] = 4;
  doc["continuation_prefix"] = Json::array({{{"token_id", 111}, {"text", "o"}}});
  doc["input_token_ids"] = {72, 101, 108, 108, 111};
  doc["input_token_ids_sha256"] = common::sha256_id("[72,101,108,108,111]");
  doc["candidates"] = Json::array({{{"engine", "kiln"}, {"token_id", 44}, {"text", ","}},
                                   {{"engine", "vllm"}, {"token_id", 33}, {"text", "!"}}});
  std::string req = d.dir().write("kiln.json", doc.dump(2));
  auto checked = run({"request", "check", "--json", req});
  REQUIRE_MESSAGE(checked.status == 0, checked.err);

  // Receipts for this dispute, made from Kiln's real ones: each engine's output continues with
  // the prefix "o" and its candidate, for this model and prompt, sealed as Kiln seals them.
  std::filesystem::create_directories(d.dir() / "receipts");
  Json with_receipts = doc;
  for (const auto& [engine, text] : {std::pair{"kiln", ","}, std::pair{"vllm", "!"}}) {
    std::string file = kReceiptStem + "." + engine + ".json";
    Json r = common::parse_strict(
        common::read_file(ASSAY_CLIENT_TEST_DIR "/fixtures/kiln/receipts/" + file, 1 << 20));
    r["engine"]["model_identity"] = doc["model_identity"];
    r["engine"]["model_identity"]["path"] = model;
    Json& run0 = r["runs"][0];
    run0["prompt_token_counts"] = {4};
    run0["prompt_tokens_min"] = 4;
    run0["prompt_tokens_max"] = 4;
    std::string content = std::string("o") + text + " and so on";
    run0["output_evidence"][0]["exact_output"]["content_base64"] = common::base64_encode(content);
    run0["output_evidence"][0]["content_sha256"] = common::sha256_id(content);
    run0["output_evidence"][0]["content_utf8_bytes"] = content.size();
    r.erase("receipt_sha256");
    r["receipt_sha256"] = common::sha256_id(common::python_canonical(r));
    std::string bytes = d.dir().write("receipts/" + file, r.dump(2) + "\n");
    with_receipts["source"][std::string(engine) + "_receipt"]["file_sha256"] =
        common::sha256_id(common::read_file(bytes, 1 << 20));
    with_receipts["source"][std::string(engine) + "_receipt"]["content_sha256"] =
        r["receipt_sha256"];
  }
  with_receipts["id"] = "kiln-with-receipts";
  std::string req_receipts = d.dir().write("kiln-receipts.json", with_receipts.dump(2));
  auto with = run({"submit", req_receipts, "--model", model, "--receipts",
                   (d.dir() / "receipts").string(), "--wait", "--wait-timeout", "300", "--json"},
                  d.env());
  REQUIRE_MESSAGE(with.status == 0, with.out << with.err);
  std::string with_id = common::parse_strict(with.out)["id"];
  Json with_result = common::parse_strict(run({"result", with_id}, d.env()).out);
  CHECK(with_result["request"]["receipts"]["checked"] == true);
  CHECK(with_result["request"]["receipts"]["receipts"][0]["checks"].size() == 16);
  CHECK(with_result["request"]["receipts"]["receipts"][0]["engine"] == "kiln");

  // Kiln's v2 record of it: not written, each field that would be false listed (exit 9).
  std::string v2 = (d.dir() / "v2.json").string();
  auto export_v2 = run({"result", with_id, "--format", "kiln-v2", "-o", v2}, d.env());
  CHECK(export_v2.status == 9);
  CHECK(export_v2.err.find("/oracle/torch_version: ") != std::string::npos);
  CHECK(export_v2.err.find("/oracle/modeling_sha256: ") != std::string::npos);
  CHECK(export_v2.err.find("/request/source: ") == std::string::npos);  // receipts were checked
  CHECK_FALSE(std::filesystem::exists(v2));

  auto submitted =
      run({"submit", req, "--model", model, "--wait", "--wait-timeout", "300"}, d.env());
  REQUIRE_MESSAGE(submitted.status == 0, submitted.out << submitted.err);
  CHECK(submitted.out.find("  succeeded") != std::string::npos);
  std::string id;
  Json jobs = common::parse_strict(run({"list", "--json"}, d.env()).out)["jobs"];
  for (const Json& j : jobs)
    if (j["request_id"] == doc["id"]) id = j["id"];
  REQUIRE_MESSAGE(!id.empty(), run({"list", "--json"}, d.env()).out);
  Json result = common::parse_strict(run({"result", id}, d.env()).out);
  CHECK(result["request"]["schema"] == "kiln.hf-next-token-request.v1");
  CHECK(result["request"]["sha256"] == common::parse_strict(checked.out)["request_sha256"]);
  CHECK(result["request"]["input_token_ids_sha256"] == doc["input_token_ids_sha256"]);
  CHECK(result["request"]["source"] == doc["source"]);
  CHECK(
      result["request"]["receipts"] ==
      Json{{"checked", false}, {"reason", "no receipts were given (assay submit --receipts DIR)"}});
  CHECK(result["model_identity"]["content_sha256"] == doc["model_identity"]["content_sha256"]);

  // The same file with --numerics is another job (the key keeps assay's additions), and its
  // result names the same Kiln request (request.sha256 leaves them out) with an envelope.
  if (!hf.empty()) {
    auto with_numerics = run({"submit", req, "--model", model, "--numerics", "--wait",
                              "--wait-timeout", "300", "--json"},
                             d.env());
    REQUIRE_MESSAGE(with_numerics.status == 0, with_numerics.out << with_numerics.err);
    std::string numerics_id = common::parse_strict(with_numerics.out)["id"];
    CHECK(numerics_id != id);
    Json numerics = common::parse_strict(run({"result", numerics_id}, d.env()).out);
    CHECK(numerics["request"]["sha256"] == result["request"]["sha256"]);
    CHECK(numerics["oracle"]["logits_sha256"] == result["oracle"]["logits_sha256"]);
    REQUIRE(numerics["numerics"].contains("verdict"));
    CHECK(numerics["numerics"]["requested"]["reduction_seeds"] == 16);  // {}: every default
    CAPTURE(numerics["numerics"]["verdict"].dump(2));
    CHECK(numerics["numerics"]["verdict"]["explanation"].get<std::string>().size() > 20);
  } else {
    MESSAGE("the numerics part skipped: assay-hf-worker was not built");
  }

  // A copy whose prefix text is not its token's decoding fails in the oracle, naming the id,
  // the claimed and the decoded text.
  doc["id"] = "kiln-wrong-prefix-text";
  doc["continuation_prefix"][0]["text"] = "0";
  std::string bad = d.dir().write("kiln-bad-prefix.json", doc.dump(2));
  auto failed =
      run({"submit", bad, "--model", model, "--wait", "--wait-timeout", "300", "--json"}, d.env());
  CHECK(failed.status == 5);
  Json job = common::parse_strict(failed.out);
  CHECK(job["state"] == "failed");
  std::string message = job["error"]["message"];
  CAPTURE(message);
  CHECK(message.find("request.token_text_mismatch") != std::string::npos);
  CHECK(message.find("continuation_prefix[0]: token_id 111 claims text \"0\" but decodes to "
                     "\"o\"") != std::string::npos);
}

TEST_CASE("Kiln's real request with its real receipts passes assayd's receipt checks") {
  Daemon d;
  std::string model = qwen_sized_config(d.dir());
  // Beside the request: found without --receipts.
  receipts_copy(d.dir(), "kiln");
  std::string req = d.dir().write("kiln/request.json", kiln_real_request().dump(2));
  auto beside = run({"submit", req, "--model", model, "--json"}, d.env());
  REQUIRE_MESSAGE(beside.status == 0, beside.err);
  std::string id = common::parse_strict(beside.out)["id"];
  Json job = common::parse_strict(run({"status", id, "--json"}, d.env()).out);
  CAPTURE(job.dump(2));
  CHECK(job["events"][0]["message"] ==
        "accepted; receipts checked: kiln (16 checks), vllm (16 checks)");
  Json checks = common::parse_strict(
      common::read_file(d.dir() / "state" / "jobs" / id / "checks.json", 1 << 20));
  CHECK(checks["receipts"]["checked"] == true);
  CHECK(checks["receipts"]["receipts"][1]["file_sha256"] ==
        "sha256:7773d4c207040ab4dd3dbfb5e5f0bf3a310d9312835667f292e9c2932e495692");

  // Named with --receipts: the same checked dispute, so the same job.
  std::filesystem::create_directories(d.dir() / "elsewhere");
  std::string elsewhere = d.dir().write("elsewhere/request.json", kiln_real_request().dump());
  auto named = run(
      {"submit", elsewhere, "--model", model, "--receipts", receipts_copy(d.dir(), "r"), "--json"},
      d.env());
  REQUIRE_MESSAGE(named.status == 0, named.err);
  CHECK(common::parse_strict(named.out)["id"] == id);
  CHECK(common::parse_strict(named.out)["duplicate"] == true);

  // Without receipts: it still runs, as another job, and the client says they were not checked.
  auto unchecked = run({"submit", elsewhere, "--model", model, "--json"}, d.env());
  REQUIRE_MESSAGE(unchecked.status == 0, unchecked.err);
  CHECK(unchecked.err.find("are not beside it; they are not checked") != std::string::npos);
  CHECK(common::parse_strict(unchecked.out)["id"] != id);
}

TEST_CASE("tampered receipts, a swapped engine and a wrong run id are each refused by name") {
  Daemon d;
  std::string model = qwen_sized_config(d.dir());
  std::string good = receipts_copy(d.dir(), "good");
  auto refused = [&](const Json& doc, const std::string& receipts) {
    std::string req = d.dir().write("req.json", doc.dump());
    auto r = run({"submit", req, "--model", model, "--receipts", receipts}, d.env());
    CHECK(r.status == 4);
    CHECK(r.err.find("request.receipt_mismatch") != std::string::npos);
    return r.err;
  };

  std::string one_byte = receipts_copy(d.dir(), "one-byte");
  std::string kiln_file = "one-byte/" + kReceiptStem + ".kiln.json";
  std::string bytes = common::read_file(d.dir() / kiln_file, 1 << 20);
  bytes[bytes.find("llmbox")] = 'L';
  d.dir().write(kiln_file, bytes);
  CHECK(refused(kiln_real_request(), one_byte)
            .find("kiln receipt (request.source.kiln_receipt): check file_sha256 failed") !=
        std::string::npos);

  Json swapped = kiln_real_request();
  std::swap(swapped["source"]["kiln_receipt"], swapped["source"]["vllm_receipt"]);
  CHECK(refused(swapped, good).find("check engine failed") != std::string::npos);

  Json run_id = kiln_real_request();
  run_id["prompt"]["generator"]["run_id"] = "another-run";
  CHECK(refused(run_id, good).find("check run_id failed: workload.run_id is") != std::string::npos);

  // Not a regular file: a symlink and a FIFO in the receipt's place, refused without blocking.
  std::string linked = receipts_copy(d.dir(), "linked");
  std::filesystem::remove(d.dir() / "linked" / (kReceiptStem + ".vllm.json"));
  std::filesystem::create_symlink(good + "/" + kReceiptStem + ".vllm.json",
                                  d.dir() / "linked" / (kReceiptStem + ".vllm.json"));
  CHECK(refused(kiln_real_request(), linked).find("links are not followed") != std::string::npos);
  std::string fifo = receipts_copy(d.dir(), "fifo");
  std::filesystem::remove(d.dir() / "fifo" / (kReceiptStem + ".kiln.json"));
  REQUIRE(::mkfifo((d.dir() / "fifo" / (kReceiptStem + ".kiln.json")).c_str(), 0644) == 0);
  CHECK(refused(kiln_real_request(), fifo).find("is not a regular file") != std::string::npos);

  // --receipts with an assay request is a usage error; nothing was queued by any of this.
  std::string assay_req = d.dir().write("assay.json", request_doc("plain").dump());
  CHECK(run({"submit", assay_req, "--model", model, "--receipts", good}, d.env()).status == 2);
  CHECK(common::parse_strict(run({"list", "--json"}, d.env()).out)["jobs"].empty());
}
