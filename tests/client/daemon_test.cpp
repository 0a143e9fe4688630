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
#include "daemon_support.h"
#include "support.h"

namespace {

using namespace assay::client::test;  // Daemon, run, TempDir, request_doc, oracle_bin, ...
using assay::common::Json;
namespace common = assay::common;

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

  // A malformed id is a bad command line (exit 2), refused before assayd is asked.
  r = run({"status", "not-a-job"}, d.env());
  CHECK(r.status == 2);
  CHECK(r.err.find("\"not-a-job\" is not a job id") != std::string::npos);

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

TEST_CASE(
    "a host without the transformers worker says so at start and refuses its backend at "
    "admission, by name") {
  Daemon d({"--hf-worker", "/nonexistent/assay-hf-worker"});
  CHECK(common::read_file(d.dir() / "assayd.log", 1 << 20)
            .find("no transformers worker at /nonexistent/assay-hf-worker") != std::string::npos);
  std::string model = broken_model(d.dir());
  for (const char* backend : {"transformers", "both"}) {
    Json doc = request_doc(std::string("hf-") + backend);
    doc["oracle"] = {{"backend", backend}};
    std::string req = d.dir().write("hf.json", doc.dump());
    auto r = run({"submit", req, "--model", model}, d.env());
    CAPTURE(r.err);
    CHECK(r.status == 4);
    CHECK(r.err.find("HTTP 422 request.backend_unavailable") != std::string::npos);
    CHECK(r.err.find("/nonexistent/assay-hf-worker") != std::string::npos);
  }
  CHECK(run({"list"}, d.env()).out == "no jobs\n");  // nothing was queued
  // The C++ oracle's backend is still taken.
  Json doc = request_doc("libtorch");
  doc["oracle"] = {{"backend", "libtorch"}};
  CHECK(run({"submit", d.dir().write("lt.json", doc.dump()), "--model", model}, d.env()).status ==
        0);
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
  // `show`: the verdict and the candidates for people; --json the result document itself.
  auto shown = run({"show", id}, d.env());
  CHECK(shown.status == 0);
  CAPTURE(shown.out);
  CHECK(shown.out.find(" produced the reference argmax (token ") != std::string::npos);
  CHECK(shown.out.find("ENGINE  TOKEN  TEXT") != std::string::npos);
  CHECK(shown.out.find("\",\"") != std::string::npos);  // kiln's text, quoted
  CHECK(shown.out.find("; memory peak ") != std::string::npos);
  auto shown_json = run({"show", id, "--json"}, d.env());
  CHECK(common::parse_strict(shown_json.out) ==
        common::parse_strict(common::read_file(out("result.json"), 1 << 24)));

  auto verified = run({"verify", out("result.json"), "--pubkey", out("pubkey.pem"), "--artifact",
                       out("logits.safetensors"), "--json"},
                      {.socket = "/nonexistent/assayd.sock"});
  CHECK(verified.status == 0);
  Json report = common::parse_strict(verified.out);
  CHECK(report["ok"] == true);
  CHECK(report["checks"].size() == 10);

  // --decide. This fixture's random weights put neither candidate at the argmax: no decision
  // (exit 12), with --json too, and only when asked. A dispute the reference decides exits 0.
  const Json first = common::parse_strict(common::read_file(out("result.json"), 1 << 24));
  REQUIRE(first["verdict"]["argmax_candidate"] == "neither");
  CHECK(run({"status", id, "--decide"}, d.env()).status == 12);
  CHECK(run({"status", id, "--decide", "--json"}, d.env()).status == 12);
  CHECK(run({"show", id, "--decide"}, d.env()).status == 12);
  CHECK(run({"wait", id, "--decide"}, d.env()).status == 12);
  CHECK(run({"show", id}, d.env()).status == 0);
  CHECK(run({"wait", id}, d.env()).status == 0);
  const std::int64_t argmax = first["oracle"]["argmax"];
  Json decided = doc;
  decided["id"] = "decided";
  decided["candidates"] = Json::array(
      {{{"engine", "kiln"}, {"token_id", argmax}, {"text", first["oracle"]["argmax_text"]}},
       {{"engine", "vllm"},
        {"token_id", argmax == 33 ? 44 : 33},
        {"text", argmax == 33 ? "," : "!"}}});
  std::string decided_req = d.dir().write("decided.json", decided.dump());
  auto decision =
      run({"submit", decided_req, "--model", model, "--wait", "--wait-timeout", "300", "--decide"},
          d.env());
  CAPTURE(decision.out + decision.err);
  CHECK(decision.status == 0);
  CHECK(decision.out.find("kiln") != std::string::npos);
  // --decide means nothing without --wait on submit: a usage error, nothing submitted.
  CHECK(run({"submit", decided_req, "--model", model, "--decide"}, d.env()).status == 2);

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
