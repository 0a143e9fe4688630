// The fingerprint cache: a digest is reused only when the file's (dev, inode, size, mtime,
// ctime) and fs-verity digest equal its entry's exactly; anything else is read and hashed again.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <fstream>
#include <optional>
#include <set>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/json.h"
#include "fingerprint/fingerprint.h"
#include "fingerprint/model_fds.h"
#include "tests/fingerprint/util.h"

namespace assay::fingerprint::test {
namespace {

const std::map<std::string, std::size_t> kShards = {{"model-a.safetensors", 300000},
                                                    {"model-b.safetensors", 70000}};

// The entries a supervisor would store after `f`, all computed by job "j1".
std::vector<CacheEntry> entries_of(const Fingerprint& f, const std::string& job = "j1") {
  std::vector<CacheEntry> out;
  for (const FileDigest& d : f.files) {
    CacheEntry e = d.state;
    if (!d.from_cache) {
      e.job = job;
      e.at = "2025-01-01T00:00:00.000Z";
    }
    out.push_back(e);
  }
  return out;
}

Options with_cache(std::vector<CacheEntry> cache, std::set<std::string>* read = nullptr) {
  Options o;
  o.cache = std::move(cache);
  if (read) o.after_read = [read](const std::string& rel) { read->insert(rel); };
  return o;
}

const FileDigest& file(const Fingerprint& f, const std::string& name) {
  for (const auto& d : f.files)
    if (d.state.name == name) return d;
  FAIL("no file " << name);
  throw;
}

}  // namespace

TEST_CASE(
    "an unchanged model's shards are not read again: their digests come from the cache, the "
    "small files are hashed every time, same identity") {
  TempDir dir;
  make_model(dir.path(), kShards);
  Fingerprint first = fingerprint_model(dir.path(), "m");
  REQUIRE(first.files.size() == 4);
  for (const auto& d : first.files) CHECK_FALSE(d.from_cache);
  CHECK(first.stats.cached_files == 0);

  std::set<std::string> read;
  Fingerprint second = fingerprint_model(dir.path(), "m", with_cache(entries_of(first), &read));
  CHECK(second.identity == first.identity);
  CHECK(read == std::set<std::string>{"config.json", "tokenizer.json"});
  CHECK(second.stats.bytes == first.files[2].state.size + first.files[3].state.size);
  CHECK(second.stats.cached_files == 2);
  CHECK(second.stats.cached_bytes == 300000 + 70000);
  for (const auto& d : second.files) {
    bool shard = d.state.name.ends_with(".safetensors");
    CHECK(d.from_cache == shard);
    if (!shard) continue;
    CHECK(d.state.job == "j1");
    CHECK(d.state.at == "2025-01-01T00:00:00.000Z");
  }
  common::Json j = to_json(second.files[0]);
  CHECK(j["source"] == "cache");
  CHECK(j["job"] == "j1");
  CHECK(to_json(first.files[0])["job"].is_null());
  CHECK(to_json(first.files[0])["source"] == "computed");
}

TEST_CASE("a rewritten shard is hashed again even with its old mtime put back (ctime moved)") {
  TempDir dir;
  make_model(dir.path(), kShards);
  Fingerprint first = fingerprint_model(dir.path(), "m");
  fs::path shard = dir.path() / "model-b.safetensors";
  struct stat before {};
  REQUIRE(::stat(shard.c_str(), &before) == 0);
  ::usleep(20000);  // a later ctime on coarse-grained clocks too
  // Same size, other bytes, written in place (same inode), then the old mtime restored.
  {
    common::UniqueFd fd(::open(shard.c_str(), O_WRONLY | O_CLOEXEC));
    std::string other = random_bytes(70000, 99);
    REQUIRE(::pwrite(fd.get(), other.data(), other.size(), 0) == 70000);
  }
  struct timespec times[2] = {before.st_atim, before.st_mtim};
  REQUIRE(::utimensat(AT_FDCWD, shard.c_str(), times, 0) == 0);

  std::set<std::string> read;
  Fingerprint second = fingerprint_model(dir.path(), "m", with_cache(entries_of(first), &read));
  CHECK(read == std::set<std::string>{"model-b.safetensors", "config.json", "tokenizer.json"});
  CHECK_FALSE(file(second, "model-b.safetensors").from_cache);
  CHECK(file(second, "model-a.safetensors").from_cache);
  CHECK(file(second, "model-b.safetensors").state.sha256 !=
        file(first, "model-b.safetensors").state.sha256);
  CHECK(second.identity.content_sha256 != first.identity.content_sha256);
  // Without the cache the same identity comes out: the cache changed nothing but the work.
  CHECK(fingerprint_model(dir.path(), "m").identity == second.identity);
}

TEST_CASE("each key field must match: another inode, size, mtime or name is hashed again") {
  TempDir dir;
  make_model(dir.path(), kShards);
  Fingerprint first = fingerprint_model(dir.path(), "m");
  for (int field = 0; field < 5; ++field) {
    CAPTURE(field);
    std::vector<CacheEntry> cache = entries_of(first);
    for (auto& e : cache) {
      if (e.name != "model-a.safetensors") continue;
      if (field == 0) e.ino += 1;
      if (field == 1) e.size += 1;
      if (field == 2) e.mtime_ns += 1;
      if (field == 3) e.ctime_ns -= 1;
      if (field == 4) e.dev += 1;
    }
    std::set<std::string> read;
    Fingerprint f = fingerprint_model(dir.path(), "m", with_cache(cache, &read));
    CHECK(read == std::set<std::string>{"model-a.safetensors", "config.json", "tokenizer.json"});
    CHECK(f.stats.cached_files == 1);
  }
}

TEST_CASE(
    "a chat template rewritten through a shared mapping (mtime and ctime unchanged) is hashed "
    "afresh, never taken from the cache") {
  TempDir dir;
  make_model(dir.path(), kShards);
  fs::path jinja = dir.path() / "chat_template.jinja";
  write_file(jinja, std::string(4096, 'a'));
  common::UniqueFd fd(::open(jinja.c_str(), O_RDWR | O_CLOEXEC));
  REQUIRE(fd);
  void* map = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  REQUIRE(map != MAP_FAILED);
  auto* bytes = static_cast<char*>(map);
  bytes[0] = 'b';  // the first write fault of the clean page moves mtime and ctime
  Fingerprint first = fingerprint_model(dir.path(), "m");
  struct stat before {};
  REQUIRE(::stat(jinja.c_str(), &before) == 0);
  bytes[1] = 'c';  // the page is still dirty: no fault, no time update
  struct stat after {};
  REQUIRE(::stat(jinja.c_str(), &after) == 0);
  REQUIRE(after.st_mtim.tv_nsec == before.st_mtim.tv_nsec);
  REQUIRE(after.st_ctim.tv_nsec == before.st_ctim.tv_nsec);
  Fingerprint second = fingerprint_model(dir.path(), "m", with_cache(entries_of(first)));
  ::munmap(map, 4096);
  std::string now(4096, 'a');
  now[0] = 'b', now[1] = 'c';
  REQUIRE(second.identity.chat_template_hash);
  CHECK(*second.identity.chat_template_hash == common::sha256_id(now));
  CHECK(*second.identity.chat_template_hash != *first.identity.chat_template_hash);
  CHECK_FALSE(file(second, "chat_template.jinja").from_cache);
}

// A shared, writable mapping of a whole file, as a user's script or an engine may keep one.
struct SharedMapping {
  common::UniqueFd fd;
  char* bytes = nullptr;
  std::size_t size = 0;
  explicit SharedMapping(const fs::path& file)
      : fd(::open(file.c_str(), O_RDWR | O_CLOEXEC)), size(fs::file_size(file)) {
    REQUIRE(fd);
    void* map = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    REQUIRE(map != MAP_FAILED);
    bytes = static_cast<char*>(map);
  }
  ~SharedMapping() { ::munmap(bytes, size); }
};

bool same_times(const fs::path& file, const struct stat& before) {
  struct stat now {};
  REQUIRE(::stat(file.c_str(), &now) == 0);
  return now.st_mtim.tv_sec == before.st_mtim.tv_sec &&
         now.st_mtim.tv_nsec == before.st_mtim.tv_nsec &&
         now.st_ctim.tv_sec == before.st_ctim.tv_sec &&
         now.st_ctim.tv_nsec == before.st_ctim.tv_nsec;
}

TEST_CASE(
    "a shard written through a shared mapping into a page that mapping had dirtied is hashed "
    "again: the fingerprint wrote the page back, so the second write moved ctime") {
  TempDir dir;
  make_model(dir.path(), kShards);
  fs::path shard = dir.path() / "model-a.safetensors";
  SharedMapping map(shard);
  map.bytes[100] ^= 1;  // dirties the page (the fault moves both times)
  Fingerprint first = fingerprint_model(dir.path(), "m");
  CHECK(file(first, "model-a.safetensors").state.sha256 ==
        common::sha256_id(common::read_file(shard, 1 << 24)));
  ::usleep(20000);      // a later tick of the coarse clock
  map.bytes[101] ^= 1;  // the same page: before the fix it was still dirty and no time moved
  std::set<std::string> read;
  Fingerprint second = fingerprint_model(dir.path(), "m", with_cache(entries_of(first), &read));
  CHECK(read.count("model-a.safetensors") == 1);
  CHECK_FALSE(file(second, "model-a.safetensors").from_cache);
  CHECK(file(second, "model-a.safetensors").state.sha256 ==
        common::sha256_id(common::read_file(shard, 1 << 24)));
  CHECK(second.identity.content_sha256 != first.identity.content_sha256);
}

TEST_CASE(
    "on tmpfs, where writes through a shared mapping never move the times, a shard's digest is "
    "never reused nor offered for keeping") {
  if (!fs::is_directory("/dev/shm")) {
    MESSAGE("skipped: no /dev/shm");
    return;
  }
  TempDir dir("/dev/shm");
  make_model(dir.path(), kShards);
  fs::path shard = dir.path() / "model-b.safetensors";
  SharedMapping map(shard);
  map.bytes[10] ^= 1;
  Fingerprint first = fingerprint_model(dir.path(), "m");
  for (const FileDigest& d : first.files) CHECK_FALSE(d.storable);
  struct stat before {};
  REQUIRE(::stat(shard.c_str(), &before) == 0);
  ::usleep(20000);
  map.bytes[11] ^= 1;
  REQUIRE(same_times(shard, before));  // the case a (dev, ino, size, mtime, ctime) key misses
  std::set<std::string> read;
  Fingerprint second = fingerprint_model(dir.path(), "m", with_cache(entries_of(first), &read));
  CHECK(read.count("model-a.safetensors") == 1);  // unchanged, but its key is not sound here
  CHECK(read.count("model-b.safetensors") == 1);
  CHECK(file(second, "model-b.safetensors").state.sha256 ==
        common::sha256_id(common::read_file(shard, 1 << 24)));
  CHECK(second.stats.cached_files == 0);
}

TEST_CASE(
    "a shard is offered for keeping only when both its times are over 2 s older than the "
    "writeback before its read; config and tokenizer never") {
  TempDir dir;
  make_model(dir.path(), kShards);
  Fingerprint fresh = fingerprint_model(dir.path(), "m");
  for (const FileDigest& d : fresh.files) CHECK_FALSE(d.storable);
  ::usleep(2'100'000);
  Fingerprint settled = fingerprint_model(dir.path(), "m");
  for (const FileDigest& d : settled.files)
    CHECK(d.storable == d.state.name.ends_with(".safetensors"));
  // A hit stays storable: its state is as old as it was.
  Fingerprint hit = fingerprint_model(dir.path(), "m", with_cache(entries_of(settled)));
  CHECK(file(hit, "model-a.safetensors").from_cache);
  CHECK(file(hit, "model-a.safetensors").storable);
}

TEST_CASE(
    "write_back_directory writes back the regular files at the top of a directory only: a FIFO, "
    "a device node, a link, a subdirectory are never opened (no hang), a link to a directory is "
    "not followed, in any component of the path") {
  TempDir dir;
  make_model(dir.path(), kShards);
  std::size_t regular = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) regular += e.is_regular_file();
  REQUIRE(::mkfifo((dir / "fifo").c_str(), 0600) == 0);
  const bool root = ::geteuid() == 0;
  if (root) REQUIRE(::mknod((dir / "null").c_str(), S_IFCHR | 0600, makedev(1, 3)) == 0);
  fs::create_symlink(dir / "model-a.safetensors", dir / "link.safetensors");
  fs::create_directory(dir / "sub");
  {
    std::ofstream f(dir / "sub" / "inner.bin");
    f << "not at the top";
  }
  CHECK(write_back_directory(dir.path().string()) == regular);
  TempDir other;
  fs::create_directory_symlink(dir.path(), other / "linked-model");
  CHECK(write_back_directory((other / "linked-model").string()) == 0);
  // A link anywhere in the path, not only its last component (a directory swapped for a link
  // after admission checked the path).
  CHECK(write_back_directory((other / "linked-model" / ".").string()) == 0);
  CHECK(write_back_directory((dir / "no-such-dir").string()) == 0);
  CHECK(write_back_directory((dir / "model-a.safetensors").string()) == 0);
}

