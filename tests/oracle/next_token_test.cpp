#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/error.h"
#include "worker/next_token.h"

using assay::common::Error;
using assay::common::Json;
using namespace assay::oracle;

namespace {

Tokenizer letters() {
  Json vocab = Json::object();
  for (int i = 0; i < 6; ++i) vocab[std::string(1, static_cast<char>('a' + i))] = i;
  return Tokenizer::from_json(
      {{"model", {{"type", "BPE"}, {"vocab", vocab}}}, {"decoder", {{"type", "ByteLevel"}}}});
}

Json valid_input() {
  return {{"schema", "assay.oracle-input.v1"},
          {"model_dir", "/models/tiny"},
          {"input_token_ids", {1, 2, 3}},
          {"candidate_tokens",
           {{{"engine", "kiln"}, {"token_id", 4}, {"text", "e"}},
            {{"engine", "vllm"}, {"token_id", 5}, {"text", "f"}}}},
          {"execution", {{"device", "cpu"}, {"dtype", "bfloat16"}, {"threads", 2}}}};
}

std::string error_code(const Json& doc) {
  try {
    parse_oracle_input(doc);
  } catch (const Error& e) {
    return e.code();
  }
  return "accepted";
}

}  // namespace

TEST_CASE("oracle input parses every field") {
  OracleInput in = parse_oracle_input(valid_input());
  CHECK(in.model_dir == "/models/tiny");
  CHECK(in.input_token_ids == std::vector<std::int64_t>{1, 2, 3});
  REQUIRE(in.candidates.size() == 2);
  CHECK(in.candidates[1].engine == "vllm");
  CHECK(in.candidates[1].token_id == 5);
  CHECK(in.execution.threads == 2);
}

TEST_CASE("oracle input rejects missing, unknown and out-of-range fields") {
  Json doc = valid_input();
  doc.erase("execution");
  CHECK(error_code(doc) == "json.missing_field");
  doc = valid_input();
  doc["extra"] = 1;
  CHECK(error_code(doc) == "json.unknown_field");
  doc = valid_input();
  doc["schema"] = "assay.oracle-input.v2";
  CHECK(error_code(doc) == "input.invalid");
  doc = valid_input();
  doc["model_dir"] = "relative/dir";
  CHECK(error_code(doc) == "input.invalid");
  doc = valid_input();
  doc["candidate_tokens"].erase(1);
  CHECK(error_code(doc) == "input.invalid");
  doc = valid_input();
  doc["execution"]["threads"] = 0;
  CHECK(error_code(doc) == "input.invalid");
  doc = valid_input();
  doc["input_token_ids"] = Json::array();
  CHECK(error_code(doc) == "input.invalid");
}

TEST_CASE("oracle input takes the supervisor's model_fds and refuses malformed ones") {
  Json doc = valid_input();
  CHECK_FALSE(parse_oracle_input(doc).model_fds.has_value());
  doc["model_fds"] =
      Json::parse(R"([{"name":"config.json","fd":3},{"name":"model.safetensors","fd":4}])");
  OracleInput in = parse_oracle_input(doc);
  REQUIRE(in.model_fds.has_value());
  CHECK(*in.model_fds ==
        std::vector<assay::fingerprint::ModelFd>{{"config.json", 3}, {"model.safetensors", 4}});
  doc["model_fds"] = Json::parse(R"([{"name":"../config.json","fd":3}])");
  CHECK(error_code(doc) == "input.invalid");
  doc["model_fds"] = Json::parse(R"([{"name":"config.json","fd":1}])");
  CHECK(error_code(doc) == "input.invalid");
  doc["model_fds"] = Json::parse(R"([{"name":"a","fd":3},{"name":"a","fd":4}])");
  CHECK(error_code(doc) == "input.invalid");
}

TEST_CASE("ranking: argmax, margin, top tokens and candidate ranks") {
  std::vector<float> logits{0.5f, 2.0f, -1.0f, 1.25f, 2.0f, 1.0f};
  std::vector<Candidate> cands{{"kiln", 4, "e"}, {"vllm", 3, "d"}};
  Json r = rank_logits(logits, letters(), cands);
  CHECK(r["argmax"] == 1);  // lowest id among equal maxima
  CHECK(r["argmax_text"] == "b");
  CHECK(r["top_logit_margin"] == 0.0);
  CHECK(r["top_logit_tie"] == true);
  REQUIRE(r["top_tokens"].size() == 6);
  CHECK(r["top_tokens"][0]["token_id"] == 1);
  CHECK(r["top_tokens"][1]["token_id"] == 4);
  CHECK(r["top_tokens"][2]["token_id"] == 3);
  CHECK(r["top_tokens"][5]["token_id"] == 2);
  CHECK(r["candidate_tokens"][0]["rank"] == 1);  // tied with the argmax: nothing is greater
  CHECK(r["candidate_tokens"][0]["is_argmax"] == false);
  CHECK(r["candidate_tokens"][1]["rank"] == 3);
  CHECK(r["candidate_tokens"][1]["logit"] == 1.25);
}

