// Next-token oracle requests: assay's own `assay.next-token-request.v1` and Kiln's
// `kiln.hf-next-token-request.v1` (schemas/next-token-request.schema.json,
// schemas/kiln-next-token-request.schema.json), parsed strictly and checked for internal
// consistency. Everything here is offline: nothing touches the model directory.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/json.h"

namespace assay::common {

enum class RequestKind { kAssay, kKiln };

struct Candidate {
  std::string engine;  // unique within a request; "neither" is reserved
  std::int64_t token_id = 0;
  std::string text;
};

// A token Kiln forces after the prompt (continuation_prefix[i]) with the text Kiln claims the
// tokenizer decodes it to; the text is checked where the tokenizer is (the worker).
struct PrefixToken {
  std::int64_t token_id = 0;
  std::string text;
};

// What a job does when one of its workers saw memory pressure (a memory.high/max/oom event or
// swap): record it in the evidence and go on, or fail with worker.memory_pressure (Kiln's rule).
enum class MemoryPolicy { kRecord, kReject };
std::string_view memory_policy_name(MemoryPolicy policy);
// Throws Error(code) naming `where` and the value unless it is "record" or "reject".
MemoryPolicy memory_policy_from(const Json& value, std::string_view where, std::string_view code);

struct RequestLimits {
  std::optional<double> timeout_seconds;      // per worker run
  std::optional<std::uint64_t> memory_bytes;  // per worker cgroup memory.max
  // Absent: the configured policy. A Kiln request without it gets Kiln's (reject).
  std::optional<MemoryPolicy> memory_events;
};

// Request limits the parser enforces.
inline constexpr std::size_t kMaxRequestBytes = 16 * 1024 * 1024;
inline constexpr std::size_t kMaxInputTokens = 1'000'000;
inline constexpr std::size_t kMaxCandidates = 64;
inline constexpr std::size_t kMaxMessages = 1024;  // Kiln prompt.messages
inline constexpr std::int64_t kMaxTokenId = (std::int64_t{1} << 31) - 1;

struct NextTokenRequest {
  RequestKind kind = RequestKind::kAssay;
  std::string schema;  // protocol::kNextTokenRequest or protocol::kKilnNextTokenRequest
  std::string id;
  std::optional<std::string> model_dir;  // absolute; Kiln requests never carry one
  // The expected Kiln-compatible model identity {id, config_hash, tokenizer_hash,
  // chat_template_hash, weight_files, content_sha256}; content_sha256 already re-checked.
  std::optional<Json> model_identity;
  std::vector<std::int64_t> input_token_ids;
  std::string input_token_ids_sha256;  // recomputed (and equal to the document's, if given)
  std::vector<Candidate> candidates;
  RequestLimits limits;
  // Kiln's {source_commit, kiln_receipt, vllm_receipt}, shape-checked and kept verbatim for
  // the result; null for assay requests.
  Json source;
  // sha256 of the canonical form of the whole document: RFC 8785 for an assay request, Kiln's
  // form (kiln_canonical, non-ASCII escaped) for a Kiln request, so it is the id Kiln publishes.
  std::string request_sha256;
  Json document;  // the document as parsed
  // request.oracle.backend: "libtorch" (assay-oracle, the C++ port), "transformers"
  // (assay-hf-worker, transformers' own eager forward) or "both" (libtorch makes the result,
  // transformers is compared with it); absent: the configured oracle_backend.
  std::optional<std::string> backend;
  // request.numerics with every default spelled out ({reduction_seeds, batch_sizes, sdpa,
  // kv_cache, fp32, spread_factor, margin_steps}), or null: the numerics envelope to run beside
  // the reference (common/numerics.h), and the policy its verdict uses.
  Json numerics = nullptr;
  // Kiln: continuation_prefix in order (their ids end input_token_ids); empty for assay requests.
  std::vector<PrefixToken> continuation_prefix;

  // {"schema", "request_sha256", "input_token_ids_sha256", "model_content_sha256" (or null)}:
  // what `assay request check` prints.
  Json check_report() const;
  // Throws Error("request.invalid_token_id") naming the first input or candidate token id
  // that is >= vocab_size.
  void check_vocab(std::int64_t vocab_size) const;
};

// Parses `text` strictly (common::parse_strict: duplicate keys, depth, size) and validates it.
// Throws Error with a stable code naming the offending value:
//   json.invalid                   malformed JSON, duplicate key, too large
//   request.unknown_schema         "schema" is not one of the two request schemas
//   request.invalid                a missing, mistyped, unknown or out-of-range field
//   request.invalid_token_id       a negative or too large token id
//   request.inconsistent_token_ids Kiln: input_token_ids != prompt.token_ids followed by the
//                                  continuation_prefix ids
//   request.token_count_mismatch   Kiln: prompt.token_count != the number of prompt.token_ids
//   request.sha_mismatch           input_token_ids_sha256, model_identity.content_sha256 or
//                                  (Kiln) prompt.utf8_sha256 differs from the value recomputed
//                                  from the document
// Each message names the field, the expected (recomputed) and the found value.
NextTokenRequest parse_request(std::string_view text);
NextTokenRequest validate_request(const Json& document);

// Pieces shared with the fidelity request (common/fidelity.h), with the same errors:
// doc["limits"] (absent: no limits), and the token id array obj[key] named `where.key`.
RequestLimits parse_request_limits(const Json& doc);
// doc["numerics"] with every default spelled out (NextTokenRequest::numerics), or null when
// absent. Throws Error("request.invalid") naming the field and value.
Json parse_numerics_spec(const Json& doc);
std::vector<std::int64_t> parse_token_id_array(const Json& obj, std::string_view key,
                                               std::string_view where, bool allow_empty);

// sha256 of the canonical JSON array of the ids ("[1,2,3]"), as Kiln publishes it.
std::string token_ids_sha256(std::span<const std::int64_t> ids);
// Kiln's canonical JSON (Python json.dumps(sort_keys, separators=(",",":"), ensure_ascii,
// allow_nan=False)): common::python_canonical. It differs from RFC 8785 (canonical()) in its
// escapes (every non-ASCII character as \uXXXX) and its floats (300.0 stays 300.0, 1e-05 keeps
// its exponent); it was the RFC 8785 form re-escaped until Kiln's real results, whose floats
// did not recompute, showed the difference.
std::string kiln_canonical(const Json& value);
// Recomputes a Kiln-compatible identity's content_sha256: the sha256 of Kiln's canonical form
// (kiln_canonical) of {id, config_hash, tokenizer_hash, chat_template_hash, weight_files}. Throws
// Error("request.invalid") when the identity is malformed (names the field).
std::string model_content_sha256(const Json& model_identity);
// Checks the identity's shape and its content_sha256; throws as above.
void validate_model_identity(const Json& model_identity, std::string_view where);

}  // namespace assay::common
