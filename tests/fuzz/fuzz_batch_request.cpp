// Batch requests as assayd reads a submission's body (the strict parse with kMaxRequestBytes, as
// supervisor/api/routes.cpp does, then common::validate_batch_request): every state is a request
// validate_request accepts on its own, all on one model, and the canonical form is the same batch.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "common/batch.h"
#include "common/error.h"
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace assay;
  common::Json doc;
  common::BatchRequest b;
  try {
    doc = common::parse_strict(fuzz::as_text(data, size), {.max_bytes = common::kMaxRequestBytes});
    b = common::validate_batch_request(doc);
  } catch (const common::Error&) {
    return 0;
  }
  if (b.states.empty() || b.states.size() > common::kMaxBatchStates) std::abort();
  if (b.states.size() != doc["states"].size()) std::abort();
  for (std::size_t i = 0; i < b.states.size(); ++i) {
    const auto& s = b.states[i];
    if (common::validate_request(doc["states"][i]).request_sha256 != s.request_sha256) std::abort();
    if (s.model_dir && s.model_dir != b.model_dir) std::abort();
    if (s.model_identity &&
        (*s.model_identity)["content_sha256"] != (*b.model_identity)["content_sha256"])
      std::abort();
  }
  auto again = common::validate_batch_request(common::parse_strict(
      common::canonical(doc), {.max_bytes = 1 << 26, .exact_integers = false}));
  if (again.request_sha256 != b.request_sha256) std::abort();
  return 0;
}
