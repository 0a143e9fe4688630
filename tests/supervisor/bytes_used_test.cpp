// check_bytes_used: the oracle's bytes_used against what the fingerprint worker hashed, a weight
// file copied and hashed or (fs-verity) mapped and bound by the digest the fingerprint measured.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <string>

#include "common/error.h"
#include "common/json.h"
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
