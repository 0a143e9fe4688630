// Kiln's v2 record from an assay result (client/kiln_export.h), on a real assay result
// (fixtures/report/: a demo run's result and its logits) and Kiln's two real records.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>

#include <sys/stat.h>

#include "client/kiln_export.h"
#include "client/verify.h"
#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/json_schema.h"
#include "common/kiln_schemas.h"
#include "common/numerics.h"
#include "common/safetensors.h"
#include "support.h"

namespace {

using assay::common::Json;
namespace client = assay::client;
namespace common = assay::common;
namespace fs = std::filesystem;
using assay::client::test::TempDir;

const std::string kFixtures = ASSAY_CLIENT_TEST_DIR "/fixtures/";

Json assay_result() {
  return common::parse_strict(common::read_file(kFixtures + "report/result.json", 1 << 24));
}

bool listed(const client::KilnExport& e, const std::string& pointer) {
  for (const auto& f : e.false_fields)
    if (f.starts_with(pointer + ": ")) return true;
  return false;
}

}  // namespace

TEST_CASE("kiln_file_text writes Kiln's two real records byte for byte") {
  for (const char* name :
       {"kiln/20260719t003452-rocm-strix-halo-hf-next-token-first-divergence-v1.json",
        "kiln/20260719t022838-rocm-strix-halo-hf-layer-attribution-v1.json"}) {
    std::string bytes = common::read_file(kFixtures + name, 1 << 24);
    CHECK(client::kiln_file_text(common::parse_strict(bytes)) == bytes);
  }
}

TEST_CASE("a CPU run of the libtorch backend is not Kiln's record: every false field is listed") {
  Json result = assay_result();
  client::KilnExport e = client::kiln_v2_record(result);
  CHECK_FALSE(e.writable());
  for (const auto& f : e.false_fields) MESSAGE("not a fact of this run: " << f);
  // Exactly these, each with its reason: Kiln's pins this CPU build and tiny model cannot meet
  // (torch, HIP, vocabulary), what the libtorch backend does not run (transformers, a Python
  // worker), what cgroup v1 does not count, what an assay request lacks (receipts, Kiln's path),
  // what the demo's build and model lacked (a clean pushed tree, a chat template).
  std::vector<std::string> pointers;
  for (const auto& f : e.false_fields) {
    pointers.push_back(f.substr(0, f.find(": ")));
    CHECK(f.size() > pointers.back().size() + 2);
  }
  CHECK(pointers == std::vector<std::string>{
                        "/implementation/hf_worker_sha256", "/implementation/python_sha256",
                        "/model_fingerprint/python_sha256", "/model_identity/chat_template_hash",
                        "/oracle/configuration_sha256", "/oracle/linear_attention_implementation",
                        "/oracle/memory_high_events", "/oracle/memory_oom_events",
                        "/oracle/modeling_sha256", "/oracle/torch_hip_version",
                        "/oracle/torch_version", "/oracle/transformers_version", "/oracle/vocab",
                        "/request/contract_path", "/request/source", "/source/commit",
                        "/source/origin_main", "/source/tree"});
  // Kiln's const pins this machine cannot meet, reported, not hidden.
  CHECK(listed(e, "/oracle/torch_version"));
  CHECK(listed(e, "/oracle/vocab"));
  CHECK(listed(e, "/oracle/torch_hip_version"));
  // What the libtorch backend does not compute.
  CHECK(listed(e, "/oracle/modeling_sha256"));
  CHECK(listed(e, "/oracle/transformers_version"));
  CHECK(listed(e, "/oracle/configuration_sha256"));
  CHECK(listed(e, "/implementation/hf_worker_sha256"));
  // An assay request has no receipts; cgroup v1 has no memory.high counter.
  CHECK(listed(e, "/request/source"));
  CHECK(listed(e, "/request/contract_path"));
  CHECK(listed(e, "/oracle/memory_high_events"));
  // What was true is carried as the run had it.
  CHECK(e.record["oracle"]["logits_sha256"] == result["oracle"]["logits_sha256"]);
  CHECK(e.record["verdict"] == result["verdict"]);
  CHECK(e.record["oracle"]["memory_max_events"] == 0);
  CHECK(e.record["containment"]["network"] == "forbidden");
  // Kiln's device is the accelerator's name, assay's device_name; never the spec "cpu".
  CHECK(result["oracle"]["device"] == "cpu");
  CHECK(e.record["oracle"]["device"] == result["oracle"]["device_name"]);
  CHECK_FALSE(listed(e, "/oracle/device"));
  Json unnamed = result;
  unnamed["oracle"].erase("device_name");
  client::KilnExport u = client::kiln_v2_record(unnamed);
  CHECK(listed(u, "/oracle/device"));
  CHECK(u.record["oracle"]["device"].is_null());
  CHECK(e.record["oracle"]["candidate_tokens"][0] == Json{{"engine", "kiln"},
                                                          {"token_id", 135},
                                                          {"text", "\ufffd"},
                                                          {"logit", 1.6640625},
                                                          {"rank", 1}});
  Json body = e.record;
  body.erase("result_sha256");
  CHECK(e.record["result_sha256"] == common::sha256_id(common::python_canonical(body)));
  // A fingerprint reused from an earlier job: no fingerprint process ran in this one.
  CHECK_FALSE(listed(e, "/model_fingerprint/process"));
  Json reused = result;
  reused["model_fingerprint"]["process"] = nullptr;
  reused["model_fingerprint"]["reused"] = {{"job", "j-0123456789abcdef01234567"},
                                           {"at", "2026-12-06T10:00:00.000Z"}};
  client::KilnExport r = client::kiln_v2_record(reused);
  CHECK(listed(r, "/model_fingerprint/process"));
}

