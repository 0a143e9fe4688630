// What the fuzz targets share: the input as text, inputs made of parts, the source tree's
// fixtures, the engine's way of failing a job, a scratch directory for the parsers that read files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/fs.h"

namespace assay::fuzz {

inline std::string_view as_text(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// A target that takes several documents reads them from one input cut at this line; the seeds
// are written the same way, so they stay readable.
inline constexpr std::string_view kPartSeparator = "\n--assay-fuzz-part--\n";

inline std::vector<std::string_view> parts(std::string_view text, std::size_t max_parts) {
  std::vector<std::string_view> out;
  while (out.size() + 1 < max_parts) {
    auto cut = text.find(kPartSeparator);
    if (cut == std::string_view::npos) break;
    out.push_back(text.substr(0, cut));
    text.remove_prefix(cut + kPartSeparator.size());
  }
  out.push_back(text);
  return out;
}

// A file of the source tree (ASSAY_SOURCE_DIR is set by tests/fuzz/CMakeLists.txt).
inline std::string source_file(const std::string& relative) {
  return common::read_file(std::filesystem::path(ASSAY_SOURCE_DIR) / relative, 64 << 20);
}

// Failures that are not common::Error, by message, printed at exit as "supervisor.internal xN:
// what" (scripts/fuzz counts them); never destroyed, the exit handler reads it.
inline std::map<std::string, std::size_t>& internal_failures() {
  static auto* seen = [] {
    std::atexit([] {
      for (const auto& [what, n] : internal_failures())
        std::fprintf(stderr, "supervisor.internal x%zu: %s\n", n, what.c_str());
    });
    return new std::map<std::string, std::size_t>;
  }();
  return *seen;
}

// Runs `f` as assayd runs a job's steps (jobs/engine.cpp, jobs/scheduler.cpp): common::Error
// fails the job with its code, any other std::exception with "supervisor.internal", which is
// counted here. False when the job failed.
inline bool as_the_engine_does(const std::function<void()>& f) {
  try {
    f();
    return true;
  } catch (const common::Error&) {
    return false;
  } catch (const std::exception& e) {
    ++internal_failures()[std::string(e.what()).substr(0, 160)];
    return false;
  }
}

// A fresh directory under $TMPDIR for this process, removed when it exits.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    std::string pattern = (std::filesystem::temp_directory_path() / "assay-fuzz-XXXXXX").string();
    if (!mkdtemp(pattern.data())) std::abort();
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(scratch_dir(), ec);
    });
    return std::filesystem::path(pattern);
  }();
  return dir;
}

}  // namespace assay::fuzz