TEST_CASE(
    "settled_state writes a file back and takes its state, settled only when both times are over "
    "2 s older than the writeback; on a filesystem whose ctime may not follow mapped writes it "
    "gives none") {
  TempDir dir;
  make_model(dir.path(), kShards);
  const std::string shard = (dir / "model-a.safetensors").string();
  common::UniqueFd fd(::open(shard.c_str(), O_RDONLY | O_CLOEXEC));
  REQUIRE(fd.get() >= 0);
  struct stat st {};
  REQUIRE(::fstat(fd.get(), &st) == 0);
  auto fresh = settled_state(fd.get(), "model-a.safetensors");
  REQUIRE(fresh);
  CHECK(fresh->state == file_state("model-a.safetensors", st));
  CHECK_FALSE(fresh->fsverity_digest);  // no fs-verity on this host's test directories
  CHECK_FALSE(fresh->settled());
  ::usleep(2'100'000);
  auto later = settled_state(fd.get(), "model-a.safetensors");
  REQUIRE(later);
  CHECK(later->state == fresh->state);
  CHECK(later->settled());
  // tmpfs: a write through a mapping never moves its times.
  TempDir shm("/dev/shm");
  make_model(shm.path(), kShards);
  common::UniqueFd tmp(::open((shm / "model-a.safetensors").c_str(), O_RDONLY | O_CLOEXEC));
  REQUIRE(tmp.get() >= 0);
  CHECK_FALSE(settled_state(tmp.get(), "model-a.safetensors"));
}

