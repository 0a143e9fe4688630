// Bug or numerics: the class of a dispute state from its numerics envelope, the figures of the
// state's logits under legitimate executions (worker/hf/assay_numerics.py runs them). One rule,
// written here and in schemas/next-token-oracle-result.schema.json (numerics), used by assayd to
// write the verdict and by `assay verify` to recompute it from the record's own figures.
//
// For a bf16 member m: T_m its top logit, a_m its argmax, t_m whether its top is tied; for a
// candidate token c: x_{m,c} its logit and g_{m,c} = T_m - x_{m,c} its gap to the top. step(v)
// is the spacing of bfloat16 numbers at |v|. With k = spread_factor and n = margin_steps:
//   neither            no member's argmax is a candidate;
//   reference_decides  every member has the same argmax a, untied, a is a candidate, and every
//                      other candidate c trails it in every member by more than the measured
//                      spread of its gap: min_m g_{m,c} > k (max_m g_{m,c} - min_m g_{m,c}) +
//                      n step(T_reference). The other engines' tokens are not a legitimate
//                      outcome of the model's arithmetic as sampled: a bug is likely;
//   numerically_tied   otherwise: the members disagree among the candidates, or a deficit is
//                      within that spread. Both tokens are legitimate outcomes; one state
//                      cannot tell a subtle bug from numerics.
// The fp32 member is reported beside the class, never part of it.
#pragma once

#include <string>
#include <vector>

#include "common/json.h"

namespace assay::common {

struct NumericsPolicy {
  double spread_factor = 3.0;
  double margin_steps = 1.0;
};

// The spacing of bfloat16 numbers at |v| (8 significant bits): 2^(e-7) for 2^e <= |v| < 2^(e+1),
// 2^-133 below the smallest normal.
double bf16_step(double v);

// {class, explanation, reference_argmax, unanimous_argmax, members, candidates: [{token_id,
// engines, argmax_members, logit: {reference, min, max, spread, spread_steps}, gap: {reference,
// min, max, spread}, threshold, beyond}], fp32: {argmax, argmax_is_candidate, candidates}}.
// `members` are the bf16 members' figures ({name, argmax, argmax_logit, top_tie, candidates:
// [{token_id, logit}]}; the first is the reference), `candidates` the request's [{engine,
// token_id}], `fp32` the fp32 figures or null. Throws Error("numerics.invalid") naming what is
// missing or inconsistent (no member, a candidate without its logit in a member).
Json numerics_verdict(const Json& members, const Json& candidates, const Json& fp32,
                      const NumericsPolicy& policy);

// The policy a record or request states: {spread_factor, margin_steps}; absent fields take the
// defaults. Throws Error("request.invalid") naming a value out of range (spread_factor in
// [1, 100], margin_steps in [0, 64]).
NumericsPolicy numerics_policy(const Json& doc, const std::string& where);
Json to_json(const NumericsPolicy& policy);

// The bf16 members a request.numerics spec (defaults spelled out, request.h) asks the worker
// for, in the order it runs them: reference, reduction:0..N-1, sdpa, kv-cache, batched:B.
std::vector<std::string> numerics_member_names(const Json& spec);

}  // namespace assay::common
