// The statistics people compare quantizations by, as llama.cpp's `llama-perplexity
// --kl-divergence` prints them, computed in fp64 from the per-position series of a comparison.
// Standard errors are sqrt(population variance / (n - 1)), llama.cpp's form; percentiles are
// numpy's default method (compare.h, percentile). Every field is documented in
// schemas/compare-output.schema.json#/$defs/statistics.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "common/json.h"

namespace assay::compare {

// One entry per scored position, in input order, except the next-token series, which hold only
// positions whose next token is known (position + 1 < the context's token count).
struct Series {
  std::vector<double> kl;
  std::vector<std::int64_t> same_top;  // 1 where the argmaxes agree, else 0
  std::vector<double> delta_p_top;     // p_cand(t) - p_ref(t), t = the reference's argmax
  std::vector<double> delta_p_next;    // p_cand(t) - p_ref(t), t = the actual next token
  std::vector<double> nll_reference;   // -log p_ref(next token)
  std::vector<double> nll_candidate;   // -log p_cand(next token)
};

// Neumaier-compensated mean; values non-empty.
double mean(std::span<const double> values);
// sqrt(sum (x - mean)^2 / n / (n - 1)); null (as nullopt) for n < 2.
std::optional<double> standard_error(std::span<const double> values);
// Pearson correlation; nullopt when n < 2 or either series is constant.
std::optional<double> correlation(std::span<const double> a, std::span<const double> b);

// The "statistics" object: kl, same_top, delta_p_top, delta_p_next (null without next tokens),
// perplexity (null without next tokens).
common::Json statistics_json(const Series& s);

}  // namespace assay::compare
