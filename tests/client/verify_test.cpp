// `assay verify` against records made here with common/sign.h: the valid one passes, and each
// kind of tampering is caught by the check that should catch it.
#include <cstdlib>
#include <fstream>

#include <doctest/doctest.h>

#include <functional>

#include "client/verify.h"
#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "common/result.h"
#include "common/sign.h"
#include "support.h"

namespace {

using assay::common::Json;
namespace common = assay::common;
namespace client = assay::client;
using client::test::TempDir;

// A signed record as assayd writes it: result.json (canonical, self-hashed), the logits
// artifact, result.dsse.json (in-toto statement over both) and the public key PEM.
struct Record {
  TempDir dir;
  common::SigningKey key = common::SigningKey::generate();
  std::string result_path, envelope_path, artifact_path, pubkey_path;
  Json result;

  Record() {
    std::string artifact = "bytes standing in for the logits tensor file";
    artifact_path = dir.write("logits.safetensors", artifact);
    result = Json{
        {"schema", std::string(assay::protocol::kNextTokenResult)},
        {"created_at_utc", "2026-11-30T04:00:00Z"},
        {"supervisor", {{"version", "0.1.0"}, {"key_id", key.key_id()}}},
        {"request",
         {{"schema", std::string(assay::protocol::kNextTokenRequest)},
          {"id", "dispute-1"},
          {"sha256", common::sha256_id("request")}}},
        {"reference_artifact",
         {{"bytes", artifact.size()}, {"sha256", common::sha256_id(artifact)}}},
        {"verdict",
         {{"argmax_candidate", "kiln"},
          {"argmax_token_id", 42},
          {"candidate_attribution_complete", true}}},
    };
    write_signed(common::seal_result(result));
    pubkey_path = dir.write("pubkey.pem", key.public_key_pem());
  }

  // Writes result bytes and an envelope whose statement names exactly those bytes.
  void write_signed(const std::string& result_bytes) {
    result_path = dir.write("result.json", result_bytes);
    // Exactly what assayd signs (common/result.h).
    Json statement = common::make_result_statement(
        result_bytes, result["reference_artifact"]["sha256"].get<std::string>());
    Json env = common::dsse_sign(common::kInTotoPayloadType, common::canonical(statement), key);
    // As assayd writes it (supervisor: canonical form and a newline).
    envelope_path = dir.write("result.dsse.json", common::canonical(env) + "\n");
  }

  client::VerifyInputs inputs() const {
    return {.result = result_path,
            .envelope = envelope_path,
            .public_key = key.public_key_pem(),
            .artifact = artifact_path};
  }
};

const client::Check& check(const client::VerifyReport& r, const std::string& name) {
  for (const auto& c : r.checks)
    if (c.name == name) return c;
  FAIL("no check named " << name);
  throw std::logic_error("unreachable");
}

std::vector<std::string> failed(const client::VerifyReport& r) {
  std::vector<std::string> names;
  for (const auto& c : r.checks)
    if (!c.ok) names.push_back(c.name);
  return names;
}

}  // namespace

TEST_CASE("verify accepts an untouched record and names every check it ran") {
  Record rec;
  auto report = client::verify_result(rec.inputs());
  CHECK(report.ok());
  std::vector<std::string> names;
  for (const auto& c : report.checks) names.push_back(c.name);
  CHECK(names == std::vector<std::string>{"result.schema", "result.canonical", "result_sha256",
                                          "key_id", "envelope.payload_type", "signature",
                                          "statement.type", "subject.result", "subject.artifact",
                                          "artifact.file"});
  CHECK(check(report, "result_sha256").detail == rec.result["result_sha256"]);
}

