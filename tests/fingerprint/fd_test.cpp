// model_fds: the fingerprint reads the files the supervisor opened, only through those
// descriptors, and never a path below the model directory.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <vector>

#include "common/error.h"
#include "common/fs.h"
#include "common/json.h"
#include "fingerprint/fingerprint.h"
#include "tests/fingerprint/util.h"

namespace assay::fingerprint::test {
namespace {

constexpr uid_t kNobody = 65534;

// Descriptors opened by the test, standing in for the supervisor's.
struct OpenedFds {
  std::vector<common::UniqueFd> owned;
  std::vector<ModelFd> list;
  void add(const std::string& name, const fs::path& path, int flags = O_RDONLY) {
    int fd = ::open(path.c_str(), flags | O_CLOEXEC);
    REQUIRE_MESSAGE(fd >= 3, path.string());
    owned.emplace_back(fd);
    list.push_back({name, fd});
  }
};

bool validate_input_ok(const fs::path& doc) {
  auto r = run_command(std::string(ASSAY_PYTHON3) + " " + ASSAY_SOURCE_DIR +
                       "/tests/tools/validate_schema.py " + ASSAY_SOURCE_DIR +
                       "/schemas/fingerprint-input.schema.json " + quote(doc.string()) + " 2>&1");
  INFO(r.out);
  return r.status == 0;
}

Options with_fds(const std::vector<ModelFd>& fds) {
  Options o;
  o.model_fds = fds;
  return o;
}

std::string error_code(const fs::path& dir, const Options& o) {
  try {
    fingerprint_model(dir, "m", o);
  } catch (const common::Error& e) {
    return e.code() + ": " + e.what();
  }
  return "accepted";
}

// An indexed model with a tokenizer_config.json carrying a chat template.
void make_indexed_model(const fs::path& dir) {
  make_model(dir, {{"model-00001-of-00002.safetensors", 70000},
                   {"model-00002-of-00002.safetensors", 5000}});
  write_file(dir / "model.safetensors.index.json",
             R"({"weight_map":{"b":"model-00002-of-00002.safetensors",)"
             R"("a":"model-00001-of-00002.safetensors"}})");
  write_file(dir / "tokenizer_config.json", R"({"chat_template":"{{ m }}"})");
}

OpenedFds open_all(const fs::path& dir, const std::vector<std::string>& names) {
  OpenedFds f;
  for (const auto& n : names) f.add(n, dir / n);
  return f;
}

const std::vector<std::string> kIndexedNames = {"config.json",
                                                "tokenizer.json",
                                                "tokenizer_config.json",
                                                "model.safetensors.index.json",
                                                "model-00001-of-00002.safetensors",
                                                "model-00002-of-00002.safetensors"};

TEST_CASE(
    "with model_fds the identity is read through the descriptors and equals the directory's") {
  TempDir d;
  make_indexed_model(d.path());
  OpenedFds fds = open_all(d.path(), kIndexedNames);
  Fingerprint by_path = fingerprint_model(d.path(), "m");
  Fingerprint by_fds = fingerprint_model(d.path(), "m", with_fds(fds.list));
  CHECK(by_fds.identity == by_path.identity);
  CHECK(by_fds.identity.chat_template_hash.has_value());
  CHECK(by_fds.shard_order == by_path.shard_order);
  // pread leaves the shared file offsets where the supervisor had them.
  for (const auto& f : fds.list) CHECK(::lseek(f.fd, 0, SEEK_CUR) == 0);
  // A second run through the same descriptors gives the same identity.
  CHECK(fingerprint_model(d.path(), "m", with_fds(fds.list)).identity == by_path.identity);
}

TEST_CASE(
    "without an index the listed top-level *.safetensors are the shards, as in the directory") {
  TempDir d;
  make_model(d.path(), {{"b.safetensors", 1000}, {"a.safetensors", 2000}});
  OpenedFds fds =
      open_all(d.path(), {"config.json", "tokenizer.json", "b.safetensors", "a.safetensors"});
  Fingerprint by_fds = fingerprint_model(d.path(), "m", with_fds(fds.list));
  CHECK(by_fds.identity == fingerprint_model(d.path(), "m").identity);
  CHECK(by_fds.shard_order == std::vector<std::string>{"a.safetensors", "b.safetensors"});
}

TEST_CASE("with model_fds no path below model_dir is opened: the directory may be gone") {
  TempDir d;
  make_indexed_model(d / "model");
  OpenedFds fds = open_all(d / "model", kIndexedNames);
  Fingerprint by_path = fingerprint_model(d / "model", "m");
  fs::rename(d / "model", d / "elsewhere");
  Fingerprint by_fds = fingerprint_model(d / "model", "m", with_fds(fds.list));
  CHECK(by_fds.identity == by_path.identity);
  CHECK(error_code(d / "model", {}).starts_with("fingerprint.missing"));
}

TEST_CASE(
    "with model_fds a needed file not passed is an error naming it; optional ones are absent") {
  TempDir d;
  make_indexed_model(d.path());
  std::vector<std::string> names = kIndexedNames;
  std::erase(names, "tokenizer.json");
  std::string err = error_code(d.path(), with_fds(open_all(d.path(), names).list));
  CHECK(err.starts_with("fingerprint.missing_fd"));
  CHECK(err.find(d.path().string() + "/tokenizer.json") != std::string::npos);

  names = kIndexedNames;
  std::erase(names, "model-00002-of-00002.safetensors");
  err = error_code(d.path(), with_fds(open_all(d.path(), names).list));
  CHECK(err.starts_with("fingerprint.missing_fd"));
  CHECK(err.find("model-00002-of-00002.safetensors") != std::string::npos);

  // Not passing tokenizer_config.json means it is absent: no template, a different identity.
  names = kIndexedNames;
  std::erase(names, "tokenizer_config.json");
  Fingerprint f = fingerprint_model(d.path(), "m", with_fds(open_all(d.path(), names).list));
  CHECK_FALSE(f.identity.chat_template_hash.has_value());
}

TEST_CASE("a descriptor that is not a readable regular file is refused, naming the file") {
  TempDir d;
  make_model(d.path(), {{"model.safetensors", 100}});
  OpenedFds fds = open_all(d.path(), {"tokenizer.json", "model.safetensors"});
  SUBCASE("a directory") {
    fds.add("config.json", d.path(), O_RDONLY | O_DIRECTORY);
    std::string err = error_code(d.path(), with_fds(fds.list));
    CHECK(err.starts_with("fingerprint.not_regular"));
    CHECK(err.find("config.json") != std::string::npos);
  }
  SUBCASE("an O_PATH descriptor") {
    fds.add("config.json", d / "config.json", O_PATH);
    std::string err = error_code(d.path(), with_fds(fds.list));
    CHECK(err.starts_with("fingerprint.bad_fd"));
    CHECK(err.find("config.json (fd ") != std::string::npos);
  }
  SUBCASE("a closed descriptor") {
    fds.list.push_back({"config.json", 1000});
    std::string err = error_code(d.path(), with_fds(fds.list));
    CHECK(err.starts_with("fingerprint.bad_fd"));
    CHECK(err.find("(fd 1000)") != std::string::npos);
  }
}

TEST_CASE("parse_model_fds refuses stdio fds, repeated names or fds, and paths leaving the dir") {
  auto code = [](const std::string& text) {
    try {
      parse_model_fds(common::parse_strict(text), "input.json", "x.bad");
    } catch (const common::Error& e) {
      return e.code() + ": " + e.what();
    }
    return std::string("accepted");
  };
  CHECK(parse_model_fds(common::parse_strict(R"([{"name":"a/b.safetensors","fd":3}])"), "w", "x") ==
        std::vector<ModelFd>{{"a/b.safetensors", 3}});
  CHECK(code(R"([{"name":"config.json","fd":2}])").find("fd 2 is outside") != std::string::npos);
  CHECK(code(R"([{"name":"a","fd":3},{"name":"a","fd":4}])").find("'a' appears twice") !=
        std::string::npos);
  CHECK(code(R"([{"name":"a","fd":3},{"name":"b","fd":3}])").find("fd 3 is given for two") !=
        std::string::npos);
  for (const char* bad : {"../x", "/etc/passwd", "a/../b", "a//b", "a/", ".", ""})
    CHECK_MESSAGE(code(std::string(R"([{"name":")") + bad + R"(","fd":3}])").starts_with("x.bad"),
                  bad);
  CHECK(code(R"({"name":"a","fd":3})").find("not an array") != std::string::npos);
  CHECK(code(R"([{"name":"a","fd":3,"mode":1}])").starts_with("json.unknown_field"));
}

// The worker run as an unprivileged uid on a root-only directory, with and without the fds.
TEST_CASE("the worker reads a root-only model through passed fds as nobody, and fails by path") {
  if (::geteuid() != 0) {
    MESSAGE("skipped: needs root to make a root-only directory and to drop to uid 65534");
    return;
  }
  TempDir d;
  fs::permissions(d.path(), fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                                fs::perms::others_read | fs::perms::others_exec);
  fs::path model = d / "model", work = d / "work";
  make_indexed_model(model);
  fs::permissions(model, fs::perms::owner_all);  // 0700, owned by root
  fs::create_directories(work);
  REQUIRE(::chown(work.c_str(), kNobody, kNobody) == 0);

  common::Json fds = common::Json::array();
  std::string opens;
  for (std::size_t i = 0; i < kIndexedNames.size(); ++i) {
    fds.push_back({{"name", kIndexedNames[i]}, {"fd", 3 + i}});
    opens += " --open " + quote((model / kIndexedNames[i]).string());
  }
  common::Json input = {{"schema", "assay.fingerprint-input.v1"},
                        {"model_dir", model.string()},
                        {"id", "m"},
                        {"model_fds", fds}};
  write_file(work / "input.json", input.dump());
  auto as_nobody = [&](const std::string& open_args) {
    return run_command(std::string(ASSAY_RUN_WITH_FDS_BIN) + " --uid 65534 --gid 65534" +
                       open_args + " -- " + ASSAY_FINGERPRINT_BIN + " run --input " +
                       quote((work / "input.json").string()) + " --workdir " +
                       quote(work.string()) + " 2>&1");
  };
  auto r = as_nobody(opens);
  INFO(r.out);
  REQUIRE(r.status == 0);
  common::Json out = common::parse_strict(common::read_file(work / "output.json", 1 << 20));
  CHECK(out["model_identity"] == to_json(fingerprint_model(model, "m").identity));
  CHECK(validate_input_ok(work / "input.json"));

  // The same input without model_fds: the worker has to open the paths, which nobody cannot.
  fs::remove(work / "output.json");
  input.erase("model_fds");
  write_file(work / "input.json", input.dump());
  r = as_nobody("");
  INFO(r.out);
  CHECK(r.status == 1);
  CHECK(r.out.find("fingerprint.open: open directory " + model.string() + ": Permission denied") !=
        std::string::npos);
  CHECK_FALSE(fs::exists(work / "output.json"));
}

}  // namespace
}  // namespace assay::fingerprint::test
