// The numerics verdict's rule (common/numerics.h) on envelopes built by hand: each class, the
// threshold's two parts, ties, and the figures a verifier recomputes.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/numerics.h"

namespace assay::common {
namespace {

// One member: its argmax, top logit, and the logits of tokens 1 and 2 (the candidates).
Json member(const std::string& name, std::int64_t argmax, double top, double x1, double x2,
            bool tie = false) {
  return Json{{"name", name},
              {"argmax", argmax},
              {"argmax_logit", top},
              {"top_tie", tie},
              {"candidates", Json::array({Json{{"token_id", 1}, {"logit", x1}},
                                          Json{{"token_id", 2}, {"logit", x2}}})}};
}

const Json kCandidates = Json::array(
    {Json{{"engine", "vllm"}, {"token_id", 1}}, Json{{"engine", "kiln"}, {"token_id", 2}}});

}  // namespace

TEST_CASE("numerics: bf16 steps are the spacing of 8 significant bits at the value's magnitude") {
  CHECK(bf16_step(18.5) == 0.125);  // Kiln's dispute: 18.5 and 18.25 are two steps apart
  CHECK(bf16_step(-18.5) == 0.125);
  CHECK(bf16_step(16.0) == 0.125);
  CHECK(bf16_step(15.99) == 0.0625);
  CHECK(bf16_step(1.0) == std::ldexp(1.0, -7));
  CHECK(bf16_step(0.0) == std::ldexp(1.0, -133));
}

TEST_CASE(
    "numerics: Kiln's two-step margin is decided only when the members' spread of the gap "
    "leaves room: spread 0 decides, a one-step spread ties") {
  // Every member agrees exactly: 0.25 > 3 x 0 + 1 x 0.125.
  Json same = Json::array({member("reference", 1, 18.5, 18.5, 18.25),
                           member("reduction:0", 1, 18.5, 18.5, 18.25),
                           member("sdpa", 1, 18.5, 18.5, 18.25)});
  Json v = numerics_verdict(same, kCandidates, nullptr, {});
  CHECK(v["class"] == "reference_decides");
  CHECK(v["unanimous_argmax"] == 1);
  CHECK(v["step"] == 0.125);
  CHECK(v["candidates"][1]["gap"]["min"] == 0.25);
  CHECK(v["candidates"][1]["threshold"] == 0.125);
  CHECK(v["candidates"][1]["beyond"] == true);
  CHECK(v["candidates"][0]["threshold"].is_null());
  CHECK(v["explanation"].get<std::string>().find("2 bf16 steps") != std::string::npos);
  // One member moves kiln's token up one step: same argmax everywhere, but the gap's spread is
  // a step, and 0.125 < 3 x 0.125 + 0.125.
  Json moved = same;
  moved[2] = member("sdpa", 1, 18.5, 18.5, 18.375);
  v = numerics_verdict(moved, kCandidates, nullptr, {});
  CHECK(v["class"] == "numerically_tied");
  CHECK(v["unanimous_argmax"] == 1);
  CHECK(v["candidates"][1]["gap"]["min"] == 0.125);
  CHECK(v["candidates"][1]["gap"]["spread"] == 0.125);
  CHECK(v["candidates"][1]["threshold"] == 0.5);
  CHECK(v["candidates"][1]["logit"]["spread_steps"] == 1.0);
  CHECK(v["explanation"].get<std::string>().find("cannot tell a bug from numerics") !=
        std::string::npos);
  // A looser request: margin 0 and factor 1 still does not decide 0.125 against 0.125.
  v = numerics_verdict(moved, kCandidates, nullptr, NumericsPolicy{1.0, 0.0});
  CHECK(v["class"] == "numerically_tied");
}

TEST_CASE(
    "numerics: members that disagree on the argmax tie; none of them a candidate is neither") {
  Json split = Json::array({member("reference", 1, 5.0, 5.0, 4.96875),
                            member("reduction:0", 2, 5.0, 4.96875, 5.0),
                            member("sdpa", 1, 5.0, 5.0, 4.9375)});
  Json v = numerics_verdict(split, kCandidates, nullptr, {});
  CHECK(v["class"] == "numerically_tied");
  CHECK(v["unanimous_argmax"].is_null());
  CHECK(v["candidates"][0]["argmax_members"] == 2);
  CHECK(v["candidates"][1]["argmax_members"] == 1);

  Json other =
      Json::array({member("reference", 7, 9.0, 5.0, 1.0), member("sdpa", 7, 9.0, 5.0, 1.0)});
  v = numerics_verdict(other, kCandidates, nullptr, {});
  CHECK(v["class"] == "neither");
  CHECK(v["reference_argmax"] == 7);

  // A tied top in any member is not a decision, even when every argmax agrees.
  Json tied =
      Json::array({member("reference", 1, 5.0, 5.0, 3.0), member("sdpa", 1, 5.0, 5.0, 3.0, true)});
  CHECK(numerics_verdict(tied, kCandidates, nullptr, {})["class"] == "numerically_tied");
}

TEST_CASE("numerics: a gross deficit is decided, and the fp32 fact is reported beside the class") {
  Json far = Json::array({member("reference", 1, 12.0, 12.0, 9.0),
                          member("reduction:0", 1, 12.0625, 12.0625, 9.0),
                          member("kv-cache", 1, 12.0, 12.0, 9.0625)});
  Json fp32 = member("fp32", 2, 12.1, 11.9, 12.1);
  Json v = numerics_verdict(far, kCandidates, fp32, {});
  CHECK(v["class"] == "reference_decides");
  CHECK(v["fp32"]["argmax"] == 2);
  CHECK(v["fp32"]["argmax_is_candidate"] == true);
  CHECK(v["fp32"]["candidates"][1]["logit"] == 12.1);
  // Same engine for both? One token, every member's argmax: decided, nothing to compare.
  Json one =
      Json::array({Json{{"engine", "a"}, {"token_id", 1}}, Json{{"engine", "b"}, {"token_id", 1}}});
  v = numerics_verdict(far, one, nullptr, {});
  CHECK(v["class"] == "reference_decides");
  CHECK(v["candidates"].size() == 1);
  CHECK(v["candidates"][0]["engines"] == Json::array({"a", "b"}));
}

TEST_CASE("numerics: figures that are missing or inconsistent are refused by name") {
  CHECK_THROWS_WITH_AS(numerics_verdict(Json::array(), kCandidates, nullptr, {}),
                       doctest::Contains("members is empty"), Error);
  Json m = Json::array({member("reference", 1, 5.0, 5.0, 6.0)});
  CHECK_THROWS_WITH_AS(numerics_verdict(m, kCandidates, nullptr, {}),
                       doctest::Contains("above the member's top"), Error);
  Json missing = Json::array({member("reference", 1, 5.0, 5.0, 4.0)});
  missing[0]["candidates"].erase(1);
  CHECK_THROWS_WITH_AS(numerics_verdict(missing, kCandidates, nullptr, {}),
                       doctest::Contains("no logit for candidate token 2"), Error);
  // A top_tie that is not a boolean is refused by name, not with a JSON type error (a worker's
  // output and a record under `assay verify` are read with this rule).
  Json odd = Json::array({member("reference", 1, 5.0, 5.0, 4.0)});
  odd[0]["top_tie"] = 5;
  CHECK_THROWS_WITH_AS(numerics_verdict(odd, kCandidates, nullptr, {}),
                       doctest::Contains("numerics.members[0].top_tie is not a boolean"), Error);
  CHECK_THROWS_WITH_AS(numerics_verdict(missing, kCandidates, Json(7), {}),
                       doctest::Contains("numerics.members[0] has no logit"), Error);
  CHECK_THROWS_WITH_AS(numerics_verdict(Json::array({member("reference", 1, 5.0, 5.0, 4.0)}),
                                        kCandidates, Json("fp32"), {}),
                       doctest::Contains("numerics.fp32.argmax is not an integer"), Error);
  CHECK_THROWS_WITH_AS(numerics_policy(Json{{"spread_factor", 0.5}}, "request.numerics"),
                       doctest::Contains("request.numerics.spread_factor"), Error);
  CHECK(numerics_policy(Json::object(), "x").spread_factor == 3.0);
}

}  // namespace assay::common
