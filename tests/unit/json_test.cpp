#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <string>

#include "common/error.h"
#include "common/json.h"
#include "common/text.h"
#include "test_util.h"

using assay::common::canonical;
using assay::common::Error;
using assay::common::Json;
using assay::common::parse_strict;
using assay::common::ParseLimits;

namespace {

std::string parse_error(std::string_view text, const ParseLimits& limits = {}) {
  try {
    parse_strict(text, limits);
  } catch (const Error& e) {
    return e.code() + ": " + e.what();
  }
  return "";
}

std::string canonical_of_bits(std::uint64_t bits) {
  return canonical(Json(std::bit_cast<double>(bits)));
}

}  // namespace

TEST_CASE("strict parse accepts an ordinary document and keeps every value") {
  Json v = parse_strict(R"({"a": [1, -2, 3.5, "x", null, true], "b": {"c": false}})");
  CHECK(v["a"][0] == 1);
  CHECK(v["a"][1] == -2);
  CHECK(v["a"][2] == 3.5);
  CHECK(v["a"][3] == "x");
  CHECK(v["a"][4].is_null());
  CHECK(v["b"]["c"] == false);
}

TEST_CASE("strict parse rejects a duplicate key and names its JSON pointer") {
  std::string err = parse_error(R"({"a": {"b": 1, "b": 2}})");
  CHECK(err.find("json.invalid") == 0);
  CHECK(err.find("/a/b") != std::string::npos);
  CHECK(err.find("duplicate key \"b\"") != std::string::npos);
  // Inside an array the pointer carries the element index.
  std::string err2 = parse_error(R"({"list": [{}, {"k": 1, "k": 1}]})");
  CHECK(err2.find("/list/1/k") != std::string::npos);
}

TEST_CASE("strict parse rejects NaN, Infinity and numbers that overflow a double") {
  CHECK(parse_error("[NaN]").find("json.invalid") == 0);
  CHECK(parse_error("[Infinity]").find("json.invalid") == 0);
  CHECK(parse_error("[-Infinity]").find("json.invalid") == 0);
  std::string err = parse_error(R"({"x": 1e400})");
  CHECK(err.find("/x") != std::string::npos);
  CHECK(err.find("1e400") != std::string::npos);
}

TEST_CASE("strict parse enforces the depth limit of 64") {
  std::string ok(64, '[');
  ok += std::string(64, ']');
  CHECK_NOTHROW(parse_strict(ok));
  std::string deep(65, '[');
  deep += std::string(65, ']');
  CHECK(parse_error(deep).find("nesting deeper than 64") != std::string::npos);
}

TEST_CASE("strict parse enforces the caller's size limit") {
  std::string err = parse_error(R"({"a":"0123456789"})", ParseLimits{10, 64, true});
  CHECK(err.find("json.too_large") == 0);
  CHECK(err.find("18 bytes") != std::string::npos);
}

TEST_CASE("strict parse rejects integers outside +-2^53 when exact integers are demanded") {
  CHECK_NOTHROW(parse_strict("[9007199254740992, -9007199254740992]"));
  std::string err = parse_error(R"({"ids": [1, 9007199254740993]})");
  CHECK(err.find("/ids/1") != std::string::npos);
  CHECK(err.find("9007199254740993") != std::string::npos);
  CHECK(parse_error("[-9007199254740993]").find("outside +-2^53") != std::string::npos);
  CHECK(parse_error("[100000000000000000000000]").find("outside +-2^53") != std::string::npos);
  ParseLimits loose;
  loose.exact_integers = false;
  CHECK(parse_strict("[9007199254740993]", loose)[0].get<std::uint64_t>() == 9007199254740993ULL);
}

TEST_CASE("strict parse rejects invalid UTF-8, trailing data and empty input") {
  CHECK(parse_error("[\"\xff\"]").find("json.invalid") == 0);
  CHECK(parse_error("{} {}").find("json.invalid") == 0);
  CHECK(parse_error("").find("json.invalid") == 0);
  CHECK(parse_error("{\"a\":1,}").find("json.invalid") == 0);
}

// Found by fuzz_kiln_record and fuzz_verify_result: the parser's message quoted the bytes it last
// read, so `assay verify --json` could not write a report on a file that is not UTF-8.
TEST_CASE("strict parse names invalid UTF-8 it read in a message that is valid UTF-8") {
  std::string message = parse_error("{\"a\":\"\xff\"}");
  CHECK(message.find("json.invalid") == 0);
  CHECK(assay::common::is_valid_utf8(message));
  CHECK(message.find("\\xFF") != std::string::npos);
}