TEST_CASE("verify catches a result edited after signing, even with a recomputed result_sha256") {
  Record rec;
  SUBCASE("verdict changed, self-hash left alone") {
    Json forged = rec.result;
    forged["verdict"]["argmax_candidate"] = "vllm";
    rec.dir.write("result.json", common::canonical(forged));
    auto report = client::verify_result(rec.inputs());
    CHECK(failed(report) == std::vector<std::string>{"result_sha256", "subject.result"});
    CHECK(check(report, "result_sha256")
              .detail.find("claimed " + rec.result["result_sha256"].get<std::string>()) == 0);
  }
  SUBCASE("verdict changed and the self-hash recomputed: only the signature binding catches it") {
    Json forged = rec.result;
    forged["verdict"]["argmax_candidate"] = "vllm";
    forged["result_sha256"] = common::compute_result_sha256(forged);
    rec.dir.write("result.json", common::canonical(forged));
    CHECK(failed(client::verify_result(rec.inputs())) ==
          std::vector<std::string>{"subject.result"});
  }
  SUBCASE("same content, not canonical bytes") {
    rec.dir.write("result.json", rec.result.dump(2));
    CHECK(failed(client::verify_result(rec.inputs())) ==
          std::vector<std::string>{"result.canonical", "subject.result"});
  }
}

TEST_CASE("verify rejects an envelope whose payload was replaced") {
  Record rec;
  Json env = common::parse_strict(common::read_file(rec.envelope_path, 1 << 20));
  std::string payload = common::base64_decode(env["payload"].get<std::string>());
  Json statement = common::parse_strict(payload);
  statement["subject"][0]["digest"]["sha256"] = std::string(64, 'a');
  env["payload"] = common::base64_encode(common::canonical(statement));
  rec.dir.write("result.dsse.json", env.dump());
  auto report = client::verify_result(rec.inputs());
  CHECK(failed(report) == std::vector<std::string>{"signature"});
  CHECK(check(report, "signature")
            .detail.find("signatures[0] (keyid " + rec.key.key_id() +
                         ") does not verify with the given key") != std::string::npos);
}

TEST_CASE("verify names the signature that verified and the key it verified with") {
  Record rec;
  auto report = client::verify_result(rec.inputs());
  CHECK(check(report, "signature").detail ==
        "Ed25519 DSSE: signatures[0] verifies with key " + rec.key.key_id() + " (keyid names it)");
}

// Every bit of every byte of a real envelope file, flipped one at a time: none may verify.
// The file is canonical JSON plus a newline, so no single-bit flip keeps it semantically equal
// (no whitespace inside; '\n' flips to a non-whitespace byte; no escapes or numbers whose spelling
// could change); base64 flips either change the decoded bytes or set unused bits (refused).
// In memory, through the two calls verify_result makes on the envelope's bytes (parse_strict,
// dsse_open), so that the 3,000-odd variants take well under a second.
TEST_CASE("no single-bit flip anywhere in a real envelope verifies") {
  Record rec;
  const std::string original = common::read_file(rec.envelope_path, 1 << 20);
  const std::string key = rec.key.public_key_pem();
  auto verifies = [&](const std::string& bytes) {
    try {
      common::dsse_open(common::parse_strict(bytes), key);
      return true;
    } catch (const common::Error&) {
      return false;
    }
  };
  REQUIRE(verifies(original));
  std::size_t flips = 0;
  std::string accepted;  // "byte I bit B; ..." of each flip that verified
  for (std::size_t i = 0; i < original.size(); ++i)
    for (int bit = 0; bit < 8; ++bit) {
      std::string flipped = original;
      flipped[i] = static_cast<char>(flipped[i] ^ (1 << bit));
      ++flips;
      if (verifies(flipped))
        accepted += "byte " + std::to_string(i) + " bit " + std::to_string(bit) + "; ";
    }
  CHECK(flips == 8 * original.size());
  CHECK(original.size() > 400);
  CHECK(accepted == "");

  // And through `assay verify`'s own path for the flips that used to pass: every bit of the
  // character before each '=' (the padding flips 241 of 3,360 were accepted before).
  for (std::size_t i = 1; i < original.size(); ++i) {
    if (original[i] != '=' || original[i - 1] == '=') continue;
    for (int bit = 0; bit < 8; ++bit) {
      std::string flipped = original;
      flipped[i - 1] = static_cast<char>(flipped[i - 1] ^ (1 << bit));
      std::ofstream(rec.envelope_path, std::ios::binary | std::ios::trunc) << flipped;
      CAPTURE(i - 1);
      CAPTURE(bit);
      CHECK_FALSE(check(client::verify_result(rec.inputs()), "signature").ok);
    }
  }
}

