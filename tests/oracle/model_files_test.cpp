// ModelFiles: each file read once into this process's own memory, hashed on the way (or a weight
// file with fs-verity mapped), by name below the directory or only through the supervisor's
// descriptors.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/fsverity.h"
#include "common/identity.h"
#include "tests/support/process.h"
#include "worker/model_files.h"

namespace fs = std::filesystem;
using assay::common::Error;
using assay::common::Json;
using assay::oracle::ModelFiles;
using assay::test_support::TempDir;

namespace {

void write(const fs::path& p, const std::string& content) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << content;
}

std::string text_of(const std::shared_ptr<const assay::oracle::FileImage>& image) {
  return std::string(image->text());
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.code() + ": " + e.what();
  }
  return "accepted";
}

}  // namespace

TEST_CASE("a file is read whole once, its digest is of exactly those bytes, later reads reuse it") {
  TempDir d;
  std::string content(700000, 'x');  // several read chunks
  for (std::size_t i = 0; i < content.size(); i += 4093) content[i] = static_cast<char>(i % 251);
  write(d / "config.json", content);
  ModelFiles files = ModelFiles::from_directory(d.path());
  auto image = files.read("config.json", 1 << 20);
  CHECK(text_of(image) == content);
  CHECK(image->sha256() == assay::common::sha256_id(content));
  CHECK(files.records().at("config.json").bytes == content.size());
  CHECK(files.records().at("config.json").sha256() == assay::common::sha256_id(content));
  write(d / "config.json", "{}");  // a later read gets the bytes already used, not the new file
  CHECK(files.read("config.json", 1 << 20) == image);
  CHECK(error_of([&] { files.read("tokenizer.json", 1 << 20); }).starts_with("fs.open"));
  CHECK(error_of([&] {
          ModelFiles::from_directory(d.path()).read("config.json", 1);
        }).starts_with("fs.too_large"));
}

TEST_CASE("a FIFO or a symlink under a model file's name is refused, not waited on or followed") {
  TempDir d;
  REQUIRE(::mkfifo((d / "config.json").c_str(), 0600) == 0);
  write(d / "real.json", "{}");
  fs::create_symlink(d / "real.json", d / "tokenizer.json");
  ModelFiles files = ModelFiles::from_directory(d.path());
  CHECK(error_of([&] { files.read("config.json", 100); }).starts_with("fs.not_regular"));
  CHECK(error_of([&] { files.read("tokenizer.json", 100); }).starts_with("fs.open"));
}

