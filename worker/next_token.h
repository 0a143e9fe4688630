// The next-token command's documents without the model: assay.oracle-input.v1 parsing and
// the ranking of a logits vector (argmax, top tokens, candidate ranks, margin).
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/json.h"
#include "fingerprint/model_fds.h"
#include "worker/tokenizer.h"

namespace assay::oracle {

struct Candidate {
  std::string engine;
  std::int64_t token_id = 0;
  std::string text;
};

struct Execution {
  std::string device = "cpu";  // cpu, cuda, cuda:N
  std::string dtype = "bfloat16";
  int threads = 1;
};

// The files the supervisor opened (input "model_fds"); when given, the model is read only
// through them. Throws Error("input.invalid") naming the entry.
using ModelFds = std::optional<std::vector<fingerprint::ModelFd>>;
ModelFds parse_optional_model_fds(const common::Json& doc, const std::string& where);

// What a next-token dispute asks of the model: a single input holds one, a batch input many.
struct Dispute {
  std::vector<std::int64_t> input_token_ids;
  std::vector<Candidate> candidates;
  // Kiln's continuation_prefix: ids the engine generated before the dispute, with the text it
  // says each decodes to (engine is empty). Checked against the tokenizer like candidates.
  std::vector<Candidate> continuation_prefix;
};

struct OracleInput : Dispute {
  std::filesystem::path model_dir;
  ModelFds model_fds;
  // Shards whose digest the fingerprint left to this worker (ModelFiles::expect_unchanged).
  std::vector<fingerprint::FileState> unchanged_files;
  Execution execution;
};

// One state of an assay.oracle-batch-input.v1: its index in the batch request.
struct BatchState : Dispute {
  std::size_t index = 0;
};

struct OracleBatchInput {
  std::filesystem::path model_dir;
  ModelFds model_fds;
  std::vector<BatchState> states;
  Execution execution;
};

// The "execution" object of the worker inputs; throws like parse_oracle_input.
Execution parse_execution(const common::Json& ex, const std::string& where);

// Throws common::Error("input.invalid" / "json.unknown_field") naming the field.
OracleInput parse_oracle_input(const common::Json& doc);
OracleBatchInput parse_oracle_batch_input(const common::Json& doc);

// Throws Error("request.invalid_token_id") naming the position and value when an id is
// outside [0, vocab_size).
void check_token_ids(std::span<const std::int64_t> ids, std::int64_t vocab_size,
                     const std::string& what);

// Throws Error("request.candidate_text_mismatch") when a candidate's text is not what its
// token id decodes to, Error("request.invalid_token_id") when the id is out of range.
// Throws common::Error("request.token_text_mismatch") naming the index, the id, the claimed and
// the decoded text of the first continuation_prefix token whose text is not its decoding.
void check_prefix_texts(const std::vector<Candidate>& prefix, const Tokenizer& tokenizer);
void check_candidates(const std::vector<Candidate>& candidates, const Tokenizer& tokenizer,
                      std::int64_t vocab_size);
// The tokenizer's half of check_candidates, before the model is loaded: a wrong text is refused
// in milliseconds, not after the weights were read.
void check_candidate_texts(const std::vector<Candidate>& candidates, const Tokenizer& tokenizer);

// argmax (lowest id among equal maxima), argmax_text, top_tokens (10, highest first, ties by
// id), candidate_tokens with rank = 1 + count of strictly greater logits, top_logit_margin
// (top-1 minus top-2 logit, 0 with top_logit_tie true on an exact tie). Throws
// Error("oracle.non_finite_logits") naming the first NaN/Inf position.
common::Json rank_logits(std::span<const float> logits, const Tokenizer& tokenizer,
                         const std::vector<Candidate>& candidates);

}  // namespace assay::oracle
