// The oracle's batch mode: many next-token states on one loaded model.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "common/json.h"
#include "worker/loader.h"
#include "worker/next_token.h"
#include "worker/run.h"
#include "worker/tokenizer.h"

namespace assay::oracle {

// A state's files in the workspace: state-<index>.json (an assay.oracle-output.v1 with
// batch_index, or {"index", "error": {code, message}} for a state that failed alone) and
// state-<index>.safetensors (its logits, written before the .json).
std::string batch_state_file(std::size_t index, std::string_view extension);

// Reads an assay.oracle-batch-input.v1 and writes each state's files as it ends (the .json
// atomically and last), then output.json (assay.oracle-batch-output.v1). Throws common::Error
// for what fails the whole run (the input, the model); a state's own failure is in its file.
int run_next_token_batch(const std::string& input_path, const std::string& workdir);

// Every state of `in` in order on a loaded model, each state's file written into `dir` as it
// ends, then output.json. `process`: bytes_used and load_seconds, copied into every state's
// output, with `extra` (a resident worker's "resident"); duration_seconds count from `started`.
void run_batch_states(const OracleBatchInput& in, const std::filesystem::path& dir,
                      const ExecOptions& options, const LoadedModel& loaded,
                      const Tokenizer& tokenizer, common::Json process, const common::Json& extra,
                      Clock::time_point started);

}  // namespace assay::oracle
