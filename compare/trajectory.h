// Trajectory attribution: per engine, the reference's logits at every position that predicted
// one of the engine's continuation tokens (an `assay-oracle capture` over prompt + continuation),
// reduced to the reference argmax, its margin over the runner-up and the engine's token's rank;
// then where each engine first left the reference, and where the engines first left each other.
// The worker `assay-compare trajectory` is parse_trajectory_input + analyse_trajectory +
// write_trajectory_outputs. No LibTorch; the [rows, vocab] logits are read through the mapping,
// one row at a time.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "common/json.h"

namespace assay::compare {

struct TrajectoryEngine {
  std::string engine;
  std::vector<std::int64_t> token_ids;  // the continuation; row i of the logits predicts token i
  std::string logits_path;              // relative to the workspace (the cwd), or absolute
};

struct TrajectoryInput {
  std::int64_t vocab_size = 0;
  std::int64_t prompt_length = 0;  // row i is position prompt_length - 1 + i
  std::string artifact_file;       // a plain file name in the workdir
  std::vector<TrajectoryEngine> engines;
};

// Validates an assay.compare-trajectory-input.v1 document (unknown fields refused); throws
// Error("input.invalid") naming the field and the value.
TrajectoryInput parse_trajectory_input(const common::Json& doc, const std::string& where);

struct TrajectoryAnalysis {
  common::Json document;  // assay.compare-trajectory-output.v1
  std::string artifact;   // the safetensors image whose sha256 the document holds
};

// Reads every file (tensor "logits", F32 or BF16, [continuation length, vocab_size]) and
// analyses it. The reference argmax is the lowest index among the largest logits; an engine
// departs at the first index whose token is not that argmax. Throws Error with
// compare.bad_file, compare.missing_tensor, compare.bad_dtype, compare.bad_shape,
// compare.vocab_mismatch, compare.non_finite.
TrajectoryAnalysis analyse_trajectory(const TrajectoryInput& input);

// <workdir>/<artifact_file>, then <workdir>/output.json, both atomically.
void write_trajectory_outputs(const TrajectoryAnalysis& a, const std::filesystem::path& workdir,
                              const std::string& artifact_file);

}  // namespace assay::compare
