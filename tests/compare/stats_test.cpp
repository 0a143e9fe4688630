// The metric block's arithmetic and input.json validation, through the library.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/error.h"
#include "compare/compare.h"
#include "tests/compare/util.h"

namespace assay::compare::test {
namespace {

TEST_CASE("percentiles match numpy's default method bit for bit") {
  // Expected values printed by numpy 1.24: np.percentile(a, [50, 95, 99, 99.9]).
  std::vector<double> a = {1, 2, 3, 4};
  CHECK(percentile(a, 50) == 2.5);
  CHECK(percentile(a, 95) == 3.8499999999999996);
  CHECK(percentile(a, 99) == 3.9699999999999998);
  CHECK(percentile(a, 99.9) == 3.9970000000000003);
  std::vector<double> c;
  for (int i = 0; i < 1000; ++i) c.push_back(i / 7.0);
  CHECK(percentile(c, 50) == 71.35714285714286);
  CHECK(percentile(c, 95) == 135.57857142857142);
  CHECK(percentile(c, 99) == 141.28714285714284);
  CHECK(percentile(c, 99.9) == 142.57157142857145);
  std::vector<double> one = {0.25};
  CHECK(percentile(one, 50) == 0.25);
  CHECK(percentile(one, 99.9) == 0.25);
}

TEST_CASE("summarize sorts, takes median as p50, and means exactly") {
  std::vector<double> b = {0.5, 0.1, 0.7, 0.3, 0.9, 0.2, 0.8};
  Stats s = summarize(b);
  CHECK(s.median == 0.5);
  CHECK(s.p95 == 0.87);
  CHECK(s.p99 == 0.894);
  CHECK(s.p99_9 == 0.8994000000000001);
  CHECK(s.mean == 0.5);
  CHECK(s.max == 0.9);
  CHECK(s.min == 0.1);
  // A compensated sum: 1e16 + 1 + ... does not lose the ones.
  std::vector<double> big = {1e16, 1, 1, 1, 1, -1e16};
  CHECK(summarize(big).mean == 4.0 / 6.0);
}

TEST_CASE("histogram: exact zeros and negatives apart, decade bins from 1e-15 to 1e2") {
  std::vector<double> kl = {0.0, 0.0, -1e-17, 5e-16, 1e-15, 3e-3, 0.5, 0.99, 1.0, 250.0};
  common::Json h = histogram(kl);
  CHECK(h["zero"] == 2);
  CHECK(h["negative"] == 1);
  REQUIRE(h["edges"].size() == 18);
  CHECK(h["edges"][0] == 1e-15);
  CHECK(h["edges"][17] == 1e2);
  REQUIRE(h["counts"].size() == 19);
  CHECK(h["counts"][0] == 1);   // (0, 1e-15)
  CHECK(h["counts"][1] == 1);   // [1e-15, 1e-14)
  CHECK(h["counts"][13] == 1);  // [1e-3, 1e-2)
  CHECK(h["counts"][15] == 2);  // [1e-1, 1)
  CHECK(h["counts"][16] == 1);  // [1, 10)
  CHECK(h["counts"][18] == 1);  // [1e2, inf)
  std::int64_t total = h["zero"].get<std::int64_t>() + h["negative"].get<std::int64_t>();
  for (const auto& c : h["counts"]) total += c.get<std::int64_t>();
  CHECK(total == static_cast<std::int64_t>(kl.size()));
}

common::Json valid_input() {
  return common::Json::parse(R"({
    "schema": "assay.compare-input.v1", "vocab_size": 1001, "kl_file": "kl.safetensors",
    "contexts": [
      {"id": "c0", "positions": [[0, 17], [40, 41]],
       "reference": {"path": "/r0.safetensors", "sha256": null},
       "candidate": {"path": "/c0.safetensors",
                     "sha256": "sha256:0000000000000000000000000000000000000000000000000000000000000000"},
       "reproduction": {"path": "/p0.safetensors", "sha256": null}},
      {"id": "c1", "positions": [[5, 6], [6, 9]],
       "reference": {"path": "/r1.safetensors", "sha256": null},
       "candidate": {"path": "/c1.safetensors", "sha256": null},
       "reproduction": {"path": "/p1.safetensors", "sha256": null}}
    ]})");
}

TEST_CASE("parse_input reads contexts, ranges and optional digests") {
  common::Json j = valid_input();
  CompareInput in = parse_input(j, "input.json");
  CHECK(in.vocab_size == 1001);
  CHECK(in.kl_file == "kl.safetensors");
  REQUIRE(in.contexts.size() == 2);
  CHECK(in.contexts[0].rows() == 18);
  CHECK(in.contexts[1].rows() == 4);  // adjacent ranges are disjoint
  CHECK(in.contexts[0].candidate.sha256.has_value());
  CHECK(!in.contexts[0].reference.sha256.has_value());
  CHECK(in.contexts[1].reproduction->path == "/p1.safetensors");
  // No reproduction at all: absent and null are the same.
  j["contexts"][0].erase("reproduction");
  j["contexts"][1]["reproduction"] = nullptr;
  in = parse_input(j, "input.json");
  CHECK(!in.contexts[0].reproduction);
  CHECK(!in.contexts[1].reproduction);
}

TEST_CASE("parse_input refuses malformed input.json with input.invalid, naming the value") {
  struct Case {
    std::string pointer;  // JSON pointer to change
    common::Json value;   // null + erase when `erase`
    std::string named;
    bool erase = false;
  };
  const std::vector<Case> cases = {
      {"/schema", "assay.compare-input.v2", "assay.compare-input.v2"},
      {"/colour", 1, "colour"},
      {"/contexts/0/colour", 1, "colour"},
      {"/contexts/0/reference/colour", 1, "colour"},
      {"/vocab_size", 0, "vocab_size"},
      {"/vocab_size", 1.5, "vocab_size"},
      {"/kl_file", "../kl.safetensors", "../kl.safetensors"},
      {"/kl_file", "kl.bin", "kl.bin"},
      {"/kl_file", "output.json", "output.json"},
      {"/contexts", common::Json::array(), "contexts"},
      {"/contexts/1/id", "c0", "\"c0\" is not unique"},
      {"/contexts/1/id", "", "contexts[1].id"},
      {"/contexts/0/positions", common::Json::parse("[[0, 17], [10, 41]]"), "[10,41]"},
      {"/contexts/0/positions", common::Json::parse("[[5, 5]]"), "[5,5]"},
      {"/contexts/0/positions", common::Json::parse("[[-1, 5]]"), "[-1,5]"},
      {"/contexts/0/positions", common::Json::parse("[[0, 1, 2]]"), "[0,1,2]"},
      {"/contexts/0/positions", common::Json::array(), "positions"},
      {"/contexts/0/reference/path", "../outside.safetensors", "../outside.safetensors"},
      {"/contexts/0/candidate/sha256", "sha256:ABC", "sha256:ABC"},
      {"/contexts/0/candidate/sha256", nullptr, "sha256", true},
      {"/contexts/0/reproduction", nullptr, "all or none", true},
  };
  for (const Case& c : cases) {
    common::Json j = valid_input();
    common::Json::json_pointer ptr(c.pointer);
    if (c.erase)
      j[ptr.parent_pointer()].erase(ptr.back());
    else
      j[ptr] = c.value;
    std::string code, message;
    try {
      parse_input(j, "input.json");
    } catch (const common::Error& e) {
      code = e.code();
      message = e.what();
    }
    CAPTURE(c.pointer);
    CAPTURE(message);
    CHECK(code == "input.invalid");
    CHECK(contains(message, c.named));
  }
}

}  // namespace
}  // namespace assay::compare::test
