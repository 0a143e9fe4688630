// Layer-attribution requests as assayd reads a submission's body (the strict parse with
// kMaxRequestBytes, as supervisor/api/routes.cpp does, then common::validate_layer_request).
// What it accepts keeps the header's promises and its canonical form is the same request again.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "common/error.h"
#include "common/identity.h"
#include "common/layers.h"
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace assay;
  common::LayerRequest r;
  try {
    r = common::validate_layer_request(
        common::parse_strict(fuzz::as_text(data, size), {.max_bytes = common::kMaxRequestBytes}));
  } catch (const common::Error&) {
    return 0;
  }
  if (r.model_dir.empty() || r.model_dir.front() != '/') std::abort();
  if (r.rows_path.empty() || r.rows_path.front() != '/') std::abort();
  if (!common::is_identity(r.rows_sha256)) std::abort();
  if (r.patching && (r.rows != common::LayerRows::kAll || !r.next_token_id)) std::abort();
  if (r.input_token_ids.empty() || r.input_token_ids.size() > common::kMaxLayerTokens) std::abort();
  if (!(r.tolerance >= 0)) std::abort();
  std::int64_t top = r.next_token_id.value_or(0);
  for (std::int64_t id : r.input_token_ids) top = std::max(top, id);
  r.check_vocab(top + 1);
  if (r.row_count() < 1) std::abort();
  auto again = common::validate_layer_request(common::parse_strict(
      common::canonical(r.document), {.max_bytes = 1 << 26, .exact_integers = false}));
  if (again.request_sha256 != r.request_sha256) std::abort();
  return 0;
}
