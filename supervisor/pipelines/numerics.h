// The numerics envelope of a next-token state (common/numerics.h): the transformers worker's
// `envelope` step over the oracle's input, and the result's "numerics" section built around the
// oracle's own reference.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "common/json.h"
#include "supervisor/config.h"
#include "supervisor/contain/contain.h"
#include "supervisor/pipelines/pipeline.h"
#include "supervisor/pipelines/steps.h"

namespace assay::supervisor {

// Step "numerics": assay-hf-worker envelope over `states` ([{index, input_token_ids,
// candidate_tokens: [{engine, token_id}]}]) with the request's numerics spec, on the input
// `oracle_input()` makes (the model's descriptors, the execution). Its output is checked: the
// schema, the bytes it computed with against the fingerprint, one figures document per state
// and exactly the members the spec names (Error("worker.numerics_output") otherwise).
Step numerics_step(const Config& config, const std::string& model_dir,
                   std::function<common::Json()> oracle_input, common::Json spec,
                   common::Json states, const FingerprintRun& fingerprint, common::Json& output,
                   std::optional<contain::Evidence>& evidence);

// What the envelope's worker holds at most for a model and a state of `tokens` ids: the weights
// as read, as loaded and as the model's (three copies while transformers builds it), then the
// float32 model; the largest batch's sequence; Python and transformers (1 GiB).
std::uint64_t numerics_required_bytes(const std::string& model_dir, std::uint64_t tokens,
                                      const common::Json& spec);

// The oracle's own reference as a member's figures ({name: "reference", argmax, argmax_logit,
// top_tie, margin, top, candidates, logits_sha256}) from its assay.oracle-output.v1.
common::Json reference_member(const common::Json& oracle_output);

// A result's "numerics": {requested, policy, candidates, members (the oracle's reference first,
// then the worker's, its own reference kept as "reference:transformers" only when its logits
// differ from the oracle's), fp32, transformers_reference_bitwise_equal, verdict, worker}.
// `state` is the worker's document of this state; `worker` its whole output and evidence.
common::Json numerics_section(const common::Json& spec, const common::Json& candidates,
                              const common::Json& oracle_output, const common::Json& state,
                              const common::Json& worker, const contain::Evidence& evidence);

// A section's "worker": the transformers worker's module and executable digests, its
// transformers facts, threads, load and forward seconds, and its process evidence.
common::Json numerics_worker_section(const common::Json& worker, const contain::Evidence& evidence);

// The same section where no single-state oracle document exists (a trajectory's divergence
// state): the members are the worker's own, its eager reference first, and `reference` says
// what that reference is.
common::Json numerics_section_own_reference(const common::Json& spec,
                                            const common::Json& candidates,
                                            const common::Json& state, const common::Json& worker,
                                            const contain::Evidence& evidence,
                                            const std::string& reference);

}  // namespace assay::supervisor
