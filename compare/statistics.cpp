#include "compare/statistics.h"

#include <algorithm>
#include <cmath>

#include "compare/compare.h"

namespace assay::compare {
namespace {

using common::Json;

Json nullable(std::optional<double> v) {
  return v ? Json(*v) : Json(nullptr);
}

double neumaier(std::span<const double> v) {
  double sum = 0, c = 0;
  for (double x : v) {
    double t = sum + x;
    c += std::fabs(sum) >= std::fabs(x) ? (sum - t) + x : (x - t) + sum;
    sum = t;
  }
  return sum + c;
}

// Sum of (a - ma)(b - mb), compensated.
double co_moment(std::span<const double> a, double ma, std::span<const double> b, double mb) {
  std::vector<double> terms(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) terms[i] = (a[i] - ma) * (b[i] - mb);
  return neumaier(terms);
}

struct Pct {
  const char* key;
  double pct;
};
constexpr Pct kKlPercentiles[] = {{"p99_9", 99.9}, {"p99", 99},    {"p95", 95},
                                  {"p90", 90},     {"median", 50}, {"p10", 10},
                                  {"p5", 5},       {"p1", 1},      {"p0_1", 0.1}};
constexpr Pct kDeltaPercentiles[] = {{"p99_9", 99.9}, {"p99", 99},    {"p95", 95},  {"p90", 90},
                                     {"p75", 75},     {"median", 50}, {"p25", 25},  {"p10", 10},
                                     {"p5", 5},       {"p1", 1},      {"p0_1", 0.1}};

template <std::size_t N>
void add_distribution(Json& out, std::span<const double> values, const Pct (&pcts)[N]) {
  std::vector<double> sorted(values.begin(), values.end());
  std::sort(sorted.begin(), sorted.end());
  out["max"] = sorted.back();
  for (const Pct& p : pcts) out[p.key] = percentile(sorted, p.pct);
  out["min"] = sorted.front();
}

Json delta_p(std::span<const double> dp) {
  if (dp.empty()) return nullptr;
  Json out{{"n", dp.size()}, {"mean", mean(dp)}, {"standard_error", nullable(standard_error(dp))}};
  std::vector<double> squares(dp.size());
  for (std::size_t i = 0; i < dp.size(); ++i) squares[i] = dp[i] * dp[i];
  const double rms = std::sqrt(mean(squares));
  out["rms"] = rms;
  // llama.cpp: d(sqrt m) = dm / (2 sqrt m); undefined at rms 0.
  std::optional<double> se2 = standard_error(squares);
  out["rms_standard_error"] = se2 && rms > 0 ? Json(0.5 / rms * *se2) : Json(nullptr);
  add_distribution(out, dp, kDeltaPercentiles);
  return out;
}

Json side(std::span<const double> nll) {
  const double m = mean(nll);
  std::optional<double> se = standard_error(nll);
  const double ppl = std::exp(m);
  return {{"ppl", ppl},
          {"ppl_standard_error", se ? Json(ppl * *se) : Json(nullptr)},
          {"mean_nll", m},
          {"mean_nll_standard_error", nullable(se)}};
}

Json perplexity(std::span<const double> ref, std::span<const double> cand) {
  if (ref.empty()) return nullptr;
  const std::size_t n = ref.size();
  Json r = side(ref), c = side(cand);
  const double mr = r["mean_nll"].get<double>(), mc = c["mean_nll"].get<double>();
  std::vector<double> diff(n);
  for (std::size_t i = 0; i < n; ++i) diff[i] = cand[i] - ref[i];
  const double ln_ratio = mc - mr;
  std::optional<double> ln_se = standard_error(diff);
  const double ratio = std::exp(ln_ratio);
  const double ppl_r = r["ppl"].get<double>(), ppl_c = c["ppl"].get<double>();
  Json difference{{"value", ppl_c - ppl_r}, {"standard_error", nullptr}};
  if (n >= 2) {
    // The delta method's se_c^2 + se_r^2 - 2 ppl_c ppl_r cov, computed as the standard error of
    // the per-token series ppl_c nll_c - ppl_r nll_r: algebraically equal, but without the
    // cancellation of three numbers of order ppl^2 (a perplexity of e^40 left 2e17 of rounding
    // where two equal sides must give exactly 0).
    std::vector<double> w(n);
    for (std::size_t i = 0; i < n; ++i) w[i] = ppl_c * cand[i] - ppl_r * ref[i];
    difference["standard_error"] = nullable(standard_error(w));
  }
  return {{"tokens", n},
          {"reference", r},
          {"candidate", c},
          {"ln_ppl_correlation", nullable(correlation(cand, ref))},
          {"ln_ratio", {{"value", ln_ratio}, {"standard_error", nullable(ln_se)}}},
          {"ratio",
           {{"value", ratio}, {"standard_error", ln_se ? Json(ratio * *ln_se) : Json(nullptr)}}},
          {"difference", difference}};
}

}  // namespace

double mean(std::span<const double> values) {
  return neumaier(values) / static_cast<double>(values.size());
}

std::optional<double> standard_error(std::span<const double> values) {
  const std::size_t n = values.size();
  if (n < 2) return std::nullopt;
  const double m = mean(values);
  const double var = co_moment(values, m, values, m) / static_cast<double>(n);
  return std::sqrt(var / static_cast<double>(n - 1));
}

std::optional<double> correlation(std::span<const double> a, std::span<const double> b) {
  if (a.size() < 2) return std::nullopt;
  const double ma = mean(a), mb = mean(b);
  const double sab = co_moment(a, ma, b, mb);
  const double saa = co_moment(a, ma, a, ma), sbb = co_moment(b, mb, b, mb);
  if (saa <= 0 || sbb <= 0) return std::nullopt;
  return sab / std::sqrt(saa * sbb);
}

Json statistics_json(const Series& s) {
  const std::size_t n = s.kl.size();
  Json kl{{"n", n}, {"mean", mean(s.kl)}, {"standard_error", nullable(standard_error(s.kl))}};
  add_distribution(kl, s.kl, kKlPercentiles);
  std::int64_t same = 0;
  for (std::int64_t v : s.same_top) same += v;
  const double p = static_cast<double>(same) / static_cast<double>(n);
  Json same_top{
      {"n", n},
      {"count", same},
      {"fraction", p},
      {"standard_error",
       n >= 2 ? Json(std::sqrt(p * (1.0 - p) / static_cast<double>(n - 1))) : Json(nullptr)}};
  return {{"kl", kl},
          {"same_top", same_top},
          {"delta_p_top", delta_p(s.delta_p_top)},
          {"delta_p_next", delta_p(s.delta_p_next)},
          {"perplexity", perplexity(s.nll_reference, s.nll_candidate)}};
}

}  // namespace assay::compare
