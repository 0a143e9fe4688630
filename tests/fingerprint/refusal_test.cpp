// What the fingerprint refuses, with an error code and a message naming the file.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "common/error.h"
#include "fingerprint/fingerprint.h"
#include "tests/fingerprint/util.h"

namespace assay::fingerprint::test {
namespace {

// The refusal's code and message, or "accepted".
std::pair<std::string, std::string> refusal(const fs::path& dir, const Options& options = {},
                                            const std::string& id = "m") {
  try {
    fingerprint_model(dir, id, options);
  } catch (const common::Error& e) {
    return {e.code(), e.what()};
  }
  return {"accepted", ""};
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

TEST_CASE("a symlinked shard is refused, naming it") {
  TempDir d, elsewhere;
  make_model(d.path(), {});
  write_file(elsewhere / "real.safetensors", "weights");
  fs::create_symlink(elsewhere / "real.safetensors", d / "model.safetensors");
  auto [code, msg] = refusal(d.path());
  CHECK(code == "fingerprint.symlink");
  CHECK(contains(msg, (d / "model.safetensors").string()));
}

TEST_CASE("a symlinked config.json is refused") {
  TempDir d;
  make_model(d.path(), {{"model.safetensors", 8}});
  fs::rename(d / "config.json", d / "real-config.json");
  fs::create_symlink("real-config.json", d / "config.json");
  auto [code, msg] = refusal(d.path());
  CHECK(code == "fingerprint.symlink");
  CHECK(contains(msg, "config.json"));
}

TEST_CASE("a symlink in a directory component of the model path is refused, naming it") {
  TempDir d;
  make_model(d / "real", {{"model.safetensors", 8}});
  fs::create_symlink(d / "real", d / "link");
  auto [code, msg] = refusal(d / "link");
  CHECK(code == "fingerprint.symlink");
  CHECK(contains(msg, (d / "link").string()));
  CHECK(refusal(d / "real").first == "accepted");
}

TEST_CASE("a symlinked subdirectory in an index-named shard path is refused") {
  TempDir d, elsewhere;
  make_model(d.path(), {});
  write_file(elsewhere / "a.safetensors", "weights");
  fs::create_directory_symlink(elsewhere.path(), d / "sub");
  write_file(d / "model.safetensors.index.json", R"({"weight_map":{"w":"sub/a.safetensors"}})");
  auto [code, msg] = refusal(d.path());
  CHECK(code == "fingerprint.symlink");
  CHECK(contains(msg, (d / "sub").string()));
}

TEST_CASE("a shard in a real subdirectory named by the index is accepted") {
  TempDir d;
  make_model(d.path(), {{"sub/a.safetensors", 100}});
  write_file(d / "model.safetensors.index.json", R"({"weight_map":{"w":"sub/a.safetensors"}})");
  Fingerprint f = fingerprint_model(d.path(), "m");
  CHECK(f.identity.weight_files.at(0).path == "sub/a.safetensors");
}

TEST_CASE("a FIFO or directory where a shard should be is refused as not regular") {
  TempDir d;
  make_model(d.path(), {});
  REQUIRE(::mkfifo((d / "model.safetensors").c_str(), 0600) == 0);
  auto [code, msg] = refusal(d.path());
  CHECK(code == "fingerprint.not_regular");
  CHECK(contains(msg, "model.safetensors"));

  TempDir d2;
  make_model(d2.path(), {{"a.safetensors", 8}});
  fs::create_directory(d2 / "b.safetensors");
  auto [code2, msg2] = refusal(d2.path());
  CHECK(code2 == "fingerprint.not_regular");
  CHECK(contains(msg2, "b.safetensors"));
}

TEST_CASE("an empty shard is refused") {
  TempDir d;
  make_model(d.path(), {{"a.safetensors", 8}});
  write_file(d / "b.safetensors", "");
  auto [code, msg] = refusal(d.path());
  CHECK(code == "fingerprint.empty_shard");
  CHECK(contains(msg, "b.safetensors"));
}

TEST_CASE("two names for one file (hard link) are refused, naming both") {
  TempDir d;
  make_model(d.path(), {{"a.safetensors", 64}});
  fs::create_hard_link(d / "a.safetensors", d / "b.safetensors");
  auto [code, msg] = refusal(d.path());
  CHECK(code == "fingerprint.duplicate_inode");
  CHECK(contains(msg, "a.safetensors"));
  CHECK(contains(msg, "b.safetensors"));
}

TEST_CASE("a shard named by the index but missing is refused, naming it") {
  TempDir d;
  make_model(d.path(), {{"model-00001-of-00002.safetensors", 64}});
  write_file(d / "model.safetensors.index.json", R"({"weight_map":{
      "a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors"}})");
  auto [code, msg] = refusal(d.path());
  CHECK(code == "fingerprint.missing");
  CHECK(contains(msg, "model-00002-of-00002.safetensors"));
}

TEST_CASE("config.json and tokenizer.json are required") {
  TempDir d;
  make_model(d.path(), {{"model.safetensors", 8}});
  fs::remove(d / "tokenizer.json");
  auto [code, msg] = refusal(d.path());
  CHECK(code == "fingerprint.missing");
  CHECK(contains(msg, "tokenizer.json"));
  fs::remove(d / "config.json");
  CHECK(contains(refusal(d.path()).second, "config.json"));
}

TEST_CASE("a directory without any safetensors file is refused") {
  TempDir d;
  make_model(d.path(), {{"weights.bin", 8}});
  CHECK(refusal(d.path()).first == "fingerprint.no_shards");
}

TEST_CASE("an ambiguous or malformed index is refused") {
  TempDir d;
  make_model(d.path(), {{"a.safetensors", 8}});
  auto index_refusal = [&](const std::string& text) {
    write_file(d / "model.safetensors.index.json", text);
    return refusal(d.path());
  };
  CHECK(index_refusal(R"({"weight_map":{"w":"a.safetensors","w":"b.safetensors"}})").first ==
        "fingerprint.bad_json");
  CHECK(index_refusal(R"({"weight_map":{"w":"a.safetensors"})").first == "fingerprint.bad_json");
  CHECK(index_refusal(R"({"metadata":{}})").first == "fingerprint.bad_index");
  CHECK(index_refusal(R"({"weight_map":{}})").first == "fingerprint.bad_index");
  CHECK(index_refusal(R"({"weight_map":{"w":7}})").first == "fingerprint.bad_index");
  CHECK(index_refusal(R"({"weight_map":{"w":"../a.safetensors"}})").first ==
        "fingerprint.bad_name");
  CHECK(index_refusal(R"({"weight_map":{"w":"/etc/passwd"}})").first == "fingerprint.bad_name");
  CHECK(index_refusal(R"({"weight_map":{"w":"a.safetensors"}})").first == "accepted");
}

TEST_CASE("a chat_template that is not a string is refused as ambiguous") {
  TempDir d;
  make_model(d.path(), {{"a.safetensors", 8}});
  write_file(d / "tokenizer_config.json",
             R"({"chat_template":[{"name":"default","template":"x"}]})");
  auto [code, msg] = refusal(d.path());
  CHECK(code == "fingerprint.bad_tokenizer_config");
  CHECK(contains(msg, "tokenizer_config.json"));
}

TEST_CASE("an id or shard path outside printable ASCII is refused") {
  TempDir d;
  make_model(d.path(), {{"a.safetensors", 8}});
  CHECK(refusal(d.path(), {}, "mod\xc3\xa8le").first == "fingerprint.bad_name");
  CHECK(refusal(d.path(), {}, "").first == "fingerprint.bad_name");
  make_model(d.path(), {{"\xc3\xa9.safetensors", 8}});
  CHECK(refusal(d.path()).first == "fingerprint.bad_name");
}

TEST_CASE("a shard that grows while it is read is refused") {
  TempDir d;
  make_model(d.path(), {{"a.safetensors", 100000}, {"b.safetensors", 100}});
  Options o = with_hook(
      [&](const std::string& rel) {
        if (rel == "b.safetensors") {
          std::ofstream f(d / rel, std::ios::app);
          f << "x";
        }
      },
      1);
  auto [code, msg] = refusal(d.path(), o);
  CHECK(code == "fingerprint.changed");
  CHECK(contains(msg, "b.safetensors"));
}

TEST_CASE("a shard whose mtime changes (same size) while it is read is refused") {
  TempDir d;
  make_model(d.path(), {{"a.safetensors", 4096}});
  Options o = with_hook([&](const std::string& rel) {
    if (rel != "a.safetensors") return;
    struct timespec times[2] = {{0, UTIME_OMIT}, {1234567, 0}};
    REQUIRE(::utimensat(AT_FDCWD, (d / rel).c_str(), times, 0) == 0);
  });
  auto [code, msg] = refusal(d.path(), o);
  CHECK(code == "fingerprint.changed");
  CHECK(contains(msg, "a.safetensors"));
}

TEST_CASE("a shard replaced by rename while it is read is refused") {
  TempDir d;
  make_model(d.path(), {{"a.safetensors", 4096}});
  Options o = with_hook([&](const std::string& rel) {
    if (rel != "a.safetensors") return;
    write_file(d / "new.tmp", random_bytes(4096, 99));
    fs::rename(d / "new.tmp", d / rel);
  });
  auto [code, msg] = refusal(d.path(), o);
  CHECK(code == "fingerprint.changed");
  CHECK(contains(msg, "a.safetensors"));
}

TEST_CASE("a changed config.json is refused too") {
  TempDir d;
  make_model(d.path(), {{"a.safetensors", 64}});
  Options o = with_hook([&](const std::string& rel) {
    if (rel == "config.json") REQUIRE(::truncate((d / rel).c_str(), 3) == 0);
  });
  auto [code, msg] = refusal(d.path(), o);
  CHECK(code == "fingerprint.changed");
  CHECK(contains(msg, "config.json"));
}

}  // namespace
}  // namespace assay::fingerprint::test
