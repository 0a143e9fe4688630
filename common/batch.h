// Batch requests (assay.next-token-batch-request.v1): many next-token states on one model, each
// any single request assay accepts (assay's or Kiln's), run by one oracle worker that loads the
// model once. Parsed strictly and checked offline, like common/request.h.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "common/json.h"
#include "common/request.h"

namespace assay::common {

inline constexpr std::size_t kMaxBatchStates = 4096;

struct BatchRequest {
  std::string schema;  // protocol::kNextTokenBatchRequest
  std::string id;
  std::optional<std::string> model_dir;  // absolute; else the states' or the submission's
  RequestLimits limits;                  // per worker run, as a single job's
  std::vector<NextTokenRequest> states;
  // The model identity the states name (all that name one name the same content_sha256).
  std::optional<Json> model_identity;
  std::string request_sha256;  // sha256 of the RFC 8785 form of the whole document
};

// {"schema", "id", "model_dir"?, "limits"?, "states": [request, ...]} with 1 to kMaxBatchStates
// states. Throws Error with validate_request's codes, the message naming the state
// ("states[3]: ..."), and:
//   request.invalid       a missing, mistyped or unknown field; a state with its own limits
//   request.mixed_models  states that name different model directories or identities
BatchRequest validate_batch_request(const Json& document);

}  // namespace assay::common
