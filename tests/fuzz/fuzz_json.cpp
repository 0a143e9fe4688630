// Strict parsing never crashes; whatever it accepts canonicalises, and the canonical form
// parses back to the same canonical form.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "common/error.h"
#include "common/json.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  assay::common::Json value;
  try {
    value = assay::common::parse_strict(text, {1 << 20, 64, true});
  } catch (const assay::common::Error&) {
    return 0;
  }
  std::string c = assay::common::canonical(value);
  // 1e20 canonicalises to an integer literal past 2^53, so re-parse without exact integers.
  std::string again =
      assay::common::canonical(assay::common::parse_strict(c, {1 << 22, 64, false}));
  if (c != again) std::abort();
  return 0;
}
