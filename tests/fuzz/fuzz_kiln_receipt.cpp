// Kiln's engine receipts as assayd checks them against Kiln's real request
// (tests/client/fixtures/kiln-request-v1.json) with common::check_kiln_receipt, for both slots.
// The first check is the file's sha256, which no mutation keeps; so each input is checked twice:
// as it is, with the request naming its sha256, and sealed as Kiln seals a receipt (receipt_sha256
// of its body in Kiln's canonical form; tests/client/receipt_test.cpp does the same), with the
// request naming both digests, so that the later checks see the fuzzed fields.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "common/error.h"
#include "common/identity.h"
#include "common/kiln_receipt.h"
#include "tests/fuzz/fuzz.h"

namespace {

using namespace assay;

const common::NextTokenRequest& kiln_request() {
  static const auto r =
      common::parse_request(fuzz::source_file("tests/client/fixtures/kiln-request-v1.json"));
  return r;
}

// Checks `bytes` as `slot`'s receipt of a request naming `file_sha256` and `content_sha256`.
void check(const common::ReceiptSlot& slot, std::string_view bytes,
           const std::string& content_sha256) {
  common::NextTokenRequest r = kiln_request();
  r.source[slot.key]["file_sha256"] = common::sha256_id(bytes);
  if (!content_sha256.empty()) r.source[slot.key]["content_sha256"] = content_sha256;
  try {
    common::ReceiptReport report = common::check_kiln_receipt(r, slot, bytes);
    // Every check passed, in order, ending with the continuation.
    if (report.checks.empty() || report.checks.back() != "continuation") std::abort();
    (void)common::receipts_checked({report});
  } catch (const common::Error& e) {
    if (e.code() != "request.receipt_mismatch") std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string_view bytes = fuzz::as_text(data, size);
  for (const auto& slot : common::receipt_slots()) check(slot, bytes, "");
  common::Json receipt;
  try {
    receipt = common::parse_strict(bytes, {.max_bytes = common::kMaxReceiptBytes});
  } catch (const common::Error&) {
    return 0;
  }
  if (!receipt.is_object()) return 0;
  receipt.erase("receipt_sha256");
  std::string sealed_sha256;
  try {
    sealed_sha256 = common::sha256_id(common::python_canonical(receipt));
  } catch (const common::Error&) {
    return 0;
  }
  receipt["receipt_sha256"] = sealed_sha256;
  const std::string sealed = common::python_canonical(receipt);
  for (const auto& slot : common::receipt_slots()) check(slot, sealed, sealed_sha256);
  return 0;
}
