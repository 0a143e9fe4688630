// The summaries of a KL series declared in compare.h: numpy's default percentile bit for bit,
// the compensated mean and the order statistics, and the decade histogram.
#include <algorithm>
#include <cmath>
#include <iterator>
#include <vector>

#include "compare/compare.h"

namespace assay::compare {
namespace {

using common::Json;

double neumaier_sum(std::span<const double> v) {
  double sum = 0, c = 0;
  for (double x : v) {
    double t = sum + x;
    c += std::fabs(sum) >= std::fabs(x) ? (sum - t) + x : (x - t) + sum;
    sum = t;
  }
  return sum + c;
}

}  // namespace

double percentile(std::span<const double> x, double pct) {
  const double q = pct / 100.0;
  const std::size_t n = x.size();
  const double h = static_cast<double>(n - 1) * q;
  if (h >= static_cast<double>(n - 1)) return x[n - 1];
  if (h <= 0) return x[0];
  const double lo = std::floor(h);
  const std::size_t i = static_cast<std::size_t>(lo);
  const double t = h - lo;
  const double a = x[i], b = x[i + 1];
  const double diff = b - a;
  return t >= 0.5 ? b - diff * (1.0 - t) : a + diff * t;
}

Stats summarize(std::span<const double> values) {
  std::vector<double> sorted(values.begin(), values.end());
  std::sort(sorted.begin(), sorted.end());
  Stats s;
  s.mean = neumaier_sum(values) / static_cast<double>(values.size());
  s.median = percentile(sorted, 50);
  s.p95 = percentile(sorted, 95);
  s.p99 = percentile(sorted, 99);
  s.p99_9 = percentile(sorted, 99.9);
  s.max = sorted.back();
  s.min = sorted.front();
  return s;
}

Json to_json(const Stats& s) {
  return {{"mean", s.mean},   {"median", s.median}, {"p95", s.p95}, {"p99", s.p99},
          {"p99_9", s.p99_9}, {"max", s.max},       {"min", s.min}};
}

Json histogram(std::span<const double> kl) {
  static constexpr double kEdges[] = {1e-15, 1e-14, 1e-13, 1e-12, 1e-11, 1e-10, 1e-9, 1e-8, 1e-7,
                                      1e-6,  1e-5,  1e-4,  1e-3,  1e-2,  1e-1,  1e0,  1e1,  1e2};
  constexpr std::size_t kBins = std::size(kEdges) + 1;
  std::vector<std::int64_t> counts(kBins, 0);
  std::int64_t zero = 0, negative = 0;
  for (double v : kl) {
    if (v == 0.0) {
      ++zero;
    } else if (v < 0) {
      ++negative;
    } else {
      counts[static_cast<std::size_t>(std::upper_bound(std::begin(kEdges), std::end(kEdges), v) -
                                      std::begin(kEdges))]++;
    }
  }
  return {{"zero", zero},
          {"negative", negative},
          {"edges", std::vector<double>(std::begin(kEdges), std::end(kEdges))},
          {"counts", counts}};
}

}  // namespace assay::compare
