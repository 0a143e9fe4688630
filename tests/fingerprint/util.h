// Model directories on disk and command runs for the fingerprint tests.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <stdexcept>
#include <string>

#include "fingerprint/fingerprint.h"
#include "tests/support/process.h"

namespace assay::fingerprint::test {

namespace fs = std::filesystem;

using test_support::TempDir;

inline void write_file(const fs::path& path, const std::string& content) {
  fs::create_directories(path.parent_path());
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(content.data(), static_cast<std::streamsize>(content.size()));
  if (!f) throw std::runtime_error("cannot write " + path.string());
}

// Deterministic pseudo-random bytes: real data, different for every seed.
inline std::string random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string out(n, '\0');
  for (std::size_t i = 0; i < n; i += 8) {
    std::uint64_t v = rng();
    for (std::size_t k = 0; k < 8 && i + k < n; ++k) out[i + k] = static_cast<char>(v >> (8 * k));
  }
  return out;
}

// config.json, tokenizer.json, and the named shards of the given sizes.
inline void make_model(const fs::path& dir, const std::map<std::string, std::size_t>& shards,
                       std::uint64_t seed = 1) {
  write_file(dir / "config.json", R"({"model_type":"llama","hidden_size":64})");
  write_file(dir / "tokenizer.json", R"({"version":"1.0","model":{"type":"BPE"}})");
  for (const auto& [name, size] : shards) write_file(dir / name, random_bytes(size, seed++));
}

inline Options with_threads(unsigned threads, double max_read_mib_per_second = 0) {
  Options o;
  o.threads = threads;
  o.max_read_mib_per_second = max_read_mib_per_second;
  return o;
}

inline Options with_hook(std::function<void(const std::string&)> after_read, unsigned threads = 0) {
  Options o;
  o.threads = threads;
  o.after_read = std::move(after_read);
  return o;
}

using test_support::CommandResult;
using test_support::quote;
using test_support::run_command;

}  // namespace assay::fingerprint::test
