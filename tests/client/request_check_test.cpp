// `assay request check`: offline validation of assay and Kiln requests, printing identities
// recomputed from the document.
#include <doctest/doctest.h>

#include "common/identity.h"
#include "common/protocol.h"
#include "support.h"

namespace {

using assay::common::Json;
namespace common = assay::common;
using assay::client::test::run;
using assay::client::test::TempDir;

const std::string kConfigHash = common::sha256_id("config.json bytes");
const std::string kTokenizerHash = common::sha256_id("tokenizer.json bytes");

Json model_identity() {
  Json core{{"id", "fixture/tiny-llama"},
            {"config_hash", kConfigHash},
            {"tokenizer_hash", kTokenizerHash},
            {"chat_template_hash", nullptr},
            {"weight_files", Json::array({{{"path", "model.safetensors"},
                                           {"bytes", 1024},
                                           {"sha256", common::sha256_id("weights")}}})}};
  Json identity = core;
  // Computed here from the definition (canonical hash of the five fields), not by the parser.
  identity["content_sha256"] = common::sha256_id(core.dump());
  return identity;
}

Json candidates() {
  return Json::array({{{"engine", "kiln"}, {"token_id", 5}, {"text", " the"}},
                      {{"engine", "vllm"}, {"token_id", 9}, {"text", " a"}}});
}

Json assay_request() {
  return Json{{"schema", std::string(assay::protocol::kNextTokenRequest)},
              {"id", "dispute-1"},
              {"model_dir", "/models/tiny"},
              {"input_token_ids", {1, 2, 3}},
              {"candidates", candidates()}};
}

Json kiln_request() {
  return Json{{"schema", std::string(assay::protocol::kKilnNextTokenRequest)},
              {"id", "kiln-7"},
              {"source", {{"engine", "kiln"}, {"run", "r-17"}}},
              {"model_identity", model_identity()},
              {"prompt", {{"token_ids", {1, 2}}, {"text", "hi"}}},
              {"continuation_prefix", {{"token_ids", {3}}, {"text", "!"}}},
              {"input_token_ids", {1, 2, 3}},
              {"input_token_ids_sha256", common::sha256_id("[1,2,3]")},
              {"candidates", candidates()}};
}

}  // namespace

TEST_CASE("request check prints the recomputed identities of an assay request") {
  TempDir dir;
  Json doc = assay_request();
  auto r = run({"request", "check", dir.write("req.json", doc.dump(2))});
  REQUIRE(r.status == 0);
  Json out = common::parse_strict(r.out);
  CHECK(out["schema"] == "assay.next-token-request.v1");
  CHECK(out["request_sha256"] == common::sha256_id(common::canonical(doc)));
  CHECK(out["input_token_ids_sha256"] == common::sha256_id("[1,2,3]"));
  CHECK(out["model_content_sha256"].is_null());
}

TEST_CASE("request check accepts a Kiln request as is and reports its model content hash") {
  TempDir dir;
  Json doc = kiln_request();
  auto r = run({"request", "check", "--json", dir.write("kiln.json", doc.dump())});
  REQUIRE(r.status == 0);
  Json out = common::parse_strict(r.out);
  CHECK(out["schema"] == "kiln.hf-next-token-request.v1");
  CHECK(out["request_sha256"] == common::sha256_id(common::canonical(doc)));
  CHECK(out["model_content_sha256"] == model_identity()["content_sha256"]);
  CHECK(r.out.find('\n') == r.out.size() - 1);  // --json: one line
}

TEST_CASE("request check refuses invalid documents with exit 7 and the error's code") {
  TempDir dir;
  struct Case {
    const char* name;
    std::string text;
    const char* code;
  };
  Json bad_kiln_ids = kiln_request();
  bad_kiln_ids["input_token_ids"] = {1, 2, 4};
  bad_kiln_ids["input_token_ids_sha256"] = common::sha256_id("[1,2,4]");
  Json bad_sha = kiln_request();
  bad_sha["input_token_ids_sha256"] = common::sha256_id("[1,2]");
  Json bad_content = kiln_request();
  bad_content["model_identity"]["content_sha256"] = common::sha256_id("other");
  Json unknown_field = assay_request();
  unknown_field["temperature"] = 0;
  Json one_candidate = assay_request();
  one_candidate["candidates"].erase(1);
  Json negative_id = assay_request();
  negative_id["input_token_ids"] = {1, -2};
  Json relative_model = assay_request();
  relative_model["model_dir"] = "models/tiny";
  Json wrong_schema = assay_request();
  wrong_schema["schema"] = "assay.next-token-request.v2";
  std::vector<Case> cases{
      {"malformed JSON", "{\"schema\": ", "json.invalid"},
      {"duplicate key", R"({"id":"a","id":"b"})", "json.invalid"},
      {"wrong schema", wrong_schema.dump(), "request.unknown_schema"},
      {"unknown field", unknown_field.dump(), "request.invalid"},
      {"one candidate", one_candidate.dump(), "request.invalid"},
      {"negative token id", negative_id.dump(), "request.invalid_token_id"},
      {"relative model_dir", relative_model.dump(), "request.invalid"},
      {"Kiln ids != prompt + prefix", bad_kiln_ids.dump(), "request.inconsistent_token_ids"},
      {"Kiln token ids sha", bad_sha.dump(), "request.sha_mismatch"},
      {"Kiln content_sha256", bad_content.dump(), "request.sha_mismatch"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.name);
    auto r = run({"request", "check", dir.write("bad.json", c.text)});
    CHECK(r.status == 7);
    CHECK(r.out.empty());
    CHECK(r.err.find(std::string("[") + c.code + "]") != std::string::npos);
  }
}

TEST_CASE("request check names a missing file and exits 7") {
  auto r = run({"request", "check", "/nonexistent/req.json"});
  CHECK(r.status == 7);
  CHECK(r.err.find("/nonexistent/req.json") != std::string::npos);
}