TEST_CASE("verify refuses an envelope with a changed keyid or an extra bogus signature") {
  Record rec;
  Json env = common::parse_strict(common::read_file(rec.envelope_path, 1 << 20));
  auto other = common::SigningKey::generate();
  SUBCASE("keyid names another key") {
    env["signatures"][0]["keyid"] = other.key_id();
    rec.dir.write("result.dsse.json", common::canonical(env));
    auto report = client::verify_result(rec.inputs());
    CHECK(failed(report) == std::vector<std::string>{"signature"});
    CHECK(check(report, "signature").detail.find("[sign.keyid_mismatch]") != std::string::npos);
  }
  SUBCASE("a second entry that does not verify") {
    env["signatures"].push_back(
        {{"keyid", other.key_id()}, {"sig", common::base64_encode(std::string(64, '\x01'))}});
    rec.dir.write("result.dsse.json", common::canonical(env));
    auto report = client::verify_result(rec.inputs());
    CHECK(failed(report) == std::vector<std::string>{"signature"});
    CHECK(check(report, "signature").detail.find("signatures[1]") != std::string::npos);
    CHECK(check(report, "signature").detail.find("[sign.verify_failed]") != std::string::npos);
  }
}

TEST_CASE("verify rejects a record checked with another key") {
  Record rec;
  auto other = common::SigningKey::generate();
  auto in = rec.inputs();
  in.public_key = other.public_key_pem();
  auto report = client::verify_result(in);
  CHECK(failed(report) == std::vector<std::string>{"key_id", "signature"});
  CHECK(check(report, "key_id").detail ==
        "result names key " + rec.key.key_id() + ", the given public key is " + other.key_id());
}

TEST_CASE("verify checks the artifact file's digest and size against the result") {
  Record rec;
  rec.dir.write("logits.safetensors", "different bytes");
  auto report = client::verify_result(rec.inputs());
  CHECK(failed(report) == std::vector<std::string>{"artifact.file"});
  CHECK(check(report, "artifact.file").detail.find(common::sha256_id("different bytes")) !=
        std::string::npos);
}

TEST_CASE("verify without an envelope fails the signature check instead of passing silently") {
  Record rec;
  auto in = rec.inputs();
  in.envelope.reset();
  auto report = client::verify_result(in);
  CHECK_FALSE(report.ok());
  CHECK(failed(report) == std::vector<std::string>{"signature"});
}

TEST_CASE("assay verify exits 0 on a good record and 6 on a tampered one, offline with --pubkey") {
  Record rec;
  client::Environment env{.socket = "/nonexistent/assayd.sock"};  // proves it stays offline
  auto good = client::test::run({"verify", rec.result_path, "--pubkey", rec.pubkey_path}, env);
  CHECK(good.status == 0);
  CHECK(good.out.find("verified: " + rec.result_path) != std::string::npos);

  auto json = client::test::run({"verify", rec.result_path, "--pubkey", rec.pubkey_path,
                                 "--artifact", rec.artifact_path, "--json"},
                                env);
  CHECK(json.status == 0);
  Json doc = common::parse_strict(json.out);
  CHECK(doc["ok"] == true);
  CHECK(doc["checks"].size() == 10);

  Json forged = rec.result;
  forged["verdict"]["argmax_token_id"] = 7;
  rec.dir.write("result.json", common::canonical(forged));
  auto bad = client::test::run({"verify", rec.result_path, "--pubkey", rec.pubkey_path}, env);
  CHECK(bad.status == 6);
  CHECK(bad.out.find("FAIL  result_sha256") != std::string::npos);
  CHECK(bad.out.find("NOT VERIFIED") != std::string::npos);
}

