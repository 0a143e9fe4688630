// The KL kernel: its exp against libm, its two clones against each other, and KL, argmax and
// the non-finite check against straightforward long-double arithmetic.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "compare/kernel.h"
#include "tests/compare/util.h"

namespace assay::compare::test {
namespace {

std::uint64_t bits(double x) {
  std::uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

std::int64_t ulp_distance(double a, double b) {
  return std::llabs(static_cast<std::int64_t>(bits(a)) - static_cast<std::int64_t>(bits(b)));
}

// A row in the element type the kernel reads.
struct StoredRow {
  std::vector<float> f32;
  std::vector<std::uint16_t> bf16;
  Element element;
  Row row() const {
    return {element == Element::kF32 ? static_cast<const void*>(f32.data()) : bf16.data(), element};
  }
  double at(std::size_t i) const {
    return element == Element::kF32 ? f32[i] : static_cast<double>(from_bf16(bf16[i]));
  }
};

StoredRow stored(const std::vector<float>& v, Element e) {
  StoredRow s{v, {}, e};
  for (float f : v) s.bf16.push_back(to_bf16(f));
  return s;
}

struct Reference {
  long double kl;
  std::size_t ref_argmax, cand_argmax;
};

// The formula in long double with libm, one element at a time.
Reference reference_kl(const StoredRow& r, const StoredRow& c, std::size_t n) {
  auto lse = [n](const StoredRow& x, std::size_t& argmax) {
    long double m = x.at(0);
    argmax = 0;
    for (std::size_t i = 1; i < n; ++i)
      if (x.at(i) > m) m = x.at(i), argmax = i;
    long double s = 0;
    for (std::size_t i = 0; i < n; ++i) s += std::exp(static_cast<long double>(x.at(i)) - m);
    return m + std::log(s);
  };
  Reference out{};
  long double lr = lse(r, out.ref_argmax), lc = lse(c, out.cand_argmax);
  for (std::size_t i = 0; i < n; ++i) {
    long double lpr = r.at(i) - lr, lpc = c.at(i) - lc;
    out.kl += std::exp(lpr) * (lpr - lpc);
  }
  return out;
}

std::vector<float> noisy(const std::vector<float>& base, std::uint64_t seed, float sigma) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v = base;
  for (float& x : v) x += d(rng);
  return v;
}

RowResult run(const StoredRow& r, const StoredRow& c, std::size_t n) {
  std::vector<double> scratch(scratch_size(n));
  return kl_row(r.row(), c.row(), n, scratch.data());
}

TEST_CASE("exp_nonpositive is within 2 ulp of std::exp on [-708, 0], and exactly 0 below -708") {
  std::vector<double> x;
  const std::size_t dense = 1 << 22;
  for (std::size_t i = 0; i <= dense; ++i) x.push_back(-708.0 * static_cast<double>(i) / dense);
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> small(-1.0, 0.0);
  for (int i = 0; i < 200000; ++i) x.push_back(small(rng));                 // where most mass lies
  for (int i = 0; i < 2000; ++i) x.push_back(-std::ldexp(1.0, -i % 1074));  // down to denormals
  for (double v :
       {0.0, -0.0, -0.34657359027997264, -0.34657359027997270, -708.0, -707.9999999999999, -1e-300})
    x.push_back(v);
  std::vector<double> y(x.size());
  exp_nonpositive(x.data(), y.data(), x.size());
  std::int64_t worst = 0;
  double worst_at = 0;
  std::size_t within_one = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    std::int64_t d = ulp_distance(y[i], std::exp(x[i]));
    within_one += d <= 1;
    if (d > worst) worst = d, worst_at = x[i];
  }
  MESSAGE("worst " << worst << " ulp at x = " << worst_at << "; " << within_one << " of "
                   << x.size() << " within 1 ulp");
  CHECK(worst <= 2);
  CHECK(y[x.size() - 7] == 1.0);  // exp(0) is exactly 1: the row max contributes exactly 1
  CHECK(y[x.size() - 6] == 1.0);

