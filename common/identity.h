// `sha256:<64 lowercase hex>` identities over bytes, files and canonical JSON.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "common/json.h"

namespace assay::common {

using Digest = std::array<std::uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(Sha256&&) noexcept;
  Sha256& operator=(Sha256&&) noexcept;
  void update(const void* data, std::size_t size);
  void update(std::string_view s) { update(s.data(), s.size()); }
  Digest finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

Digest sha256(const void* data, std::size_t size);
std::string hex(std::span<const std::uint8_t> bytes);
// "sha256:" + hex(digest).
std::string identity(const Digest& digest);
std::string sha256_id(std::string_view bytes);
std::string sha256_id(const void* data, std::size_t size);
// Streams the file with large reads; a regular file only (opened with O_NOFOLLOW and O_NONBLOCK:
// a symlink or a FIFO is refused with Error("fs.open"/"fs.not_regular"), never waited on).
std::string sha256_file_id(const std::filesystem::path& path);
// Streams an open descriptor from its current offset to its end; `what` names it in errors.
std::string sha256_fd_id(int fd, const std::string& what);
// sha256 of canonical(value).
std::string sha256_canonical_id(const Json& value);
// True for "sha256:" followed by exactly 64 lowercase hex digits.
bool is_identity(std::string_view s);

}  // namespace assay::common
