// check_bytes_used: the oracle's bytes_used against what the fingerprint worker hashed, a weight
// file copied and hashed or (fs-verity) mapped and bound by the digest the fingerprint measured.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <optional>
#include <string>

#include "common/error.h"
#include "common/identity.h"
#include "common/json.h"
#include "common/request.h"
#include "supervisor/pipelines/steps.h"

namespace sup = assay::supervisor;
using assay::common::Error;
using assay::common::Json;

namespace {

const std::string kShaA = "sha256:" + std::string(64, 'a');
const std::string kShaB = "sha256:" + std::string(64, 'b');
const std::string kConfig = "sha256:" + std::string(64, 'c');
const std::string kTokenizer = "sha256:" + std::string(64, 'd');
const std::string kVerity = "sha256:" + std::string(64, 'e');

// A fingerprint of two shards, a.safetensors with fs-verity (when `verity`), b without.
sup::FingerprintRun fingerprint(const Json& verity = kVerity) {
  Json a{{"name", "a.safetensors"}, {"size", 10}, {"sha256", kShaA}, {"source", "computed"}};
  if (!verity.is_null()) a["fsverity_digest"] = verity;
  sup::FingerprintRun run;
  run.output = {
      {"model_identity",
       {{"weight_files",
         {{{"path", "a.safetensors"}, {"bytes", 10}, {"sha256", kShaA}},
          {{"path", "b.safetensors"}, {"bytes", 20}, {"sha256", kShaB}}}},
        {"config_hash", kConfig},
        {"tokenizer_hash", kTokenizer}}},
      {"files",
       {a, {{"name", "b.safetensors"}, {"size", 20}, {"sha256", kShaB}, {"source", "computed"}}}}};
  return run;
}

Json oracle(const Json& a) {
  return {{"bytes_used",
           {{"weight_files", {a, {{"path", "b.safetensors"}, {"bytes", 20}, {"sha256", kShaB}}}},
            {"config_hash", kConfig},
            {"tokenizer_hash", kTokenizer}}}};
}

Json mapped(const Json& digest = kVerity, std::uint64_t bytes = 10) {
  return {{"path", "a.safetensors"},
          {"bytes", bytes},
          {"fsverity_digest", digest},
          {"bound_by", "fs-verity"}};
}

// "accepted", or the error's code and message.
std::string check(const Json& out, const sup::FingerprintRun& fp) {
  try {
    sup::check_bytes_used(out, fp, "oracle");
  } catch (const Error& e) {
    return e.code() + ": " + e.what();
  }
  return "accepted";
}

}  // namespace

TEST_CASE("a copied weight file matches on path, bytes and sha256, with or without fs-verity") {
  Json copied{{"path", "a.safetensors"}, {"bytes", 10}, {"sha256", kShaA}};
  CHECK(check(oracle(copied), fingerprint()) == "accepted");
  CHECK(check(oracle(copied), fingerprint(nullptr)) == "accepted");
  copied["sha256"] = kShaB;
  CHECK(check(oracle(copied), fingerprint())
            .starts_with("job.bytes_mismatch: the oracle worker "
                         "computed with weight file a.safetensors"));
}

TEST_CASE("a weight file bound by fs-verity matches only the fingerprint's fs-verity digest") {
  CHECK(check(oracle(mapped()), fingerprint()) == "accepted");
  // The fingerprint read it without fs-verity (a copy, or fs-verity enabled since).
  std::string e = check(oracle(mapped()), fingerprint(nullptr));
  CHECK(
      e.starts_with("job.bytes_mismatch: the oracle worker computed with weight file "
                    "a.safetensors"));
  CHECK(e.find("\"fsverity_digest\":null") != std::string::npos);
  // Another fs-verity digest: other bytes (or another tree) than the ones hashed.
  e = check(oracle(mapped("sha256:" + std::string(64, 'f'))), fingerprint());
  CHECK(e.starts_with("job.bytes_mismatch"));
  CHECK(e.find(kVerity) != std::string::npos);
  CHECK(check(oracle(mapped(kVerity, 11)), fingerprint()).starts_with("job.bytes_mismatch"));
  // Only the fs-verity form is understood; anything else is a mismatch, never a pass.
  Json other = mapped();
  other["bound_by"] = "trust";
  CHECK(check(oracle(other), fingerprint()).starts_with("job.bytes_mismatch"));
  Json extra = mapped();
  extra["sha256"] = kShaB;
  CHECK(check(oracle(extra), fingerprint()).starts_with("job.bytes_mismatch"));
  Json elsewhere = mapped();
  elsewhere["path"] = "b.safetensors";
  CHECK(check(oracle(elsewhere), fingerprint()).starts_with("job.bytes_mismatch"));
}

