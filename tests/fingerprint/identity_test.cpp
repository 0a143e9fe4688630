// What the identity is: equal to an independent computation, and chosen by Kiln's rules.
#include <doctest/doctest.h>

#include <chrono>
#include <thread>
#include <vector>

#include "common/fs.h"
#include "common/identity.h"
#include "common/json.h"
#include "fingerprint/fingerprint.h"
#include "tests/fingerprint/util.h"

namespace assay::fingerprint::test {
namespace {

common::Json independent_identity(const fs::path& dir, const std::string& id) {
  auto r = run_command(std::string(ASSAY_PYTHON3) + " " + ASSAY_SOURCE_DIR +
                       "/tests/fingerprint/independent_identity.py " + quote(dir.string()) + " " +
                       quote(id));
  REQUIRE(r.status == 0);
  return common::parse_strict(r.out);
}

std::vector<std::string> paths(const ModelIdentity& m) {
  std::vector<std::string> out;
  for (const auto& w : m.weight_files) out.push_back(w.path);
  return out;
}

TEST_CASE("identity equals sha256sum plus Python's canonical json.dumps for an indexed model") {
  TempDir d;
  make_model(d.path(), {{"model-00001-of-00002.safetensors", 300000},
                        {"model-00002-of-00002.safetensors", 123457}});
  write_file(
      d / "model.safetensors.index.json",
      R"({"metadata":{"total_size":1},"weight_map":{"lm_head.weight":"model-00002-of-00002.safetensors","embed.weight":"model-00001-of-00002.safetensors"}})");
  write_file(d / "tokenizer_config.json",
             R"({"chat_template":"{% for m in messages %}{{m}}{% endfor %}"})");
  Fingerprint f = fingerprint_model(d.path(), "org/model-7b");
  CHECK(to_json(f.identity) == independent_identity(d.path(), "org/model-7b"));
  CHECK(common::is_identity(f.identity.content_sha256));
  CHECK(f.identity.weight_files.size() == 2);
  CHECK(f.identity.weight_files[1].bytes == 123457);
}

TEST_CASE(
    "identity equals the independent computation without index, template or tokenizer_config") {
  TempDir d;
  make_model(d.path(), {{"b.safetensors", 1000}, {"a.safetensors", 2000}});
  Fingerprint f = fingerprint_model(d.path(), "m");
  CHECK(!f.identity.chat_template_hash);
  CHECK(to_json(f.identity) == independent_identity(d.path(), "m"));
}

TEST_CASE("index names the shards: first-occurrence order, deduplicated, identity sorted by path") {
  TempDir d;
  make_model(d.path(), {{"model-00001-of-00002.safetensors", 100},
                        {"model-00002-of-00002.safetensors", 200},
                        {"model.safetensors", 50},
                        {"stray.safetensors", 70}});
  write_file(d / "model.safetensors.index.json", R"({"weight_map":{
      "z.weight":"model-00002-of-00002.safetensors",
      "a.weight":"model-00001-of-00002.safetensors",
      "m.weight":"model-00002-of-00002.safetensors"}})");
  Fingerprint f = fingerprint_model(d.path(), "m");
  CHECK(f.shard_order == std::vector<std::string>{"model-00002-of-00002.safetensors",
                                                  "model-00001-of-00002.safetensors"});
  CHECK(paths(f.identity) == std::vector<std::string>{"model-00001-of-00002.safetensors",
                                                      "model-00002-of-00002.safetensors"});
  CHECK(to_json(f.identity) == independent_identity(d.path(), "m"));
}

TEST_CASE("without an index model.safetensors alone is the weights, other shards are ignored") {
  TempDir d;
  make_model(d.path(), {{"model.safetensors", 64}, {"adapter.safetensors", 32}});
  Fingerprint f = fingerprint_model(d.path(), "m");
  CHECK(paths(f.identity) == std::vector<std::string>{"model.safetensors"});
}

TEST_CASE("without index or model.safetensors every *.safetensors counts, sorted by path bytes") {
  TempDir d;
  make_model(d.path(), {{"b.safetensors", 10},
                        {"a.safetensors", 10},
                        {"_.safetensors", 10},
                        {"B.safetensors", 10},
                        {"notes.txt", 10}});
  Fingerprint f = fingerprint_model(d.path(), "m");
  CHECK(paths(f.identity) == std::vector<std::string>{"B.safetensors", "_.safetensors",
                                                      "a.safetensors", "b.safetensors"});
}

TEST_CASE("chat_template.jinja wins over tokenizer_config.json's chat_template") {
  TempDir d;
  make_model(d.path(), {{"model.safetensors", 16}});
  write_file(d / "chat_template.jinja", "{{ bos_token }}");
  write_file(d / "tokenizer_config.json", R"({"chat_template":"other"})");
  Fingerprint f = fingerprint_model(d.path(), "m");
  CHECK(f.identity.chat_template_hash == common::sha256_id(std::string("{{ bos_token }}")));
}

TEST_CASE("tokenizer_config's chat_template is hashed as its UTF-8 string, escapes decoded") {
  TempDir d;
  make_model(d.path(), {{"model.safetensors", 16}});
  write_file(d / "tokenizer_config.json", R"({"chat_template":"caf\u00e9\n{{x}}"})");
  Fingerprint f = fingerprint_model(d.path(), "m");
  CHECK(f.identity.chat_template_hash == common::sha256_id(std::string("caf\xc3\xa9\n{{x}}")));
  CHECK(to_json(f.identity) == independent_identity(d.path(), "m"));
}