TEST_CASE("every way the draft breaks Kiln's schema is among the listed fields") {
  client::KilnExport e = client::kiln_v2_record(assay_result());
  auto errors = common::kiln_schemas().validate(
      e.record, *common::kiln_schema_id_for("kiln.rocm-hf-next-token-oracle.v2"));
  CHECK_FALSE(errors.empty());
  for (const auto& error : errors) {
    bool explained = false;
    for (const auto& f : e.false_fields) {
      std::string pointer = f.substr(0, f.find(": "));
      explained = explained || error.pointer == pointer || error.pointer.starts_with(pointer + "/");
    }
    CAPTURE(error.pointer);
    CAPTURE(error.message);
    CHECK(explained);
  }
}

TEST_CASE("on Kiln's stack with checked receipts, every field but one is a fact and Kiln-valid") {
  // The run a Kiln user would have: Kiln's pinned stack on ROCm through the transformers
  // backend, a Kiln request with checked receipts. Built from the real result by setting exactly
  // the facts such a run records, to test the export's rules; assay signs no such run here.
  Json r = assay_result();
  r["source"]["tree_modified"] = false;
  r["oracle"]["backend"] = "transformers";
  r["oracle"]["linear_attention_implementation"] = "transformers_torch_fallback";
  r["oracle"]["configuration_sha256"] = "sha256:" + std::string(64, '3');
  r["oracle"]["vocab_size"] = 248320;
  r["oracle"]["runtime"]["torch"]["version_label"] = "2.13.0+rocm7.2";
  r["oracle"]["runtime"]["torch"]["hip_version"] = "7.2.53211";
  r["oracle"]["process"]["normalised"]["memory_high_events"] = 0;
  r["oracle"]["process"]["normalised"]["memory_oom_events"] = 0;
  r["model_identity"]["chat_template_hash"] = "sha256:" + std::string(64, '4');
  r["request"]["schema"] = "kiln.hf-next-token-request.v1";
  r["request"]["source"] = common::parse_strict(
      common::read_file(kFixtures + "kiln-request-v1.json", 1 << 20))["source"];
  r["request"]["receipts"] = {{"checked", true}, {"receipts", Json::array()}};
  // The transformers run's worker script and interpreter, as the worker hashed them.
  const std::string worker = "sha256:" + std::string(64, '5'),
                    python = "sha256:" + std::string(64, '6');
  r["oracle"]["executable_sha256"] = worker;
  r["oracle"]["transformers"] = {
      {"version", "5.13.1"},
      {"python", {{"path", "/usr/bin/python3.11"}, {"sha256", python}, {"version", "3.11.2"}}}};
  client::KilnExport e = client::kiln_v2_record(r, {.contract_path = "requests/x.json"});
  CHECK(e.record["implementation"]["hf_worker_sha256"] == worker);
  CHECK(e.record["implementation"]["python_sha256"] == python);
  CHECK_FALSE(listed(e, "/implementation/hf_worker_sha256"));
  CHECK_FALSE(listed(e, "/implementation/python_sha256"));
  // The fingerprint is assay's C++ program: Kiln's Python fingerprinter's hash stays listed.
  CHECK(listed(e, "/model_fingerprint/python_sha256"));
  std::vector<std::string> left = e.false_fields;
  for (const auto& f : left) MESSAGE("still not a fact: " << f);
  // Built from a checkout without origin/main (the fixture's build records none).
  CHECK(listed(e, "/source/tree"));
  CHECK(listed(e, "/source/origin_main"));
  CHECK_FALSE(listed(e, "/oracle/torch_version"));
  CHECK_FALSE(listed(e, "/request/source"));
  CHECK_FALSE(listed(e, "/oracle/memory_high_events"));

  // Built from the pushed tip, with the transformers files the worker hashed: every field of the
  // v2 record is written and the record is valid against Kiln's published schema, except the
  // one fact no assay job has: the fingerprint ran in C++ (assay-fingerprint), so there is no
  // fingerprinting interpreter to name, and Kiln's schema wants one.
  const std::string commit = r["source"]["git_commit"];
  r["source"]["git_tree"] = std::string(40, 'e');
  r["source"]["origin_main"] = commit;
  r["oracle"]["transformers"]["modeling_sha256"] = "sha256:" + std::string(64, '7');
  r["oracle"]["transformers"]["configuration_sha256"] = "sha256:" + std::string(64, '8');
  client::KilnExport pushed = client::kiln_v2_record(r, {.contract_path = "requests/x.json"});
  for (const auto& f : pushed.false_fields) MESSAGE("on Kiln's stack, not a fact: " << f);
  CHECK(pushed.record["source"] ==
        Json{{"commit", commit}, {"origin_main", commit}, {"tree", std::string(40, 'e')}});
  REQUIRE(pushed.false_fields.size() == 1);
  CHECK(pushed.false_fields[0].starts_with("/model_fingerprint/python_sha256: "));
  auto errors = common::kiln_schemas().validate(
      pushed.record, *common::kiln_schema_id_for("kiln.rocm-hf-next-token-oracle.v2"));
  for (const auto& error : errors) {
    CAPTURE(error.message);
    CHECK(error.pointer == "/model_fingerprint/python_sha256");
  }
  // origin/main elsewhere: said, with both commits.
  r["source"]["origin_main"] = std::string(40, 'a');
  client::KilnExport behind = client::kiln_v2_record(r, {.contract_path = "requests/x.json"});
  CHECK(listed(behind, "/source/origin_main"));
  CHECK(behind.record["source"]["origin_main"] == std::string(40, 'a'));
  // A modified tree: neither its commit nor the commit's tree is the tree that was built.
  r["source"]["origin_main"] = commit;
  r["source"]["tree_modified"] = true;
  client::KilnExport modified = client::kiln_v2_record(r, {.contract_path = "requests/x.json"});
  CHECK(listed(modified, "/source/commit"));
  CHECK(listed(modified, "/source/tree"));
}