namespace {

// The same model as fingerprint(nullptr), as a fingerprint that deferred b.safetensors.
sup::FingerprintRun deferred(const std::optional<Json>& expected = std::nullopt) {
  sup::FingerprintRun run = fingerprint(nullptr);
  Json identity = run.output["model_identity"];
  identity["id"] = "m";
  identity["chat_template_hash"] = nullptr;
  Json pending = identity;
  pending["weight_files"][1]["sha256"] = nullptr;
  run.output.erase("model_identity");
  run.output["pending_identity"] = pending;
  run.output["files"][1] = {
      {"name", "b.safetensors"}, {"dev", "1"},      {"ino", "2"},        {"size", 20},
      {"mtime_ns", "3"},         {"ctime_ns", "4"}, {"sha256", nullptr}, {"source", "deferred"}};
  run.output["cacheable"] = {"b.safetensors"};
  run.expected = expected;
  return run;
}

Json complete_identity() {
  Json identity = fingerprint(nullptr).output["model_identity"];
  identity["id"] = "m";
  identity["chat_template_hash"] = nullptr;
  identity["content_sha256"] = assay::common::model_content_sha256(identity);
  return identity;
}

std::string complete(sup::FingerprintRun& fp, const Json& out) {
  try {
    sup::complete_fingerprint(fp, out, "oracle");
  } catch (const Error& e) {
    return e.code() + ": " + e.what();
  }
  return "accepted";
}

}  // namespace

TEST_CASE(
    "a deferred shard's digest comes from the oracle's bytes_used: the completed identity is the "
    "one a whole fingerprint gives, cached once, and the oracle is given the shard's state") {
  sup::FingerprintRun fp = deferred();
  REQUIRE(fp.pending());
  CHECK(fp.identity()["weight_files"][1]["sha256"].is_null());
  CHECK(sup::deferred_files(fp) == Json::parse(R"([{"name":"b.safetensors","dev":"1","ino":"2",
      "size":20,"mtime_ns":"3","ctime_ns":"4"}])"));
  int stored = 0;
  fp.store_cache = [&](const Json& output) {
    ++stored;
    CHECK(output["files"][1]["sha256"] == kShaB);
  };
  Json copied{{"path", "a.safetensors"}, {"bytes", 10}, {"sha256", kShaA}};
  CHECK(complete(fp, oracle(copied)) == "accepted");
  CHECK_FALSE(fp.pending());
  CHECK(fp.identity() == complete_identity());
  CHECK(fp.output["files"][1]["source"] == "reader");
  CHECK(fp.output["files"][1]["reader"] == "oracle");
  CHECK(stored == 1);
  CHECK(sup::deferred_files(fp).empty());
  CHECK(check(oracle(copied), fp) == "accepted");
  CHECK(complete(fp, Json::object()) == "accepted");  // no longer pending: nothing to do
  CHECK(stored == 1);
}

TEST_CASE(
    "a deferred shard that the oracle did not hash, or hashed with other bytes, signs nothing") {
  Json copied{{"path", "a.safetensors"}, {"bytes", 10}, {"sha256", kShaA}};
  Json out = oracle(copied);
  out["bytes_used"]["weight_files"].erase(1);
  sup::FingerprintRun fp = deferred();
  CHECK(complete(fp, out).starts_with(
      "job.bytes_mismatch: the fingerprint left weight file b.safetensors (20 bytes) to the "
      "oracle worker, whose bytes_used has no entry for it"));
  CHECK(fp.pending());
  out = oracle(copied);
  out["bytes_used"]["weight_files"][1]["bytes"] = 21;
  CHECK(complete(fp, out).starts_with("job.bytes_mismatch"));
  out = oracle(copied);
  out["bytes_used"]["weight_files"][1] = {{"path", "b.safetensors"},
                                          {"bytes", 20},
                                          {"fsverity_digest", kVerity},
                                          {"bound_by", "fs-verity"}};
  CHECK(complete(fp, out).starts_with("job.bytes_mismatch"));
  CHECK(complete(fp, Json::array()).starts_with("job.bytes_mismatch"));
}

