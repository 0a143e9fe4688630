// assay-compare trajectory: first departures, the engines' first divergence and the artifact,
// on logits files built so that every answer is known.
#include <doctest/doctest.h>

#include <unistd.h>

#include "common/error.h"
#include "common/identity.h"
#include "common/safetensors.h"
#include "common/trajectory.h"
#include "compare/trajectory.h"
#include "tests/compare/util.h"

namespace assay::compare::test {
namespace {

using common::Json;

constexpr std::size_t kVocab = 50;

// Rows whose argmax is `argmax[i]` (logit 5 + i/8), runner-up token (argmax+1)%V at 4, the rest
// below 1: the margin is exactly 1 + i/8 (binary fractions).
std::vector<float> rows_with_argmax(const std::vector<std::int64_t>& argmax, std::uint64_t seed) {
  std::vector<float> v = random_logits(argmax.size(), kVocab, seed, 0.1f);
  for (std::size_t r = 0; r < argmax.size(); ++r) {
    v[r * kVocab + static_cast<std::size_t>(argmax[r])] = 5.0f + static_cast<float>(r) / 8;
    v[r * kVocab + static_cast<std::size_t>((argmax[r] + 1) % kVocab)] = 4.0f;
  }
  return v;
}

struct Fixture {
  TempDir dir;
  // The reference's greedy continuation from the prompt.
  std::vector<std::int64_t> greedy{7, 3, 12, 12, 40, 1, 9, 22};
  TrajectoryInput input(std::size_t k) {
    // "a" follows the reference for k tokens, then takes the runner-up; "b" never departs.
    std::vector<std::int64_t> a(greedy.begin(), greedy.end());
    a[k] = (greedy[k] + 1) % kVocab;
    // After a's departure its states differ from the reference's: its rows there are other
    // rows, with argmaxes of their own (a keeps following those).
    std::vector<std::int64_t> a_argmax = greedy;
    for (std::size_t i = k + 1; i < a.size(); ++i) a_argmax[i] = a[i] = (greedy[i] + 5) % kVocab;
    write_logits(dir.path() / "a.safetensors", rows_with_argmax(a_argmax, 1), a.size(), kVocab,
                 common::Dtype::kF32);
    write_logits(dir.path() / "b.safetensors", rows_with_argmax(greedy, 2), greedy.size(), kVocab,
                 common::Dtype::kF32);
    TrajectoryInput in;
    in.vocab_size = kVocab;
    in.prompt_length = 5;
    in.artifact_file = "trajectory.safetensors";
    in.engines = {{"a", a, (dir.path() / "a.safetensors").string()},
                  {"b", greedy, (dir.path() / "b.safetensors").string()}};
    return in;
  }
};

}  // namespace

TEST_CASE(
    "trajectory: an engine that follows the reference for k tokens departs at k; one that "
    "never departs has first_departure null") {
  for (std::size_t k : {std::size_t{0}, std::size_t{3}, std::size_t{7}}) {
    CAPTURE(k);
    Fixture f;
    TrajectoryAnalysis t = analyse_trajectory(f.input(k));
    const Json& a = t.document["engines"][0];
    const Json& b = t.document["engines"][1];
    CHECK(a["first_departure"] == Json(k));
    CHECK(b["first_departure"].is_null());
    CHECK(b["departure"].is_null());
    CHECK(b["tokens_matching_argmax"] == 8);
    CHECK(a["tokens_matching_argmax"] == 7);
    const Json& dep = a["departure"];
    CHECK(dep["index"] == Json(k));
    CHECK(dep["position"] == Json(4 + k));  // prompt 5: position 4 predicts token 0
    CHECK(dep["argmax_token_id"] == f.greedy[k]);
    CHECK(dep["engine_token_id"] == (f.greedy[k] + 1) % 50);
    CHECK(dep["engine_token_rank"] == 2);
    CHECK(dep["margin"].get<double>() == 1.0 + static_cast<double>(k) / 8);
    REQUIRE(dep["top10"].size() == 10);
    CHECK(dep["top10"][0]["token_id"] == f.greedy[k]);
    CHECK(dep["top10"][1]["token_id"] == (f.greedy[k] + 1) % 50);
    CHECK(dep["top10"][1]["logit"].get<double>() == 4.0);
    CHECK(t.document["departed_first"] == Json{{"index", k}, {"engines", {"a"}}});
    // The engines diverge where a departs; b chose the reference argmax there.
    const Json& d = t.document["divergence"];
    CHECK(d["index"] == Json(k));
    CHECK(d["argmax_candidate"] == "b");
    CHECK(d["candidate_attribution_complete"] == true);
    CHECK(d["tokens"]["a"] == (f.greedy[k] + 1) % 50);
    CHECK(d["tokens"]["b"] == f.greedy[k]);
  }
}

TEST_CASE(
    "trajectory: the artifact holds argmax and margin per position per engine, and the full "
    "logits only at the departure") {
  Fixture f;
  TrajectoryInput in = f.input(3);
  TrajectoryAnalysis t = analyse_trajectory(in);
  CHECK(t.document["artifact_sha256"] == common::sha256_id(t.artifact));
  auto index = common::parse_safetensors(std::as_bytes(std::span(t.artifact)));
  const auto* argmax = index.find("engine1.argmax");
  REQUIRE(argmax != nullptr);
  REQUIRE(argmax->shape == std::vector<std::int64_t>{8});
  std::vector<std::int64_t> got(8);
  std::memcpy(got.data(), argmax->data, argmax->nbytes);
  CHECK(got == f.greedy);
  const auto* margin = index.find("engine0.margin");
  REQUIRE(margin != nullptr);
  double m3;
  std::memcpy(&m3, margin->data + 3 * sizeof(double), sizeof m3);
  CHECK(m3 == 1.0 + 3.0 / 8);
  CHECK(index.find("engine0.departure_logits") != nullptr);
  CHECK(index.find("engine0.departure_logits")->shape == std::vector<std::int64_t>{50});
  CHECK(index.find("engine1.departure_logits") == nullptr);
  CHECK(index.metadata.at("engines") == "[\"a\",\"b\"]");
}

TEST_CASE(
    "trajectory: identical continuations have no divergence; a continuation that ends "
    "early diverges where it ends") {
  Fixture f;
  TrajectoryInput in = f.input(3);
  in.engines[0] = in.engines[1];
  in.engines[0].engine = "a";
  CHECK(analyse_trajectory(in).document["divergence"].is_null());
  CHECK(analyse_trajectory(in).document["departed_first"].is_null());

  std::vector<std::int64_t> shorter(f.greedy.begin(), f.greedy.begin() + 5);
  write_logits(f.dir.path() / "s.safetensors", rows_with_argmax(shorter, 3), 5, kVocab,
               common::Dtype::kBF16);
  in.engines[0] = {"short", shorter, (f.dir.path() / "s.safetensors").string()};
  Json d = analyse_trajectory(in).document["divergence"];
  CHECK(d["index"] == 5);
  CHECK(d["tokens"]["short"].is_null());
  CHECK(d["reference_from"] == "b");
  CHECK(d["argmax_candidate"] == "b");
  CHECK(d["candidate_attribution_complete"] == false);
}

TEST_CASE("trajectory: a capture with the wrong number of rows or columns is refused by name") {
  Fixture f;
  TrajectoryInput in = f.input(2);
  in.engines[1].token_ids.pop_back();
  try {
    analyse_trajectory(in);
    FAIL("accepted 8 rows for 7 tokens");
  } catch (const common::Error& e) {
    CHECK(e.code() == "compare.bad_shape");
    CHECK(contains(e.what(), "engine \"b\""));
  }
  in = f.input(2);
  in.vocab_size = 60;
  CHECK_THROWS_WITH_AS(analyse_trajectory(in), doctest::Contains("50 columns"), common::Error);
}

TEST_CASE(
    "trajectory input: unknown fields, a token id outside the vocabulary and one engine "
    "are refused") {
  Json doc{{"schema", common::kCompareTrajectoryInput},
           {"vocab_size", 50},
           {"prompt_length", 3},
           {"artifact_file", "t.safetensors"},
           {"engines",
            {{{"engine", "a"}, {"token_ids", {1, 2}}, {"logits", "a.safetensors"}},
             {{"engine", "b"}, {"token_ids", {1, 3}}, {"logits", "b.safetensors"}}}}};
  CHECK(parse_trajectory_input(doc, "in").engines.size() == 2);
  Json bad = doc;
  bad["extra"] = 1;
  CHECK_THROWS_WITH_AS(parse_trajectory_input(bad, "in"), doctest::Contains("extra"),
                       common::Error);
  bad = doc;
  bad["engines"][1]["token_ids"][1] = 50;
  CHECK_THROWS_WITH_AS(parse_trajectory_input(bad, "in"),
                       doctest::Contains("in.engines[1].token_ids[1]"), common::Error);
  bad = doc;
  bad["engines"].erase(1);
  CHECK_THROWS_AS(parse_trajectory_input(bad, "in"), common::Error);
  bad = doc;
  bad["engines"][0]["logits"] = "../x.safetensors";
  CHECK_THROWS_AS(parse_trajectory_input(bad, "in"), common::Error);
}

}  // namespace assay::compare::test