TEST_CASE("verify --kiln --artifact recomputes the logits facts of a record from its file") {
  TempDir tmp;
  client::KilnExport e = client::kiln_v2_record(assay_result());
  fs::path record = tmp.path() / "record.json";
  std::ofstream(record) << client::kiln_file_text(e.record);
  fs::path logits = kFixtures + "report/logits.safetensors";
  client::VerifyReport r = client::verify_kiln(record, logits);
  CAPTURE(r.to_json().dump(2));
  for (const char* name :
       {"kiln.result_sha256", "kiln.artifact.file", "kiln.artifact.logits_sha256",
        "kiln.artifact.input_ids", "kiln.artifact.argmax", "kiln.artifact.top_tokens",
        "kiln.artifact.candidates", "kiln.top_tokens", "kiln.candidate_tokens",
        "kiln.verdict.argmax_candidate"}) {
    bool ok = false;
    for (const auto& c : r.checks) ok = ok || (c.name == name && c.ok);
    CAPTURE(name);
    CHECK(ok);
  }
  // One logit changed in a copy of the artifact: the file, the digest and the argmax break.
  std::string bytes = common::read_file(logits, 1 << 20);
  bytes[bytes.size() - 4 * 100 - 2] ^= 0x40;
  fs::path tampered = tmp.path() / "logits.safetensors";
  std::ofstream(tampered, std::ios::binary) << bytes;
  client::VerifyReport bad = client::verify_kiln(record, tampered);
  CHECK_FALSE(bad.ok());
  for (const auto& c : bad.checks)
    if (c.name == "kiln.artifact.file" || c.name == "kiln.artifact.logits_sha256")
      CHECK_FALSE(c.ok);
}