TEST_CASE(
    "a file's fs-verity digest is recorded beside its sha256, and a cached sha256 is reused only "
    "beside the same fs-verity digest") {
  // This host's kernel has no fs-verity: a stand-in answers for model-a (tests/vm/verity.sh runs
  // the real thing). Enabling fs-verity moves neither mtime nor ctime, so only this tells.
  TempDir dir;
  make_model(dir.path(), kShards);
  auto verity = [](std::optional<std::string> digest) {
    return [digest](int, const std::string& shown) -> std::optional<std::string> {
      return shown.ends_with("/model-a.safetensors") ? digest : std::nullopt;
    };
  };
  const std::string d1 = "sha256:" + std::string(64, '1'), d2 = "sha512:" + std::string(128, '2');
  Fingerprint plain = fingerprint_model(dir.path(), "m");
  Options o;
  o.measure_fsverity = verity(d1);
  Fingerprint first = fingerprint_model(dir.path(), "m", o);
  CHECK(file(first, "model-a.safetensors").state.fsverity_digest == d1);
  CHECK_FALSE(file(first, "model-b.safetensors").state.fsverity_digest);
  CHECK(to_json(file(first, "model-a.safetensors"))["fsverity_digest"] == d1);
  CHECK_FALSE(to_json(file(first, "model-b.safetensors")).contains("fsverity_digest"));
  // Not part of the identity: the same bytes, the same identity, with or without fs-verity.
  CHECK(first.identity == plain.identity);
  CHECK(to_json(first.identity).dump().find("fsverity") == std::string::npos);

  auto reads = [&](const std::vector<CacheEntry>& cache, std::optional<std::string> now) {
    std::set<std::string> read;
    Options c = with_cache(cache, &read);
    c.measure_fsverity = verity(now);
    Fingerprint f = fingerprint_model(dir.path(), "m", c);
    CHECK(f.identity == plain.identity);
    return read.count("model-a.safetensors") == 1;
  };
  CHECK_FALSE(reads(entries_of(first), d1));      // the same digest: reused
  CHECK(reads(entries_of(first), d2));            // another digest
  CHECK(reads(entries_of(first), std::nullopt));  // (a copy) without fs-verity
  CHECK(reads(entries_of(plain), d1));            // fs-verity enabled since the digest was computed
  CHECK_FALSE(reads(entries_of(plain), std::nullopt));
}

