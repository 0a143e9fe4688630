// The engine audit (issue 42): whether an engine's outputs over a panel of contexts leave the
// model's arithmetic by more than legitimate executions do. One state cannot tell a subtle bug
// from numerics (common/numerics.h); many positions can.
//
// The anchor is the model's float32 answer: the same bf16 weights with every activation in
// float32 (the envelope's fp32 fact). At every scored position p, d_x(p) is the mean over the
// vocabulary of (log_softmax(x) - log_softmax(fp32))^2 for x the engine's logits or a bf16
// member's (worker/hf/assay_numerics.py: the reference, reduction:<seed>, sdpa). Each member is a
// legitimate execution, so its distance to the anchor is rounding alone; the unit is the member
// whose sum over the panel is largest (the farthest legitimate execution measured). Per context
// c, a_c = sum of the engine's d over c's positions and b_c the unit member's. Then
//   ratio  = sqrt(sum_c a_c / sum_c b_c): the engine's RMS distance in units of the unit's;
//   ci95   = sqrt of R^2 -/+ t_{0.975, n-1} se, se^2 = n/(n-1) sum_c (a_c - R^2 b_c)^2 / (sum b)^2
//            (the delta method for a ratio of sums over n contexts, the contexts independent);
//   test   = the paired one-sided t test of a_c - b_c over the n contexts (df n - 1), H0: the
//            engine is no farther from the anchor than the unit member; p = P(T >= t);
//   class  = "beyond_legitimate" when p < alpha: farther than any legitimate execution measured,
//            over these contexts (a bug is likely), else "within_legitimate" (at this panel's
//            power it is indistinguishable from a correct implementation; ci95's upper end is the
//            largest excess the panel cannot exclude).
// Every figure the class uses is in the record: a verifier recomputes it with this function.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/json.h"
#include "common/request.h"

namespace assay::common {

inline constexpr std::string_view kAuditRequest = "assay.engine-audit-request.v1";
inline constexpr std::string_view kAuditResult = "assay.engine-audit-result.v1";
inline constexpr std::string_view kAuditPredicateType = "https://assay.dev/engine-audit/v1";
inline constexpr std::string_view kAuditInput = "assay.audit-input.v1";
inline constexpr std::string_view kAuditOutput = "assay.audit-output.v1";
// The artifact: the worker's per-position figures (assay.audit-output.v1), as it wrote them.
inline constexpr std::string_view kAuditArtifactFileName = "audit.json";
inline constexpr std::size_t kMaxAuditContexts = 512;
inline constexpr std::size_t kMaxAuditPositions = 65536;
inline constexpr int kMaxAuditReductionSeeds = 64;

struct AuditPolicy {
  double alpha = 0.01;  // the false-alarm rate of the test
};

struct AuditContext {
  std::string id;  // unique; default c<index>
  std::vector<std::int64_t> token_ids;
  std::string logits_path;    // the engine's logits at every position: absolute
  std::string logits_sha256;  // of the whole file, "sha256:<hex>"
};

// An engine-audit request `assay.engine-audit-request.v1`
// (schemas/engine-audit-request.schema.json): an engine's logits at every position of a panel of
// contexts, one safetensors file per context (a tensor "logits", or the file's only tensor, F32 or
// BF16, [len(token_ids), vocab_size]).
struct AuditRequest {
  std::string schema;  // kAuditRequest
  std::string id;
  std::string model_dir;               // absolute, trailing slashes removed
  std::optional<Json> model_identity;  // expected identity
  std::string engine;                  // its name
  std::vector<AuditContext> contexts;  // at least 2
  int reduction_seeds = 8;
  bool sdpa = true;
  AuditPolicy policy;
  RequestLimits limits;
  std::string request_sha256;  // RFC 8785 of the whole document
  Json document;

  std::size_t positions() const;
  // The members the worker runs, in order: reference, reduction:0..N-1, sdpa.
  std::vector<std::string> member_names() const;
  // Throws Error("request.invalid_token_id") naming the first id >= vocab.
  void check_vocab(std::int64_t vocab_size) const;
};

// Throws Error with request.unknown_schema or request.invalid naming the field and value.
AuditRequest validate_audit_request(const Json& document);

// The policy a request or record states ({alpha}; absent: the default). Throws
// Error("request.invalid") naming a value out of (0, 0.5].
AuditPolicy audit_policy(const Json& doc, const std::string& where);
Json to_json(const AuditPolicy& policy);

// The statistic from per-context figures: `contexts` [{id, positions, engine_sum, member_sums:
// [one per member]}], `members` the member names in the order of member_sums (at least one).
// Returns {contexts, positions, unit_member, members: [{name, sum, ratio}], engine_sum, ratio,
// ci95: [lo, hi], test: {t, df, p_value, alpha}, class, explanation}. Throws
// Error("audit.invalid") naming what is missing, negative or not finite, or fewer than 2 contexts.
Json audit_statistics(const Json& members, const Json& contexts, const AuditPolicy& policy);

// P(T >= t) for Student's t with df > 0 degrees of freedom.
double student_t_upper(double t, double df);

}  // namespace assay::common
