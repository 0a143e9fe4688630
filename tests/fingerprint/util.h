// Model directories on disk and command runs for the fingerprint tests.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <stdexcept>
#include <string>

#include "fingerprint/fingerprint.h"

namespace assay::fingerprint::test {

namespace fs = std::filesystem;

// A fresh directory under $TMPDIR, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "assay-fp-XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  fs::path path_;
};

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

struct CommandResult {
  int status = -1;
  std::string out;
};

// Runs `cmd` with /bin/sh; stdout (and stderr if the command redirects it) is captured.
inline CommandResult run_command(const std::string& cmd) {
  CommandResult r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) throw std::runtime_error("popen failed: " + cmd);
  std::array<char, 4096> buf{};
  std::size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

inline std::string quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += (c == '\'') ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

}  // namespace assay::fingerprint::test