TEST_CASE("verify --kiln --artifact takes only the layout and metadata Kiln's reader takes") {
  TempDir tmp;
  Json result = assay_result();
  client::KilnExport e = client::kiln_v2_record(result);
  fs::path record = tmp.path() / "record.json";
  std::ofstream(record) << client::kiln_file_text(e.record);
  auto layout = [&](const fs::path& artifact) {
    client::VerifyReport r = client::verify_kiln(record, artifact);
    for (const auto& c : r.checks)
      if (c.name == "kiln.artifact.layout") return c;
    FAIL("no kiln.artifact.layout check");
    return client::Check{};
  };
  // The fixture's logits were written before the oracle wrote Kiln's metadata.
  fs::path old = kFixtures + "report/logits.safetensors";
  CHECK_FALSE(layout(old).ok);
  CHECK(layout(old).detail.find("metadata schema null") != std::string::npos);

  auto src = common::SafetensorsFile::open(old);
  auto write = [&](const std::string& name, std::map<std::string, std::string> metadata,
                   bool extra) {
    std::vector<common::TensorToWrite> tensors;
    for (const auto& t : src.tensors())
      tensors.push_back({t.name, t.dtype, t.shape, {t.data, t.nbytes}});
    std::int64_t one = 1;
    if (extra)
      tensors.push_back({"layer_last_rows",
                         common::Dtype::kI64,
                         {1},
                         std::as_bytes(std::span<const std::int64_t>(&one, 1))});
    fs::path p = tmp.path() / name;
    common::write_safetensors(p, tensors, metadata);
    return p;
  };
  const std::string linear = result["oracle"]["linear_attention_implementation"];
  std::map<std::string, std::string> kiln{{"schema", "kiln.qwen35-hf-full-logits.v1"},
                                          {"attention_implementation", "eager"},
                                          {"linear_attention_implementation", linear}};
  auto good = layout(write("good.safetensors", kiln, false));
  CAPTURE(good.detail);
  CHECK(good.ok);
  CHECK_FALSE(layout(write("extra.safetensors", kiln, true)).ok);
  CHECK(layout(write("extra.safetensors", kiln, true)).detail.find("layer_last_rows") !=
        std::string::npos);
  auto other = kiln;
  other["linear_attention_implementation"] = "transformers_torch_fallback";
  REQUIRE(linear != "transformers_torch_fallback");
  CHECK_FALSE(layout(write("other.safetensors", other, false)).ok);
  auto unnamed = kiln;
  unnamed.erase("schema");
  CHECK_FALSE(layout(write("unnamed.safetensors", unnamed, false)).ok);
}

