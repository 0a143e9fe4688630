#include "tests/fuzz/json_assert.h"

#include <execinfo.h>
#include <sanitizer/common_interface_defs.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>

namespace assay::fuzz {

void json_assertion_failed(const char* condition) {
  static const bool throw_instead = [] {
    const char* mode = std::getenv("ASSAY_FUZZ_JSON_ASSERT");
    return mode && std::string(mode) == "throw";
  }();
  if (!throw_instead) {
    std::fprintf(stderr, "nlohmann::json assertion failed: %s\n", condition);
    __sanitizer_print_stack_trace();
    std::abort();
  }
  // The site is the stack above nlohmann's frames; a few return addresses identify it.
  void* frames[8];
  int n = backtrace(frames, 8);
  std::size_t site = 0;
  for (int i = 1; i < n; ++i) site = site * 31 + std::hash<void*>()(frames[i]);
  static std::mutex mutex;
  static std::set<std::size_t>* seen = new std::set<std::size_t>;
  std::lock_guard lock(mutex);
  if (seen->insert(site).second) {
    std::fprintf(stderr, "nlohmann::json assertion failed (site %zu): %s\n", seen->size(),
                 condition);
    __sanitizer_print_stack_trace();
  }
  throw std::logic_error(std::string("nlohmann::json assertion failed: ") + condition);
}

}  // namespace assay::fuzz