TEST_CASE("the signature verifies with plain openssl as client/README.md shows") {
  if (std::system("command -v jq >/dev/null && command -v openssl >/dev/null") != 0) {
    MESSAGE("skipped: jq or openssl is not installed");
    return;
  }
  Record rec;
  // The same commands as in client/README.md, run in the record's directory.
  std::string script = "cd '" + rec.dir.path().string() +
                       "' && sh '" ASSAY_CLIENT_TEST_DIR "/openssl_verify.sh' >/dev/null 2>&1";
  CHECK(std::system(script.c_str()) == 0);
  // And openssl refuses a signature over other bytes.
  std::string tampered = "cd '" + rec.dir.path().string() +
                         "' && printf x >> pae.bin && openssl pkeyutl -verify -pubin -inkey "
                         "pubkey.pem -rawin -in pae.bin -sigfile sig.bin >/dev/null 2>&1";
  CHECK(std::system(tampered.c_str()) != 0);
}

// Kiln's own records (tests/client/fixtures/kiln/: the two real results of
// ../shared/fixtures/kiln/results/, byte for byte).
namespace {

const std::string kKilnNextToken = std::string(ASSAY_CLIENT_TEST_DIR) +
                                   "/fixtures/kiln/"
                                   "20260719t003452-rocm-strix-halo-hf-next-token-first-"
                                   "divergence-v1.json";
const std::string kKilnLayer = std::string(ASSAY_CLIENT_TEST_DIR) +
                               "/fixtures/kiln/"
                               "20260719t022838-rocm-strix-halo-hf-layer-attribution-v1.json";

const client::Check* check_named(const client::VerifyReport& r, const std::string& name) {
  for (const auto& c : r.checks)
    if (c.name == name) return &c;
  return nullptr;
}

// Writes `doc` as Kiln writes its files (indented; the bytes do not matter to the self-hash),
// with its result_sha256 recomputed in Kiln's form when `rehash`.
std::filesystem::path write_kiln(const TempDir& tmp, Json doc, bool rehash) {
  if (rehash) {
    Json body = doc;
    body.erase("result_sha256");
    doc["result_sha256"] = common::sha256_id(common::python_canonical(body));
  }
  auto path = tmp.path() / "record.json";
  std::ofstream(path) << doc.dump(2) << "\n";
  return path;
}

}  // namespace

TEST_CASE("python_float_repr writes Python's repr of a float") {
  const std::pair<double, const char*> cases[] = {
      {300.0, "300.0"},
      {1e-05, "1e-05"},
      {1e16, "1e+16"},
      {1e15, "1000000000000000.0"},
      {0.0001, "0.0001"},
      {0.1, "0.1"},
      {1.5e-07, "1.5e-07"},
      {-0.0, "-0.0"},
      {123456789012345678.0, "1.2345678901234568e+17"},
      {5e-324, "5e-324"},
      {1.7976931348623157e308, "1.7976931348623157e+308"},
      {-2.5, "-2.5"},
      {1234.5678, "1234.5678"},
      {9999999999999998.0, "9999999999999998.0"},
      {0.001, "0.001"},
      {1.23e-18, "1.23e-18"}};
  for (const auto& [value, want] : cases) CHECK(common::python_float_repr(value) == want);
  // Kiln's canonical form keeps a float a float and escapes as Python does.
  Json doc = common::parse_strict(R"({"b":300.0,"a":[1,2.5e-7],"s":"é\u0001\n"})");
  CHECK(common::python_canonical(doc) == R"({"a":[1,2.5e-07],"b":300.0,"s":"\u00e9\u0001\n"})");
}

