// Kiln's receipt checks (common/kiln_receipt.h) on Kiln's real request and the two real engine
// receipts it names (tests/client/fixtures/kiln/receipts/, byte for byte from the field).
#include <doctest/doctest.h>

#include <string>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/json.h"
#include "common/kiln_receipt.h"
#include "common/request.h"

namespace {

using assay::common::Json;
namespace common = assay::common;

const std::string kDir = ASSAY_CLIENT_TEST_DIR "/fixtures/";
const std::string kStem = "kiln/receipts/20260718t232632-rocm-strix-halo-greedy-c1-divergence-v1";

Json request_doc() {
  return common::parse_strict(common::read_file(kDir + "kiln-request-v1.json", 1 << 20));
}
std::string receipt(const std::string& engine) {
  return common::read_file(kDir + kStem + "." + engine + ".json", 1 << 20);
}
common::ReceiptSlot slot(const std::string& engine) {
  return {engine, engine + "_receipt"};
}

// The refusal's message, or "" when the receipt passed.
std::string refusal(const Json& doc, const std::string& engine, const std::string& bytes) {
  try {
    common::check_kiln_receipt(common::validate_request(doc), slot(engine), bytes);
    return "";
  } catch (const common::Error& e) {
    CHECK(e.code() == "request.receipt_mismatch");
    return e.what();
  }
}

// A receipt changed by `edit` and sealed again as Kiln seals one (receipt_sha256 of its body),
// with the request naming the new file and content hashes: only the edited fact is wrong.
std::pair<Json, std::string> resealed(const std::string& engine, auto edit) {
  Json r = common::parse_strict(receipt(engine));
  edit(r);
  r.erase("receipt_sha256");
  r["receipt_sha256"] = common::sha256_id(common::python_canonical(r));
  std::string bytes = r.dump(2) + "\n";
  Json doc = request_doc();
  doc["source"][engine + "_receipt"]["file_sha256"] = common::sha256_id(bytes);
  doc["source"][engine + "_receipt"]["content_sha256"] = r["receipt_sha256"];
  return {doc, bytes};
}

const std::vector<std::string> kAllChecks = {"file_sha256",    "json",
                                             "receipt_sha256", "content_sha256",
                                             "engine",         "driver_version",
                                             "source_commit",  "clean_tree",
                                             "run_id",         "model_identity",
                                             "single_run",     "prompt_token_count",
                                             "single_output",  "empty_reasoning",
                                             "output_sha256",  "continuation"};

}  // namespace

TEST_CASE("Kiln's real receipts pass every check against Kiln's real request") {
  auto request = common::validate_request(request_doc());
  for (const std::string engine : {"kiln", "vllm"}) {
    auto report = common::check_kiln_receipt(request, slot(engine), receipt(engine));
    CHECK(report.engine == engine);
    CHECK(report.checks == kAllChecks);
    CHECK(report.file_sha256 == request.source[engine + "_receipt"]["file_sha256"]);
    CHECK(report.receipt_sha256 == request.source[engine + "_receipt"]["content_sha256"]);
  }
  CHECK(request.source["kiln_receipt"]["file_sha256"] ==
        "sha256:2e1c15c7ff637b144d8ffa2d8a0e3bd21f03c441858ac44dd447af7a5b02572f");
}

TEST_CASE("a receipt with one byte changed fails file_sha256, naming the engine") {
  std::string bytes = receipt("kiln");
  bytes[bytes.find("llmbox")] = 'L';
  std::string why = refusal(request_doc(), "kiln", bytes);
  CHECK(why.find("kiln receipt (request.source.kiln_receipt): check file_sha256 failed") == 0);
  CHECK(why.find("sha256:2e1c15c7ff637b") != std::string::npos);
}

TEST_CASE("the other engine's receipt in a slot fails the engine check") {
  Json doc = request_doc();
  std::swap(doc["source"]["kiln_receipt"], doc["source"]["vllm_receipt"]);
  std::string why = refusal(doc, "kiln", receipt("vllm"));
  CHECK(why.find("check engine failed") != std::string::npos);
  CHECK(why.find("is the receipt of engine \"vllm\", not kiln") != std::string::npos);
}

TEST_CASE("a request whose run id is not the receipts' fails run_id") {
  Json doc = request_doc();
  doc["prompt"]["generator"]["run_id"] = "20260718t232632-rocm-strix-halo-greedy-c1-divergence-v2";
  std::string why = refusal(doc, "vllm", receipt("vllm"));
  CHECK(why.find("vllm receipt (request.source.vllm_receipt): check run_id failed") == 0);
  CHECK(why.find("divergence-v1\"") != std::string::npos);
}

TEST_CASE("a receipt body that does not hash to its own receipt_sha256 fails it") {
  // Kiln only compares the stored field with the request's; assay recomputes it.
  Json r = common::parse_strict(receipt("kiln"));
  r["engine"]["reported_version"] = "0.4.2";
  std::string bytes = r.dump(2) + "\n";
  Json doc = request_doc();
  doc["source"]["kiln_receipt"]["file_sha256"] = common::sha256_id(bytes);
  std::string why = refusal(doc, "kiln", bytes);
  CHECK(why.find("check receipt_sha256 failed: the receipt says sha256:53b92e8ab8e7") !=
        std::string::npos);
}

