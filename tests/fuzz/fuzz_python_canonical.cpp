// Kiln's canonical form (common::python_canonical, the form Kiln's self-hashes are computed over)
// never crashes on what the strict parser accepts; it is pure ASCII, and it is a fixed point:
// the form parsed again and written again gives the same bytes.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "common/error.h"
#include "common/json.h"
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace assay;
  common::Json value;
  try {
    value = common::parse_strict(fuzz::as_text(data, size), {.max_bytes = 1 << 20});
  } catch (const common::Error&) {
    return 0;
  }
  std::string form;
  try {
    form = common::python_canonical(value);
  } catch (const common::Error&) {
    return 0;  // json.not_canonicalizable: a refusal, not a crash
  }
  for (char c : form)
    if (static_cast<unsigned char>(c) > 0x7f) std::abort();
  // Integers past 2^53 cannot appear (exact integers above), floats re-parse as floats.
  std::string again = common::python_canonical(
      common::parse_strict(form, {.max_bytes = 1 << 22, .exact_integers = false}));
  if (again != form) std::abort();
  return 0;
}
