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
// Pass 1's floats, as wide as each clone's registers (and their int32, uint32, uint16 lanes).
typedef std::int32_t V4i __attribute__((vector_size(16)));
typedef float V8f __attribute__((vector_size(32)));
typedef std::int32_t V8i __attribute__((vector_size(32)));
typedef std::uint32_t V8w __attribute__((vector_size(32)));
typedef std::uint16_t V8h __attribute__((vector_size(16)));
typedef float V16f __attribute__((vector_size(64)));
typedef std::int32_t V16i __attribute__((vector_size(64)));
typedef std::uint32_t V16w __attribute__((vector_size(64)));
typedef std::uint16_t V16h __attribute__((vector_size(32)));

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

constexpr std::size_t kGroup = 16;    // lanes of every sum (see kernel_impl.inc)
constexpr std::size_t kBlock = 1024;  // elements per partial sum (a multiple of kGroup)

constexpr double kLog2e = 0x1.71547652b82fep0;
// fdlibm's split of ln 2: kLn2Hi has 32 significant bits, so k * kLn2Hi is exact for |k| < 2^21.
constexpr double kLn2Hi = 0x1.62e42feep-1;
constexpr double kLn2Lo = 0x1.a39ef35793c76p-33;
// exp's reduction to 1/16 of ln 2 (each scaled by 16 exactly).
constexpr double kExpScale = 16 * kLog2e;
constexpr double kLn2Hi16 = kLn2Hi / 16;
constexpr double kLn2Lo16 = kLn2Lo / 16;
constexpr double kExpMinArg = -708.0;
// The constants of exp (kernel_impl.inc), printed by compare/exp_tables.py:
// kExpPoly: q(r) = c0 + c1 r + ... + c4 r^4, the minimax approximation (Remez) of
// (exp(r) - 1 - r) / r^2 on |r| <= ln2/32, so that exp(r) = 1 + r + r^2 q(r) to 2.9e-17 relative.
constexpr double kExpPoly[5] = {0x1.0000000000001p-1, 0x1.55555554dd44bp-3, 0x1.55555554b9412p-5,
                                0x1.11120af72645ap-7, 0x1.6c181f4668aedp-10};
// kExp2Scale[j]: the bits of the double nearest to 2^(j/16), less j << 48, so that adding k << 48
// (k = 16 m + j) gives 2^m times that double. kExp2Tail[j]: the rest relative to it,
// 2^(j/16) / hi - 1, rounded (hi * (1 + tail) is 2^(j/16) to about 2^-106).
alignas(64) constexpr double kExp2Scale[16] = {
    0x1.0000000000000p+0, 0x1.fb5586cf9890fp-1, 0x1.f72b83c7d517bp-1, 0x1.f387a6e756238p-1,
    0x1.f06fe0a31b715p-1, 0x1.edea64c123422p-1, 0x1.ebfdad5362a27p-1, 0x1.eab07dd485429p-1,
    0x1.ea09e667f3bcdp-1, 0x1.ea11473eb0187p-1, 0x1.eace5422aa0dbp-1, 0x1.ec49182a3f090p-1,
    0x1.ee89f995ad3adp-1, 0x1.f199bdd85529cp-1, 0x1.f5818dcfba487p-1, 0x1.fa4afa2a490dap-1};
alignas(64) constexpr double kExp2Tail[16] = {0x0.0p+0,
                                              0x1.79aa65d837b6dp-54,
                                              -0x1.01b15eaa59348p-55,
                                              0x1.68efde3a8a894p-54,
                                              0x1.34d754db0abb6p-55,
                                              0x1.59f48a72a4c6dp-55,
                                              0x1.690cebb7aafb0p-56,
                                              0x1.063e1e21c5409p-54,
                                              -0x1.3b3efbf5e2228p-54,
                                              -0x1.b32dcb94da51dp-56,
                                              0x1.db72fc1f0eab4p-55,
                                              0x1.1affc2b91ce27p-56,
                                              0x1.c1a7792cb3387p-55,
                                              0x1.36eae30af0cb3p-56,
                                              0x1.4a385a63d07a7p-56,
                                              -0x1.ff7128fd391f0p-55};

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
using VF = V4f;
using VFI = V4i;
using VFW = V4w;
using VFH = V4h;
#define KERNEL_FN
#define KERNEL_INLINE inline __attribute__((always_inline))
#include "compare/kernel_impl.inc"
#undef KERNEL_FN
#undef KERNEL_INLINE
}  // namespace baseline

namespace avx2 {
using VW = V4d;
constexpr std::size_t kW = 4;
using VF = V8f;
using VFI = V8i;
using VFW = V8w;
using VFH = V8h;
#define KERNEL_AVX2
#define KERNEL_FN __attribute__((target("avx2,fma")))
#define KERNEL_INLINE inline __attribute__((always_inline, target("avx2,fma")))
#include "compare/kernel_impl.inc"
#undef KERNEL_FN
#undef KERNEL_INLINE
#undef KERNEL_AVX2
}  // namespace avx2

// AVX-512: 8 lanes for the arithmetic (the same IEEE operations per lane), each 16-lane sum in
// two registers, so its results are bitwise those of the other two; exp's table read by permutes.
namespace avx512 {
using VW = V8d;
constexpr std::size_t kW = 8;
using VF = V16f;
using VFI = V16i;
using VFW = V16w;
using VFH = V16h;
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

RowResult kl_row_baseline(Row reference, Row candidate, std::size_t vocab, double* scratch,
                          const void* next_reference, const void* next_candidate) {
  return baseline::kl_row(reference, candidate, vocab, scratch, next_reference, next_candidate);
}
RowResult kl_row_avx2(Row reference, Row candidate, std::size_t vocab, double* scratch,
                      const void* next_reference, const void* next_candidate) {
  return avx2::kl_row(reference, candidate, vocab, scratch, next_reference, next_candidate);
}
RowResult kl_row_avx512(Row reference, Row candidate, std::size_t vocab, double* scratch,
                        const void* next_reference, const void* next_candidate) {
  return avx512::kl_row(reference, candidate, vocab, scratch, next_reference, next_candidate);
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
  return (vocab + kGroup - 1) / kGroup * kGroup;
}

RowResult kl_row(Row reference, Row candidate, std::size_t vocab, double* scratch,
                 const void* next_reference, const void* next_candidate) {
  switch (kClone) {
    case Clone::kAvx512:
      return clones::kl_row_avx512(reference, candidate, vocab, scratch, next_reference,
                                   next_candidate);
    case Clone::kAvx2:
      return clones::kl_row_avx2(reference, candidate, vocab, scratch, next_reference,
                                 next_candidate);
    default:
      return clones::kl_row_baseline(reference, candidate, vocab, scratch, next_reference,
                                     next_candidate);
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
