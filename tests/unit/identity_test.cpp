#include <doctest/doctest.h>

#include "common/error.h"
#include "common/identity.h"
#include "test_util.h"

using namespace assay::common;

TEST_CASE("sha256 identities match the FIPS 180-2 vectors") {
  CHECK(sha256_id("") == "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(sha256_id("abc") ==
        "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  Sha256 h;
  h.update("ab");
  h.update("c");
  CHECK(identity(h.finish()) == sha256_id("abc"));
}

TEST_CASE("file identity streams large files and equals coreutils sha256sum") {
  assay::test::TempDir dir;
  std::string data;
  data.reserve(9 << 20);
  for (std::uint32_t i = 0; i < (9u << 20); ++i) data += static_cast<char>((i * 7919u) >> 3);
  assay::test::write_bytes(dir / "big.bin", data);
  auto r = assay::test::run_command("sha256sum " + (dir / "big.bin").string());
  REQUIRE(r.status == 0);
  CHECK(sha256_file_id(dir / "big.bin") == "sha256:" + r.output.substr(0, 64));
  CHECK(sha256_file_id(dir / "big.bin") == sha256_id(data));
}

TEST_CASE("file identity refuses a symlink") {
  assay::test::TempDir dir;
  assay::test::write_bytes(dir / "real", "x");
  std::filesystem::create_symlink(dir / "real", dir / "link");
  CHECK_THROWS_AS(sha256_file_id(dir / "link"), Error);
}

TEST_CASE("canonical identity hashes the RFC 8785 form") {
  Json v = parse_strict(R"({"b": 1, "a": [true, "x"]})");
  CHECK(sha256_canonical_id(v) == sha256_id(R"({"a":[true,"x"],"b":1})"));
}

TEST_CASE("is_identity accepts only sha256: and 64 lowercase hex digits") {
  CHECK(is_identity(sha256_id("x")));
  CHECK_FALSE(is_identity("sha256:" + std::string(63, 'a')));
  CHECK_FALSE(is_identity("sha256:" + std::string(65, 'a')));
  CHECK_FALSE(is_identity("sha256:" + std::string(64, 'A')));
  CHECK_FALSE(is_identity("sha512:" + std::string(64, 'a')));
  CHECK_FALSE(is_identity(std::string(64, 'a')));
}