TEST_CASE("canonical form matches RFC 8785 section 3.2.2 example") {
  Json v = parse_strict(R"({
    "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
    "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
    "literals": [null, true, false]
  })");
  CHECK(canonical(v) ==
        "{\"literals\":[null,true,false],\"numbers\":[333333333.3333333,1e+30,4.5,0.002,1e-27],"
        "\"string\":\"\xe2\x82\xac$\\u000f\\nA'B\\\"\\\\\\\\\\\"/\"}");
}

TEST_CASE("canonical form sorts keys by UTF-16 code units (RFC 8785 section 3.2.3)") {
  Json v = parse_strict(R"({
    "\u20ac": "Euro Sign",
    "\r": "Carriage Return",
    "\ufb33": "Hebrew Letter Dalet With Dagesh",
    "1": "One",
    "\ud83d\ude00": "Emoji: Grinning Face",
    "\u0080": "Control",
    "\u00f6": "Latin Small Letter O With Diaeresis"
  })");
  std::string c = canonical(v);
  std::vector<std::string> order = {"Carriage", "One",   "Control", "Latin",
                                    "Euro",     "Emoji", "Hebrew"};
  std::size_t pos = 0;
  for (const auto& word : order) {
    auto at = c.find(word, pos);
    CHECK_MESSAGE(at != std::string::npos, word << " out of order in " << c);
    pos = at;
  }
}

TEST_CASE("canonical numbers match the RFC 8785 appendix B vectors") {
  CHECK(canonical_of_bits(0x0000000000000000) == "0");
  CHECK(canonical_of_bits(0x8000000000000000) == "0");
  CHECK(canonical_of_bits(0x0000000000000001) == "5e-324");
  CHECK(canonical_of_bits(0x8000000000000001) == "-5e-324");
  CHECK(canonical_of_bits(0x7fefffffffffffff) == "1.7976931348623157e+308");
  CHECK(canonical_of_bits(0xffefffffffffffff) == "-1.7976931348623157e+308");
  CHECK(canonical_of_bits(0x4340000000000000) == "9007199254740992");
  CHECK(canonical_of_bits(0xc340000000000000) == "-9007199254740992");
  CHECK(canonical_of_bits(0x4430000000000000) == "295147905179352830000");
  CHECK(canonical_of_bits(0x44b52d02c7e14af5) == "9.999999999999997e+22");
  CHECK(canonical_of_bits(0x44b52d02c7e14af6) == "1e+23");
  CHECK(canonical_of_bits(0x44b52d02c7e14af7) == "1.0000000000000001e+23");
  CHECK(canonical_of_bits(0x444b1ae4d6e2ef4e) == "999999999999999700000");
  CHECK(canonical_of_bits(0x444b1ae4d6e2ef4f) == "999999999999999900000");
  CHECK(canonical_of_bits(0x444b1ae4d6e2ef50) == "1e+21");
  CHECK(canonical_of_bits(0x3eb0c6f7a0b5ed8c) == "9.999999999999997e-7");
  CHECK(canonical_of_bits(0x3eb0c6f7a0b5ed8d) == "0.000001");
  CHECK(canonical_of_bits(0x41b3de4355555553) == "333333333.3333332");
  CHECK(canonical_of_bits(0x41b3de4355555554) == "333333333.33333325");
  CHECK(canonical_of_bits(0x41b3de4355555555) == "333333333.3333333");
  CHECK(canonical_of_bits(0x41b3de4355555556) == "333333333.3333334");
  CHECK(canonical_of_bits(0x41b3de4355555557) == "333333333.33333343");
  CHECK(canonical_of_bits(0xbecbf647612f3696) == "-0.0000033333333333333333");
  CHECK(canonical_of_bits(0x43143ff3c1cb0959) == "1424953923781206.2");
}

TEST_CASE("canonical form refuses non-finite numbers and invalid UTF-8") {
  CHECK_THROWS_AS(canonical(Json(std::numeric_limits<double>::infinity())), Error);
  CHECK_THROWS_AS(canonical(Json(std::numeric_limits<double>::quiet_NaN())), Error);
  CHECK_THROWS_AS(canonical(Json(std::string("\xc3"))), Error);
}

