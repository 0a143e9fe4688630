#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "common/error.h"
#include "common/identity.h"
#include "common/json.h"
#include "common/request.h"
#include "common/result.h"
#include "common/sign.h"

using assay::common::Error;
using assay::common::Json;
namespace common = assay::common;

namespace {

Json identity() {
  Json mi{{"id", "fixture"},
          {"config_hash", "sha256:" + std::string(64, 'a')},
          {"tokenizer_hash", "sha256:" + std::string(64, 'b')},
          {"chat_template_hash", nullptr},
          {"weight_files",
           {{{"path", "model.safetensors"},
             {"bytes", 10},
             {"sha256", "sha256:" + std::string(64, 'c')}}}}};
  mi["content_sha256"] = common::model_content_sha256(mi);
  return mi;
}

Json assay_request() {
  return Json{{"schema", "assay.next-token-request.v1"},
              {"id", "r1"},
              {"model_dir", "/models/tiny"},
              {"input_token_ids", {72, 101, 108}},
              {"candidates",
               {{{"engine", "kiln"}, {"token_id", 65}, {"text", "A"}},
                {{"engine", "vllm"}, {"token_id", 66}, {"text", "B"}}}}};
}

// The shape of Kiln's real request (tests/client/fixtures/kiln-request-v1.json), shrunk.
Json kiln_request() {
  const std::string message = "Write a paragraph.";
  Json receipt{{"path", "receipts/run.kiln.json"},
               {"file_sha256", "sha256:" + std::string(64, 'd')},
               {"content_sha256", "sha256:" + std::string(64, 'e')}};
  Json r{{"schema", "kiln.hf-next-token-request.v1"},
         {"id", "k1"},
         {"source",
          {{"source_commit", std::string(40, 'f')},
           {"kiln_receipt", receipt},
           {"vllm_receipt", receipt}}},
         {"model_identity", identity()},
         {"prompt",
          {{"generator",
            {{"run_id", "run-1"},
             {"phase", "measure-c001-r000"},
             {"request_index", 0},
             {"profile", "short"},
             {"template_version", "fixed-serving-profiles-v1"}}},
           {"messages", {{{"role", "user"}, {"content", message}}}},
           {"add_generation_prompt", true},
           {"template_kwargs", {{"enable_thinking", false}}},
           {"utf8_sha256", common::sha256_id(message)},
           {"token_count", 3},
           {"token_ids", {1, 2, 3}}}},
         {"continuation_prefix", {{{"token_id", 4}, {"text", "To"}}}},
         {"input_token_ids", {1, 2, 3, 4}},
         {"candidates",
          {{{"engine", "kiln"}, {"token_id", 5}, {"text", "x"}},
           {{"engine", "vllm"}, {"token_id", 6}, {"text", "y"}}}}};
  r["input_token_ids_sha256"] = common::token_ids_sha256(std::vector<std::int64_t>{1, 2, 3, 4});
  return r;
}

std::string code_of(const Json& doc) {
  try {
    common::validate_request(doc);
  } catch (const Error& e) {
    return e.code();
  }
  return "accepted";
}

}  // namespace

TEST_CASE("token ids hash as Kiln's canonical JSON array") {
  std::vector<std::int64_t> ids{1, 2, 300};
  CHECK(common::token_ids_sha256(ids) == common::sha256_id(std::string("[1,2,300]")));
  CHECK(common::token_ids_sha256(ids) == common::sha256_canonical_id(Json{1, 2, 300}));
}

TEST_CASE("a valid assay request parses with its recomputed identities") {
  auto r = common::parse_request(assay_request().dump());
  CHECK(r.kind == common::RequestKind::kAssay);
  CHECK(r.model_dir == std::optional<std::string>("/models/tiny"));
  CHECK(r.candidates.size() == 2);
  CHECK(r.candidates[1].engine == "vllm");
  CHECK(r.request_sha256 == common::sha256_id(common::canonical(assay_request())));
  CHECK(r.input_token_ids_sha256 == common::sha256_id(std::string("[72,101,108]")));
  Json report = r.check_report();
  CHECK(report["model_content_sha256"].is_null());
  CHECK(report["schema"] == "assay.next-token-request.v1");
}

TEST_CASE("a valid Kiln request is accepted as is and keeps its source pair") {
  auto r = common::validate_request(kiln_request());
  CHECK(r.kind == common::RequestKind::kKiln);
  CHECK_FALSE(r.model_dir.has_value());
  CHECK(r.source == kiln_request()["source"]);
  REQUIRE(r.continuation_prefix.size() == 1);
  CHECK(r.continuation_prefix[0].token_id == 4);
  CHECK(r.continuation_prefix[0].text == "To");
  CHECK(r.request_sha256 == common::sha256_id(common::canonical(kiln_request())));
  CHECK(r.check_report()["model_content_sha256"] == identity()["content_sha256"]);
}

