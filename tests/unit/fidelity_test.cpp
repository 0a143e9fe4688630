// assay.fidelity-request.v1 parsing: what is accepted, and each refusal with its code and the
// value it names.
#include <doctest/doctest.h>

#include <functional>

#include "common/error.h"
#include "common/fidelity.h"
#include "common/identity.h"

using namespace assay::common;

namespace {

Json valid() {
  return Json::parse(R"({
    "schema": "assay.fidelity-request.v1",
    "id": "q4",
    "reference": {"model_dir": "/models/ref/"},
    "candidate": {"logits": [
      {"path": "/data/a.safetensors", "sha256": "sha256:)" +
                     std::string(64, 'a') + R"("},
      {"path": "/data/b.safetensors", "sha256": "sha256:)" +
                     std::string(64, 'b') + R"("}]},
    "panel": {"contexts": [
      {"id": "a", "token_ids": [1, 2, 3, 4]},
      {"token_ids": [5, 6, 7, 8, 9], "positions": [[0, 2], [3, 5]]}]}
  })");
}

// The error code, and whether the message contains `words`.
std::pair<std::string, bool> refusal(const Json& doc, const std::string& words) {
  try {
    validate_fidelity_request(doc);
  } catch (const Error& e) {
    return {e.code(), std::string(e.what()).find(words) != std::string::npos};
  }
  return {"(accepted)", false};
}

}  // namespace

TEST_CASE("a fidelity request parses into its panel, candidate and identities") {
  auto r = validate_fidelity_request(valid());
  CHECK(r.id == "q4");
  CHECK(r.reference.model_dir == "/models/ref");  // trailing slash dropped
  CHECK_FALSE(r.candidate_model);
  REQUIRE(r.candidate_logits.size() == 2);
  REQUIRE(r.panel.size() == 2);
  CHECK(r.panel[0].positions == PositionRanges{{0, 4}});  // "all" by default
  CHECK(r.panel[1].id == "c1");                           // default id
  CHECK(r.panel[1].scored == 4);
  CHECK(r.scored_positions() == 8);
  CHECK(r.block_positions == kDefaultBlockPositions);
  CHECK_FALSE(r.reproduction_confirmation);
  CHECK(r.request_sha256 == sha256_canonical_id(valid()));
  CHECK(r.panel_sha256 == sha256_canonical_id(valid()["panel"]));
  CHECK_NOTHROW(r.check_vocab(10));
  CHECK_THROWS_WITH_AS(r.check_vocab(9), doctest::Contains("contexts[1].token_ids[4] = 9"), Error);
  CHECK_NOTHROW(r.check_context_length(5));
  CHECK_THROWS_WITH_AS(r.check_context_length(4), doctest::Contains("has 5 tokens"), Error);

  Json m = valid();
  m["candidate"] = {{"model_dir", "/models/q4"}, {"label", "int4"}};
  m["panel"]["contexts"].erase(1);
  m["reproduction_confirmation"] = true;
  m["block_positions"] = 7;
  auto r2 = validate_fidelity_request(m);
  REQUIRE(r2.candidate_model);
  CHECK(r2.candidate_model->model_dir == "/models/q4");
  CHECK(r2.candidate_label == "int4");
  CHECK(r2.reproduction_confirmation);
  CHECK(r2.block_positions == 7);
}