TEST_CASE("verify --kiln --artifact with a NaN or an infinite logit fails by name, never throws") {
  // fuzz_kiln_record found it (tests/fuzz/regressions/kiln_record/): a non-finite logit reached
  // python_float_repr's throw from a check's detail, and `assay verify --kiln` terminated.
  TempDir tmp;
  client::KilnExport e = client::kiln_v2_record(assay_result());
  fs::path record = tmp.path() / "record.json";
  std::ofstream(record) << client::kiln_file_text(e.record);
  fs::path logits = kFixtures + "report/logits.safetensors";
  std::string bytes = common::read_file(logits, 1 << 20);
  std::size_t data_at = 0, argmax = 0;
  {
    common::SafetensorsFile f = common::SafetensorsFile::open(logits);
    const common::TensorView* t = f.find("logits");
    REQUIRE(t != nullptr);
    data_at = static_cast<std::size_t>(t->data - f.image().data());
    argmax = e.record["oracle"]["argmax"].get<std::size_t>();
  }
  auto with = [&](std::size_t token, float value) {
    std::string b = bytes;
    std::memcpy(b.data() + data_at + 4 * token, &value, 4);
    fs::path p = tmp.path() / "logits.safetensors";
    std::ofstream(p, std::ios::binary | std::ios::trunc) << b;
    client::VerifyReport r;
    CHECK_NOTHROW(r = client::verify_kiln(record, p));
    CAPTURE(r.to_json().dump(2));
    CHECK_FALSE(r.ok());
    (void)r.to_json().dump();
    return r;
  };
  auto named = [](const client::VerifyReport& r, const std::string& name) {
    for (const auto& c : r.checks)
      if (c.name == name) return std::optional<client::Check>(c);
    return std::optional<client::Check>();
  };
  client::VerifyReport nan = with(3, std::numeric_limits<float>::quiet_NaN());
  REQUIRE(named(nan, "kiln.artifact.no_nan"));
  CHECK_FALSE(named(nan, "kiln.artifact.no_nan")->ok);
  CHECK(named(nan, "kiln.artifact.no_nan")->detail.find("the first at token 3") !=
        std::string::npos);
  CHECK_FALSE(named(nan, "kiln.artifact.argmax"));  // no order is claimed from such logits
  // An infinity has a place in the order: the argmax moves there, and the detail says "inf".
  client::VerifyReport inf = with(argmax == 7 ? 8 : 7, std::numeric_limits<float>::infinity());
  REQUIRE(named(inf, "kiln.artifact.argmax"));
  CHECK_FALSE(named(inf, "kiln.artifact.argmax")->ok);
  CHECK(named(inf, "kiln.artifact.top_tokens")->detail.find(" at inf") != std::string::npos);
  client::VerifyReport low = with(argmax, -std::numeric_limits<float>::infinity());
  CHECK(named(low, "kiln.artifact.candidates")->detail.find("-inf") != std::string::npos);
}

TEST_CASE("verify --kiln --artifact fails, never throws, when the record's parts are not objects") {
  // fuzz_kiln_record found it (tests/fuzz/regressions/kiln_record/): Json::value on an "oracle"
  // that is a number threw out of verify_kiln.
  TempDir tmp;
  client::KilnExport e = client::kiln_v2_record(assay_result());
  fs::path logits = kFixtures + "report/logits.safetensors";
  for (std::string key : {"oracle", "reference_artifact", "verdict"}) {
    for (const Json& odd : {Json(5), Json("x"), Json::array(), Json()}) {
      Json doc = e.record;
      doc[key] = odd;
      fs::path record = tmp.path() / "record.json";
      std::ofstream(record) << client::kiln_file_text(doc);
      CAPTURE(key);
      CAPTURE(odd.dump());
      client::VerifyReport r;
      CHECK_NOTHROW(r = client::verify_kiln(record, logits));
      CHECK_FALSE(r.ok());
    }
  }
}

TEST_CASE("verify --kiln on a symlink says that links are refused (issue 36)") {
  TempDir tmp;
  client::KilnExport e = client::kiln_v2_record(assay_result());
  fs::path record = tmp.path() / "record.json";
  std::ofstream(record) << client::kiln_file_text(e.record);
  fs::create_symlink(record, tmp.path() / "link.json");
  try {
    client::verify_kiln(tmp.path() / "link.json", std::nullopt);
    FAIL("a symlink was followed");
  } catch (const common::Error& err) {
    CHECK(std::string(err.what()) ==
          (tmp.path() / "link.json").string() + " is a symlink; links are not followed");
  }
}

