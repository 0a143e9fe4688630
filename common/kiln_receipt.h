// Kiln's engine receipts (kiln.serving-benchmark receipts): the checks Kiln's oracle makes before
// it accepts a request naming them (../shared/fixtures/README.md), plus one Kiln only compares:
// the receipt's own receipt_sha256 is recomputed from its body.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/json.h"
#include "common/request.h"

namespace assay::common {

inline constexpr std::size_t kMaxReceiptBytes = 16 * 1024 * 1024;

// The engines a Kiln request names receipts for, with the request.source key of each.
struct ReceiptSlot {
  std::string engine;  // "kiln", "vllm"
  std::string key;     // "kiln_receipt", "vllm_receipt"
};
std::vector<ReceiptSlot> receipt_slots();

// What one receipt passed: {"engine", "file_sha256", "receipt_sha256", "checks": [names]}.
struct ReceiptReport {
  std::string engine;
  std::string file_sha256;
  std::string receipt_sha256;
  std::vector<std::string> checks;
  Json to_json() const;
};

// The check names, in the order they run: file_sha256, json, receipt_sha256, content_sha256,
// engine, source_commit, clean_tree, run_id, model_identity, single_run, prompt_token_count,
// single_output, empty_reasoning, output_sha256, continuation.
//
// Checks `bytes` (the file, already opened as a regular file without following a link) against
// what the Kiln request `request` says of `slot`'s receipt. Throws
// Error("request.receipt_mismatch") naming the engine, the check and both values at the first
// check that fails.
ReceiptReport check_kiln_receipt(const NextTokenRequest& request, const ReceiptSlot& slot,
                                 std::string_view bytes);

// The result's request.receipts: {"checked": true, "receipts": [ReceiptReport...]} or
// {"checked": false, "reason"}.
Json receipts_checked(const std::vector<ReceiptReport>& reports);
Json receipts_not_checked(std::string_view reason);
// receipts_not_checked for a request submitted without receipts: the same for a single job and
// a batch's state, so that their results differ only by "batch".
Json receipts_not_given(const NextTokenRequest& request);

}  // namespace assay::common
