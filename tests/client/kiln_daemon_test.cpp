// Kiln's requests through the `assay` CLI and a real `assayd serve`: Kiln's own request format end
// to end on a fixture model, and its real request with its real engine receipts, intact and
// tampered (split from daemon_test.cpp, whose running assayd it shares: daemon_support.h).
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
