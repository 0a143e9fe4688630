// `assay request check`: offline validation of assay and Kiln requests, printing identities
// recomputed from the document.
#include <doctest/doctest.h>

#include <functional>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "common/request.h"
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

// A real Kiln request (a Qwen3.5-4B divergence between Kiln and vLLM), byte for byte as Kiln
// wrote it, with the three identities Kiln published for it.
const std::string kKilnFixture =
    std::string(ASSAY_CLIENT_TEST_DIR) + "/fixtures/kiln-request-v1.json";
constexpr const char* kKilnRequestSha256 =
    "sha256:fbe61941ebc147d50141a04bb8541e7ccb5bc16d6c893285ec9a2660f51336c4";
constexpr const char* kKilnInputIdsSha256 =
    "sha256:709d0a314cde9072ac79b0752e795f1b76bfaea5b553ccdf26f7fbd5ac44b1a0";
constexpr const char* kKilnContentSha256 =
    "sha256:b1f2cce5baf9e662fc4c2c421b79fccc8787521e6e85810eebffbb4aa43b309f";

Json kiln_fixture() {
  return common::parse_strict(common::read_file(kKilnFixture, 1 << 20));
}

Json kiln_request() {
  const std::string message = "hi";
  return Json{{"schema", std::string(assay::protocol::kKilnNextTokenRequest)},
              {"id", "kiln-7"},
              {"source",
               {{"source_commit", std::string(40, 'a')},
                {"kiln_receipt",
                 {{"path", "receipts/k.json"},
                  {"file_sha256", common::sha256_id("k file")},
                  {"content_sha256", common::sha256_id("k content")}}},
                {"vllm_receipt",
                 {{"path", "receipts/v.json"},
                  {"file_sha256", common::sha256_id("v file")},
                  {"content_sha256", common::sha256_id("v content")}}}}},
              {"model_identity", model_identity()},
              {"prompt",
               {{"generator",
                 {{"run_id", "r-17"},
                  {"phase", "measure"},
                  {"request_index", 0},
                  {"profile", "short"},
                  {"template_version", "v1"}}},
                {"messages", Json::array({{{"role", "user"}, {"content", message}}})},
                {"add_generation_prompt", true},
                {"template_kwargs", {{"enable_thinking", false}}},
                {"utf8_sha256", common::sha256_id(message)},
                {"token_count", 2},
                {"token_ids", {1, 2}}}},
              {"continuation_prefix", Json::array({{{"token_id", 3}, {"text", "!"}}})},
              {"input_token_ids", {1, 2, 3}},
              {"input_token_ids_sha256", common::sha256_id("[1,2,3]")},
              {"candidates", candidates()}};
}

