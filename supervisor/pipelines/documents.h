// What the supervisor makes of the workers' documents and the model directory's config.json: the
// oracle's input and output, the verdict, the checkpoint's dtype and sizes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/json.h"
#include "common/request.h"

namespace assay::supervisor {

// The dtype the oracle runs a checkpoint in: float32 checkpoints in float32, the rest bfloat16.
std::string execution_dtype(const std::string& model_dir);
// config.json's vocab_size (top level or text_config, as multimodal checkpoints nest it);
// throws Error("request.bad_model") naming the file when unreadable or absent.
std::int64_t read_vocab_size(const std::filesystem::path& model_dir);
// config.json, read with no link followed; Error("request.bad_model") naming it otherwise.
common::Json read_model_config(const std::filesystem::path& model_dir);
// config.json's hidden_size (top level or text_config); Error("request.bad_model") when absent.
std::int64_t read_hidden_size(const std::filesystem::path& model_dir);
// config.json's max_position_embeddings, when it has one.
std::optional<std::int64_t> read_max_positions(const std::filesystem::path& model_dir);
// config.json's eos_token_id (an integer or a list of them, at the top or in text_config); empty
// when it names none.
std::vector<std::int64_t> read_eos_token_ids(const std::filesystem::path& model_dir);

// Bytes the oracle needs for a model directory and a forward over `tokens` tokens (the longest
// sequence of the job): shard bytes, the dtype of config.json and estimate_sequence_bytes. Looks
// at the directory with stat only (a FIFO or device named *.safetensors is not opened).
// `logit_rows`: the logits rows held at once (every position for a next-token forward; a
// capture's block for the LM head in blocks); default `tokens`.
std::uint64_t estimate_required_bytes(const std::filesystem::path& model_dir,
                                      std::uint64_t tokens = 0,
                                      std::optional<std::uint64_t> logit_rows = std::nullopt);
// What grows with the sequence: eager attention's heads x T x T scores and weights (execution
// dtype and float32 softmax), the causal mask, and T x vocab logits (execution dtype and
// float32). Long prompts were OOM-killed under a limit sized by the weights alone.
std::uint64_t estimate_sequence_bytes(const std::filesystem::path& model_dir, std::uint64_t tokens,
                                      std::uint64_t logit_rows);

// assay.oracle-input.v1 for a request.
common::Json oracle_input(const std::string& model_dir, const common::NextTokenRequest& request,
                          const common::Json& candidates, const std::string& device, int threads);
// File name of the logits artifact inside the oracle's workspace.
std::string oracle_artifact_name(const common::Json& oracle_output);
// The result's "oracle" section: the worker's output plus its containment evidence.
common::Json oracle_section(const common::Json& oracle_output, const common::Json& evidence);
// The result's "source": the tree assayd was built from, as embedded at build time
// (cmake/build_info.cmake): {version, git_commit, git_tree (the commit's tree object),
// origin_main (what refs/remotes/origin/main named, or null), tree_modified, reason}. Without a
// git identity (a release tarball) the git fields are null and reason says why.
common::Json source_section();
// The oracle's reported execution configuration, checked: configuration_sha256 must be the
// canonical sha256 of configuration (Error("worker.oracle_output") otherwise).
void check_configuration(const common::Json& oracle_output, const std::string& role);

// {argmax_candidate, argmax_token_id, candidate_attribution_complete}, by Kiln's rule: the
// argmax_candidate is the engine whose candidate token alone equals the reference argmax, and
// "neither" when none does or several do (two engines that gave the same token). Complete
// means exactly one candidate matches (Kiln's meaning) and, stricter than Kiln, the top logit is
// not tied and the oracle reported every candidate's logit.
common::Json make_verdict(const common::NextTokenRequest& request,
                          const common::Json& oracle_output);

// The last `max_bytes` of a text file ("" when unreadable) as valid UTF-8, for error messages.
std::string tail_file(const std::filesystem::path& path, std::size_t max_bytes);

}  // namespace assay::supervisor
