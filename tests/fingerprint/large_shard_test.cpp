// A shard past 2 GiB (real data, not sparse) hashes correctly: no 32-bit size or offset anywhere.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "common/fs.h"
#include "fingerprint/fingerprint.h"
#include "tests/fingerprint/util.h"

namespace assay::fingerprint::test {
namespace {

TEST_SUITE("large") {
  TEST_CASE("a shard of more than 2 GiB of real data hashes like openssl dgst") {
    TempDir d;
    make_model(d.path(), {});
    constexpr std::uint64_t kSize = (std::uint64_t{2} << 30) + 4099;
    {
      // One random MiB, its first 8 bytes replaced by the block number, so no block repeats.
      std::string block = random_bytes(1 << 20, 42);
      common::UniqueFd fd =
          common::open_nofollow(d / "model.safetensors", O_WRONLY | O_CREAT | O_EXCL, 0644);
      std::uint64_t written = 0;
      for (std::uint64_t n = 0; written < kSize; ++n) {
        std::memcpy(block.data(), &n, sizeof n);
        std::size_t len =
            static_cast<std::size_t>(std::min<std::uint64_t>(block.size(), kSize - written));
        if (::write(fd.get(), block.data(), len) != static_cast<ssize_t>(len)) break;
        written += len;
      }
    }
    struct stat st {};
    REQUIRE(::stat((d / "model.safetensors").c_str(), &st) == 0);
    REQUIRE(static_cast<std::uint64_t>(st.st_size) == kSize);
    REQUIRE(static_cast<std::uint64_t>(st.st_blocks) * 512 >= kSize);  // not sparse

    Fingerprint f = fingerprint_model(d.path(), "big", with_threads(2));
    // openssl dgst, not sha256sum: both are independent readers of the file, and coreutils'
    // portable SHA-256 would take most of this test's time budget for 2 GiB.
    auto ref = run_command("openssl dgst -sha256 -r " + quote((d / "model.safetensors").string()));
    REQUIRE(ref.status == 0);
    REQUIRE(f.identity.weight_files.size() == 1);
    CHECK(f.identity.weight_files[0].bytes == kSize);
    CHECK(f.identity.weight_files[0].sha256 == "sha256:" + ref.out.substr(0, 64));
    CHECK(f.stats.bytes >= kSize);
  }
}

}  // namespace
}  // namespace assay::fingerprint::test
