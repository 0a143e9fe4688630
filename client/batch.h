// Batch submissions: a JSONL file of next-token requests (assay's or Kiln's, one per line) made
// into one assay.next-token-batch-request.v1, and the summary a finished batch prints.
#pragma once

#include <string>

#include "common/json.h"

namespace assay::client {

struct BatchDocument {
  std::string body;  // the batch request, canonical JSON
  std::string request_sha256;
  std::size_t states = 0;
};

// Each non-empty line of `jsonl` is one state's request. The batch's id is `id`. Throws
// common::Error naming the line (and the state) of the first bad request.
BatchDocument batch_from_jsonl(const std::string& jsonl, const std::string& id);

// The summary of an assay.next-token-batch-result.v1: counts per verdict and a line per state.
std::string batch_report(const common::Json& result);

}  // namespace assay::client
