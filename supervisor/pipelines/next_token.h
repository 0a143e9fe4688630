// The next-token result (assay.next-token-oracle-result.v1), built the same way for a single job
// and for each state of a batch, so that a consumer cannot tell them apart but by "batch".
#pragma once

#include <filesystem>
#include <string>

#include "common/json.h"
#include "common/request.h"
#include "supervisor/contain/evidence.h"
#include "supervisor/pipelines/pipeline.h"
#include "supervisor/pipelines/steps.h"

namespace assay::supervisor {

// The result of one dispute: `oracle` is the oracle's output for it, `artifact` its logits file
// (hashed here), `facts.job_id` the job the result is of.
common::Json next_token_result(const Config& config, const RunFacts& facts,
                               const common::NextTokenRequest& request,
                               const FingerprintRun& fingerprint, const common::Json& oracle,
                               const contain::Evidence& oracle_evidence,
                               const std::filesystem::path& artifact, const common::Json& receipts,
                               const common::Json& prompt_check);
// "succeeded: reference argmax ID -> ENGINE", the terminal event of a result.
std::string next_token_message(const common::Json& result);

}  // namespace assay::supervisor
