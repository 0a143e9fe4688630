// The engine audit's statistic (common/audit.h) on per-context sums built by hand, Student's t
// tail against its closed forms, and the request parser's refusals.
#include <doctest/doctest.h>

#include <cmath>
#include <string>

#include "common/audit.h"
#include "common/error.h"

namespace assay::common {
namespace {

Json context(const std::string& id, std::uint64_t positions, double engine,
             std::vector<double> members) {
  return Json{
      {"id", id}, {"positions", positions}, {"engine_sum", engine}, {"member_sums", Json(members)}};
}

const Json kMembers = Json::array({"reference", "reduction:0", "sdpa"});

Json request(int contexts = 2) {
  Json ctx = Json::array(), files = Json::array();
  for (int i = 0; i < contexts; ++i) {
    ctx.push_back(Json{{"token_ids", Json::array({1, 2, 3})}});
    files.push_back(Json{{"path", "/x/c" + std::to_string(i) + ".safetensors"},
                         {"sha256", "sha256:" + std::string(64, 'a')}});
  }
  return Json{{"schema", "assay.engine-audit-request.v1"},
              {"id", "audit-1"},
              {"model_dir", "/models/tiny/"},
              {"engine", {{"name", "kiln"}, {"logits", files}}},
              {"panel", {{"contexts", ctx}}}};
}

std::string refusal(const Json& doc) {
  try {
    validate_audit_request(doc);
  } catch (const Error& e) {
    return e.code() + ": " + e.what();
  }
  return "accepted";
}

}  // namespace

TEST_CASE("Student's t upper tail agrees with its closed forms for 1 and 2 degrees of freedom") {
  const double pi = std::acos(-1.0);
  for (double t : {-30.0, -2.5, -1.0, 0.0, 0.3, 1.0, 2.0, 7.5, 100.0, 1e4}) {
    CAPTURE(t);
    const double cauchy = 0.5 - std::atan(t) / pi;
    CHECK(student_t_upper(t, 1) == doctest::Approx(cauchy).epsilon(1e-10));
    const double two = 0.5 - t / (2 * std::sqrt(t * t + 2));
    CHECK(student_t_upper(t, 2) == doctest::Approx(two).epsilon(1e-10));
  }
  // Far tails keep their relative precision (a p-value of 1e-12 is not rounded to 0).
  const double t = 1e6;
  CHECK(student_t_upper(t, 2) / (0.5 - t / (2 * std::sqrt(t * t + 2))) ==
        doctest::Approx(1.0).epsilon(1e-3));
  // Many degrees of freedom: the normal's 97.5% point.
  CHECK(student_t_upper(1.959963984540054, 1e7) == doctest::Approx(0.025).epsilon(1e-5));
  CHECK(std::isnan(student_t_upper(1.0, 0)));
}

TEST_CASE("an engine as far from the anchor as the farthest member is within_legitimate") {
  // The unit is sdpa (the largest sum); the engine equals it in every context.
  Json contexts =
      Json::array({context("a", 10, 3.0, {1.0, 1.1, 3.0}), context("b", 10, 5.0, {2.0, 2.1, 5.0}),
                   context("c", 12, 4.0, {1.5, 1.4, 4.0})});
  Json s = audit_statistics(kMembers, contexts, AuditPolicy{});
  CAPTURE(s.dump(2));
  CHECK(s["unit_member"] == "sdpa");
  CHECK(s["ratio"] == 1.0);
  CHECK(s["positions"] == 32);
  CHECK(s["contexts"] == 3);
  CHECK(s["test"]["p_value"] == 1.0);
  CHECK(s["class"] == "within_legitimate");
  CHECK(s["members"][2]["ratio"] == 1.0);
  CHECK(s["members"][0]["ratio"].get<double>() == doctest::Approx(std::sqrt(4.5 / 12.0)));
  CHECK(s["ci95"][0].get<double>() <= 1.0);
  CHECK(s["ci95"][1].get<double>() >= 1.0);
}

TEST_CASE("an engine farther than every member in every context is beyond_legitimate") {
  Json contexts = Json::array();
  for (int i = 0; i < 20; ++i) {
    const double unit = 1.0 + 0.05 * (i % 7);
    contexts.push_back(
        context("c" + std::to_string(i), 16, unit * (1.4 + 0.01 * (i % 3)), {unit * 0.9, unit}));
  }
  Json s = audit_statistics(Json::array({"reference", "reduction:0"}), contexts, AuditPolicy{});
  CAPTURE(s.dump(2));
  CHECK(s["unit_member"] == "reduction:0");
  CHECK(s["ratio"].get<double>() == doctest::Approx(std::sqrt(1.41)).epsilon(0.01));
  CHECK(s["test"]["df"] == 19);
  CHECK(s["test"]["p_value"].get<double>() < 1e-10);
  CHECK(s["class"] == "beyond_legitimate");
  CHECK(s["ci95"][0].get<double>() > 1.15);
  CHECK(s["explanation"].get<std::string>().find("A bug is likely") != std::string::npos);
  // The same figures at a false-alarm rate no p-value can meet are still within: alpha decides.
  Json again = audit_statistics(Json::array({"reference", "reduction:0"}), contexts,
                                AuditPolicy{.alpha = 1e-300});
  CHECK(again["class"] == "within_legitimate");
}

TEST_CASE("the paired t test: a noisy excess over few contexts is not called a bug") {
  // Differences +0.5, -0.4, +0.6, -0.3: mean 0.1, sd ~0.54, t ~0.37 with 3 df.
  Json contexts = Json::array({context("a", 8, 2.5, {2.0}), context("b", 8, 1.6, {2.0}),
                               context("c", 8, 2.6, {2.0}), context("d", 8, 1.7, {2.0})});
  Json s = audit_statistics(Json::array({"reference"}), contexts, AuditPolicy{});
  const double t = s["test"]["t"].get<double>();
  CHECK(t == doctest::Approx(0.1 / (std::sqrt((0.16 + 0.25 + 0.25 + 0.16) / 3) / 2)));
  CHECK(s["test"]["p_value"].get<double>() == doctest::Approx(student_t_upper(t, 3)));
  CHECK(s["test"]["p_value"].get<double>() > 0.3);
  CHECK(s["class"] == "within_legitimate");
  // A verifier recomputes exactly the same document.
  CHECK(audit_statistics(Json::array({"reference"}), contexts, AuditPolicy{}) == s);
}

TEST_CASE("the statistic refuses figures it cannot test, naming them") {
  auto code = [](const Json& members, const Json& contexts) -> std::string {
    try {
      audit_statistics(members, contexts, AuditPolicy{});
    } catch (const Error& e) {
      return e.code() + ": " + e.what();
    }
    return "accepted";
  };
  CHECK(code(kMembers, Json::array({context("a", 3, 1, {1, 1, 1})})) ==
        "audit.invalid: the test needs at least 2 contexts, got 1");
  CHECK(code(kMembers, Json::array({context("a", 3, 1, {1, 1, 1}), context("b", 3, -1, {1, 1, 1})}))
            .find("contexts[1].engine_sum is -1.0, not >= 0") != std::string::npos);
  CHECK(code(kMembers, Json::array({context("a", 3, 1, {1, 1}), context("b", 3, 1, {1, 1, 1})}))
            .find("contexts[0].member_sums does not hold one figure per member (3)") !=
        std::string::npos);
  CHECK(code(kMembers, Json::array({context("a", 3, 1, {0, 0, 0}), context("b", 3, 1, {0, 0, 0})}))
            .find("there is no unit") != std::string::npos);
  CHECK(code(Json::array(), Json::array()).find("members must be a non-empty array") !=
        std::string::npos);
}

TEST_CASE("engine-audit requests: defaults, and each malformed field refused by name") {
  AuditRequest r = validate_audit_request(request(3));
  CHECK(r.model_dir == "/models/tiny");
  CHECK(r.contexts.size() == 3);
  CHECK(r.contexts[2].id == "c2");
  CHECK(r.positions() == 9);
  CHECK(r.reduction_seeds == 8);
  CHECK(r.sdpa);
  CHECK(r.policy.alpha == 0.01);
  CHECK(r.member_names().size() == 10);
  CHECK(r.member_names().back() == "sdpa");
  CHECK_THROWS_WITH_AS(r.check_vocab(3), doctest::Contains("token_ids[2] = 3 is not below"), Error);

  CHECK(refusal(request(1)).find("request.panel.contexts must be an array of 2..512") !=
        std::string::npos);
  Json doc = request(2);
  doc["engine"]["logits"].erase(1);
  CHECK(
      refusal(doc).find("request.engine.logits must hold one file per panel context (2), got 1") !=
      std::string::npos);
  doc = request(2);
  doc["panel"]["contexts"][0]["id"] = "same";
  doc["panel"]["contexts"][1]["id"] = "same";
  CHECK(refusal(doc).find("contexts[1].id \"same\" is not unique") != std::string::npos);
  doc = request(2);
  doc["audit"] = {{"alpha", 0}};
  CHECK(refusal(doc).find("request.audit.alpha must be a number in (0, 0.5], got 0") !=
        std::string::npos);
  doc["audit"] = {{"reduction_seeds", 65}};
  CHECK(refusal(doc).find("reduction_seeds must be an integer in 1..64, got 65") !=
        std::string::npos);
  doc["audit"] = {{"sdpa", "yes"}};
  CHECK(refusal(doc).find("request.audit.sdpa must be true or false") != std::string::npos);
  doc = request(2);
  doc["engine"]["logits"][1]["path"] = "relative.safetensors";
  CHECK(refusal(doc).find("request.engine.logits[1].path \"relative.safetensors\" is not an "
                          "absolute path") != std::string::npos);
  doc = request(2);
  doc["engine"]["logits"][0]["sha256"] = "abc";
  CHECK(refusal(doc).find("is not \"sha256:\" and 64 lowercase hex digits") != std::string::npos);
  doc = request(2);
  doc["schema"] = "assay.engine-audit-request.v2";
  CHECK(refusal(doc).rfind("request.unknown_schema", 0) == 0);
  doc = request(2);
  doc["surprise"] = 1;
  CHECK(refusal(doc).find("surprise") != std::string::npos);
}

}  // namespace assay::common
