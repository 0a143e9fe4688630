// fs-verity (Documentation/filesystems/fsverity.rst): a file whose every page the kernel checks
// against a Merkle tree as it reads it, and whose bytes nobody can change once enabled.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace assay::common {

// The fs-verity file digest of the open file `fd`, in `fsverity measure`'s form
// ("sha256:<hex>" or "sha512:<hex>": the digest of the file's fs-verity descriptor, which binds
// its size and Merkle root, not the sha256 of its bytes). nullopt when the file has no fs-verity
// (ENODATA), or the filesystem or kernel has none (ENOTTY, EOPNOTSUPP). Any other failure
// throws Error("fs.verity") naming `shown` and the errno.
std::optional<std::string> measure_fsverity(int fd, const std::string& shown);

// True for "sha256:<64 hex>" or "sha512:<128 hex>", lowercase: a digest measure_fsverity returns.
bool is_fsverity_digest(std::string_view s);

}  // namespace assay::common