TEST_CASE("resealed receipts fail on the one fact that is false") {
  auto dirty =
      resealed("kiln", [](Json& r) { r["driver_environment"]["repository"]["dirty"] = true; });
  CHECK(refusal(dirty.first, "kiln", dirty.second).find("check clean_tree failed") !=
        std::string::npos);

  auto commit = resealed("vllm", [](Json& r) {
    r["driver_environment"]["repository"]["commit"] = std::string(40, '0');
  });
  CHECK(refusal(commit.first, "vllm", commit.second).find("check source_commit failed") !=
        std::string::npos);

  auto model = resealed("kiln", [](Json& r) {
    r["engine"]["model_identity"]["config_hash"] = "sha256:" + std::string(64, '1');
  });
  CHECK(refusal(model.first, "kiln", model.second)
            .find("check model_identity failed: engine.model_identity (without path) differs "
                  "from request.model_identity: differs in config_hash") != std::string::npos);

  auto two_runs = resealed("kiln", [](Json& r) { r["runs"].push_back(r["runs"][0]); });
  CHECK(refusal(two_runs.first, "kiln", two_runs.second).find("check single_run failed") !=
        std::string::npos);

  auto c8 = resealed("vllm", [](Json& r) { r["runs"][0]["concurrency"] = 8; });
  CHECK(refusal(c8.first, "vllm", c8.second).find("runs[0].concurrency is 8, not 1") !=
        std::string::npos);

  auto tokens = resealed("kiln", [](Json& r) { r["runs"][0]["prompt_token_counts"] = {164}; });
  CHECK(refusal(tokens.first, "kiln", tokens.second).find("check prompt_token_count failed") !=
        std::string::npos);

  auto reasoning = resealed("vllm", [](Json& r) {
    r["runs"][0]["output_evidence"][0]["exact_output"]["reasoning_content_base64"] = "aG1t";
    r["runs"][0]["output_evidence"][0]["reasoning_utf8_bytes"] = 3;
  });
  CHECK(refusal(reasoning.first, "vllm", reasoning.second).find("check empty_reasoning failed") !=
        std::string::npos);
}

TEST_CASE(
    "Kiln's four receipt rules: driver version 7, repeat 0, exact_output with its two keys only, "
    "prompt_token_counts exactly [n]") {
  auto driver = resealed("kiln", [](Json& r) { r["driver_version"] = "8"; });
  CHECK(refusal(driver.first, "kiln", driver.second)
            .find("check driver_version failed: driver_version is \"8\", Kiln's receipts come "
                  "from driver version \"7\"") != std::string::npos);
  auto driver_int = resealed("vllm", [](Json& r) { r["driver_version"] = 7; });
  CHECK(refusal(driver_int.first, "vllm", driver_int.second).find("check driver_version failed") !=
        std::string::npos);

  auto repeat = resealed("vllm", [](Json& r) { r["runs"][0]["repeat"] = 1; });
  CHECK(refusal(repeat.first, "vllm", repeat.second)
            .find("check single_run failed: runs[0].repeat is 1, not 0") != std::string::npos);
  auto warmup = resealed("kiln", [](Json& r) { r["runs"][0]["repeat"] = -1; });
  CHECK(refusal(warmup.first, "kiln", warmup.second).find("runs[0].repeat is -1") !=
        std::string::npos);
  auto repeat_float = resealed("kiln", [](Json& r) { r["runs"][0]["repeat"] = 0.0; });
  CHECK(refusal(repeat_float.first, "kiln", repeat_float.second).find("runs[0].repeat is 0.0") !=
        std::string::npos);

  auto extra = resealed("vllm", [](Json& r) {
    r["runs"][0]["output_evidence"][0]["exact_output"]["tool_calls_base64"] = "";
  });
  CHECK(refusal(extra.first, "vllm", extra.second)
            .find("check single_output failed: output_evidence[0].exact_output has keys "
                  "[content_base64, reasoning_content_base64, tool_calls_base64], not exactly "
                  "content_base64 and reasoning_content_base64") != std::string::npos);

  const int n = request_doc()["prompt"]["token_count"].get<int>();
  REQUIRE(n == 163);
  auto twice = resealed("kiln", [&](Json& r) { r["runs"][0]["prompt_token_counts"] = {n, n}; });
  CHECK(refusal(twice.first, "kiln", twice.second)
            .find("check prompt_token_count failed: runs[0].prompt_token_counts is [163,163], "
                  "not [163]") != std::string::npos);
  auto none =
      resealed("kiln", [](Json& r) { r["runs"][0]["prompt_token_counts"] = Json::array(); });
  CHECK(refusal(none.first, "kiln", none.second).find("check prompt_token_count failed") !=
        std::string::npos);
  auto as_float = resealed("vllm", [&](Json& r) { r["runs"][0]["prompt_token_counts"] = {163.0}; });
  CHECK(refusal(as_float.first, "vllm", as_float.second).find("check prompt_token_count failed") !=
        std::string::npos);
}

TEST_CASE("an output that does not continue with the prefix and the candidate fails") {
  // vLLM's real output is "To establish a foundation…": under Kiln's candidate it fails.
  Json doc = request_doc();
  doc["candidates"][1]["text"] = " baseline";
  std::string why = refusal(doc, "vllm", receipt("vllm"));
  CHECK(why.find("check continuation failed: the output starts \"To establish a foundation") !=
        std::string::npos);
  CHECK(why.find("\"To establish a baseline\"") != std::string::npos);
}

TEST_CASE("an assay request names no receipts to check") {
  Json doc{{"schema", "assay.next-token-request.v1"},
           {"id", "x"},
           {"input_token_ids", {1, 2}},
           {"candidates",
            {{{"engine", "a"}, {"token_id", 1}, {"text", "a"}},
             {{"engine", "b"}, {"token_id", 2}, {"text", "b"}}}}};
  CHECK_THROWS_WITH_AS(
      common::check_kiln_receipt(common::validate_request(doc), slot("kiln"), receipt("kiln")),
      "only a Kiln request names engine receipts", common::Error);
}
