// common/json_schema.h on Kiln's published schemas (compiled in, common/kiln_schemas.h) and
// Kiln's real documents (tests/client/fixtures/, byte for byte as Kiln wrote them), plus the
// 2020-12 semantics Kiln's schemas rely on. Expected errors were cross-checked with Python's
// jsonschema 4.26.0 (Draft202012Validator with its format checker).
#include <doctest/doctest.h>

#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/fs.h"
#include "common/json_schema.h"
#include "common/kiln_schemas.h"
#include "common/worker_schemas.h"

namespace {

using assay::common::Json;
namespace common = assay::common;

const std::string kFixtures = ASSAY_TEST_DATA "/client/fixtures/";
const std::string kKilnSchemaDir = ASSAY_TEST_DATA "/../schemas/kiln/";
const std::string kKilnIds = "https://ericflo.github.io/kiln/schemas/";
const char* kNextToken =
    "kiln/20260719t003452-rocm-strix-halo-hf-next-token-first-divergence-v1.json";
const char* kLayer = "kiln/20260719t022838-rocm-strix-halo-hf-layer-attribution-v1.json";
const char* kRequest = "kiln-request-v1.json";

Json read_json(const std::string& path) {
  return common::parse_strict(common::read_file(path, 1 << 24));
}
Json fixture(const std::string& name) {
  return read_json(kFixtures + name);
}

// Every error as "pointer: message", in the order the validator found them.
std::vector<std::string> errors_against(const Json& doc, const std::string& schema_id,
                                        const common::SchemaSet& set = common::kiln_schemas()) {
  std::vector<std::string> out;
  for (const auto& e : set.validate(doc, schema_id)) out.push_back(e.pointer + ": " + e.message);
  return out;
}
std::vector<std::string> kiln_errors(const Json& doc) {
  auto id = common::kiln_schema_id_for(doc["schema"].get<std::string>());
  REQUIRE(id.has_value());
  return errors_against(doc, *id);
}
std::string only_error(const Json& doc) {
  auto errors = kiln_errors(doc);
  REQUIRE(errors.size() == 1);
  return errors[0];
}

// A set of one schema, for the keyword semantics.
const std::string kTestId = "https://example.test/s.json";
common::SchemaSet one(Json schema) {
  schema["$id"] = kTestId;
  common::SchemaSet set;
  set.add(schema);
  return set;
}
bool valid(const common::SchemaSet& set, const Json& doc) {
  return set.validate(doc, kTestId).empty();
}
std::string add_error(Json schema) {
  try {
    common::SchemaSet().add(std::move(schema));
  } catch (const common::Error& e) {
    return e.code() + ": " + e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("Kiln's real results and request are valid against Kiln's published schemas") {
  CHECK(kiln_errors(fixture(kNextToken)).empty());
  CHECK(kiln_errors(fixture(kLayer)).empty());
  CHECK(kiln_errors(fixture(kRequest)).empty());
}

TEST_CASE("each schema in schemas/kiln is compiled in under the const of its schema field") {
  std::set<std::string> consts;
  for (const auto& entry : std::filesystem::directory_iterator(kKilnSchemaDir)) {
    Json schema = read_json(entry.path());
    std::string name = schema["properties"]["schema"]["const"];
    CHECK(common::kiln_schema_id_for(name) == schema["$id"].get<std::string>());
    consts.insert(name);
  }
  CHECK(consts == std::set<std::string>{
                      "kiln.hf-next-token-request.v1", "kiln.rocm-hf-layer-attribution-result.v1",
                      "kiln.rocm-hf-layer-attribution-result.v2",
                      "kiln.rocm-hf-next-token-oracle.v1", "kiln.rocm-hf-next-token-oracle.v2"});
  CHECK(common::kiln_schema_id_for("kiln.rocm-hf-next-token-oracle.v2") ==
        kKilnIds + "rocm-hf-next-token-oracle-v2.schema.json");
  CHECK_FALSE(common::kiln_schema_id_for("assay.next-token-oracle-result.v1").has_value());
  CHECK_FALSE(common::kiln_schema_id_for("kiln.rocm-hf-next-token-oracle.v3").has_value());
}

TEST_CASE("a one-field change to a real Kiln document fails naming the pointer and the keyword") {
  Json next = fixture(kNextToken);
  Json layer = fixture(kLayer);
  Json request = fixture(kRequest);

  SUBCASE("a schema const of another version") {
    next["schema"] = "kiln.rocm-hf-next-token-oracle.v2";
    CHECK(
        errors_against(next, kKilnIds + "rocm-hf-next-token-oracle-v1.schema.json") ==
        std::vector<std::string>{"/schema: const: expected \"kiln.rocm-hf-next-token-oracle.v1\", "
                                 "found \"kiln.rocm-hf-next-token-oracle.v2\""});
  }
  SUBCASE("a pinned version") {
    next["oracle"]["torch_version"] = "2.13.0+cu130";
    CHECK(only_error(next) ==
          "/oracle/torch_version: const: expected \"2.13.0+rocm7.2\", found \"2.13.0+cu130\"");
  }
  SUBCASE("a required field removed") {
    next["verdict"].erase("candidate_attribution_complete");
    CHECK(only_error(next) == "/verdict: required: \"candidate_attribution_complete\" is missing");
  }
  SUBCASE("a property the schema does not allow") {
    next["verdict"]["winner"] = "kiln";
    CHECK(only_error(next) == "/verdict/winner: additionalProperties: \"winner\" is not allowed");
  }
  SUBCASE("a sha256 too short for its pattern") {
    next["oracle"]["logits_sha256"] = "sha256:abc";
    CHECK(only_error(next) ==
          "/oracle/logits_sha256: pattern: expected a match of \"^sha256:[0-9a-f]{64}$\", found "
          "\"sha256:abc\"");
  }
  SUBCASE("a negative count") {
    next["oracle"]["memory_oom_events"] = -1;
    CHECK(only_error(next) == "/oracle/memory_oom_events: minimum: expected >= 0, found -1");
  }
  SUBCASE("a duration of zero where it must be positive") {
    layer["duration_seconds"] = 0;
    CHECK(only_error(layer) == "/duration_seconds: exclusiveMinimum: expected > 0, found 0");
  }
  SUBCASE("a token id written as a string") {
    next["oracle"]["argmax"] = "15787";
    CHECK(only_error(next) == "/oracle/argmax: type: expected integer, found string \"15787\"");
    next["oracle"]["argmax"] = nullptr;  // once, not "found null null"
    CHECK(only_error(next) == "/oracle/argmax: type: expected integer, found null");
  }
  SUBCASE("an hour past 23 in created_at_utc") {
    layer["created_at_utc"] = "2026-07-19T25:28:38.318030Z";
    CHECK(only_error(layer) ==
          "/created_at_utc: format: expected an RFC 3339 date-time, found "
          "\"2026-07-19T25:28:38.318030Z\"");
  }
  SUBCASE("an empty string where minLength is 1") {
    layer["model_identity"]["id"] = "";
    CHECK(only_error(layer) ==
          "/model_identity/id: minLength: expected at least 1 characters, found 0 in \"\"");
  }
  SUBCASE("the candidates in the wrong order (prefixItems through allOf)") {
    std::swap(request["candidates"][0], request["candidates"][1]);
    CHECK(
        kiln_errors(request) ==
        std::vector<std::string>{"/candidates/0/engine: const: expected \"kiln\", found \"vllm\"",
                                 "/candidates/1/engine: const: expected \"vllm\", found \"kiln\""});
  }
  SUBCASE("a third candidate") {
    request["candidates"].push_back(request["candidates"][0]);
    CHECK(kiln_errors(request) ==
          std::vector<std::string>{"/candidates: maxItems: expected at most 2 items, found 3",
                                   "/candidates: items: expected at most 2 items, found 3"});
  }
  SUBCASE("every error, not just the first") {
    next["oracle"]["torch_version"] = "2.13.0+cu130";
    next["oracle"]["argmax"] = -5;
    next.erase("created_at_utc");
    CHECK(kiln_errors(next) ==
          std::vector<std::string>{": required: \"created_at_utc\" is missing",
                                   "/oracle/argmax: minimum: expected >= 0, found -5",
                                   "/oracle/torch_version: const: expected \"2.13.0+rocm7.2\", "
                                   "found \"2.13.0+cu130\""});
  }
}

TEST_CASE("a $ref to a sibling file resolves against the $id of the schema it is written in") {
  // The v2 layer-attribution schema takes model_identity from the v2 oracle schema, whose
  // modelIdentity in turn refers to "#/$defs/weightFile": a def only the oracle schema has.
  Json identity = fixture(kLayer)["model_identity"];
  common::SchemaSet set = common::kiln_schemas();
  const std::string probe = kKilnIds + "probe.schema.json";
  set.add({{"$id", probe},
           {"$ref", "rocm-hf-layer-attribution-v2.schema.json#/properties/model_identity"}});
  CHECK(errors_against(identity, probe, set).empty());
  identity["weight_files"][1]["bytes"] = 0;
  CHECK(errors_against(identity, probe, set) ==
        std::vector<std::string>{"/weight_files/1/bytes: minimum: expected >= 1, found 0"});

  // Kiln's real v1 layer result against the v2 schema: exactly the differences Python's
  // jsonschema reports, none of them inside model_identity (resolved across files).
  std::vector<std::string> pointers;
  for (const auto& e : common::kiln_schemas().validate(
           fixture(kLayer), kKilnIds + "rocm-hf-layer-attribution-v2.schema.json"))
    pointers.push_back(e.pointer);
  std::sort(pointers.begin(), pointers.end());
  CHECK(pointers ==
        std::vector<std::string>{
            "", "/binary/rocm_archs", "/containment/hf", "/containment/hf/memory_max_gib",
            "/containment/hf/thermal", "/containment/kiln", "/containment/kiln/memory_max_gib",
            "/containment/kiln/thermal", "/implementation", "/implementation/supervisor_sha256",
            "/schema", "/worker/containment", "/worker/schema"});
}

TEST_CASE("a keyword, format or $ref the validator does not implement makes add() throw") {
  CHECK(add_error({{"$id", kTestId}, {"properties", {{"a", {{"patternProperties", {}}}}}}}) ==
        "schema.invalid: https://example.test/s.json#/properties/a/patternProperties: keyword "
        "\"patternProperties\" is not supported by assay's validator");
  CHECK(add_error({{"$id", kTestId}, {"anyOf", {true}}}).find("keyword \"anyOf\"") !=
        std::string::npos);
  // Unused definitions are checked too: a schema is never half-understood.
  CHECK(add_error({{"$id", kTestId}, {"$defs", {{"x", {{"dependentRequired", {}}}}}}})
            .find("#/$defs/x/dependentRequired") != std::string::npos);
  CHECK(add_error({{"$id", kTestId}, {"format", "email"}}).find("format \"email\"") !=
        std::string::npos);
  CHECK(add_error({{"$id", kTestId}, {"$ref", "#anchor"}}).find("anchors are not supported") !=
        std::string::npos);
  CHECK(add_error({{"$id", kTestId}, {"$ref", "../other.json"}}).find("only a sibling") !=
        std::string::npos);
  CHECK(add_error({{"$id", kTestId}, {"$ref", "#/%24defs/x"}}).find("percent-encoding") !=
        std::string::npos);
  CHECK(add_error({{"$id", kTestId}, {"$ref", "#/a~2"}}).find("$ref \"#/a~2\"") !=
        std::string::npos);
  CHECK(add_error({{"$id", kTestId}, {"items", {{"$id", "inner.json"}}}})
            .find("#/items/$id: $id inside a schema") != std::string::npos);
  CHECK(add_error({{"$id", kTestId}, {"$schema", "http://json-schema.org/draft-07/schema#"}})
            .find("is not draft 2020-12") != std::string::npos);
  CHECK(add_error({{"$id", kTestId}, {"minLength", -1}}).find("minLength must be") !=
        std::string::npos);
  CHECK(add_error({{"$id", kTestId}, {"pattern", "("}}).find("does not compile") !=
        std::string::npos);
  CHECK(add_error({{"type", "object"}}) ==
        "schema.invalid: a schema of the set needs a string $id");
  // Annotations are fine.
  CHECK(add_error({{"$id", kTestId},
                   {"$schema", "https://json-schema.org/draft/2020-12/schema"},
                   {"title", "t"},
                   {"description", "d"},
                   {"$comment", "c"},
                   {"examples", {1}},
                   {"default", 1},
                   {"deprecated", false}}) == "");
}

TEST_CASE("a $ref that names nothing, or loops, fails validation rather than passing") {
  CHECK_THROWS_WITH_AS(one({{"$ref", "missing.json#/x"}}).validate(Json(1), kTestId),
                       doctest::Contains("names no schema of the set"), common::Error);
  CHECK_THROWS_WITH_AS(one({{"$ref", "#/$defs/none"}}).validate(Json(1), kTestId),
                       doctest::Contains("points at nothing"), common::Error);
  CHECK_THROWS_WITH_AS(one({{"$ref", "#"}}).validate(Json(1), kTestId),
                       doctest::Contains("\"#\" loops at /"), common::Error);
  CHECK_THROWS_AS(common::kiln_schemas().validate(Json(1), "https://example.test/none.json"),
                  common::Error);
}

TEST_CASE("integer is any number without a fractional part, as 2020-12 says") {
  auto integer = one({{"type", "integer"}});
  CHECK(valid(integer, common::parse_strict("3")));
  CHECK(valid(integer, common::parse_strict("3.0")));
  CHECK(valid(integer, common::parse_strict("-0.0")));
  CHECK_FALSE(valid(integer, common::parse_strict("3.5")));
  CHECK_FALSE(valid(integer, Json("3")));
  CHECK(valid(one({{"type", "number"}}), Json(3)));
  CHECK(valid(one({{"type", {"string", "null"}}}), Json()));
  CHECK_FALSE(valid(one({{"type", {"string", "null"}}}), Json(false)));
}

TEST_CASE("const and enum compare JSON values: 1 equals 1.0, but not true") {
  CHECK(valid(one({{"const", 1}}), common::parse_strict("1.0")));
  CHECK_FALSE(valid(one({{"const", 1}}), Json(true)));
  CHECK(valid(one({{"const", common::parse_strict(R"({"a": 1, "b": [2.0]})")}}),
              common::parse_strict(R"({"b": [2], "a": 1.0})")));
  CHECK(valid(one({{"enum", {"a", 248320}}}), common::parse_strict("248320.0")));
  CHECK(errors_against(Json("c"), kTestId, one({{"enum", {"a", "b"}}})) ==
        std::vector<std::string>{": enum: expected one of [\"a\",\"b\"], found \"c\""});
}

TEST_CASE("minLength and maxLength count code points, not bytes") {
  auto two = one({{"type", "string"}, {"minLength", 2}, {"maxLength", 2}});
  CHECK(valid(two, Json("é€")));           // 2 code points, 5 bytes
  CHECK(valid(two, Json("\U0001F600a")));  // one of them outside the BMP
  CHECK_FALSE(valid(two, Json("é")));
  CHECK_FALSE(valid(two, Json("abc")));
}

TEST_CASE("pattern is an ECMAScript regex searched, not anchored") {
  auto b = one({{"pattern", "b+"}});
  CHECK(valid(b, Json("abbc")));
  CHECK_FALSE(valid(b, Json("ac")));
  CHECK(valid(b, Json(7)));  // applies to strings only
  // ECMA-262's $ is the end of the text; Python's re (and so Python's jsonschema) also lets it
  // match before a final newline.
  auto sha = one({{"pattern", "^[0-9a-f]{4}$"}});
  CHECK(valid(sha, Json("00ff")));
  CHECK_FALSE(valid(sha, Json("00ff\n")));
}

TEST_CASE("prefixItems, items and additionalProperties apply to what they cover") {
  auto pair = one({{"prefixItems", {{{"const", "a"}}, {{"const", "b"}}}}, {"items", false}});
  CHECK(valid(pair, Json::array({"a", "b"})));
  CHECK(valid(pair, Json::array({"a"})));
  CHECK_FALSE(valid(pair, Json::array({"a", "b", "c"})));
  CHECK_FALSE(valid(pair, Json::array({"b"})));
  auto rest = one({{"prefixItems", {{{"type", "string"}}}}, {"items", {{"type", "integer"}}}});
  CHECK(valid(rest, Json::array({"a", 1, 2})));
  CHECK(errors_against(Json::array({"a", 1, "x"}), kTestId, rest) ==
        std::vector<std::string>{"/2: type: expected integer, found string \"x\""});
  auto map = one({{"properties", {{"a", {{"type", "string"}}}}},
                  {"additionalProperties", {{"type", "integer"}}}});
  CHECK(valid(map, Json{{"a", "x"}, {"b", 1}}));
  CHECK(errors_against(Json{{"a", "x"}, {"b/c", "y"}}, kTestId, map) ==
        std::vector<std::string>{"/b~1c: type: expected integer, found string \"y\""});
  CHECK(valid(one({{"minItems", 1}}), Json("not an array")));
}

TEST_CASE("oneOf holds when exactly one alternative does; none reports the nearest one's errors") {
  auto either = one({{"oneOf", {{{"type", "integer"}}, {{"type", "string"}, {"minLength", 2}}}}});
  CHECK(valid(either, Json(3)));
  CHECK(valid(either, Json("ab")));
  CHECK(errors_against(Json("a"), kTestId, either) ==
        std::vector<std::string>{
            ": oneOf: matches none of the 2 alternatives; nearest, alternative 1:",
            ": minLength: expected at least 2 characters, found 1 in \"a\""});
  auto both = one({{"oneOf", {{{"type", "number"}}, {{"type", "integer"}}}}});
  CHECK(valid(both, Json(1.5)));
  CHECK(errors_against(Json(2), kTestId, both) ==
        std::vector<std::string>{": oneOf: matches alternatives 0 and 1, expected exactly one"});
  CHECK(add_error({{"$id", kTestId}, {"oneOf", Json::array()}}).find("non-empty array") !=
        std::string::npos);
}

TEST_CASE("uniqueItems compares JSON values (1 equals 1.0) and names the repeated one") {
  auto unique = one({{"uniqueItems", true}});
  CHECK(valid(unique, Json::array({1, "1", Json::array({1}), Json{{"a", 1}}})));
  CHECK(errors_against(Json::array({2, 1, 1.0}), kTestId, unique) ==
        std::vector<std::string>{": uniqueItems: 1 occurs more than once"});
  CHECK(errors_against(Json::array({Json{{"a", 1}, {"b", 2}}, Json{{"b", 2}, {"a", 1}}}), kTestId,
                       unique)
            .size() == 1);
  CHECK(valid(one({{"uniqueItems", false}}), Json::array({1, 1})));
  CHECK(add_error({{"$id", kTestId}, {"uniqueItems", 1}}).find("uniqueItems must be") !=
        std::string::npos);
}

TEST_CASE("every worker-output schema is compiled in under its document's schema name") {
  const auto& catalog = common::worker_output_schemas();
  for (const char* name :
       {"assay.fingerprint-output.v1", "assay.oracle-output.v1", "assay.oracle-capture-output.v1",
        "assay.oracle-layers-output.v1", "assay.compare-output.v1",
        "assay.compare-trajectory-output.v1", "assay.numerics-output.v1", "assay.audit-output.v1",
        "assay.prompt-check-output.v1", "assay.compare-layers-output.v1"})
    CHECK_MESSAGE(catalog.id_for(name).has_value(), name);
  CHECK_FALSE(catalog.id_for("assay.next-token-request.v1").has_value());
}

TEST_CASE("check_worker_output fails by the caller's code, naming the schema and the pointers") {
  auto message = [](const Json& output) -> std::string {
    try {
      common::check_worker_output(output, "worker.oracle_output", "oracle's output.json");
      return "";
    } catch (const common::Error& e) {
      CHECK(e.code() == "worker.oracle_output");
      return e.what();
    }
  };
  CHECK(message(Json::array({1, 2})).find("is not a JSON object with a string \"schema\"") !=
        std::string::npos);
  CHECK(message(Json{{"schema", 5}}).find("with a string \"schema\"") != std::string::npos);
  // A schema assay publishes no file for is left to the step's own checks.
  CHECK(message(Json{{"schema", "assay.oracle-batch-output.v1"}}) == "");
  std::string m = message(Json{{"schema", "assay.oracle-layers-output.v1"}, {"hidden_size", "x"}});
  CHECK_MESSAGE(m.find("is not a valid assay.oracle-layers-output.v1:") != std::string::npos, m);
  CHECK_MESSAGE(m.find(" more") != std::string::npos, m);
}

TEST_CASE("format date-time is asserted as RFC 3339") {
  auto dt = one({{"type", "string"}, {"format", "date-time"}});
  for (const char* good :
       {"2026-07-19T02:28:38.318030Z", "2026-07-19t02:28:38z", "2026-07-19T02:28:38+05:30",
        "2024-02-29T00:00:00Z", "2000-02-29T00:00:00-00:00", "1998-12-31T23:59:60Z",
        "1998-12-31T15:59:60-08:00"}) {
    CAPTURE(good);
    CHECK(valid(dt, Json(good)));
  }
  for (const char* bad :
       {"2026-07-19 02:28:38Z", "2026-07-19T02:28:38", "2026-07-19", "2023-02-29T00:00:00Z",
        "1900-02-29T00:00:00Z", "2026-04-31T00:00:00Z", "2026-13-01T00:00:00Z",
        "2026-07-19T24:00:00Z", "2026-07-19T02:60:00Z", "1998-12-31T23:58:60Z",
        "1998-12-31T23:59:61Z", "2026-07-19T02:28:38+24:00", "2026-07-19T02:28:38+0530",
        "2026-07-19T02:28:38.Z", "2026-07-19T02:28:38Z\n"}) {
    CAPTURE(bad);
    CHECK_FALSE(valid(dt, Json(bad)));
  }
}

// Found while writing fuzz_json_schema: std::regex recursed once per digit of the fraction, so a
// Kiln record with a long one overflowed the stack of `assay verify --kiln`.
TEST_CASE("format date-time checks a fraction of any length") {
  auto dt = one({{"type", "string"}, {"format", "date-time"}});
  const std::string digits(400000, '1');
  CHECK(valid(dt, Json("2026-07-19T02:28:38." + digits + "Z")));
  CHECK(valid(dt, Json("2026-07-19T02:28:38." + digits + "+05:30")));
  CHECK_FALSE(valid(dt, Json("2026-07-19T02:28:38." + digits + "x")));
}
