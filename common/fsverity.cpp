#include "common/fsverity.h"

#include <linux/fsverity.h>
#include <sys/ioctl.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>

#include "common/error.h"
#include "common/identity.h"

namespace assay::common {
namespace {

// FS_VERITY_MAX_DIGEST_SIZE is 64 (sha512).
constexpr std::size_t kMaxDigest = 64;

}  // namespace

std::optional<std::string> measure_fsverity(int fd, const std::string& shown) {
  alignas(fsverity_digest) std::uint8_t buf[sizeof(fsverity_digest) + kMaxDigest] = {};
  auto* d = reinterpret_cast<fsverity_digest*>(buf);
  d->digest_size = kMaxDigest;
  if (::ioctl(fd, FS_IOC_MEASURE_VERITY, d) != 0) {
    int err = errno;
    if (err == ENODATA || err == ENOTTY || err == EOPNOTSUPP) return std::nullopt;
    throw_errno("fs.verity", "FS_IOC_MEASURE_VERITY on " + shown, err);
  }
  std::string algorithm;
  switch (d->digest_algorithm) {
    case FS_VERITY_HASH_ALG_SHA256:
      algorithm = "sha256";
      break;
    case FS_VERITY_HASH_ALG_SHA512:
      algorithm = "sha512";
      break;
    default:
      throw Error("fs.verity", shown + " has fs-verity digest algorithm " +
                                   std::to_string(d->digest_algorithm) +
                                   ", neither sha256 (1) nor sha512 (2)");
  }
  std::size_t size = std::min<std::size_t>(d->digest_size, kMaxDigest);
  return algorithm + ":" + hex({d->digest, size});
}

bool is_fsverity_digest(std::string_view s) {
  std::size_t hex_digits = s.starts_with("sha256:") ? 64 : s.starts_with("sha512:") ? 128 : 0;
  return hex_digits && s.size() == 7 + hex_digits &&
         std::all_of(s.begin() + 7, s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

}  // namespace assay::common