TEST_CASE("verify --kiln passes both of Kiln's real results") {
  for (const std::string& file : {kKilnNextToken, kKilnLayer}) {
    client::VerifyReport r = client::verify_kiln(file);
    CAPTURE(r.to_json().dump(2));
    CHECK(r.ok());
    REQUIRE(check_named(r, "kiln.result_sha256") != nullptr);
    CHECK(check_named(r, "kiln.result_sha256")->ok);
  }
  // The next-token result's facts were checked, not only its hash, and its schema.
  client::VerifyReport r = client::verify_kiln(kKilnNextToken);
  for (const char* name :
       {"kiln.schema_valid", "kiln.top_tokens", "kiln.top_logit_margin", "kiln.candidate_tokens",
        "kiln.verdict.argmax_candidate", "kiln.verdict.candidate_attribution_complete"}) {
    CAPTURE(name);
    REQUIRE(check_named(r, name) != nullptr);
    CHECK(check_named(r, name)->ok);
  }
}

TEST_CASE("verify --kiln fails a one-field change to each real result, naming what broke") {
  TempDir tmp;
  Json next = common::parse_strict(common::read_file(kKilnNextToken, 1 << 24));
  Json layer = common::parse_strict(common::read_file(kKilnLayer, 1 << 24));
  SUBCASE("a changed field without a new hash fails the self-hash") {
    for (Json doc : {next, layer}) {
      doc["created_at_utc"] = "2026-01-01T00:00:00Z";
      auto r = client::verify_kiln(write_kiln(tmp, doc, false));
      CHECK_FALSE(r.ok());
      CHECK_FALSE(check_named(r, "kiln.result_sha256")->ok);
    }
  }
  SUBCASE("the same number written as an integer (18 for 18.0) changes Kiln's canonical bytes") {
    Json doc = next;
    REQUIRE(doc["oracle"]["top_tokens"][2]["logit"] == 18.0);
    REQUIRE(doc["oracle"]["top_tokens"][2]["logit"].is_number_float());
    doc["oracle"]["top_tokens"][2]["logit"] = 18;
    auto r = client::verify_kiln(write_kiln(tmp, doc, false));
    CHECK_FALSE(check_named(r, "kiln.result_sha256")->ok);
  }
  SUBCASE("the verdict given to the other engine, hash recomputed") {
    Json doc = next;
    doc["verdict"]["argmax_candidate"] = "kiln";
    auto r = client::verify_kiln(write_kiln(tmp, doc, true));
    CAPTURE(r.to_json().dump(2));
    CHECK(check_named(r, "kiln.result_sha256")->ok);
    CHECK_FALSE(r.ok());
    CHECK_FALSE(check_named(r, "kiln.verdict.argmax_candidate")->ok);
    CHECK(check_named(r, "kiln.verdict.argmax_candidate")->detail.find("\"vllm\"") !=
          std::string::npos);
  }
  SUBCASE("Kiln's cross-field rules, each broken alone in a resealed record") {
    struct Case {
      const char* check;
      std::function<void(Json&)> edit;
    };
    for (const Case& c : std::vector<Case>{
             {"kiln.request_sha256",
              [](Json& d) { d["oracle"]["request_sha256"] = "sha256:" + std::string(64, '0'); }},
             {"kiln.request_id", [](Json& d) { d["oracle"]["request_id"] = "another-request"; }},
             {"kiln.output_bytes",
              [](Json& d) {
                d["oracle"]["output_bytes"] = d["oracle"]["output_bytes"].get<std::int64_t>() + 1;
              }},
             {"kiln.origin_main",
              [](Json& d) { d["source"]["origin_main"] = std::string(40, 'a'); }},
             {"kiln.python_sha256", [](Json& d) {
                d["model_fingerprint"] = {
                    {"implementation_sha256", "sha256:" + std::string(64, '1')},
                    {"python_sha256", "sha256:" + std::string(64, '2')},
                    {"thermal", Json::object()}};
              }}}) {
      Json doc = next;
      // Unchanged, each rule holds on the real record.
      if (std::string(c.check) != "kiln.python_sha256") {
        auto fine = client::verify_kiln(write_kiln(tmp, doc, true));
        REQUIRE(check_named(fine, c.check) != nullptr);
        CHECK(check_named(fine, c.check)->ok);
      }
      c.edit(doc);
      auto r = client::verify_kiln(write_kiln(tmp, doc, true));
      CAPTURE(c.check);
      CAPTURE(r.to_json().dump(2));
      CHECK(check_named(r, "kiln.result_sha256")->ok);
      CHECK_FALSE(r.ok());
      REQUIRE(check_named(r, c.check) != nullptr);
      CHECK_FALSE(check_named(r, c.check)->ok);
    }
  }
  SUBCASE("a top token's logit raised above the argmax's, hash recomputed") {
    Json doc = next;
    doc["oracle"]["top_tokens"][1]["logit"] = 19.0;
    auto r = client::verify_kiln(write_kiln(tmp, doc, true));
    CHECK_FALSE(check_named(r, "kiln.top_tokens")->ok);
  }
  SUBCASE("a margin that does not follow, hash recomputed") {
    Json doc = next;
    doc["oracle"]["top_logit_margin"] = 0.5;
    auto r = client::verify_kiln(write_kiln(tmp, doc, true));
    CHECK_FALSE(check_named(r, "kiln.top_logit_margin")->ok);
  }
  SUBCASE("top logits whose difference overflows to infinity fail the margin, never throw") {
    Json doc = next;
    Json& top = doc["oracle"]["top_tokens"];
    top[0]["logit"] = 1.7e308;
    for (std::size_t i = 1; i < top.size(); ++i) top[i]["logit"] = -1.7e308;
    client::VerifyReport r;
    CHECK_NOTHROW(r = client::verify_kiln(write_kiln(tmp, doc, true)));
    REQUIRE(check_named(r, "kiln.top_logit_margin") != nullptr);
    CHECK_FALSE(check_named(r, "kiln.top_logit_margin")->ok);
    CHECK(check_named(r, "kiln.top_logit_margin")->detail.find("(inf)") != std::string::npos);
  }
  SUBCASE("a candidate's rank that does not follow, hash recomputed") {
    Json doc = next;
    doc["oracle"]["candidate_tokens"][0]["rank"] = 1;
    auto r = client::verify_kiln(write_kiln(tmp, doc, true));
    CHECK_FALSE(check_named(r, "kiln.candidate_tokens")->ok);
  }
  SUBCASE("an unknown schema") {
    Json doc = layer;
    doc["schema"] = "kiln.something-else.v1";
    auto r = client::verify_kiln(write_kiln(tmp, doc, true));
    CHECK_FALSE(check_named(r, "kiln.schema")->ok);
  }
  SUBCASE("Kiln's layer-attribution rules, each broken alone in a resealed record") {
    struct Case {
      const char* check;
      std::function<void(Json&)> edit;
    };
    auto& b = layer["worker"]["boundaries"];
    REQUIRE(b.size() == 34);
    for (const Case& c : std::vector<Case>{
             {"kiln.layer.boundaries",
              [](Json& d) { d["worker"]["boundaries"][5]["name"] = "layer_04_full_attention"; }},
             {"kiln.layer.boundaries", [](Json& d) { d["worker"]["boundaries"][7]["index"] = 8; }},
             {"kiln.layer.metrics",
              [](Json& d) {
                // The relative error no longer the RMS error over the reference's RMS.
                auto& x = d["worker"]["boundaries"][3];
                x["root_mean_square_error"] = x["root_mean_square_error"].get<double>() * 2;
              }},
             {"kiln.layer.metrics",
              [](Json& d) {
                auto& x = d["worker"]["boundaries"][9];
                x["mean_abs_error"] = x["max_abs_error"].get<double>() + 1.0;
              }},
             {"kiln.layer.largest_growth",
              [](Json& d) { d["worker"]["largest_relative_error_growth"]["index"] = 4; }},
             {"kiln.layer.largest_growth",
              [](Json& d) {
                auto& g = d["worker"]["largest_relative_error_growth"];
                g["relative_root_mean_square_error_delta"] =
                    g["relative_root_mean_square_error_delta"].get<double>() * (1 + 1e-9);
              }},
             {"kiln.layer.last_rows_sha256",
              [](Json& d) {
                d["worker"]["hf_layer_last_rows_sha256"] = "sha256:" + std::string(64, '0');
              }},
             {"kiln.layer.output_bytes",
              [](Json& d) {
                d["reference"]["evidence"]["output_bytes"] =
                    d["reference"]["bytes"].get<std::int64_t>() + 1;
              }},
             {"kiln.layer.request_sha256",
              [](Json& d) {
                d["reference"]["evidence"]["request_sha256"] = "sha256:" + std::string(64, '0');
              }},
             {"kiln.origin_main",
              [](Json& d) { d["source"]["origin_main"] = std::string(40, 'a'); }}}) {
      CAPTURE(c.check);
      auto fine = client::verify_kiln(write_kiln(tmp, layer, true));
      REQUIRE(check_named(fine, c.check) != nullptr);
      CHECK(check_named(fine, c.check)->ok);
      Json doc = layer;
      c.edit(doc);
      auto r = client::verify_kiln(write_kiln(tmp, doc, true));
      CAPTURE(r.to_json().dump(2));
      CHECK(check_named(r, "kiln.result_sha256")->ok);
      CHECK_FALSE(r.ok());
      REQUIRE(check_named(r, c.check) != nullptr);
      CHECK_FALSE(check_named(r, c.check)->ok);
    }
  }
  SUBCASE("layer metrics whose quotient or step overflows to infinity fail, never throw") {
    Json doc = layer;
    auto& x = doc["worker"]["boundaries"][3];
    x["root_mean_square_error"] = 1e308;
    x["reference_root_mean_square"] = 1e-308;
    x["relative_root_mean_square_error"] = 1.7e308;
    doc["worker"]["boundaries"][4]["relative_root_mean_square_error"] = -1.7e308;
    client::VerifyReport r;
    CHECK_NOTHROW(r = client::verify_kiln(write_kiln(tmp, doc, true)));
    REQUIRE(check_named(r, "kiln.layer.metrics") != nullptr);
    CHECK_FALSE(check_named(r, "kiln.layer.metrics")->ok);
    CHECK(check_named(r, "kiln.layer.metrics")->detail.find("inf") != std::string::npos);
    REQUIRE(check_named(r, "kiln.layer.largest_growth") != nullptr);
    CHECK_FALSE(check_named(r, "kiln.layer.largest_growth")->ok);
  }
  SUBCASE("a field Kiln's schema forbids, hash recomputed: each record fails schema_valid") {
    Json doc = layer;
    doc["worker"]["extra"] = 1;
    auto r = client::verify_kiln(write_kiln(tmp, doc, true));
    CHECK(check_named(r, "kiln.result_sha256")->ok);
    REQUIRE(check_named(r, "kiln.schema_valid") != nullptr);
    CHECK_FALSE(check_named(r, "kiln.schema_valid")->ok);
    CAPTURE(check_named(r, "kiln.schema_valid")->detail);
    CHECK(check_named(r, "kiln.schema_valid")->detail.find("/worker") == 0);

    doc = next;
    doc["oracle"]["torch_version"] = "2.13.0+cu130";
    r = client::verify_kiln(write_kiln(tmp, doc, true));
    CHECK(check_named(r, "kiln.result_sha256")->ok);
    CHECK_FALSE(check_named(r, "kiln.schema_valid")->ok);
    CAPTURE(check_named(r, "kiln.schema_valid")->detail);
    CHECK(check_named(r, "kiln.schema_valid")->detail.find("/oracle/torch_version") == 0);
  }
}