TEST_CASE("a fidelity result has no Kiln next-token record") {
  Json fidelity =
      common::parse_strict(common::read_file(kFixtures + "report/fidelity-result.json", 1 << 24));
  CHECK_THROWS_WITH_AS(client::kiln_v2_record(fidelity),
                       doctest::Contains("Kiln's v2 record is of a next-token result"),
                       common::Error);
}

namespace {

// The report fixture's result with a numerics envelope: the reference as its oracle has it and
// two reduction orders whose argmax logit sits one bf16 step (2^-7 at 1.66) above and below; the
// class from the rule (common/numerics.h), as the worker's result would carry it.
Json with_envelope() {
  Json r = assay_result();
  const Json& o = r["oracle"];
  const std::int64_t argmax = o["argmax"];
  Json candidates = Json::array();
  for (const Json& c : o["candidate_tokens"])
    candidates.push_back({{"engine", c["engine"]}, {"token_id", c["token_id"]}});
  auto member = [&](const std::string& name, double shift) {
    auto moved = [&](const Json& t) {
      return t["token_id"] == argmax ? t["logit"].get<double>() + shift : t["logit"].get<double>();
    };
    Json top = Json::array(), cands = Json::array();
    for (const Json& t : o["top_tokens"])
      top.push_back({{"token_id", t["token_id"]}, {"logit", moved(t)}});
    for (const Json& c : o["candidate_tokens"])
      cands.push_back({{"token_id", c["token_id"]}, {"logit", moved(c)}, {"rank", c["rank"]}});
    return Json{{"name", name},
                {"argmax", argmax},
                {"argmax_logit", top[0]["logit"]},
                {"top_tie", false},
                {"margin", o["top_logit_margin"].get<double>() + shift},
                {"top", top},
                {"candidates", cands},
                {"logits_sha256", name == "reference" ? o["logits_sha256"].get<std::string>()
                                                      : common::sha256_id(name)}};
  };
  Json members = Json::array({member("reference", 0), member("reduction:0", 0.0078125),
                              member("reduction:1", -0.0078125)});
  common::NumericsPolicy policy;
  r["numerics"] = {{"requested", {{"reduction_seeds", 2}}},
                   {"policy", common::to_json(policy)},
                   {"candidates", candidates},
                   {"members", members},
                   {"fp32", nullptr},
                   {"transformers_reference_bitwise_equal", true},
                   {"verdict", common::numerics_verdict(members, candidates, nullptr, policy)},
                   {"worker",
                    {{"numerics_module_sha256", nullptr},
                     {"executable_sha256", nullptr},
                     {"transformers", nullptr},
                     {"threads", 2},
                     {"load_seconds", 0.1},
                     {"forward_seconds", 0.2},
                     {"process", o["process"]}}}};
  return r;
}

int validate(const std::string& schema, const fs::path& doc) {
  const std::string cmd = "'" ASSAY_VALIDATE_PYTHON "' '" ASSAY_SOURCE_DIR
                          "/tests/tools/validate_schema.py' '" ASSAY_SOURCE_DIR "/schemas/" +
                          schema + ".schema.json' '" + doc.string() + "' >/dev/null 2>&1";
  return std::system(cmd.c_str());
}

const client::Check* named_check(const client::VerifyReport& r, const std::string& name) {
  for (const auto& c : r.checks)
    if (c.name == name) return &c;
  return nullptr;
}

}  // namespace