TEST_CASE("position ranges must be sorted, disjoint, non-empty and inside the context") {
  CHECK(parse_position_ranges(Json("all"), 3, "p") == PositionRanges{{0, 3}});
  CHECK(parse_position_ranges(Json::parse("[[0,1],[1,3]]"), 3, "p") ==
        PositionRanges{{0, 1}, {1, 3}});
  for (const char* bad : {"[]", "[[1,1]]", "[[2,1]]", "[[0,4]]", "[[-1,2]]", "[[1,2],[0,1]]",
                          "[[0,2],[1,3]]", "[[0]]", "[[0,1,2]]", "[[0,\"1\"]]", "\"some\"", "3"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(parse_position_ranges(Json::parse(bad), 3, "p"), Error);
  }
  CHECK(count_positions({{0, 2}, {5, 9}}) == 6);
  CHECK(position_ranges_json({{0, 2}}).dump() == "[[0,2]]");
}

TEST_CASE("bad fidelity requests are refused with a code naming the value") {
  struct Case {
    const char* what;
    std::function<void(Json&)> change;
    const char* code;
    const char* words;
  };
  std::vector<Case> cases = {
      {"wrong schema", [](Json& j) { j["schema"] = "assay.next-token-request.v1"; },
       "request.unknown_schema", "assay.next-token-request.v1"},
      {"unknown field", [](Json& j) { j["extra"] = 1; }, "request.invalid", "extra"},
      {"no id", [](Json& j) { j.erase("id"); }, "request.invalid", "id"},
      {"relative model", [](Json& j) { j["reference"]["model_dir"] = "models/ref"; },
       "request.invalid", "models/ref"},
      {"both candidates", [](Json& j) { j["candidate"]["model_dir"] = "/m"; }, "request.invalid",
       "exactly one of"},
      {"no candidate kind", [](Json& j) { j["candidate"] = Json::object(); }, "request.invalid",
       "exactly one of"},
      {"file count", [](Json& j) { j["candidate"]["logits"].erase(1); }, "request.invalid",
       "one file per panel context (2)"},
      {"bad sha", [](Json& j) { j["candidate"]["logits"][0]["sha256"] = "sha256:XYZ"; },
       "request.invalid", "sha256:XYZ"},
      {"same file twice",
       [](Json& j) { j["candidate"]["logits"][1]["path"] = "/data/a.safetensors"; },
       "request.invalid", "named twice"},
      {"empty panel", [](Json& j) { j["panel"]["contexts"] = Json::array(); }, "request.invalid",
       "contexts"},
      {"duplicate context id", [](Json& j) { j["panel"]["contexts"][1]["id"] = "a"; },
       "request.invalid", "\"a\" appears twice"},
      {"empty context", [](Json& j) { j["panel"]["contexts"][0]["token_ids"] = Json::array(); },
       "request.invalid", "must not be empty"},
      {"negative token", [](Json& j) { j["panel"]["contexts"][0]["token_ids"][2] = -1; },
       "request.invalid_token_id", "token_ids[2]"},
      {"range outside",
       [](Json& j) {
         j["panel"]["contexts"][1]["positions"] = {{0, 6}};
       },
       "request.invalid", "[0,6]"},
      {"block too large", [](Json& j) { j["block_positions"] = 5000; }, "request.invalid", "5000"},
      {"reproduction not bool", [](Json& j) { j["reproduction_confirmation"] = "yes"; },
       "request.invalid", "\"yes\""},
      {"bad limits",
       [](Json& j) {
         j["limits"] = {{"timeout_seconds", -1}};
       },
       "request.invalid", "timeout_seconds"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.what);
    Json doc = valid();
    c.change(doc);
    auto [code, named] = refusal(doc, c.words);
    CHECK(code == c.code);
    CHECK_MESSAGE(named, "message should name " << c.words);
  }
  CHECK_THROWS_AS(parse_fidelity_request("{\"schema\": 1, \"schema\": 2}"), Error);
  CHECK_THROWS_AS(parse_fidelity_request("[1, 2"), Error);
}

TEST_CASE("thresholds parse sorted by name; unknown names, negatives and non-numbers are refused") {
  Json doc = valid();
  doc["thresholds"] = {{"min_top1_agreement", 0.95}, {"max_mean_kl", 0.01}};
  FidelityRequest r = validate_fidelity_request(doc);
  REQUIRE(r.thresholds.size() == 2);
  CHECK(r.thresholds[0].name == "max_mean_kl");
  CHECK(r.thresholds[0].bound == 0.01);
  CHECK(r.thresholds[1].name == "min_top1_agreement");
  CHECK(thresholds_json(r.thresholds) == doc["thresholds"]);
  CHECK(validate_fidelity_request(valid()).thresholds.empty());

  doc["thresholds"] = {{"max_mean_kld", 0.01}};
  CHECK(refusal(doc, "request.thresholds.max_mean_kld is not a known threshold") ==
        std::pair<std::string, bool>{"request.invalid", true});
  doc["thresholds"] = {{"max_mean_kl", -1}};
  CHECK(refusal(doc, "max_mean_kl must be a finite number >= 0, got -1") ==
        std::pair<std::string, bool>{"request.invalid", true});
  doc["thresholds"] = {{"max_mean_kl", "0.1"}};
  CHECK(refusal(doc, "got \"0.1\"").second);
  doc["thresholds"] = Json::array();
  CHECK(refusal(doc, "request.thresholds must be an object").second);
}

TEST_CASE("threshold gates: max bounds pass at or below, min at or above, unmeasured fails") {
  Json stats = Json::parse(R"({"kl": {"mean": 0.02, "p99": 0.5}, "same_top": {"fraction": 0.9},
                               "delta_p_next": null, "perplexity": {"ratio": {"value": 1.01}}})");
  std::vector<Threshold> t = {{"max_mean_kl", 0.02},
                              {"max_kl_p99", 0.4},
                              {"min_top1_agreement", 0.9},
                              {"max_rms_delta_p", 1.0},
                              {"max_ppl_ratio", 1.02}};
  Json gates = evaluate_thresholds(t, stats);
  CHECK(gates[0]["passed"] == true);  // equal to the bound
  CHECK(gates[1]["passed"] == false);
  CHECK(gates[1]["observed"] == 0.5);
  CHECK(gates[2]["passed"] == true);
  CHECK(gates[2]["comparison"] == ">=");
  CHECK(gates[3]["observed"].is_null());
  CHECK(gates[3]["passed"] == false);
  CHECK(gates[4]["statistic"] == "perplexity.ratio.value");
  Json all = finalize_gates({{"reproduction", nullptr}, {"thresholds", gates}});
  CHECK(all["status"] == "failed");
  CHECK(all["failed"] == Json::array({"max_kl_p99", "max_rms_delta_p"}));
  CHECK(finalize_gates({{"reproduction", nullptr}, {"thresholds", Json::array()}})["status"] ==
        "none");
}

