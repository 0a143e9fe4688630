// Logits files, temp dirs and command runs for the compare tests.
#pragma once


#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/fs.h"
#include "common/json.h"
#include "common/safetensors.h"
#include "tests/support/process.h"

namespace assay::compare::test {

namespace fs = std::filesystem;

using test_support::TempDir;

// Round to nearest even, as torch and numpy-based writers store bf16.
inline std::uint16_t to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

inline float from_bf16(std::uint16_t h) {
  std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Row-major [rows, vocab] logits ~ N(0, sigma), deterministic per seed.
inline std::vector<float> random_logits(std::size_t rows, std::size_t vocab, std::uint64_t seed,
                                        float sigma = 3.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(rows * vocab);
  for (float& x : v) x = d(rng);
  return v;
}

// values rounded to bf16 and back, so F32 and BF16 files can hold the same numbers.
inline std::vector<float> bf16_exact(std::vector<float> v) {
  for (float& x : v) x = from_bf16(to_bf16(x));
  return v;
}

// Writes a safetensors file with `name` holding `values` as F32 or BF16 [rows, vocab].
inline void write_logits(const fs::path& path, const std::vector<float>& values, std::size_t rows,
                         std::size_t vocab, common::Dtype dtype = common::Dtype::kF32,
                         const std::string& name = "logits") {
  std::vector<std::uint16_t> half;
  std::span<const std::byte> bytes = std::as_bytes(std::span<const float>(values));
  if (dtype == common::Dtype::kBF16) {
    for (float f : values) half.push_back(to_bf16(f));
    bytes = std::as_bytes(std::span<const std::uint16_t>(half));
  }
  common::write_safetensors(
      path,
      {{name, dtype, {static_cast<std::int64_t>(rows), static_cast<std::int64_t>(vocab)}, bytes}});
}

using test_support::CommandResult;
using test_support::quote;
using test_support::run_command;

inline bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

}  // namespace assay::compare::test