TEST_CASE(
    "a Kiln request's sha256 is Kiln's identity of its retained file, without assay's "
    "additions") {
  // Kiln's record names the request file Kiln keeps (request.sha256: "canonical SHA-256 identity
  // of the retained request content"); `assay submit --numerics`, limits and an oracle backend
  // are assay's, so a record exported from such a job still names Kiln's file.
  const std::string kiln_id = common::sha256_id(common::python_canonical(kiln_request()));
  Json added = kiln_request();
  added["numerics"] = Json::object();
  added["limits"] = {{"memory_events", "record"}};
  added["oracle"] = {{"backend", "transformers"}};
  auto r = common::validate_request(added);
  CHECK(r.request_sha256 == kiln_id);
  CHECK(r.document == added);  // the job keeps the whole document (and keys on it)
  // An assay request's sha256 is its whole document's, additions and all.
  Json assay = assay_request();
  auto plain = common::validate_request(assay);
  assay["numerics"] = Json::object();
  CHECK(common::validate_request(assay).request_sha256 != plain.request_sha256);
}

TEST_CASE("memory_events: a Kiln request rejects memory pressure unless it says otherwise") {
  CHECK(common::validate_request(kiln_request()).limits.memory_events ==
        common::MemoryPolicy::kReject);
  Json kiln = kiln_request();
  kiln["limits"] = {{"memory_events", "record"}};
  CHECK(common::validate_request(kiln).limits.memory_events == common::MemoryPolicy::kRecord);
  Json assay = assay_request();
  CHECK_FALSE(common::validate_request(assay).limits.memory_events.has_value());
  assay["limits"] = {{"memory_events", "reject"}};
  CHECK(common::validate_request(assay).limits.memory_events == common::MemoryPolicy::kReject);
  assay["limits"] = {{"memory_events", true}};
  CHECK_THROWS_WITH_AS(common::validate_request(assay),
                       "request.limits.memory_events must be \"record\" or \"reject\", got true",
                       common::Error);
}

TEST_CASE("request.oracle.backend chooses libtorch or transformers and names a bad value") {
  CHECK_FALSE(common::validate_request(assay_request()).backend.has_value());
  Json doc = assay_request();
  doc["oracle"] = {{"backend", "transformers"}};
  CHECK(common::validate_request(doc).backend == "transformers");
  Json kiln = kiln_request();
  kiln["oracle"] = {{"backend", "libtorch"}};
  CHECK(common::validate_request(kiln).backend == "libtorch");
  doc["oracle"] = {{"backend", "vllm"}};
  CHECK_THROWS_WITH_AS(
      common::validate_request(doc),
      "request.oracle.backend must be \"libtorch\", \"transformers\" or \"both\", got \"vllm\"",
      common::Error);
  doc["oracle"] = {{"backend", "transformers"}, {"device", "cuda"}};
  CHECK_THROWS_AS(common::validate_request(doc), common::Error);
}

TEST_CASE("key order and whitespace do not change the request sha256") {
  auto a = common::parse_request(R"({"schema":"assay.next-token-request.v1","id":"x",
    "input_token_ids":[1],"candidates":[{"engine":"a","token_id":1,"text":""},
    {"engine":"b","token_id":2,"text":""}]})");
  auto b = common::parse_request(R"({"candidates":[{"text":"","token_id":1,"engine":"a"},
    {"engine":"b","text":"","token_id":2}],"input_token_ids":[1],"id":"x",
    "schema":"assay.next-token-request.v1"})");
  CHECK(a.request_sha256 == b.request_sha256);
}