TEST_CASE("finalize_gates refuses gates of the wrong shape by name, never another error") {
  // fuzz_worker_output: a compare worker's threshold without "passed" reached a const
  // operator[] (an assertion) in the daemon.
  const std::vector<std::pair<Json, std::string>> cases{
      {Json(5), "gates is 5, not an object"},
      {Json{{"thresholds", Json::array({Json{{"name", "max_kl"}}})}},
       "gates.thresholds[0] has no boolean \"passed\" and string \"name\""},
      {Json{{"thresholds", Json::array({Json{{"name", "a"}, {"passed", true}}, 7})}},
       "gates.thresholds[1] has no boolean \"passed\" and string \"name\""},
      {Json{{"thresholds", "all"}}, "gates.thresholds is not a list"},
      {Json{{"reproduction", "yes"}}, "gates.reproduction is not an object"},
      {Json{{"reproduction", {{"weights_identity_equal", 1}}}},
       "gates.reproduction.weights_identity_equal is neither true, false nor null"}};
  for (const auto& [gates, why] : cases) {
    CAPTURE(gates.dump());
    CHECK_THROWS_WITH_AS(finalize_gates(gates), why.c_str(), assay::common::Error);
  }
  CHECK(finalize_gates({{"reproduction", {{"a", true}, {"b", nullptr}}}})["status"] ==
        "incomplete");
}