TEST_CASE("ranking: the margin is top-1 minus top-2 and top_tokens holds at most 10") {
  std::vector<float> logits(20);
  for (int i = 0; i < 20; ++i) logits[i] = static_cast<float>(i) * 0.5f;
  Json r = rank_logits(logits, letters(), {{"a", 19, ""}, {"b", 0, "a"}});
  CHECK(r["argmax"] == 19);
  CHECK(r["argmax_text"].is_null());  // id 19 is past this tokenizer's vocabulary
  CHECK(r["top_logit_margin"] == 0.5);
  CHECK(r["top_logit_tie"] == false);
  CHECK(r["top_tokens"].size() == 10);
  CHECK(r["top_tokens"][9]["token_id"] == 10);
  CHECK(r["candidate_tokens"][1]["rank"] == 20);
}

TEST_CASE("ranking refuses non-finite logits, naming the position") {
  std::vector<float> logits{0.0f, std::numeric_limits<float>::quiet_NaN(), 1.0f};
  CHECK_THROWS_WITH_AS(rank_logits(logits, letters(), {}), doctest::Contains("token 1"), Error);
}

TEST_CASE("candidates must decode to their recorded text and be inside the vocabulary") {
  Tokenizer t = letters();
  CHECK_NOTHROW(check_candidates({{"kiln", 4, "e"}, {"vllm", 0, "a"}}, t, 6));
  try {
    check_candidates({{"kiln", 4, "e"}, {"vllm", 0, "b"}}, t, 6);
    FAIL("accepted a mismatched text");
  } catch (const Error& e) {
    CHECK(e.code() == "request.candidate_text_mismatch");
    CHECK(std::string(e.what()).find("vllm") != std::string::npos);
  }
  try {
    check_candidates({{"kiln", 6, "g"}, {"vllm", 0, "a"}}, t, 6);
    FAIL("accepted an id outside the vocabulary");
  } catch (const Error& e) {
    CHECK(e.code() == "request.invalid_token_id");
    CHECK(std::string(e.what()).find("= 6") != std::string::npos);
  }
}

TEST_CASE("oracle batch input: states with their indices, each parsed as a single input's") {
  Json single = valid_input();
  Json s0{{"index", 3},
          {"input_token_ids", single["input_token_ids"]},
          {"candidate_tokens", single["candidate_tokens"]}};
  Json s1 = s0;
  s1["index"] = 7;
  s1["continuation_prefix"] = {{{"token_id", 2}, {"text", "c"}}};
  Json doc{{"schema", "assay.oracle-batch-input.v1"},
           {"model_dir", "/models/tiny"},
           {"execution", single["execution"]},
           {"states", {s0, s1}}};
  OracleBatchInput in = parse_oracle_batch_input(doc);
  REQUIRE(in.states.size() == 2);
  CHECK(in.states[0].index == 3);
  CHECK(in.states[1].index == 7);
  CHECK(in.states[1].input_token_ids == std::vector<std::int64_t>{1, 2, 3});
  CHECK(in.states[1].continuation_prefix.size() == 1);
  CHECK(in.execution.threads == 2);

  auto code = [](const Json& d) {
    try {
      parse_oracle_batch_input(d);
    } catch (const Error& e) {
      return e.code();
    }
    return std::string("accepted");
  };
  Json bad = doc;
  bad["states"][1]["index"] = -1;
  CHECK(code(bad) == "input.invalid");
  bad = doc;
  bad["states"] = Json::array();
  CHECK(code(bad) == "input.invalid");
  bad = doc;
  bad["states"][0]["limits"] = Json::object();
  CHECK(code(bad) == "json.unknown_field");
  bad = doc;
  bad["schema"] = "assay.oracle-input.v1";
  CHECK(code(bad) == "input.invalid");
}