  std::vector<double> below = {
      -708.0000000000001, -708.5, -745.2, -1e10, -1e300, -std::numeric_limits<double>::infinity()};
  std::vector<double> out(below.size(), 1.0);
  exp_nonpositive(below.data(), out.data(), below.size());
  for (double v : out) CHECK(bits(v) == 0);  // +0.0
}

TEST_CASE("the AVX2 and baseline exp clones agree bit for bit") {
  if (!clones::cpu_has_avx2()) {
    MESSAGE("this CPU has no AVX2: only the baseline clone runs here");
    return;
  }
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> d(-720.0, 0.0);
  std::vector<double> x(1000003);
  for (double& v : x) v = d(rng);
  std::vector<double> a(x.size()), b(x.size());
  clones::exp_baseline(x.data(), a.data(), x.size());
  clones::exp_avx2(x.data(), b.data(), x.size());
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);
}

TEST_CASE("the AVX2 and baseline KL clones agree bit for bit on random rows") {
  if (!clones::cpu_has_avx2()) {
    MESSAGE("this CPU has no AVX2: only the baseline clone runs here");
    return;
  }
  std::uint64_t seed = 100;
  std::size_t rows_checked = 0;
  for (std::size_t vocab : {1ul, 3ul, 4ul, 5ul, 17ul, 1001ul, 1040ul, 4096ul, 65539ul, 248320ul}) {
    for (float sigma : {3.0f, 200.0f}) {  // 200: many terms below exp's -708 cut-off
      auto base = random_logits(1, vocab, ++seed, sigma);
      auto cand = noisy(base, ++seed, 0.5f);
      for (Element re : {Element::kF32, Element::kBF16})
        for (Element ce : {Element::kF32, Element::kBF16}) {
          StoredRow r = stored(base, re), c = stored(cand, ce);
          std::vector<double> s1(scratch_size(vocab)), s2(scratch_size(vocab));
          RowResult a = clones::kl_row_baseline(r.row(), c.row(), vocab, s1.data());
          RowResult b = clones::kl_row_avx2(r.row(), c.row(), vocab, s2.data());
          CAPTURE(vocab);
          CAPTURE(sigma);
          CHECK(bits(a.kl) == bits(b.kl));
          CHECK(a.reference_argmax == b.reference_argmax);
          CHECK(a.candidate_argmax == b.candidate_argmax);
          CHECK(a.non_finite == -1);
          CHECK(b.non_finite == -1);
          ++rows_checked;
        }
    }
  }
  CHECK(rows_checked == 80);
}

TEST_CASE("the next-row prefetch hint changes no bit of any result") {
  const std::size_t vocab = 4099;
  auto base = random_logits(2, vocab, 400);
  auto cand = noisy(base, 401, 0.5f);
  for (Element e : {Element::kF32, Element::kBF16}) {
    StoredRow r = stored(base, e), c = stored(cand, e);
    const std::size_t size = e == Element::kF32 ? 4 : 2;
    auto next = [&](const StoredRow& s) {
      return static_cast<const unsigned char*>(s.row().data) + vocab * size;
    };
    Row r0{r.row().data, e}, c0{c.row().data, e};
    std::vector<double> s1(scratch_size(vocab)), s2(scratch_size(vocab));
    RowResult plain = kl_row(r0, c0, vocab, s1.data());
    RowResult hinted = kl_row(r0, c0, vocab, s2.data(), next(r), next(c));
    CHECK(bits(plain.kl) == bits(hinted.kl));
    CHECK(bits(plain.reference_log_sum) == bits(hinted.reference_log_sum));
    CHECK(bits(plain.candidate_log_sum) == bits(hinted.candidate_log_sum));
    CHECK(plain.reference_argmax == hinted.reference_argmax);
    CHECK(plain.candidate_argmax == hinted.candidate_argmax);
    CHECK(plain.kl > 0);
  }
}

TEST_CASE("kl_row agrees with long-double arithmetic to 1e-12 relative, argmaxes exactly") {
  std::uint64_t seed = 200;
  for (std::size_t vocab : {2ul, 7ul, 1001ul, 151936ul}) {
    for (float noise : {0.5f, 3.0f}) {
      auto base = random_logits(1, vocab, ++seed);
      auto cand = noisy(base, ++seed, noise);
      for (Element re : {Element::kF32, Element::kBF16})
        for (Element ce : {Element::kF32, Element::kBF16}) {
          StoredRow r = stored(base, re), c = stored(cand, ce);
          RowResult got = run(r, c, vocab);
          Reference want = reference_kl(r, c, vocab);
          CAPTURE(vocab);
          CAPTURE(noise);
          CHECK(got.kl > 0);
          CHECK(std::fabs(got.kl - static_cast<double>(want.kl)) <=
                1e-12 * static_cast<double>(want.kl));
          CHECK(got.reference_argmax == static_cast<std::int64_t>(want.ref_argmax));
          CHECK(got.candidate_argmax == static_cast<std::int64_t>(want.cand_argmax));
        }
    }
  }
}

