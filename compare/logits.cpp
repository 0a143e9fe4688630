// Opening and validating one logits safetensors file (compare/logits.h): its tensor, dtype and
// shape, its two digests, and exact access to single elements for the probabilities and for
// messages about a non-finite logit.
#include "compare/logits.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "common/error.h"
#include "common/identity.h"

namespace assay::compare {

using common::Error;

common::SafetensorsFile open_logits_file(const LogitsFileRef& r, const std::string& what) {
  if (r.fd >= 0) {
    try {
      return common::SafetensorsFile::open_fd(r.fd, r.path);
    } catch (const Error& e) {
      throw Error("compare.bad_file", what + ": " + e.what());
    }
  }
  const std::string& path = r.path;
  std::error_code ec;
  if (std::filesystem::is_regular_file(path, ec) && std::filesystem::file_size(path, ec) == 0)
    throw Error("compare.bad_file", what + " is empty");
  try {
    return common::SafetensorsFile::open(path);
  } catch (const Error& e) {
    if (e.code().rfind("fs.", 0) == 0)
      throw Error("compare.bad_file", what + ": cannot open: " + e.what());
    throw Error("compare.bad_file", what + ": " + e.what());
  }
}

Logits::Logits(const LogitsFileRef& r, std::string role_, const std::string& context_)
    : ref(r),
      role(std::move(role_)),
      what(role + " logits " + r.path + " (context '" + context_ + "')"),
      file(open_logits_file(r, what)) {
  const common::TensorView* t = file.find("logits");
  if (!t) {
    if (file.tensors().size() != 1) {
      std::string names;
      for (const auto& v : file.tensors()) names += (names.empty() ? "\"" : ", \"") + v.name + "\"";
      throw Error("compare.missing_tensor",
                  what + " has no tensor \"logits\" and " + std::to_string(file.tensors().size()) +
                      " tensors (" + (names.empty() ? "none" : names) + "), not exactly one");
    }
    t = &file.tensors().front();
  }
  tensor = *t;
  if (tensor.dtype == common::Dtype::kF32)
    element = Element::kF32;
  else if (tensor.dtype == common::Dtype::kBF16)
    element = Element::kBF16;
  else
    throw Error("compare.bad_dtype", what + ": tensor \"" + tensor.name + "\" has dtype " +
                                         std::string(common::dtype_name(tensor.dtype)) +
                                         ", not F32 or BF16");
}

std::string Logits::shape_text() const {
  std::string s = "[";
  for (std::size_t i = 0; i < tensor.shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(tensor.shape[i]);
  return s + "]";
}

void Logits::check_shape(std::int64_t rows, std::int64_t vocab) const {
  const std::string expected =
      "[" + std::to_string(rows) + ", " + std::to_string(vocab) + "] (scored positions, vocab)";
  if (tensor.shape.size() != 2)
    throw Error("compare.bad_shape", what + ": tensor \"" + tensor.name + "\" has shape " +
                                         shape_text() + ", expected " + expected);
  if (tensor.shape[1] != vocab)
    throw Error("compare.vocab_mismatch",
                what + ": tensor \"" + tensor.name + "\" has " + std::to_string(tensor.shape[1]) +
                    " columns but vocab_size is " + std::to_string(vocab));
  if (tensor.shape[0] != rows)
    throw Error("compare.bad_shape", what + ": tensor \"" + tensor.name + "\" has " +
                                         std::to_string(tensor.shape[0]) +
                                         " rows but the context scores " + std::to_string(rows) +
                                         " positions; expected shape " + expected);
}

void Logits::hash(bool whole_file, bool raw) {
  constexpr std::size_t kChunk = 4 << 20;
  common::Sha256 file_hash, tensor_hash;
  std::span<const std::byte> image = file.image();
  const std::byte* t0 = tensor.data;
  const std::byte* t1 = tensor.data + tensor.nbytes;
  for (std::size_t off = 0; off < image.size(); off += kChunk) {
    const std::byte* a = image.data() + off;
    const std::byte* b = a + std::min(kChunk, image.size() - off);
    if (whole_file) file_hash.update(a, static_cast<std::size_t>(b - a));
    const std::byte* lo = std::max(a, t0);
    const std::byte* hi = std::min(b, t1);
    if (raw && lo < hi) tensor_hash.update(lo, static_cast<std::size_t>(hi - lo));
  }
  if (whole_file) file_sha256 = common::identity(file_hash.finish());
  if (raw) tensor_sha256 = common::identity(tensor_hash.finish());
}

void Logits::check_sha256() const {
  if (ref.sha256 && *ref.sha256 != *file_sha256)
    // The file's own digest is not named: the error reaches the submitter, who may not be
    // allowed to read what the path led to.
    throw Error("compare.sha_mismatch", what + ": the file's sha256 differs from the " +
                                            *ref.sha256 + " the input expects");
}

double Logits::at(std::size_t row, std::size_t vocab, std::int64_t column) const {
  const std::byte* p = tensor.data + (row * vocab + static_cast<std::size_t>(column)) *
                                         (element == Element::kF32 ? 4 : 2);
  float f;
  if (element == Element::kF32) {
    std::memcpy(&f, p, sizeof f);
  } else {
    std::uint16_t h;
    std::memcpy(&h, p, sizeof h);
    std::uint32_t w = static_cast<std::uint32_t>(h) << 16;
    std::memcpy(&f, &w, sizeof f);
  }
  return f;
}

std::string Logits::value_text(std::size_t row, std::size_t vocab, std::int64_t column) const {
  float f;
  const std::byte* p = tensor.data + (row * vocab + static_cast<std::size_t>(column)) *
                                         (element == Element::kF32 ? 4 : 2);
  if (element == Element::kF32) {
    std::memcpy(&f, p, sizeof f);
  } else {
    std::uint16_t h;
    std::memcpy(&h, p, sizeof h);
    std::uint32_t w = static_cast<std::uint32_t>(h) << 16;
    std::memcpy(&f, &w, sizeof f);
  }
  if (std::isnan(f)) return "NaN";
  return f > 0 ? "+Inf" : "-Inf";
}

}  // namespace assay::compare