TEST_CASE("chat_template_hash is null when tokenizer_config.json has no chat_template") {
  TempDir d;
  make_model(d.path(), {{"model.safetensors", 16}});
  write_file(d / "tokenizer_config.json", R"({"bos_token":"<s>","chat_template":null})");
  CHECK(to_json(fingerprint_model(d.path(), "m").identity)["chat_template_hash"].is_null());
}

TEST_CASE("the identity holds no directory path: the same files elsewhere give the same hash") {
  TempDir a, b;
  make_model(a.path(), {{"model.safetensors", 4096}}, 7);
  make_model(b / "deeper/dir", {{"model.safetensors", 4096}}, 7);
  Fingerprint fa = fingerprint_model(a.path(), "m");
  CHECK(fa.identity == fingerprint_model(b / "deeper/dir", "m").identity);
  CHECK(fa.identity.content_sha256 != fingerprint_model(a.path(), "m2").identity.content_sha256);
}

TEST_CASE("one changed byte in a shard changes its sha256 and content_sha256") {
  TempDir d;
  make_model(d.path(), {{"model.safetensors", 4096}});
  Fingerprint before = fingerprint_model(d.path(), "m");
  std::string bytes = random_bytes(4096, 1);
  bytes[2048] ^= 1;
  write_file(d / "model.safetensors", bytes);
  Fingerprint after = fingerprint_model(d.path(), "m");
  CHECK(after.identity.weight_files[0].sha256 != before.identity.weight_files[0].sha256);
  CHECK(after.identity.content_sha256 != before.identity.content_sha256);
  CHECK(after.identity.config_hash == before.identity.config_hash);
}

TEST_CASE("content_sha256 is the canonical hash of the identity without content_sha256") {
  TempDir d;
  make_model(d.path(), {{"x.safetensors", 100}, {"y.safetensors", 100}});
  ModelIdentity m = fingerprint_model(d.path(), "m").identity;
  common::Json j = to_json(m);
  j.erase("content_sha256");
  CHECK(m.content_sha256 == common::sha256_id(common::canonical(j)));
  CHECK(content_sha256(m) == m.content_sha256);
}

TEST_CASE("every thread count gives the same identity, and stats count every byte once") {
  TempDir d;
  make_model(d.path(),
             {{"s1.safetensors", 70000}, {"s2.safetensors", 90000}, {"s3.safetensors", 110000}});
  write_file(d / "chat_template.jinja", "T");
  std::uint64_t expected = 70000 + 90000 + 110000 + fs::file_size(d / "config.json") +
                           fs::file_size(d / "tokenizer.json") + 1;
  Fingerprint one = fingerprint_model(d.path(), "m", with_threads(1));
  CHECK(one.stats.threads == 1);
  CHECK(one.stats.bytes == expected);
  CHECK(one.stats.files == 6);
  for (unsigned t : {2u, 3u, 16u}) {
    Fingerprint many = fingerprint_model(d.path(), "m", with_threads(t));
    CHECK(many.identity == one.identity);
    CHECK(many.stats.bytes == expected);
    CHECK(many.stats.threads == std::min(t, 6u));
  }
}

TEST_CASE("concurrent fingerprints of one directory agree") {
  TempDir d;
  make_model(d.path(), {{"a.safetensors", 1 << 20}, {"b.safetensors", 1 << 19}});
  write_file(d / "tokenizer_config.json", R"({"chat_template":"t"})");
  ModelIdentity reference = fingerprint_model(d.path(), "m", with_threads(1)).identity;
  std::vector<ModelIdentity> got(6);
  {
    std::vector<std::jthread> threads;
    for (std::size_t i = 0; i < got.size(); ++i)
      threads.emplace_back(
          [&, i] { got[i] = fingerprint_model(d.path(), "m", with_threads(2)).identity; });
  }
  for (const auto& g : got) CHECK(g == reference);
  // And separate processes of the binary at the same time.
  std::string cmd;
  for (int i = 0; i < 3; ++i)
    cmd += std::string(ASSAY_FINGERPRINT_BIN) + " --model " + quote(d.path().string()) +
           " --id m --out " + quote((d / ("out" + std::to_string(i) + ".json")).string()) + " & ";
  REQUIRE(run_command(cmd + "wait").status == 0);
  for (int i = 0; i < 3; ++i) {
    auto doc =
        common::parse_strict(common::read_file(d / ("out" + std::to_string(i) + ".json"), 1 << 20));
    CHECK(doc["model_identity"] == to_json(reference));
  }
}

TEST_CASE("the read-rate cap slows the read to about the cap") {
  TempDir d;
  make_model(d.path(), {{"a.safetensors", 3 << 20}});
  auto t0 = std::chrono::steady_clock::now();
  Fingerprint f = fingerprint_model(d.path(), "m", with_threads(1, 8));
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // 3 MiB at 8 MiB/s: one 64 KiB chunk goes at once, the rest is paced (a lower bound only).
  CHECK(seconds >= 0.3);
  CHECK(f.identity == fingerprint_model(d.path(), "m").identity);
}

}  // namespace
}  // namespace assay::fingerprint::test