TEST_CASE("kiln-v2 keeps Kiln's record exactly and puts the numerics envelope beside it, bound") {
  TempDir tmp;
  client::KilnExport plain = client::kiln_v2_record(assay_result());
  CHECK(plain.numerics.is_null());
  Json result = with_envelope();
  client::KilnExport e = client::kiln_v2_record(result);
  // The record is the same as without the envelope: Kiln's schema admits no field of assay's.
  CHECK(e.record == plain.record);
  REQUIRE(e.numerics.is_object());
  CHECK(e.numerics["schema"] == client::kKilnNumericsAddendum);
  CHECK(e.numerics["kiln_record"]["result_sha256"] == e.record["result_sha256"]);
  CHECK(e.numerics["assay_result"]["result_sha256"] == result["result_sha256"]);
  CHECK(e.numerics["numerics"] == result["numerics"]);
  const std::string cls = e.numerics["numerics"]["verdict"]["class"];
  MESSAGE("class " << cls << ": " << e.numerics["numerics"]["verdict"]["explanation"]);

  fs::path record = tmp.path() / "record.json";
  std::ofstream(record) << client::kiln_file_text(e.record);
  fs::path beside = client::kiln_numerics_path(record);
  CHECK(beside == tmp.path() / "record.assay-numerics.json");
  std::ofstream(beside) << e.numerics.dump(2);
  CHECK(validate("kiln-numerics-addendum", beside) == 0);
  CHECK(validate("next-token-oracle-result", [&] {
          fs::path p = tmp.path() / "result.json";
          Json r = result;
          r["request"]["receipts"] = {{"checked", false}, {"reason", "none"}};
          r["request"]["prompt_check"] = {{"checked", false}, {"reason", "ids"}};
          std::ofstream(p) << r.dump();
          return p;
        }()) == 0);

  // Found beside the record: bound, its class recomputed, its reference and candidates Kiln's.
  client::VerifyReport r = client::verify_kiln(record);
  CAPTURE(r.to_json().dump(2));
  for (const char* name : {"kiln.numerics.addendum", "kiln.numerics.verdict",
                           "kiln.numerics.reference", "kiln.numerics.candidates"}) {
    CAPTURE(name);
    REQUIRE(named_check(r, name) != nullptr);
    CHECK(named_check(r, name)->ok);
  }

  // Another class claimed: the recomputation names it.
  Json forged = e.numerics;
  forged["numerics"]["verdict"]["class"] =
      cls == "reference_decides" ? "numerically_tied" : "reference_decides";
  std::ofstream(beside, std::ios::trunc) << forged.dump(2);
  r = client::verify_kiln(record);
  CHECK_FALSE(r.ok());
  CHECK_FALSE(named_check(r, "kiln.numerics.verdict")->ok);

  // The addendum of another record (its result_sha256 differs) is refused by its binding.
  forged = e.numerics;
  forged["kiln_record"]["result_sha256"] = common::sha256_id("another record");
  fs::path elsewhere = tmp.path() / "other.json";
  std::ofstream(elsewhere) << forged.dump(2);
  r = client::verify_kiln(record, std::nullopt, elsewhere);
  CHECK_FALSE(r.ok());
  CHECK_FALSE(named_check(r, "kiln.numerics.addendum")->ok);
  CHECK(named_check(r, "kiln.numerics.verdict") == nullptr);

  // An envelope whose reference is not the record's.
  forged = e.numerics;
  forged["numerics"]["members"][0]["logits_sha256"] = common::sha256_id("other logits");
  std::ofstream(beside, std::ios::trunc) << forged.dump(2);
  r = client::verify_kiln(record);
  CHECK_FALSE(named_check(r, "kiln.numerics.reference")->ok);

  // What sits beside the record is read as a regular file or refused by name, never followed
  // nor waited on: a link to a good addendum, a dangling link, a FIFO.
  fs::path good = tmp.path() / "good.json";
  std::ofstream(good) << e.numerics.dump(2);
  for (const char* what : {"link", "dangling", "fifo"}) {
    CAPTURE(what);
    fs::remove(beside);
    if (std::string(what) == "link") fs::create_symlink(good, beside);
    if (std::string(what) == "dangling") fs::create_symlink(tmp.path() / "gone.json", beside);
    if (std::string(what) == "fifo") REQUIRE(::mkfifo(beside.c_str(), 0600) == 0);
    client::VerifyReport refused;
    CHECK_NOTHROW(refused = client::verify_kiln(record));
    REQUIRE(named_check(refused, "kiln.numerics.addendum") != nullptr);
    CHECK_FALSE(named_check(refused, "kiln.numerics.addendum")->ok);
    CHECK(named_check(refused, "kiln.numerics.verdict") == nullptr);
  }
}