TEST_CASE("equal rows give exactly 0.0, in F32, in BF16, and across the two for the same values") {
  for (std::size_t vocab : {1ul, 5ul, 1001ul, 248320ul}) {
    auto v = bf16_exact(random_logits(1, vocab, vocab));
    for (Element re : {Element::kF32, Element::kBF16})
      for (Element ce : {Element::kF32, Element::kBF16}) {
        RowResult got = run(stored(v, re), stored(v, ce), vocab);
        CAPTURE(vocab);
        CHECK(bits(got.kl) == 0);  // +0.0 exactly
        CHECK(got.reference_argmax == got.candidate_argmax);
      }
  }
}

TEST_CASE("argmax is the lowest index among equal maxima, in any lane and in the tail") {
  std::vector<float> v(1003, -1.0f);
  v[6] = 5.0f;  // lane 2
  v[3] = 5.0f;  // lane 3, lower index
  v[1001] = 5.0f;
  StoredRow r = stored(v, Element::kF32);
  std::vector<float> w(1003, 0.0f);
  w[1002] = 2.0f;  // the last element, in the tail
  w[1001] = 2.0f;
  StoredRow c = stored(w, Element::kF32);
  RowResult got = run(r, c, v.size());
  CHECK(got.reference_argmax == 3);
  CHECK(got.candidate_argmax == 1001);
  std::vector<float> flat(9, 0.25f);  // all equal: index 0
  RowResult f = run(stored(flat, Element::kF32), stored(flat, Element::kBF16), flat.size());
  CHECK(f.reference_argmax == 0);
  CHECK(f.candidate_argmax == 0);
}

TEST_CASE("a NaN or an infinity is reported with its row side and first column, never used") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  auto base = random_logits(1, 1001, 5);
  struct Case {
    int side;
    std::size_t column;
    float value;
    Element element;
  };
  for (const Case& k : std::vector<Case>{{1, 0, nan, Element::kF32},
                                         {1, 1000, nan, Element::kF32},  // in the tail
                                         {1, 517, inf, Element::kF32},
                                         {0, 3, -inf, Element::kF32},
                                         {1, 999, nan, Element::kBF16},
                                         {0, 10, inf, Element::kBF16}}) {
    auto bad = base;
    bad[k.column] = k.value;
    bad[k.column + (k.column < 900 ? 50 : 0)] = k.value;  // a later one is not the one named
    StoredRow good = stored(base, k.element), broken = stored(bad, k.element);
    RowResult got = k.side == 0 ? run(broken, good, base.size()) : run(good, broken, base.size());
    CAPTURE(k.column);
    CHECK(got.non_finite == k.side);
    CHECK(got.non_finite_column == static_cast<std::int64_t>(k.column));
  }
  // The reference is named first when both rows are bad.
  auto bad = base;
  bad[20] = nan;
  RowResult both = run(stored(bad, Element::kF32), stored(bad, Element::kF32), base.size());
  CHECK(both.non_finite == 0);
  CHECK(both.non_finite_column == 20);
  // A bf16 NaN with a payload (0x7fc1) and the bf16 infinity (0x7f80).
  for (std::uint16_t h : {std::uint16_t{0x7fc1}, std::uint16_t{0x7f80}, std::uint16_t{0xff80}}) {
    StoredRow c = stored(base, Element::kBF16);
    c.bf16[42] = h;
    RowResult got = run(stored(base, Element::kBF16), c, base.size());
    CHECK(got.non_finite == 1);
    CHECK(got.non_finite_column == 42);
  }
}

TEST_CASE("logits at the edge of the float range give a finite KL") {
  std::vector<float> r(13, 0.0f), c(13, 0.0f);
  r[0] = std::numeric_limits<float>::max();
  r[1] = std::numeric_limits<float>::lowest();
  c[0] = 1.0f;
  c[1] = std::numeric_limits<float>::lowest();
  RowResult got = run(stored(r, Element::kF32), stored(c, Element::kF32), r.size());
  Reference want = reference_kl(stored(r, Element::kF32), stored(c, Element::kF32), r.size());
  CHECK(std::isfinite(got.kl));
  CHECK(got.kl == doctest::Approx(static_cast<double>(want.kl)).epsilon(1e-12));
  CHECK(got.reference_argmax == 0);
}

