// Private to assay-compare: one opened logits safetensors file, validated (the tensor "logits" or
// the only one, F32 or BF16) and mapped, with its shape checks, its digests (the whole file and
// the tensor's raw bytes, in one pass) and row access for the kernel. Every failure is an Error
// naming the file, its role and its context.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "common/safetensors.h"
#include "compare/compare.h"
#include "compare/kernel.h"

namespace assay::compare {

constexpr std::int64_t kMaxVocab = std::int64_t{1} << 24;  // bounds the per-row buffer (128 MiB)

// Opens and validates a safetensors file; any failure is compare.bad_file naming `what`.
common::SafetensorsFile open_logits_file(const LogitsFileRef& r, const std::string& what);

// One opened, validated logits file. Not movable: views point into the mapping.
struct Logits {
  Logits(const LogitsFileRef& r, std::string role_, const std::string& context_);
  Logits(const Logits&) = delete;
  Logits& operator=(const Logits&) = delete;

  std::string shape_text() const;
  // Throws compare.bad_shape or compare.vocab_mismatch unless the tensor is [rows, vocab].
  void check_shape(std::int64_t rows, std::int64_t vocab) const;
  // One pass over the mapping feeding both hashes: the whole file, and the tensor's raw bytes.
  void hash(bool whole_file, bool raw);
  // Throws compare.sha_mismatch when the input expects another sha256 of the file.
  void check_sha256() const;

  Row row(std::size_t i, std::size_t vocab) const {
    std::size_t esize = element == Element::kF32 ? 4 : 2;
    return {tensor.data + i * vocab * esize, element};
  }
  // The element at (row, column), widened exactly to double.
  double at(std::size_t row, std::size_t vocab, std::int64_t column) const;
  // "NaN", "+Inf" or "-Inf": the non-finite element at (row, column), for messages.
  std::string value_text(std::size_t row, std::size_t vocab, std::int64_t column) const;

  const LogitsFileRef& ref;
  std::string role;
  std::string what;
  common::SafetensorsFile file;
  common::TensorView tensor;
  Element element = Element::kF32;
  std::optional<std::string> file_sha256, tensor_sha256;
};

}  // namespace assay::compare