TEST_CASE(
    "defer_shards leaves a settled shard unread for the next reader; a fresh one, a cached one and "
    "one with fs-verity are handled as without it") {
  TempDir dir;
  make_model(dir.path(), kShards);
  Fingerprint full = fingerprint_model(dir.path(), "m");
  Options defer;
  defer.defer_shards = true;
  std::set<std::string> read;
  defer.after_read = [&read](const std::string& rel) { read.insert(rel); };
  // Fresh files: their state is no sound key yet, so they are hashed here.
  Fingerprint fresh = fingerprint_model(dir.path(), "m", defer);
  CHECK(fresh.identity == full.identity);
  CHECK(fresh.stats.deferred_files == 0);
  CHECK(read.count("model-a.safetensors") == 1);

  ::usleep(2'100'000);
  read.clear();
  Fingerprint deferred = fingerprint_model(dir.path(), "m", defer);
  CHECK(read == std::set<std::string>{"config.json", "tokenizer.json"});
  CHECK(deferred.stats.deferred_files == 2);
  CHECK(deferred.stats.deferred_bytes == 300000 + 70000);
  CHECK(deferred.stats.bytes ==
        file(full, "config.json").state.size + file(full, "tokenizer.json").state.size);
  CHECK(deferred.identity.content_sha256.empty());
  CHECK(deferred.identity.config_hash == full.identity.config_hash);
  for (const WeightFile& w : deferred.identity.weight_files) CHECK(w.sha256.empty());
  const FileDigest& a = file(deferred, "model-a.safetensors");
  CHECK(a.deferred);
  CHECK(a.storable);
  CHECK(a.state.ino == file(full, "model-a.safetensors").state.ino);
  common::Json j = to_json(a);
  CHECK(j["source"] == "deferred");
  CHECK(j["sha256"].is_null());

  // A cached shard keeps its digest from the cache; only the other one is deferred.
  std::vector<CacheEntry> cache;
  for (const CacheEntry& e : entries_of(full))
    if (e.name == "model-b.safetensors") cache.push_back(e);
  Options both = defer;
  both.cache = cache;
  Fingerprint mixed = fingerprint_model(dir.path(), "m", both);
  CHECK(file(mixed, "model-b.safetensors").from_cache);
  CHECK(file(mixed, "model-a.safetensors").deferred);
  CHECK(mixed.stats.deferred_files == 1);

  // A shard with fs-verity is hashed: its reader maps it and computes no sha256.
  Options verity = defer;
  verity.measure_fsverity = [](int, const std::string& shown) -> std::optional<std::string> {
    if (shown.ends_with("/model-a.safetensors")) return "sha256:" + std::string(64, '1');
    return std::nullopt;
  };
  Fingerprint mapped = fingerprint_model(dir.path(), "m", verity);
  CHECK_FALSE(file(mapped, "model-a.safetensors").deferred);
  CHECK(file(mapped, "model-a.safetensors").state.sha256 ==
        file(full, "model-a.safetensors").state.sha256);
  CHECK(file(mapped, "model-b.safetensors").deferred);
}