TEST_CASE("bad requests are refused with a stable code") {
  auto with = [](Json doc, const std::string& pointer, Json value) {
    doc[Json::json_pointer(pointer)] = value;
    return doc;
  };
  auto without = [](Json doc, const std::string& key) {
    doc.erase(key);
    return doc;
  };
  CHECK(code_of(with(assay_request(), "/schema", "assay.next-token-request.v2")) ==
        "request.unknown_schema");
  CHECK(code_of(without(assay_request(), "schema")) == "request.unknown_schema");
  CHECK(code_of(without(assay_request(), "candidates")) == "request.invalid");
  CHECK(code_of(without(assay_request(), "input_token_ids")) == "request.invalid");
  CHECK(code_of(with(assay_request(), "/extra", 1)) == "request.invalid");
  CHECK(code_of(with(assay_request(), "/input_token_ids", Json::array())) == "request.invalid");
  CHECK(code_of(with(assay_request(), "/input_token_ids/1", -1)) == "request.invalid_token_id");
  CHECK(code_of(with(assay_request(), "/input_token_ids/1", 1.5)) == "request.invalid_token_id");
  CHECK(code_of(with(assay_request(), "/input_token_ids/1", "7")) == "request.invalid_token_id");
  CHECK(code_of(with(assay_request(), "/input_token_ids/1", 4294967296LL)) ==
        "request.invalid_token_id");
  CHECK(code_of(with(assay_request(), "/candidates/1/engine", "kiln")) == "request.invalid");
  CHECK(code_of(with(assay_request(), "/candidates/1/engine", "neither")) == "request.invalid");
  CHECK(code_of(with(assay_request(), "/candidates/1/extra", true)) == "request.invalid");
  CHECK(code_of(with(assay_request(), "/candidates",
                     Json::array({assay_request()["candidates"][0]}))) == "request.invalid");
  CHECK(code_of(with(assay_request(), "/model_dir", "relative/dir")) == "request.invalid");
  CHECK(code_of(with(assay_request(), "/id", "")) == "request.invalid");
  CHECK(code_of(with(assay_request(), "/limits", Json{{"timeout_seconds", 0}})) ==
        "request.invalid");
  CHECK(code_of(with(assay_request(), "/input_token_ids_sha256",
                     "sha256:" + std::string(64, '0'))) == "request.sha_mismatch");
  CHECK(code_of(with(assay_request(), "/input_token_ids_sha256", "SHA256:xyz")) ==
        "request.invalid");
  CHECK(code_of(Json::array()) == "request.invalid");

  CHECK(code_of(with(kiln_request(), "/input_token_ids", {1, 2, 3, 5})) ==
        "request.inconsistent_token_ids");
  CHECK(code_of(with(kiln_request(), "/prompt/token_ids", {1, 2})) ==
        "request.token_count_mismatch");
  CHECK(code_of(with(with(kiln_request(), "/prompt/token_ids", {1, 2}), "/prompt/token_count",
                     2)) == "request.inconsistent_token_ids");
  CHECK(code_of(with(kiln_request(), "/continuation_prefix/0/token_id", 7)) ==
        "request.inconsistent_token_ids");
  CHECK(code_of(with(kiln_request(), "/prompt/messages/0/content", "Write a paragraph!")) ==
        "request.sha_mismatch");
  CHECK(code_of(without(kiln_request(), "continuation_prefix")) == "request.invalid");
  CHECK(code_of(with(kiln_request(), "/source/extra", 1)) == "request.invalid");
  CHECK(code_of(with(kiln_request(), "/prompt/text", "rendered")) == "request.invalid");
  CHECK(code_of(with(kiln_request(), "/input_token_ids_sha256",
                     "sha256:" + std::string(64, '1'))) == "request.sha_mismatch");
  CHECK(code_of(without(kiln_request(), "input_token_ids_sha256")) == "request.invalid");
  CHECK(code_of(without(kiln_request(), "model_identity")) == "request.invalid");
  CHECK(code_of(without(kiln_request(), "source")) == "request.invalid");
  CHECK(code_of(with(kiln_request(), "/model_dir", "/models/x")) == "request.invalid");
  CHECK(code_of(with(kiln_request(), "/model_identity/content_sha256",
                     "sha256:" + std::string(64, '2'))) == "request.sha_mismatch");
  CHECK(code_of(with(kiln_request(), "/model_identity/config_hash", "md5:abc")) ==
        "request.invalid");
  CHECK(code_of(with(kiln_request(), "/model_identity/weight_files/0/path", "/etc/passwd")) ==
        "request.invalid");
}

TEST_CASE("malformed JSON and duplicate keys are refused by the strict parser") {
  try {
    common::parse_request("{\"schema\":");
    FAIL("truncated JSON accepted");
  } catch (const Error& e) {
    CHECK(e.code() == "json.invalid");
  }
  try {
    common::parse_request(R"({"schema":"assay.next-token-request.v1","id":"a","id":"b"})");
    FAIL("duplicate key accepted");
  } catch (const Error& e) {
    CHECK(e.code() == "json.invalid");
  }
}

TEST_CASE("vocab check names the first token id at or above the vocab size") {
  auto r = common::validate_request(assay_request());
  CHECK_NOTHROW(r.check_vocab(260));
  try {
    r.check_vocab(100);
    FAIL("accepted");
  } catch (const Error& e) {
    CHECK(e.code() == "request.invalid_token_id");
    CHECK(std::string(e.what()).find("input_token_ids[1] = 101") != std::string::npos);
  }
}

TEST_CASE("result self-hash excludes its own field and detects tampering") {
  Json result{{"schema", "assay.next-token-oracle-result.v1"},
              {"verdict", {{"argmax_token_id", 5}}}};
  std::string bytes = common::seal_result(result);
  CHECK(common::parse_strict(bytes) == result);
  CHECK_NOTHROW(common::verify_result_sha256(result));
  result["verdict"]["argmax_token_id"] = 6;
  CHECK_THROWS_AS(common::verify_result_sha256(result), Error);
}

TEST_CASE("the result statement names the result and the artifact digests") {
  Json result{{"schema", "assay.next-token-oracle-result.v1"}};
  std::string bytes = common::seal_result(result);
  std::string artifact = "sha256:" + std::string(64, 'd');
  Json st = common::make_result_statement(bytes, artifact);
  CHECK(st["subject"][0]["name"] == "result.json");
  CHECK(st["subject"][0]["digest"]["sha256"] == common::sha256_id(bytes).substr(7));
  CHECK(st["subject"][1]["digest"]["sha256"] == std::string(64, 'd'));
  auto key = common::SigningKey::generate();
  Json env = common::dsse_sign(common::kInTotoPayloadType, common::canonical(st), key);
  CHECK(common::parse_strict(common::dsse_verify(env, key.public_key_raw())) == st);
}
