// Next-token requests, assay's and Kiln's, as assayd reads a submission's body
// (common::parse_request: the strict parse with kMaxRequestBytes, then validate_request). What it
// accepts keeps the header's promises, and its canonical form is accepted again as the same
// request (the same request_sha256).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <set>

#include "common/error.h"
#include "common/kiln_receipt.h"
#include "common/request.h"
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace assay;
  common::NextTokenRequest r;
  try {
    r = common::parse_request(fuzz::as_text(data, size));
  } catch (const common::Error&) {
    return 0;
  }
  if (r.input_token_ids.empty() || r.candidates.empty() ||
      r.candidates.size() > common::kMaxCandidates)
    std::abort();
  std::set<std::string> engines;
  std::int64_t top = 0;
  for (const auto& c : r.candidates) {
    if (c.engine == "neither" || !engines.insert(c.engine).second) std::abort();
    top = std::max(top, c.token_id);
  }
  for (std::int64_t id : r.input_token_ids) {
    if (id < 0 || id > common::kMaxTokenId) std::abort();
    top = std::max(top, id);
  }
  if (r.input_token_ids_sha256 != common::token_ids_sha256(r.input_token_ids)) std::abort();
  r.check_vocab(top + 1);  // every id is below it: must not throw
  try {
    r.check_vocab(top);
    std::abort();
  } catch (const common::Error& e) {
    if (e.code() != "request.invalid_token_id") std::abort();
  }
  (void)r.check_report();
  (void)common::receipts_not_given(r);
  // Refused again would throw, a finding. A Kiln request is hashed in Kiln's form, which keeps
  // 300.0 a float; RFC 8785 would write 300. A float past 2^53 is written as an integer.
  std::string form = r.kind == common::RequestKind::kKiln ? common::kiln_canonical(r.document)
                                                          : common::canonical(r.document);
  common::NextTokenRequest again = common::validate_request(
      common::parse_strict(form, {.max_bytes = 1 << 26, .exact_integers = false}));
  if (again.request_sha256 != r.request_sha256 || again.kind != r.kind) std::abort();
  return 0;
}