TEST_CASE("the clone in use is the widest the CPU has") {
  if (std::getenv("ASSAY_COMPARE_KERNEL")) {
    MESSAGE("ASSAY_COMPARE_KERNEL is set: the clone was chosen by hand");
    return;
  }
  CHECK(std::string(active_clone()) == (clones::cpu_has_avx512() ? "avx512"
                                        : clones::cpu_has_avx2() ? "avx2"
                                                                 : "baseline"));
}

TEST_CASE("the AVX-512 and baseline exp clones agree bit for bit") {
  if (!clones::cpu_has_avx512()) {
    MESSAGE("this CPU has no AVX-512: the AVX-512 clone does not run here");
    return;
  }
  std::mt19937_64 rng(12);
  std::uniform_real_distribution<double> d(-720.0, 0.0);
  for (std::size_t n : {1ul, 4ul, 7ul, 8ul, 13ul, 1000003ul}) {
    std::vector<double> x(n);
    for (double& v : x) v = d(rng);
    std::vector<double> a(n), b(n);
    clones::exp_baseline(x.data(), a.data(), n);
    clones::exp_avx512(x.data(), b.data(), n);
    CAPTURE(n);
    CHECK(std::memcmp(a.data(), b.data(), n * sizeof(double)) == 0);
  }
}

TEST_CASE("the AVX-512 and baseline KL clones agree bit for bit on random rows") {
  if (!clones::cpu_has_avx512()) {
    MESSAGE("this CPU has no AVX-512: the AVX-512 clone does not run here");
    return;
  }
  std::uint64_t seed = 300;
  std::size_t rows_checked = 0;
  // Vocabularies around the 8-lane, 16-element group and 1024-element block boundaries.
  for (std::size_t vocab :
       {1ul,  3ul,    4ul,    5ul,    8ul,    12ul,   15ul,   16ul,   17ul,    31ul,
        33ul, 1001ul, 1023ul, 1024ul, 1028ul, 1039ul, 1040ul, 4096ul, 65539ul, 248320ul}) {
    for (float sigma : {3.0f, 200.0f}) {
      auto base = random_logits(1, vocab, ++seed, sigma);
      auto cand = noisy(base, ++seed, 0.5f);
      for (Element re : {Element::kF32, Element::kBF16})
        for (Element ce : {Element::kF32, Element::kBF16}) {
          StoredRow r = stored(base, re), c = stored(cand, ce);
          std::vector<double> s1(scratch_size(vocab)), s2(scratch_size(vocab));
          RowResult a = clones::kl_row_baseline(r.row(), c.row(), vocab, s1.data());
          RowResult b = clones::kl_row_avx512(r.row(), c.row(), vocab, s2.data());
          CAPTURE(vocab);
          CAPTURE(sigma);
          CHECK(bits(a.kl) == bits(b.kl));
          CHECK(bits(a.reference_log_sum) == bits(b.reference_log_sum));
          CHECK(bits(a.candidate_log_sum) == bits(b.candidate_log_sum));
          CHECK(a.reference_argmax == b.reference_argmax);
          CHECK(a.candidate_argmax == b.candidate_argmax);
          CHECK(b.non_finite == -1);
          ++rows_checked;
        }
    }
  }
  CHECK(rows_checked == 160);
  // A NaN in the 8-lane part and one in the tail are found at their columns.
  std::vector<float> row(1029, 1.0f);
  for (std::size_t at : {9ul, 1027ul}) {
    auto bad = row;
    bad[at] = std::numeric_limits<float>::quiet_NaN();
    StoredRow r = stored(row, Element::kF32), c = stored(bad, Element::kF32);
    std::vector<double> s(scratch_size(row.size()));
    RowResult b = clones::kl_row_avx512(r.row(), c.row(), row.size(), s.data());
    CHECK(b.non_finite == 1);
    CHECK(b.non_finite_column == static_cast<std::int64_t>(at));
  }
}

}  // namespace
}  // namespace assay::compare::test