TEST_CASE("the image is the process's own memory: writing the file in place does not change it") {
  // A MAP_PRIVATE file mapping would show these writes in pages not yet copied.
  TempDir d;
  std::string before(3 << 20, 'a');
  write(d / "model.safetensors", before);
  ModelFiles files = ModelFiles::from_directory(d.path());
  auto images = files.read_large({"model.safetensors"}, 1);
  int fd = ::open((d / "model.safetensors").c_str(), O_WRONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  std::string after(before.size(), 'b');
  REQUIRE(::pwrite(fd, after.data(), after.size(), 0) == static_cast<ssize_t>(after.size()));
  ::close(fd);
  CHECK(text_of(images[0]) == before);
  CHECK(images[0]->sha256() == assay::common::sha256_id(before));
}

TEST_CASE("large files are read in parallel, recorded, and never read twice") {
  TempDir d;
  for (int i = 0; i < 5; ++i) write(d / ("s" + std::to_string(i)), std::string(1000 + i, 'a' + i));
  ModelFiles files = ModelFiles::from_directory(d.path());
  auto images = files.read_large({"s3", "s0", "s4", "s1", "s2"}, 3);
  REQUIRE(images.size() == 5);
  CHECK(text_of(images[0]) == std::string(1003, 'd'));
  CHECK(files.records().size() == 5);
  CHECK(files.records().at("s4").sha256() == assay::common::sha256_id(std::string(1004, 'e')));
  CHECK(error_of([&] { files.read_large({"s1"}, 1); }).find("second time") != std::string::npos);
  CHECK(error_of([&] { files.read_large({"s5", "s6"}, 2); }).starts_with("fs.open"));
}

TEST_CASE("a file large enough to be faulted in ahead of its reader is read and hashed whole") {
  // Above the Prefaulter's 128 MiB, and not a whole number of its 32 MiB steps or of the reader's
  // chunks; beside a small file read on the other thread.
  TempDir d;
  std::string big((150u << 20) + 12345, '\0');
  for (std::size_t i = 0; i < big.size(); i += 509) big[i] = static_cast<char>(1 + i % 253);
  big.back() = 'z';
  write(d / "model-00001.safetensors", big);
  write(d / "model-00002.safetensors", std::string(5000, 'q'));
  ModelFiles files = ModelFiles::from_directory(d.path());
  auto images = files.read_large({"model-00001.safetensors", "model-00002.safetensors"}, 2);
  REQUIRE(images.size() == 2);
  CHECK(images[0]->bytes().size() == big.size());
  CHECK(text_of(images[0]) == big);
  CHECK(images[0]->sha256() == assay::common::sha256_id(big));
  CHECK(text_of(images[1]) == std::string(5000, 'q'));
}

TEST_CASE("bytes_used lists the weight files sorted by path, with config and tokenizer hashes") {
  TempDir d;
  write(d / "config.json", "{\"a\":1}");
  write(d / "b.safetensors", "bbbb");
  write(d / "a.safetensors", "aa");
  write(d / "tokenizer.json", "{}");
  ModelFiles files = ModelFiles::from_directory(d.path());
  files.read("config.json", 100);
  files.read_large({"b.safetensors", "a.safetensors"}, 2);
  Json used = assay::oracle::bytes_used(files, {"b.safetensors", "a.safetensors"});
  CHECK(used["weight_files"] == Json::parse(R"([
    {"path":"a.safetensors","bytes":2,"sha256":")" +
                                            assay::common::sha256_id("aa") + R"("},
    {"path":"b.safetensors","bytes":4,"sha256":")" +
                                            assay::common::sha256_id("bbbb") + R"("}])"));
  CHECK(used["config_hash"] == assay::common::sha256_id("{\"a\":1}"));
  CHECK(used["tokenizer_hash"].is_null());  // never read
  files.read("tokenizer.json", 100);
  CHECK(assay::oracle::bytes_used(files, {"a.safetensors"})["tokenizer_hash"] ==
        assay::common::sha256_id("{}"));
}

TEST_CASE("through model_fds: only the given descriptors, pread, each checked") {
  TempDir d;
  write(d / "config.json", "{\"model_type\":\"llama\"}");
  int config = ::open((d / "config.json").c_str(), O_RDONLY | O_CLOEXEC);
  int dir = ::open(d.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  int path_only = ::open((d / "config.json").c_str(), O_PATH | O_CLOEXEC);
  REQUIRE((config >= 3 && dir >= 3 && path_only >= 3));
  fs::path shown = "/models/m";  // never opened: only named in messages
  ModelFiles files = ModelFiles::from_fds(
      shown,
      {{"config.json", config}, {"tokenizer.json", dir}, {"tokenizer_config.json", path_only}});
  CHECK(files.has("config.json"));
  CHECK_FALSE(files.has("model.safetensors"));
  CHECK(text_of(files.read("config.json", 100)) == "{\"model_type\":\"llama\"}");
  CHECK(::lseek(config, 0, SEEK_CUR) == 0);  // the shared offset is untouched
  std::string missing = error_of([&] { files.read_large({"model.safetensors"}, 1); });
  CHECK(missing.starts_with("model.missing_fd"));
  CHECK(missing.find("/models/m/model.safetensors") != std::string::npos);
  CHECK(error_of([&] { files.read("tokenizer.json", 100); }).starts_with("fs.not_regular"));
  CHECK(error_of([&] { files.read("tokenizer_config.json", 100); }).starts_with("model.bad_fd"));
  ::close(config);
  ::close(dir);
  ::close(path_only);
}

TEST_CASE("a weight file without fs-verity is copied and hashed, as the kernel here says") {
  TempDir d;
  write(d / "model.safetensors", std::string(5000, 'w'));
  write(d / "config.json", "{}");
  int fd = ::open((d / "model.safetensors").c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 3);
  // ENODATA (no fs-verity on this file), ENOTTY or EOPNOTSUPP (none on this filesystem/kernel).
  CHECK_FALSE(assay::common::measure_fsverity(fd, "model.safetensors").has_value());
  ModelFiles files = ModelFiles::from_fds("/models/m", {{"model.safetensors", fd}});
  auto images = files.read_large({"model.safetensors"}, 1);
  CHECK_FALSE(images[0]->fsverity_digest().has_value());
  CHECK(images[0]->sha256() == assay::common::sha256_id(std::string(5000, 'w')));
  CHECK_FALSE(files.records().at("model.safetensors").fsverity_digest.has_value());
  ::close(fd);
}

TEST_CASE(
    "a weight file with fs-verity is mapped, not copied or hashed; bytes_used names its "
    "fs-verity digest") {
  // This host's kernel has no fs-verity: a stand-in answers for the kernel, for one file only.
  // tests/vm/verity.sh runs the real thing.
  TempDir d;
  std::string before(3 << 20, 'a');
  write(d / "a.safetensors", before);
  write(d / "b.safetensors", "bbbb");
  write(d / "config.json", "{}");
  int a = ::open((d / "a.safetensors").c_str(), O_RDONLY | O_CLOEXEC);
  int b = ::open((d / "b.safetensors").c_str(), O_RDONLY | O_CLOEXEC);
  int config = ::open((d / "config.json").c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE((a >= 3 && b >= 3 && config >= 3));
  const std::string digest = "sha256:" + std::string(64, 'c');
  std::vector<int> asked;
  ModelFiles files = ModelFiles::from_fds(
      "/models/m", {{"a.safetensors", a}, {"b.safetensors", b}, {"config.json", config}});
  files.measure_verity_with([&](int fd, const std::string&) -> std::optional<std::string> {
    asked.push_back(fd);
    if (fd == a) return digest;
    return std::nullopt;
  });
  files.read("config.json", 100);  // small files are always copied and hashed
  auto images = files.read_large({"b.safetensors", "a.safetensors"}, 2);
  std::sort(asked.begin(), asked.end());
  CHECK(asked == std::vector<int>{std::min(a, b), std::max(a, b)});  // the given descriptors
  CHECK(images[1]->fsverity_digest() == digest);
  CHECK(text_of(images[1]) == before);
  // A mapping, not a copy: a write shows through. fs-verity is what makes the kernel refuse it.
  int w = ::open((d / "a.safetensors").c_str(), O_WRONLY | O_CLOEXEC);
  REQUIRE(w >= 0);
  REQUIRE(::pwrite(w, "z", 1, 0) == 1);
  ::close(w);
  CHECK(text_of(images[1])[0] == 'z');
  CHECK(files.records().at("a.safetensors").fsverity_digest == digest);
  Json used = assay::oracle::bytes_used(files, {"a.safetensors", "b.safetensors"});
  CHECK(used["weight_files"] == Json::parse(R"([
    {"path":"a.safetensors","bytes":3145728,"fsverity_digest":")" +
                                            digest + R"(","bound_by":"fs-verity"},
    {"path":"b.safetensors","bytes":4,"sha256":")" +
                                            assay::common::sha256_id("bbbb") + R"("}])"));
  CHECK(used["config_hash"] == assay::common::sha256_id("{}"));
  for (int fd : {a, b, config}) ::close(fd);
}

TEST_CASE(
    "a shard the fingerprint left to the oracle is read and hashed, never mapped, and only in the "
    "state the fingerprint saw") {
  TempDir d;
  write(d / "a.safetensors", std::string(300000, 'a'));
  write(d / "b.safetensors", std::string(5000, 'b'));
  int a = ::open((d / "a.safetensors").c_str(), O_RDONLY | O_CLOEXEC);
  int b = ::open((d / "b.safetensors").c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE((a >= 3 && b >= 3));
  auto state_of = [](const std::string& name, int fd) {
    struct stat st {};
    REQUIRE(::fstat(fd, &st) == 0);
    return assay::fingerprint::file_state(name, st);
  };
  const auto sa = state_of("a.safetensors", a), sb = state_of("b.safetensors", b);
  {
    ModelFiles files =
        ModelFiles::from_fds("/models/m", {{"a.safetensors", a}, {"b.safetensors", b}});
    files.expect_unchanged({sa, sb});
    // Even where the kernel would let it map the file: the digest is what completes the identity.
    files.measure_verity_with([](int, const std::string&) -> std::optional<std::string> {
      return "sha256:" + std::string(64, 'c');
    });
    auto images = files.read_large({"a.safetensors", "b.safetensors"}, 2);
    CHECK_FALSE(images[0]->fsverity_digest().has_value());
    CHECK(images[0]->sha256() == assay::common::sha256_id(std::string(300000, 'a')));
    CHECK(images[1]->sha256() == assay::common::sha256_id(std::string(5000, 'b')));
  }
  // Written since the fingerprint saw it (same size, later times): refused before a byte counts.
  ::usleep(20000);
  write(d / "b.safetensors", std::string(5000, 'B'));
  {
    ModelFiles files = ModelFiles::from_fds("/models/m", {{"b.safetensors", b}});
    files.expect_unchanged({sb});
    std::string e = error_of([&] { files.read_large({"b.safetensors"}, 1); });
    CHECK(
        e.starts_with("model.file_changed: /models/m/b.safetensors is not as the fingerprint "
                      "saw it before it was read ("));
    CHECK(e.find("mtime_ns " + std::to_string(sb.mtime_ns) + " is now ") != std::string::npos);
    CHECK(files.records().empty());
  }
  // Another file under the name: another inode.
  auto other = sb;
  other.ino += 1;
  {
    ModelFiles files = ModelFiles::from_fds("/models/m", {{"b.safetensors", b}});
    files.expect_unchanged({other});
    CHECK(error_of([&] { files.read_large({"b.safetensors"}, 1); }).find("inode ") !=
          std::string::npos);
  }
  ::close(a);
  ::close(b);
}

TEST_CASE("a failed fs-verity measurement fails the read, naming the file") {
  TempDir d;
  write(d / "model.safetensors", "x");
  ModelFiles files = ModelFiles::from_directory(d.path());
  files.measure_verity_with([](int, const std::string& shown) -> std::optional<std::string> {
    assay::common::throw_errno("fs.verity", "FS_IOC_MEASURE_VERITY on " + shown, EIO);
  });
  std::string e = error_of([&] { files.read_large({"model.safetensors"}, 1); });
  CHECK(e.starts_with("fs.verity"));
  CHECK(e.find((d / "model.safetensors").string()) != std::string::npos);
}
