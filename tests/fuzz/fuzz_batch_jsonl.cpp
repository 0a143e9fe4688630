// `assay submit --batch FILE`: a JSONL file of next-token requests, one per line, made into one
// batch request by client::batch_from_jsonl. Whatever it makes is a batch request assayd accepts
// (common::validate_batch_request) with one state per non-blank line.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "client/batch.h"
#include "common/batch.h"
#include "common/error.h"
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace assay;
  client::BatchDocument b;
  try {
    b = client::batch_from_jsonl(std::string(fuzz::as_text(data, size)), "fuzz");
  } catch (const common::Error&) {
    return 0;
  }
  common::BatchRequest parsed = common::validate_batch_request(
      common::parse_strict(b.body, {.max_bytes = 1 << 26, .exact_integers = false}));
  if (parsed.request_sha256 != b.request_sha256 || parsed.states.size() != b.states) std::abort();
  if (parsed.id != "fuzz") std::abort();
  return 0;
}