TEST_CASE("cache entries are parsed strictly") {
  common::Json ok = common::Json::array({{{"name", "config.json"},
                                          {"dev", "1"},
                                          {"ino", "2"},
                                          {"size", 3},
                                          {"mtime_ns", "1796142391146889191"},
                                          {"ctime_ns", "-5"},
                                          {"sha256", "sha256:" + std::string(64, 'a')},
                                          {"job", "j"},
                                          {"at", "t"}}});
  CHECK(parse_cache(ok, "in", "c").size() == 1);
  common::Json bad = ok;
  bad[0]["extra"] = 1;
  CHECK_THROWS_WITH_AS(parse_cache(bad, "in", "c"), doctest::Contains("extra"), common::Error);
  bad = ok;
  bad[0]["sha256"] = "sha256:xyz";
  CHECK_THROWS_WITH_AS(parse_cache(bad, "in", "c"), doctest::Contains("cache[0].sha256"),
                       common::Error);
  bad = ok;
  bad.push_back(ok[0]);
  CHECK_THROWS_WITH_AS(parse_cache(bad, "in", "c"), doctest::Contains("twice"), common::Error);
  bad = ok;
  bad[0]["ino"] = "-1";
  CHECK_THROWS_WITH_AS(parse_cache(bad, "in", "c"), doctest::Contains("cache[0].ino"),
                       common::Error);
  bad = ok;
  bad[0]["dev"] = 1;
  CHECK_THROWS_AS(parse_cache(bad, "in", "c"), common::Error);
  // 19 digits pass the pattern but not a 64-bit time: named, never std::out_of_range.
  bad = ok;
  bad[0]["mtime_ns"] = "9999999999999999999";
  CHECK_THROWS_WITH_AS(
      parse_cache(bad, "in", "c"),
      doctest::Contains("cache[0].mtime_ns \"9999999999999999999\" is out of range"),
      common::Error);
  CHECK(parse_cache(ok, "in", "c")[0].mtime_ns == 1796142391146889191);
  CHECK(parse_cache(ok, "in", "c")[0].ctime_ns == -5);
  CHECK_FALSE(parse_cache(ok, "in", "c")[0].fsverity_digest);
  common::Json verity = ok;
  verity[0]["fsverity_digest"] = "sha256:" + std::string(64, 'b');
  CHECK(parse_cache(verity, "in", "c")[0].fsverity_digest == "sha256:" + std::string(64, 'b'));
  for (std::string wrong : {"sha256:" + std::string(63, 'b'), "sha512:" + std::string(64, 'b'),
                            "sha256:" + std::string(64, 'B'), std::string("md5:00")}) {
    CAPTURE(wrong);
    verity[0]["fsverity_digest"] = wrong;
    CHECK_THROWS_WITH_AS(parse_cache(verity, "in", "c"),
                         doctest::Contains(("cache[0].fsverity_digest \"" + wrong + "\"").c_str()),
                         common::Error);
  }
}

