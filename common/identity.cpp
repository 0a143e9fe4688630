#include "common/identity.h"

#include <fcntl.h>
#include <unistd.h>

#include <openssl/evp.h>

#include <vector>

#include "common/error.h"
#include "common/fs.h"

namespace assay::common {

struct Sha256::Impl {
  EVP_MD_CTX* ctx = nullptr;
  ~Impl() { EVP_MD_CTX_free(ctx); }
};

Sha256::Sha256() : impl_(std::make_unique<Impl>()) {
  impl_->ctx = EVP_MD_CTX_new();
  if (!impl_->ctx || EVP_DigestInit_ex(impl_->ctx, EVP_sha256(), nullptr) != 1)
    throw Error("crypto.sha256", "cannot initialise SHA-256");
}
Sha256::~Sha256() = default;
Sha256::Sha256(Sha256&&) noexcept = default;
Sha256& Sha256::operator=(Sha256&&) noexcept = default;

void Sha256::update(const void* data, std::size_t size) {
  if (size && EVP_DigestUpdate(impl_->ctx, data, size) != 1)
    throw Error("crypto.sha256", "SHA-256 update failed");
}

Digest Sha256::finish() {
  Digest d{};
  unsigned int len = 0;
  if (EVP_DigestFinal_ex(impl_->ctx, d.data(), &len) != 1 || len != d.size())
    throw Error("crypto.sha256", "SHA-256 final failed");
  return d;
}

Digest sha256(const void* data, std::size_t size) {
  Sha256 h;
  h.update(data, size);
  return h.finish();
}

std::string hex(std::span<const std::uint8_t> bytes) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (auto b : bytes) {
    out += kHex[b >> 4];
    out += kHex[b & 0xf];
  }
  return out;
}

std::string identity(const Digest& digest) {
  return "sha256:" + hex(digest);
}

std::string sha256_id(std::string_view bytes) {
  return identity(sha256(bytes.data(), bytes.size()));
}

std::string sha256_id(const void* data, std::size_t size) {
  return identity(sha256(data, size));
}

std::string sha256_fd_id(int fd, const std::string& what) {
  posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  std::vector<char> buf(4 << 20);
  Sha256 h;
  for (;;) {
    ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("fs.read", "read " + what, errno);
    }
    if (n == 0) break;
    h.update(buf.data(), static_cast<std::size_t>(n));
  }
  return identity(h.finish());
}

std::string sha256_file_id(const std::filesystem::path& path) {
  // A regular file only, opened without following a symlink or waiting on a FIFO.
  UniqueFd fd = open_regular(path);
  return sha256_fd_id(fd.get(), path.string());
}

std::string sha256_canonical_id(const Json& value) {
  return sha256_id(canonical(value));
}

bool is_identity(std::string_view s) {
  if (s.size() != 71 || s.substr(0, 7) != "sha256:") return false;
  for (char c : s.substr(7))
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

}  // namespace assay::common
