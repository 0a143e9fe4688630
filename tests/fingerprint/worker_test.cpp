// The assay-fingerprint binary: worker protocol, command line, and its documents' schemas.
#include <doctest/doctest.h>

#include <unistd.h>

#include "common/fs.h"
#include "common/identity.h"
#include "common/json.h"
#include "common/request.h"
#include "fingerprint/fingerprint.h"
#include "tests/fingerprint/util.h"

namespace assay::fingerprint::test {
namespace {

const std::string kBin = ASSAY_FINGERPRINT_BIN;

CommandResult validate(const std::string& schema, const fs::path& doc) {
  return run_command(std::string(ASSAY_PYTHON3) + " " + ASSAY_SOURCE_DIR +
                     "/tests/tools/validate_schema.py " + ASSAY_SOURCE_DIR + "/schemas/" + schema +
                     " " + quote(doc.string()) + " 2>&1");
}

CommandResult run_worker(const fs::path& work, const std::string& input_json) {
  write_file(work / "input.json", input_json);
  return run_command("cd " + quote(work.string()) + " && " + kBin +
                     " run --input input.json --workdir . 2>&1");
}

common::Json read_json(const fs::path& p) {
  return common::parse_strict(common::read_file(p, 1 << 20));
}

TEST_CASE("worker run writes output.json that matches its schema and the library's identity") {
  TempDir model, work;
  make_model(model.path(), {{"model-00001-of-00002.safetensors", 5000},
                            {"model-00002-of-00002.safetensors", 7000}});
  write_file(model / "chat_template.jinja", "{{ messages }}");
  common::Json input = {{"schema", "assay.fingerprint-input.v1"},
                        {"model_dir", model.path().string()},
                        {"id", "org/m"},
                        {"threads", 2},
                        {"max_read_mib_per_second", 1000}};
  auto r = run_worker(work.path(), input.dump());
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(validate("fingerprint-input.schema.json", work / "input.json").status == 0);
  auto v = validate("fingerprint-output.schema.json", work / "output.json");
  INFO(v.out);
  CHECK(v.status == 0);
  common::Json out = read_json(work / "output.json");
  CHECK(out["schema"] == "assay.fingerprint-output.v1");
  CHECK(out["model_dir"] == model.path().string());
  CHECK(out["model_identity"] == to_json(fingerprint_model(model.path(), "org/m").identity));
  CHECK(out["implementation_sha256"] == common::sha256_file_id(kBin));
  CHECK(out["stats"]["threads"] == 2);
  CHECK(out["stats"]["files"] == 5);
  CHECK(out["stats"]["max_read_mib_per_second"] == 1000);
  CHECK(out["stats"]["bytes"].get<std::uint64_t>() ==
        12000 + fs::file_size(model / "config.json") + fs::file_size(model / "tokenizer.json") +
            fs::file_size(model / "chat_template.jinja"));
}

TEST_CASE(
    "worker run with defer_shards writes pending_identity for settled shards, valid against the "
    "schema; completed with the shards' digests it is the library's identity") {
  TempDir model, work;
  make_model(model.path(), {{"model-00001-of-00002.safetensors", 5000},
                            {"model-00002-of-00002.safetensors", 7000}});
  ::usleep(2'100'000);  // settled: both times over 2 s older than the fingerprint's writeback
  common::Json input = {{"schema", "assay.fingerprint-input.v1"},
                        {"model_dir", model.path().string()},
                        {"id", "org/m"},
                        {"defer_shards", true}};
  auto r = run_worker(work.path(), input.dump());
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(validate("fingerprint-input.schema.json", work / "input.json").status == 0);
  auto v = validate("fingerprint-output.schema.json", work / "output.json");
  INFO(v.out);
  CHECK(v.status == 0);
  common::Json out = read_json(work / "output.json");
  REQUIRE(out.contains("pending_identity"));
  CHECK_FALSE(out.contains("model_identity"));
  CHECK(out["stats"]["deferred_files"] == 2);
  CHECK(out["stats"]["deferred_bytes"] == 12000);
  CHECK(out["stats"]["bytes"].get<std::uint64_t>() ==
        fs::file_size(model / "config.json") + fs::file_size(model / "tokenizer.json"));
  common::Json pending = out["pending_identity"];
  CHECK_FALSE(pending.contains("content_sha256"));
  for (common::Json& w : pending["weight_files"]) {
    CHECK(w["sha256"].is_null());
    w["sha256"] =
        common::sha256_id(common::read_file(model / w["path"].get<std::string>(), 1 << 20));
  }
  for (const common::Json& f : out["files"])
    CHECK(f["source"] ==
          (f["name"].get<std::string>().ends_with(".safetensors") ? "deferred" : "computed"));
  pending["content_sha256"] = common::model_content_sha256(pending);
  CHECK(pending == to_json(fingerprint_model(model.path(), "org/m").identity));
  // Without it, the same directory is hashed whole.
  input.erase("defer_shards");
  REQUIRE(run_worker(work.path(), input.dump()).status == 0);
  CHECK(read_json(work / "output.json")["model_identity"] == pending);
  // Strictly a boolean.
  input["defer_shards"] = "yes";
  auto bad = run_worker(work.path(), input.dump());
  CHECK(bad.status == 1);
  CHECK(bad.out.find("defer_shards \"yes\" is not a boolean") != std::string::npos);
}

TEST_CASE("worker run refuses bad input.json, naming the value, and writes no output.json") {
  TempDir model, work;
  make_model(model.path(), {{"model.safetensors", 64}});
  std::string dir = model.path().string();
  struct Case {
    std::string input;
    std::string named;
  };
  for (const Case& c : std::vector<Case>{
           {R"({"schema":"assay.fingerprint-input.v2","model_dir":")" + dir + R"(","id":"m"})",
            "assay.fingerprint-input.v2"},
           {R"({"schema":"assay.fingerprint-input.v1","model_dir":"relative/dir","id":"m"})",
            "relative/dir"},
           {R"({"schema":"assay.fingerprint-input.v1","model_dir":")" + dir +
                R"(","id":"m","colour":1})",
            "colour"},
           {R"({"schema":"assay.fingerprint-input.v1","model_dir":")" + dir +
                R"(","id":"m","threads":0})",
            "threads"},
           {R"({"schema":"assay.fingerprint-input.v1","model_dir":")" + dir +
                R"(","id":"m","max_read_mib_per_second":-5})",
            "-5"},
           {R"({"schema":"assay.fingerprint-input.v1","model_dir":")" + dir + R"(/nope","id":"m"})",
            "nope"}}) {
    auto r = run_worker(work.path(), c.input);
    INFO(c.input, " -> ", r.out);
    CHECK(r.status == 1);
    CHECK(r.out.find(c.named) != std::string::npos);
    CHECK(!fs::exists(work / "output.json"));
  }
}