TEST_CASE(
    "the request's expected identity: what is known is checked before the oracle runs, the "
    "whole at completion") {
  Json expected = complete_identity();
  Json copied{{"path", "a.safetensors"}, {"bytes", 10}, {"sha256", kShaA}};
  sup::FingerprintRun fp = deferred(expected);
  CHECK(complete(fp, oracle(copied)) == "accepted");
  // Another digest of the deferred shard: refused at completion.
  Json other = oracle(copied);
  other["bytes_used"]["weight_files"][1]["sha256"] = "sha256:" + std::string(64, 'f');
  fp = deferred(expected);
  CHECK(complete(fp, other).starts_with("job.identity_mismatch"));
  int stored = 0;
  fp = deferred(expected);
  fp.store_cache = [&](const Json&) { ++stored; };
  (void)complete(fp, other);
  CHECK(stored == 0);  // nothing cached from a refused job
}

TEST_CASE(
    "the fingerprint step refuses a deferring output whose known fields differ from the "
    "expected identity, before any oracle runs") {
  sup::Config config;
  Json expected = complete_identity();
  sup::FingerprintRun out;
  sup::Step step = sup::fingerprint_step(config, "fingerprint", "/models/m", "m", expected, out,
                                         /*defer_shards=*/true);
  CHECK(step.input().value("defer_shards", false));
  sup::FingerprintRun shape = deferred();
  Json output = shape.output;
  output["schema"] = "assay.fingerprint-output.v1";
  std::string refused = "accepted";
  Json wrong = output;
  wrong["pending_identity"]["config_hash"] = "sha256:" + std::string(64, '0');
  try {
    step.accept(wrong, assay::contain::Evidence{});
  } catch (const Error& e) {
    refused = e.code();
  }
  CHECK(refused == "job.identity_mismatch");
  step.accept(output, assay::contain::Evidence{});
  CHECK(out.pending());
  CHECK(out.expected == expected);
  // Without defer_shards, a pending output is the worker's mistake.
  sup::FingerprintRun plain;
  sup::Step strict =
      sup::fingerprint_step(config, "fingerprint", "/models/m", "m", expected, plain);
  CHECK_FALSE(strict.input().contains("defer_shards"));
  refused = "accepted";
  try {
    strict.accept(output, assay::contain::Evidence{});
  } catch (const Error& e) {
    refused = e.code();
  }
  CHECK(refused == "worker.fingerprint_output");
}

TEST_CASE(
    "the fingerprint step refuses a worker whose deferred shards are not exactly its unhashed, "
    "cacheable weight files") {
  sup::Config config;
  sup::FingerprintRun out;
  sup::Step step = sup::fingerprint_step(config, "fingerprint", "/models/m", "m", std::nullopt, out,
                                         /*defer_shards=*/true);
  Json good = deferred().output;
  good["schema"] = "assay.fingerprint-output.v1";
  auto code = [&](const Json& output) {
    try {
      step.accept(output, assay::contain::Evidence{});
    } catch (const Error& e) {
      return e.code() + ": " + e.what();
    }
    return std::string("accepted");
  };
  CHECK(code(good) == "accepted");
  // A null digest for a shard it says it hashed: nobody would compute that digest's state check.
  Json computed = good;
  computed["files"][1]["source"] = "computed";
  CHECK(
      code(computed).starts_with("worker.fingerprint_output: fingerprint output.json defers [] "
                                 "but leaves the sha256 of [\"b.safetensors\"] unknown"));
  // Deferred, but not a sound cache key: its state proves nothing to the reader.
  Json unsettled = good;
  unsettled["cacheable"] = Json::array();
  CHECK(code(unsettled).starts_with("worker.fingerprint_output"));
  // A file it calls deferred that is not an unhashed weight file (a.safetensors, hashed here).
  Json hashed = good;
  hashed["files"][0]["source"] = "deferred";
  hashed["cacheable"] = {"a.safetensors", "b.safetensors"};
  CHECK(code(hashed).starts_with("worker.fingerprint_output"));
  // A deferred state that cannot be handed on (its time overflows 64 bits): the worker's fault.
  Json overflow = good;
  overflow["files"][1]["mtime_ns"] = "9999999999999999999";
  CHECK(code(overflow).find("mtime_ns \"9999999999999999999\" is out of range") !=
        std::string::npos);
  CHECK(code(overflow).starts_with("worker.fingerprint_output"));
  // A complete identity with a file still called deferred.
  Json complete = fingerprint(nullptr).output;
  complete["schema"] = "assay.fingerprint-output.v1";
  complete["model_identity"]["content_sha256"] = "sha256:" + std::string(64, '9');
  complete["files"][1]["source"] = "deferred";
  complete["cacheable"] = {"b.safetensors"};
  CHECK(code(complete).starts_with("worker.fingerprint_output"));
}
