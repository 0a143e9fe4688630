// The safetensors parser never crashes or reads out of bounds; every tensor it accepts lies
// inside the buffer, and its bytes are touched to let ASan check that.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "common/error.h"
#include "common/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::span<const std::byte> image(reinterpret_cast<const std::byte*>(data), size);
  try {
    auto index = assay::common::parse_safetensors(image, 1 << 20);
    unsigned sum = 0;
    for (const auto& t : index.tensors) {
      if (t.data < image.data() || t.data + t.nbytes > image.data() + image.size()) std::abort();
      if (static_cast<std::size_t>(t.numel()) * assay::common::dtype_size(t.dtype) != t.nbytes)
        std::abort();
      for (std::size_t i = 0; i < t.nbytes; ++i) sum += static_cast<unsigned>(t.data[i]);
    }
    (void)sum;
  } catch (const assay::common::Error&) {
  }
  return 0;
}
