// An engine's layer rows file as assayd checks it at admission (supervisor/pipelines/layers.cpp
// admit_layers): the safetensors header read from the descriptor by
// common::read_safetensors_header with its 64 MiB bound, then common::check_engine_rows against
// the layer- and operator-level boundaries of a two-layer model (one linear-attention layer, as
// Qwen3.5's) and a request for the last row and one for all rows. What it accepts names only the
// model's boundaries, each exactly once.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "common/error.h"
#include "common/layers.h"
#include "common/safetensors.h"
#include "tests/fuzz/fuzz.h"

namespace {

using assay::common::Json;

constexpr std::int64_t kHidden = 8;

// Layer- and operator-level boundaries (model_type qwen3: q_norm and k_norm; widths 8, 4, 16).
const std::vector<assay::common::Boundary>& boundaries() {
  static const auto b =
      assay::common::model_boundaries(Json{{"model_type", "qwen3"},
                                           {"num_hidden_layers", 2},
                                           {"hidden_size", kHidden},
                                           {"num_attention_heads", 2},
                                           {"num_key_value_heads", 1},
                                           {"head_dim", 4},
                                           {"intermediate_size", 16},
                                           {"layer_types", {"linear_attention", "full_attention"}}},
                                      kHidden);
  return b;
}

assay::common::LayerRequest request(const char* rows) {
  return assay::common::validate_layer_request(Json{
      {"schema", "assay.layer-attribution-request.v1"},
      {"id", "fuzz"},
      {"model_dir", "/models/tiny"},
      {"input_token_ids", {1, 2, 3}},
      {"rows", rows},
      {"engine",
       {{"name", "kiln"},
        {"rows_file",
         {{"path", "/data/rows.safetensors"}, {"sha256", "sha256:" + std::string(64, 'a')}}}}}});
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace assay;
  static const common::LayerRequest last = request("last"), all = request("all");
  static const int fd = memfd_create("rows", 0);
  if (fd < 0 || ftruncate(fd, 0) != 0 || pwrite(fd, data, size, 0) != static_cast<ssize_t>(size))
    std::abort();
  common::SafetensorsIndex header;
  try {
    header = common::read_safetensors_header(fd, size, 64u << 20);
  } catch (const common::Error&) {
    return 0;
  }
  for (const common::LayerRequest* r : {&last, &all}) {
    try {
      common::EngineRows given =
          common::check_engine_rows(header, boundaries(), *r, "sha256:" + std::string(64, 'b'));
      std::size_t layer_level = 0;
      for (const auto& b : boundaries()) layer_level += !b.operator_level;
      if (given.given.empty() ||
          given.given.size() - given.operators_given.size() + given.omitted.size() != layer_level)
        std::abort();
      for (const auto& name : given.given)
        if (std::count_if(boundaries().begin(), boundaries().end(),
                          [&](const auto& b) { return b.name == name; }) != 1)
          std::abort();
    } catch (const common::Error& e) {
      if (e.code() != "request.bad_layer_rows") std::abort();
    }
  }
  return 0;
}
