// Kiln's prompt check (issue 24): a Kiln request's prompt.messages rendered with the model's own
// chat template by transformers' apply_chat_template, contained, from the files the fingerprint
// hashed, and the ids required to be prompt.token_ids, before any oracle runs.
#pragma once

#include <string>

#include "common/json.h"
#include "common/request.h"
#include "supervisor/config.h"
#include "supervisor/pipelines/pipeline.h"
#include "supervisor/pipelines/steps.h"

namespace assay::supervisor {

// Memory the transformers worker needs (Python, transformers, a tokenizer): the preflight's floor
// for a job with the check.
inline constexpr std::uint64_t kPromptCheckBytes = 1ull << 30;

// The check runs for a Kiln request whose expected model has a chat template; otherwise the
// result says why not (prompt_check_skipped). A batch does not run it for its states (yet): for
// a state it would apply to, the state's result says so.
bool prompt_check_applies(const common::NextTokenRequest& request);
common::Json prompt_check_skipped(const common::NextTokenRequest& request,
                                  bool batch_state = false);
// A host without assay-hf-worker (a package without transformers) cannot render: the job still
// runs, and its result says the prompt was not checked and why, as for missing receipts.
bool prompt_check_available(const Config& config);
common::Json prompt_check_unavailable(const Config& config);

// The step (assay-hf-worker render-prompt). Its accept() requires the worker to have read the
// tokenizer and chat template the fingerprint hashed (else job.bytes_mismatch) and the rendered
// ids to be the request's: otherwise Error("request.prompt_mismatch") naming the first differing
// index, both ids and their decoded texts. `out` gets the result's request.prompt_check.
Step prompt_check_step(const Config& config, const std::string& model_dir,
                       const common::NextTokenRequest& request, const FingerprintRun& fingerprint,
                       common::Json& out);

}  // namespace assay::supervisor
