// Built with -ffp-contract=off (compare/CMakeLists.txt): see kernel.h on determinism.
#include "compare/kernel.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <immintrin.h>

namespace assay::compare {
namespace {

typedef double V4d __attribute__((vector_size(32)));
typedef std::int64_t V4l __attribute__((vector_size(32)));
typedef std::uint64_t V4u __attribute__((vector_size(32)));
typedef float V4f __attribute__((vector_size(16)));
typedef std::uint32_t V4w __attribute__((vector_size(16)));
typedef std::uint16_t V4h __attribute__((vector_size(8)));
typedef double V8d __attribute__((vector_size(64)));
typedef std::int64_t V8l __attribute__((vector_size(64)));
typedef std::uint64_t V8u __attribute__((vector_size(64)));

// The integer vectors of the same lane count as a double vector.
template <class V>
struct Lanes;
template <>
struct Lanes<V4d> {
  using L = V4l;
  using U = V4u;
};
template <>
struct Lanes<V8d> {
  using L = V8l;
  using U = V8u;
};

constexpr std::size_t kBlock = 1024;  // elements per partial sum (a multiple of 4)

constexpr double kLog2e = 0x1.71547652b82fep0;
// fdlibm's split of ln 2: kLn2Hi has 32 significant bits, so k * kLn2Hi is exact for |k| < 2^21.
constexpr double kLn2Hi = 0x1.62e42feep-1;
constexpr double kLn2Lo = 0x1.a39ef35793c76p-33;
constexpr double kExpMinArg = -708.0;
// 1/2!, 1/3!, ..., 1/13! (each quotient correctly rounded; the factorials are exact doubles).
constexpr double kExpPoly[12] = {
    1.0 / 2,     1.0 / 6,      1.0 / 24,      1.0 / 120,      1.0 / 720,       1.0 / 5040,
    1.0 / 40320, 1.0 / 362880, 1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600, 1.0 / 6227020800.0};

constexpr V4d splat(double x) {
  return V4d{x, x, x, x};
}
constexpr V4l splat_l(std::int64_t x) {
  return V4l{x, x, x, x};
}

// log(x) for a positive normal x, from basic IEEE operations only: libm's log has CPU-specific
// variants (glibc picks an FMA one at run time), and the two row log-sums must not differ
// between hosts. x = 2^e * f with f in [sqrt(1/2), sqrt(2)); log f = 2 atanh(s),
// s = (f - 1)/(f + 1), |s| <= 0.1716, summed as an odd series to s^23 (next term < 2^-56 * s).
double log_deterministic(double x) {
  std::uint64_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  std::int64_t e = static_cast<std::int64_t>(bits >> 52) - 1023;
  bits = (bits & 0x000fffffffffffffULL) | 0x3ff0000000000000ULL;
  double f;
  std::memcpy(&f, &bits, sizeof f);
  if (f > 0x1.6a09e667f3bcdp0) {  // sqrt(2)
    f *= 0.5;
    e += 1;
  }
  const double s = (f - 1.0) / (f + 1.0);  // f - 1 is exact (Sterbenz)
  const double s2 = s * s;
  double q = 2.0 / 23;
  for (int k = 21; k >= 3; k -= 2) q = q * s2 + 2.0 / k;
  const double log_f = 2.0 * s + s * (s2 * q);
  const double de = static_cast<double>(e);
  return de * kLn2Hi + (de * kLn2Lo + log_f);
}

}  // namespace

namespace clones {

namespace baseline {
using VW = V4d;
constexpr std::size_t kW = 4;
#define KERNEL_FN
#define KERNEL_INLINE inline __attribute__((always_inline))
#include "compare/kernel_impl.inc"
#undef KERNEL_FN
#undef KERNEL_INLINE
}  // namespace baseline

namespace avx2 {
using VW = V4d;
constexpr std::size_t kW = 4;
#define KERNEL_AVX2
#define KERNEL_FN __attribute__((target("avx2,fma")))
#define KERNEL_INLINE inline __attribute__((always_inline, target("avx2,fma")))
#include "compare/kernel_impl.inc"
#undef KERNEL_FN
#undef KERNEL_INLINE
#undef KERNEL_AVX2
}  // namespace avx2

// AVX-512: 8 lanes for the arithmetic (the same IEEE operations per lane), the sums still in
// 4 lanes in the 4-lane clones' order, so its results are bitwise those of the other two. The
// AVX2 loads/conversions are used for the 4-element remainder and the tail.
namespace avx512 {
using VW = V8d;
constexpr std::size_t kW = 8;
#define KERNEL_AVX2
#define KERNEL_AVX512
#define KERNEL_FN __attribute__((target("avx2,fma,avx512f")))
#define KERNEL_INLINE inline __attribute__((always_inline, target("avx2,fma,avx512f")))
#include "compare/kernel_impl.inc"
#undef KERNEL_FN
#undef KERNEL_INLINE
#undef KERNEL_AVX512
#undef KERNEL_AVX2
}  // namespace avx512

bool cpu_has_avx2() {
  __builtin_cpu_init();  // may run before libgcc's own constructor
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f");
}

RowResult kl_row_baseline(Row reference, Row candidate, std::size_t vocab, double* scratch) {
  return baseline::kl_row(reference, candidate, vocab, scratch);
}
RowResult kl_row_avx2(Row reference, Row candidate, std::size_t vocab, double* scratch) {
  return avx2::kl_row(reference, candidate, vocab, scratch);
}
RowResult kl_row_avx512(Row reference, Row candidate, std::size_t vocab, double* scratch) {
  return avx512::kl_row(reference, candidate, vocab, scratch);
}
void exp_baseline(const double* x, double* y, std::size_t n) {
  baseline::exp_array(x, y, n);
}
void exp_avx2(const double* x, double* y, std::size_t n) {
  avx2::exp_array(x, y, n);
}
void exp_avx512(const double* x, double* y, std::size_t n) {
  avx512::exp_array(x, y, n);
}

}  // namespace clones

namespace {
enum class Clone { kBaseline, kAvx2, kAvx512 };
// ASSAY_COMPARE_KERNEL=baseline|avx2 picks a narrower clone (for benchmarks and checks); the
// widest one the CPU has is the default. All give the same bits.
Clone pick_clone() {
  Clone best = clones::cpu_has_avx512() ? Clone::kAvx512
               : clones::cpu_has_avx2() ? Clone::kAvx2
                                        : Clone::kBaseline;
  const char* want = std::getenv("ASSAY_COMPARE_KERNEL");
  if (want && std::strcmp(want, "baseline") == 0) return Clone::kBaseline;
  if (want && std::strcmp(want, "avx2") == 0 && best != Clone::kBaseline) return Clone::kAvx2;
  return best;
}
const Clone kClone = pick_clone();
}  // namespace

std::size_t scratch_size(std::size_t vocab) {
  return (vocab + 3) & ~std::size_t{3};
}

RowResult kl_row(Row reference, Row candidate, std::size_t vocab, double* scratch) {
  switch (kClone) {
    case Clone::kAvx512:
      return clones::kl_row_avx512(reference, candidate, vocab, scratch);
    case Clone::kAvx2:
      return clones::kl_row_avx2(reference, candidate, vocab, scratch);
    default:
      return clones::kl_row_baseline(reference, candidate, vocab, scratch);
  }
}

void exp_nonpositive(const double* x, double* y, std::size_t n) {
  switch (kClone) {
    case Clone::kAvx512:
      return clones::exp_avx512(x, y, n);
    case Clone::kAvx2:
      return clones::exp_avx2(x, y, n);
    default:
      return clones::exp_baseline(x, y, n);
  }
}

const char* active_clone() {
  switch (kClone) {
    case Clone::kAvx512:
      return "avx512";
    case Clone::kAvx2:
      return "avx2";
    default:
      return "baseline";
  }
}

}  // namespace assay::compare