// The error validate_request throws for `doc`, or {"accepted", ""}.
std::pair<std::string, std::string> refusal(const Json& doc) {
  try {
    common::validate_request(doc);
  } catch (const common::Error& e) {
    return {e.code(), e.what()};
  }
  return {"accepted", ""};
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
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
  Json bad_count = kiln_request();
  bad_count["prompt"]["token_count"] = 3;
  Json bad_utf8 = kiln_request();
  bad_utf8["prompt"]["messages"][0]["content"] = "hi!";
  Json guessed_format = kiln_request();
  guessed_format["continuation_prefix"] = {{"token_ids", {3}}, {"text", "!"}};
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
      {"Kiln token_count", bad_count.dump(), "request.token_count_mismatch"},
      {"Kiln utf8_sha256", bad_utf8.dump(), "request.sha_mismatch"},
      {"Kiln prefix as an object", guessed_format.dump(), "request.invalid"},
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

TEST_CASE("request check prints the three identities Kiln published for its real request") {
  auto r = run({"request", "check", "--json", kKilnFixture});
  REQUIRE(r.status == 0);
  Json out = common::parse_strict(r.out);
  CHECK(out["schema"] == "kiln.hf-next-token-request.v1");
  CHECK(out["request_sha256"].get<std::string>() == kKilnRequestSha256);
  CHECK(out["input_token_ids_sha256"].get<std::string>() == kKilnInputIdsSha256);
  CHECK(out["model_content_sha256"].get<std::string>() == kKilnContentSha256);
}

TEST_CASE("assay's options beside a Kiln request never change the digest of Kiln's document") {
  // The oracle backend, limits and the numerics envelope are assay's: Kiln's closed schema has
  // none of them, so request_sha256 (what an exported record names) stays Kiln's own.
  Json doc = kiln_fixture();
  doc["oracle"] = {{"backend", "transformers"}};
  doc["limits"] = {{"timeout_seconds", 60}};
  doc["numerics"] = Json::object();
  auto r = common::validate_request(doc);
  CHECK(r.request_sha256 == kKilnRequestSha256);
  CHECK(r.document.contains("oracle"));  // kept beside it, for the job
}

TEST_CASE("a real Kiln request keeps its source verbatim and its prefix tokens with their texts") {
  Json doc = kiln_fixture();
  auto r = common::validate_request(doc);
  CHECK(r.kind == common::RequestKind::kKiln);
  CHECK(r.source == doc["source"]);
  CHECK(r.source["source_commit"] == "1434e0d110ccd012a9142f54b3f0938ab5ca503f");
  REQUIRE(r.continuation_prefix.size() == 3);
  CHECK(r.continuation_prefix[0].token_id == 1206);
  CHECK(r.continuation_prefix[0].text == "To");
  CHECK(r.continuation_prefix[1].token_id == 5517);
  CHECK(r.continuation_prefix[1].text == " establish");
  CHECK(r.continuation_prefix[2].token_id == 264);
  CHECK(r.continuation_prefix[2].text == " a");
  CHECK(r.input_token_ids.size() == 166);
  CHECK(r.input_token_ids.back() == 264);
  CHECK(r.candidates[1].text == " foundation");
}

TEST_CASE("each Kiln consistency check refuses a modified copy, naming field, expected and found") {
  const Json fixture = kiln_fixture();
  struct Case {
    const char* name;
    std::function<void(Json&)> change;
    const char* code;
    std::vector<std::string> says;
  };
  const std::string content = fixture["prompt"]["messages"][0]["content"];
  const std::string zeros = "sha256:" + std::string(64, '0');
  auto fix_ids_sha = [](Json& d) {
    d["input_token_ids_sha256"] = common::sha256_id(d["input_token_ids"].dump());
  };
  std::vector<Case> cases{
      {"token_count one short",
       [](Json& d) { d["prompt"]["token_count"] = 162; },
       "request.token_count_mismatch",
       {"request.prompt.token_count", "expected 163", "found 162"}},
      {"token_count one more",
       [](Json& d) { d["prompt"]["token_count"] = 164; },
       "request.token_count_mismatch",
       {"expected 163", "found 164"}},
      {"message content edited",
       [](Json& d) { d["prompt"]["messages"][0]["content"] = "Write"; },
       "request.sha_mismatch",
       {"request.prompt.utf8_sha256", "expected " + common::sha256_id("Write"),
        "found sha256:32c72cd7932333fd79d060e1622b6c349445416049cb75ab5075efbdcfe9742c"}},
      {"utf8_sha256 edited",
       [&](Json& d) { d["prompt"]["utf8_sha256"] = zeros; },
       "request.sha_mismatch",
       {"request.prompt.utf8_sha256",
        "expected sha256:32c72cd7932333fd79d060e1622b6c349445416049cb75ab5075efbdcfe9742c",
        "found " + zeros}},
      {"input id in the prefix part changed (its sha recomputed)",
       [&](Json& d) {
         d["input_token_ids"][164] = 999;
         fix_ids_sha(d);
       },
       "request.inconsistent_token_ids",
       {"request.input_token_ids[164]", "expected 5517", "request.continuation_prefix[1].token_id",
        "found 999"}},
      {"prompt id changed",
       [](Json& d) { d["prompt"]["token_ids"][5] = 7; },
       "request.inconsistent_token_ids",
       {"request.input_token_ids[5]", "expected 7", "request.prompt.token_ids[5]",
        "found " + fixture["input_token_ids"][5].dump()}},
      {"prefix token dropped",
       [](Json& d) { d["continuation_prefix"].erase(2); },
       "request.inconsistent_token_ids",
       {"expected 165 ids", "found 166"}},
      {"prefix token swapped for another id",
       [](Json& d) { d["continuation_prefix"][0]["token_id"] = 1207; },
       "request.inconsistent_token_ids",
       {"request.input_token_ids[163]", "expected 1207", "found 1206"}},
      {"input_token_ids_sha256 edited",
       [&](Json& d) { d["input_token_ids_sha256"] = zeros; },
       "request.sha_mismatch",
       {"request.input_token_ids_sha256", std::string("expected ") + kKilnInputIdsSha256,
        "found " + zeros}},
      {"content_sha256 edited",
       [&](Json& d) { d["model_identity"]["content_sha256"] = zeros; },
       "request.sha_mismatch",
       {"request.model_identity.content_sha256", std::string("expected ") + kKilnContentSha256,
        "found " + zeros}},
      {"a weight shard's size edited",
       [](Json& d) { d["model_identity"]["weight_files"][1]["bytes"] = 3990429409LL; },
       "request.sha_mismatch",
       {"request.model_identity.content_sha256", std::string("found ") + kKilnContentSha256}},
  };
  for (const auto& c : cases) {
    CAPTURE(c.name);
    Json doc = fixture;
    c.change(doc);
    auto [code, message] = refusal(doc);
    CHECK(code == c.code);
    for (const auto& s : c.says) {
      CAPTURE(s);
      CHECK(contains(message, s));
    }
  }
}

TEST_CASE("Kiln's closed objects refuse an unknown or missing field at every level") {
  const Json fixture = kiln_fixture();
  for (std::string pointer :
       {"/extra", "/source/extra", "/source/kiln_receipt/extra", "/source/vllm_receipt/extra",
        "/model_identity/extra", "/model_identity/weight_files/0/extra", "/prompt/text",
        "/prompt/generator/seed", "/prompt/messages/0/name", "/prompt/template_kwargs/tools",
        "/continuation_prefix/0/logprob", "/candidates/0/logprob", "/model_dir"}) {
    CAPTURE(pointer);
    Json doc = fixture;
    doc[Json::json_pointer(pointer)] = "x";
    auto [code, message] = refusal(doc);
    CHECK(code == "request.invalid");
    CHECK(contains(message, pointer.substr(pointer.rfind('/') + 1)));
  }
  for (std::string pointer :
       {"/source", "/source/source_commit", "/source/kiln_receipt/file_sha256", "/prompt",
        "/prompt/generator", "/prompt/generator/run_id", "/prompt/messages",
        "/prompt/add_generation_prompt", "/prompt/template_kwargs",
        "/prompt/template_kwargs/enable_thinking", "/prompt/utf8_sha256", "/prompt/token_count",
        "/prompt/token_ids", "/continuation_prefix", "/continuation_prefix/0/text"}) {
    CAPTURE(pointer);
    Json doc = fixture;
    auto slash = pointer.rfind('/');
    doc[Json::json_pointer(pointer.substr(0, slash))].erase(pointer.substr(slash + 1));
    auto [code, message] = refusal(doc);
    CHECK(code == "request.invalid");
    CHECK(contains(message, pointer.substr(slash + 1)));
  }
}

TEST_CASE("Kiln field types are checked as Kiln writes them") {
  const Json fixture = kiln_fixture();
  std::vector<std::pair<std::string, Json>> bad{
      {"/source/source_commit", "1434e0d"},
      {"/source/kiln_receipt/path", "/etc/passwd"},
      {"/source/vllm_receipt/content_sha256", "md5:00"},
      {"/prompt/generator/request_index", -1},
      {"/prompt/generator/profile", ""},
      {"/prompt/add_generation_prompt", "true"},
      {"/prompt/template_kwargs/enable_thinking", 0},
      {"/prompt/token_count", "163"},
      {"/prompt/messages/0/role", "robot"},
      {"/prompt/messages/0/content", 5},
      {"/continuation_prefix/1/text", nullptr},
      {"/continuation_prefix", Json{{"token_ids", {1206, 5517, 264}}, {"text", "To establish a"}}},
  };
  for (const auto& [pointer, value] : bad) {
    CAPTURE(pointer);
    Json doc = fixture;
    doc[Json::json_pointer(pointer)] = value;
    CHECK(refusal(doc).first == "request.invalid");
  }
  Json negative = fixture;
  negative["continuation_prefix"][0]["token_id"] = -1;
  CHECK(refusal(negative).first == "request.invalid_token_id");
}

TEST_CASE("utf8_sha256 names the one user message; a second user message is refused") {
  Json with_system = kiln_fixture();
  auto& messages = with_system["prompt"]["messages"];
  messages.insert(messages.begin(), Json{{"role", "system"}, {"content", "Be brief."}});
  CHECK(refusal(with_system).first == "accepted");

  Json two_users = kiln_fixture();
  two_users["prompt"]["messages"].push_back(Json{{"role", "user"}, {"content", "Again."}});
  auto [code, message] = refusal(two_users);
  CHECK(code == "request.invalid");
  CHECK(contains(message, "request.prompt.messages[1]"));

  Json no_user = kiln_fixture();
  no_user["prompt"]["messages"][0]["role"] = "system";
  CHECK(refusal(no_user).first == "request.invalid");
}

TEST_CASE("Kiln's identities escape non-ASCII text as Kiln's json.dumps does") {
  Json doc = kiln_fixture();
  doc["candidates"][1]["text"] = " fondation\u00e9\U0001F600";
  auto r = common::validate_request(doc);
  // python3: sha256(json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True))
  CHECK(r.request_sha256 ==
        "sha256:bd602bd14a3907082c275605d66aa1dec504182adda3a08089cb01e949b65ab9");
  CHECK(common::kiln_canonical(Json("\u00e9\U0001F600\n")) == "\"\\u00e9\\ud83d\\ude00\\n\"");
  CHECK(common::kiln_canonical(doc["source"]) == common::canonical(doc["source"]));

  // The model identity's content_sha256 likewise (python3, the same json.dumps of the five fields).
  Json identity = doc["model_identity"];
  identity["id"] = "Qwen3.5-4B-\u00e9";
  CHECK(common::model_content_sha256(identity) ==
        "sha256:ffeef86e72d20e2593c625fdbeba831621b861da195313671a97cd67eacbf254");
}

TEST_CASE("request check --receipts runs assayd's receipt checks offline on Kiln's real receipts") {
  const std::string receipts = std::string(ASSAY_CLIENT_TEST_DIR) + "/fixtures/kiln/receipts";
  auto r = run({"request", "check", "--json", kKilnFixture, "--receipts", receipts});
  REQUIRE_MESSAGE(r.status == 0, r.err);
  Json report = common::parse_strict(r.out);
  CHECK(report["request_sha256"] == kKilnRequestSha256);
  CHECK(report["receipts"]["checked"] == true);
  CHECK(report["receipts"]["receipts"][0]["engine"] == "kiln");
  CHECK(report["receipts"]["receipts"][0]["checks"].size() == 16);
  CHECK(report["receipts"]["receipts"][1]["receipt_sha256"] ==
        "sha256:7b9985dd155eca98e64b58e2f3b094fd9e8dd7510c587305309779e320c3001f");

  // A copy with one byte changed in the vLLM receipt: exit 7 naming the file, engine and check.
  TempDir dir;
  std::filesystem::create_directories(dir.path() / "r");
  for (const char* engine : {"kiln", "vllm"}) {
    std::string name =
        std::string("20260718t232632-rocm-strix-halo-greedy-c1-divergence-v1.") + engine + ".json";
    std::string bytes = common::read_file(receipts + "/" + name, 1 << 20);
    if (std::string(engine) == "vllm") bytes[bytes.find("llmbox")] = 'L';
    dir.write("r/" + name, bytes);
  }
  auto bad = run({"request", "check", kKilnFixture, "--receipts", (dir.path() / "r").string()});
  CHECK(bad.status == 7);
  CHECK(bad.err.find("vllm receipt (request.source.vllm_receipt): check file_sha256 failed") !=
        std::string::npos);
  CHECK(bad.err.find("[request.receipt_mismatch]") != std::string::npos);
}