TEST_CASE("the worker reuses the input's cache and says so in output.json, both valid documents") {
  TempDir dir, work;
  make_model(dir.path() / "m", kShards);
  auto run = [&](const common::Json& input) {
    common::atomic_write_file(work.path() / "input.json", input.dump());
    auto r = run_command(std::string(ASSAY_FINGERPRINT_BIN) + " run --input " +
                         quote((work.path() / "input.json").string()) + " --workdir " +
                         quote(work.path().string()) + " 2>&1");
    REQUIRE_MESSAGE(r.status == 0, r.out);
    return common::parse_strict(common::read_file(work.path() / "output.json", 1 << 20));
  };
  common::Json input{{"schema", "assay.fingerprint-input.v1"},
                     {"model_dir", (dir.path() / "m").string()},
                     {"id", "m"}};
  common::Json first = run(input);
  common::Json cache = common::Json::array();
  for (common::Json f : first["files"]) {
    CHECK(f["source"] == "computed");
    f.erase("source");
    f["job"] = "job-1";
    f["at"] = "2025-01-01T00:00:00.000Z";
    cache.push_back(f);
  }
  input["cache"] = cache;
  common::Json second = run(input);
  CHECK(second["model_identity"] == first["model_identity"]);
  CHECK(second["stats"]["cached_files"] == 2);  // the shards; config and tokenizer are read
  CHECK(second["stats"]["files"] == 2);
  for (const auto& f : second["files"]) {
    bool shard = f["name"].get<std::string>().ends_with(".safetensors");
    CHECK(f["source"] == (shard ? "cache" : "computed"));
    CHECK(f["job"] == (shard ? common::Json("job-1") : common::Json(nullptr)));
  }
  auto validate = [&](const char* schema, const fs::path& doc) {
    auto r = run_command(std::string(ASSAY_PYTHON3) + " " + ASSAY_SOURCE_DIR +
                         "/tests/tools/validate_schema.py " + ASSAY_SOURCE_DIR + "/schemas/" +
                         schema + " " + quote(doc.string()) + " 2>&1");
    INFO(r.out);
    CHECK(r.status == 0);
  };
  validate("fingerprint-input.schema.json", work.path() / "input.json");
  validate("fingerprint-output.schema.json", work.path() / "output.json");
}

}  // namespace assay::fingerprint::test
