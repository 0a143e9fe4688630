// What the oracle's modes share: deterministic set-up, the forward over one token sequence, the
// logits file, and the execution report every worker-protocol output carries.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>

#include <ATen/ATen.h>

#include "common/json.h"
#include "common/kiln_schemas.h"
#include "worker/loader.h"
#include "worker/model_files.h"
#include "worker/next_token.h"

namespace assay::oracle {

using Clock = std::chrono::steady_clock;
// When the process started (its "duration_seconds").
extern const Clock::time_point kStart;
double seconds_since(Clock::time_point t);
std::int64_t peak_rss_bytes();

// Deterministic algorithms, no TF32, a fixed number of threads. Must run before any ATen work.
void make_deterministic(int threads);
c10::ScalarType parse_dtype(const std::string& requested, const common::Json& config);
c10::Device parse_device(const std::string& name);

struct Forward {
  at::Tensor logits;  // F32 [T, vocab] on CPU, contiguous
  double load_seconds = 0, forward_seconds = 0;
  std::string architecture, attention, linear_attention;
};
// One eager forward over `ids`; throws Error("request.invalid_token_id") naming an id outside
// the vocabulary.
Forward run_forward(const std::filesystem::path& model_dir, std::span<const std::int64_t> ids,
                    const ExecOptions& options, const LoadedModel& loaded);
void write_logits(const std::filesystem::path& path, std::span<const std::int64_t> ids,
                  const at::Tensor& logits, const std::map<std::string, std::string>& metadata);
// The file's __metadata__: assay's (architecture, dtype, device) and Kiln's keys, each a fact of
// this run; "schema" only when the file has Kiln's layout (`last_position`).
std::map<std::string, std::string> logits_metadata(const Forward& f, const ExecOptions& o,
                                                   std::span<const std::int64_t> ids,
                                                   bool last_position);

// What every worker-protocol output says about how it ran.
void add_execution_report(common::Json& out, const ExecOptions& options, int threads,
                          const std::string& attention, const std::string& linear_attention);
ModelFiles open_model_files(const std::filesystem::path& dir, const ModelFds& fds);
// The worker-protocol "execution" object as options, after making ATen deterministic (which
// must come before any ATen work).
ExecOptions prepare_execution(const Execution& e, ModelFiles& files);

// A next-token output (assay.oracle-output.v1) without its process-wide fields (bytes_used, the
// execution report, timings): the ranking of the last position's logits, written to
// `workdir/logits_file`. The single and the batch mode build it the same way, so that a state's
// logits and ranking are those of a single job.
common::Json next_token_output(const std::filesystem::path& workdir, const std::string& logits_file,
                               std::span<const std::int64_t> ids,
                               const std::vector<Candidate>& candidates, const Forward& f,
                               const ExecOptions& options, const LoadedModel& loaded,
                               const Tokenizer& tokenizer);

}  // namespace assay::oracle