TEST_CASE("canonical form writes integer-valued doubles without a fraction, unlike Python") {
  // Python's json.dumps writes 1.0 and 1e-05; JCS (ECMAScript) writes 1 and 0.00001.
  CHECK(canonical(Json(1.0)) == "1");
  CHECK(canonical(Json(1e-5)) == "0.00001");
  CHECK(canonical(Json(-0.0)) == "0");
}

// Documents whose canonical form must equal Python's
// json.dumps(v, sort_keys=True, separators=(",",":"), ensure_ascii=True, allow_nan=False).
TEST_CASE("canonical form equals Python json.dumps on a corpus of ASCII documents") {
  std::mt19937_64 rng(20261130);
  auto rand_string = [&] {
    static const std::string alphabet = "abcXYZ019 _-/\\\"'{}[]:,\n\t\r\b\f\x01\x1f~!@#$%^&*()<>?";
    std::string s;
    int len = static_cast<int>(rng() % 12);
    for (int i = 0; i < len; ++i) s += alphabet[rng() % alphabet.size()];
    return s;
  };
  std::function<Json(int)> make = [&](int depth) -> Json {
    int kind = static_cast<int>(rng() % (depth > 3 ? 6 : 8));
    switch (kind) {
      case 0:
        return Json(nullptr);
      case 1:
        return Json(rng() % 2 == 0);
      case 2:
        return Json(static_cast<std::int64_t>(rng() % 18014398509481984ULL) - 9007199254740992LL);
      case 3: {  // non-integral doubles where Python's repr and ECMAScript agree
        double mant = 1.0 + static_cast<double>(rng() % 1000000) / 1048576.0 + 1.0 / 3.0;
        int exp10 = static_cast<int>(rng() % 19) - 4;  // 1e-4 .. 1e14
        double v = mant * std::pow(10.0, exp10);
        if (std::floor(v) == v) v += 0.5;  // Python writes 2.0 where ECMAScript writes 2
        if (rng() % 2) v = -v;
        return Json(v);
      }
      case 4:
        return Json(rand_string());
      case 5:
        return Json(rng() % 2 ? 1e+30 : 2.5e+200);
      case 6: {
        Json a = Json::array();
        int n = static_cast<int>(rng() % 5);
        for (int i = 0; i < n; ++i) a.push_back(make(depth + 1));
        return a;
      }
      default: {
        Json o = Json::object();
        int n = static_cast<int>(rng() % 5);
        for (int i = 0; i < n; ++i) o[rand_string()] = make(depth + 1);
        return o;
      }
    }
  };
  assay::test::TempDir dir;
  std::string lines, expected;
  for (int i = 0; i < 300; ++i) {
    Json doc = make(0);
    lines += doc.dump() + "\n";
    expected += canonical(doc) + "\n";
  }
  assay::test::write_bytes(dir / "corpus.jsonl", lines);
  std::string script =
      "import json,sys\n"
      "for line in open(sys.argv[1]):\n"
      "    v = json.loads(line)\n"
      "    sys.stdout.write(json.dumps(v, sort_keys=True, separators=(',',':'), "
      "ensure_ascii=True, allow_nan=False) + '\\n')\n";
  assay::test::write_bytes(dir / "dump.py", script);
  auto r = assay::test::run_command(std::string(ASSAY_PYTHON3) + " " + (dir / "dump.py").string() +
                                    " " + (dir / "corpus.jsonl").string());
  REQUIRE(r.status == 0);
  std::istringstream want(r.output), got(expected);
  std::string w, g;
  int line = 0;
  while (std::getline(want, w) && std::getline(got, g)) {
    ++line;
    CHECK_MESSAGE(w == g, "document " << line);
  }
  CHECK(line == 300);
}

TEST_CASE("require helpers name the missing or mistyped field") {
  Json v = parse_strict(R"({"a": 1, "s": "x"})");
  CHECK(assay::common::require_int(v, "a", "/req") == 1);
  CHECK(assay::common::require_string(v, "s", "/req") == "x");
  try {
    assay::common::require_string(v, "a", "/req");
    FAIL("no throw");
  } catch (const Error& e) {
    CHECK(std::string(e.what()) == "/req/a must be a string, got 1");
  }
  try {
    assay::common::reject_unknown_fields(v, {"a"}, "/req");
    FAIL("no throw");
  } catch (const Error& e) {
    CHECK(e.code() == "json.unknown_field");
    CHECK(std::string(e.what()) == "unknown field /req/s");
  }
}