TEST_CASE("worker run on a refused model exits 1 with the reason and writes no output.json") {
  TempDir model, work;
  make_model(model.path(), {{"a.safetensors", 64}});
  fs::create_hard_link(model / "a.safetensors", model / "b.safetensors");
  auto r = run_worker(work.path(), R"({"schema":"assay.fingerprint-input.v1","model_dir":")" +
                                       model.path().string() + R"(","id":"m"})");
  CHECK(r.status == 1);
  CHECK(r.out.find("fingerprint.duplicate_inode") != std::string::npos);
  CHECK(!fs::exists(work / "output.json"));
}

TEST_CASE("the command prints the same document, --out writes it, both match the schema") {
  TempDir model, work;
  make_model(model.path(), {{"model.safetensors", 3000}});
  auto printed = run_command(kBin + " --model " + quote(model.path().string()) + " --id m");
  REQUIRE(printed.status == 0);
  common::Json doc = common::parse_strict(printed.out);
  CHECK(doc["model_identity"] == to_json(fingerprint_model(model.path(), "m").identity));
  CHECK(doc["stats"]["max_read_mib_per_second"].is_null());
  auto written = run_command(kBin + " --model " + quote(model.path().string()) +
                             " --id m --threads 1 --out " + quote((work / "fp.json").string()));
  REQUIRE(written.status == 0);
  CHECK(written.out.empty());
  CHECK(read_json(work / "fp.json")["model_identity"] == doc["model_identity"]);
  CHECK(validate("fingerprint-output.schema.json", work / "fp.json").status == 0);
}

TEST_CASE("the command needs --model and --id and answers --help") {
  CHECK(run_command(kBin + " --id m 2>&1").status != 0);
  auto help = run_command(kBin + " --help");
  CHECK(help.status == 0);
  CHECK(help.out.find("--max-read-mib-per-second") != std::string::npos);
  CHECK(run_command(kBin + " run --help").status == 0);
}

TEST_CASE("the output schema rejects an extra key inside model_identity and a bad hash") {
  TempDir model, work;
  make_model(model.path(), {{"model.safetensors", 100}});
  auto printed = run_command(kBin + " --model " + quote(model.path().string()) + " --id m");
  REQUIRE(printed.status == 0);
  common::Json doc = common::parse_strict(printed.out);
  common::Json extra = doc;
  extra["model_identity"]["schema"] = "assay.model-identity.v1";
  write_file(work / "extra.json", extra.dump());
  auto r = validate("fingerprint-output.schema.json", work / "extra.json");
  CHECK(r.status == 1);
  CHECK(r.out.find("/model_identity") != std::string::npos);
  common::Json bad_hash = doc;
  bad_hash["model_identity"]["config_hash"] = "sha256:ABC";
  write_file(work / "bad.json", bad_hash.dump());
  CHECK(validate("fingerprint-output.schema.json", work / "bad.json").status == 1);
  write_file(work / "identity.json", doc["model_identity"].dump());
  CHECK(validate("model-identity.schema.json", work / "identity.json").status == 0);
}

}  // namespace
}  // namespace assay::fingerprint::test
