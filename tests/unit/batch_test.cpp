// assay.next-token-batch-request.v1 parsing: what is accepted, and each refusal with its code and
// the state it names.
#include <doctest/doctest.h>

#include <string>

#include "common/batch.h"
#include "common/error.h"
#include "common/identity.h"

using namespace assay::common;

namespace {

Json state(const std::string& id) {
  return Json{{"schema", "assay.next-token-request.v1"},
              {"id", id},
              {"input_token_ids", {1, 2, 3}},
              {"candidates",
               {{{"engine", "kiln"}, {"token_id", 4}, {"text", "e"}},
                {{"engine", "vllm"}, {"token_id", 5}, {"text", "f"}}}}};
}

Json batch(Json states) {
  return Json{{"schema", "assay.next-token-batch-request.v1"}, {"id", "sweep"}, {"states", states}};
}

std::pair<std::string, std::string> refusal(const Json& doc) {
  try {
    validate_batch_request(doc);
  } catch (const Error& e) {
    return {e.code(), e.what()};
  }
  return {"accepted", ""};
}

}  // namespace

TEST_CASE("batch request: states in order, each validated as a single request") {
  BatchRequest b = validate_batch_request(batch({state("a"), state("b")}));
  REQUIRE(b.states.size() == 2);
  CHECK(b.states[1].id == "b");
  CHECK(b.id == "sweep");
  CHECK_FALSE(b.model_dir.has_value());
  CHECK(b.request_sha256 == sha256_canonical_id(batch({state("a"), state("b")})));
}

TEST_CASE("batch request: a state's own model_dir becomes the batch's; two different are refused") {
  Json a = state("a"), b = state("b");
  a["model_dir"] = "/models/x";
  CHECK(validate_batch_request(batch({a, b})).model_dir == "/models/x");
  b["model_dir"] = "/models/y";
  auto [code, message] = refusal(batch({a, b}));
  CHECK(code == "request.mixed_models");
  CHECK(message.find("states[1]") != std::string::npos);
  CHECK(message.find("/models/y") != std::string::npos);
}

TEST_CASE("batch request: refusals name the state and keep the single request's code") {
  Json bad = state("b");
  bad["input_token_ids"] = {1, -2};
  auto [code, message] = refusal(batch({state("a"), bad}));
  CHECK(code == "request.invalid_token_id");
  CHECK(message.rfind("states[1]: ", 0) == 0);

  Json limited = state("c");
  limited["limits"] = {{"timeout_seconds", 5}};
  CHECK(refusal(batch({limited})).first == "request.invalid");
  CHECK(refusal(batch(Json::array())).first == "request.invalid");
  Json too_many = Json::array();
  for (std::size_t i = 0; i <= kMaxBatchStates; ++i) too_many.push_back(state("s"));
  CHECK(refusal(batch(too_many)).first == "request.invalid");
  Json unknown = batch({state("a")});
  unknown["extra"] = 1;
  CHECK(refusal(unknown).first == "json.unknown_field");
  Json relative = batch({state("a")});
  relative["model_dir"] = "models/x";
  CHECK(refusal(relative).first == "request.invalid");
  Json schema = batch({state("a")});
  schema["schema"] = "assay.next-token-request.v1";
  CHECK(refusal(schema).first == "request.unknown_schema");
}
