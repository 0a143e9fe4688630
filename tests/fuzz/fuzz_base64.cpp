// Canonical base64 (common::base64_decode, used for DSSE payloads and signatures and Kiln's
// receipt outputs): it never crashes, and whatever it accepts is exactly what base64_encode
// writes for the bytes it decodes to (RFC 4648 section 3.5: one text per byte string).
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "common/error.h"
#include "common/sign.h"
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace assay;
  std::string_view text = fuzz::as_text(data, size);
  std::string bytes;
  try {
    bytes = common::base64_decode(text);
  } catch (const common::Error& e) {
    if (e.code() != "sign.base64") std::abort();
    return 0;
  }
  if (common::base64_encode(bytes) != text) std::abort();
  // And the other way: the input taken as bytes encodes to a text that decodes back to it.
  if (common::base64_decode(common::base64_encode(text)) != text) std::abort();
  return 0;
}
