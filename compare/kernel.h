// The per-position KL kernel: KL(reference || candidate) of one logits row pair in fp64 over
// the full vocabulary, plus both argmaxes and a non-finite check, in three passes over the row.
//
// Determinism: the kernel is compiled three times from one source (kernel_impl.inc), as a
// baseline x86-64 (SSE2) clone, an AVX2 (+FMA) clone and an AVX-512 clone, with
// -ffp-contract=off: the only fused multiply-adds are the explicit ones of exp, which are
// correctly rounded everywhere (the FMA instruction; libm's fma in the baseline clone), and
// exp's table lookups fetch the same values however they are done. So all clones do the same
// IEEE operations lane by lane and add them in the same order (every sum is kept in 16 lanes,
// whatever the vector width: 2 x 8 or 4 x 4): bitwise identical results on every x86-64 host.
// The widest clone the CPU has is chosen at run time (ASSAY_COMPARE_KERNEL=baseline|avx2 asks
// for a narrower one).
#pragma once

#include <cstddef>
#include <cstdint>

namespace assay::compare {

// How the row's elements are stored (little-endian, any alignment).
enum class Element { kF32, kBF16 };

struct Row {
  const void* data;  // `vocab` elements
  Element element;
};

struct RowResult {
  double kl = 0;  // nats; exactly 0.0 when the rows are equal element for element
  std::int64_t reference_argmax = 0;  // lowest index on ties
  std::int64_t candidate_argmax = 0;
  // Each row's log-softmax as the kernel computes it: log p(v) = (x[v] - max) - log_sum, with
  // log_sum = log(sum_v exp(x[v] - max)); so any token's log-probability can be read afterwards.
  double reference_max = 0, reference_log_sum = 0;
  double candidate_max = 0, candidate_log_sum = 0;
  // -1: both rows finite. 0: the reference, 1: the candidate holds a NaN or an infinity, first
  // at non_finite_column; kl and the argmaxes are then meaningless.
  int non_finite = -1;
  std::int64_t non_finite_column = -1;
};

// scratch: at least scratch_size(vocab) doubles, reused across rows.
// next_reference / next_candidate: where the next row pair's data starts (the same element types
// and vocab), or null: a prefetch hint only, read ahead while this row's arithmetic runs; it
// changes no result.
std::size_t scratch_size(std::size_t vocab);
RowResult kl_row(Row reference, Row candidate, std::size_t vocab, double* scratch,
                 const void* next_reference = nullptr, const void* next_candidate = nullptr);

// exp for x <= 0 as the kernel computes it: within 2 ulp of exp for -708 <= x <= 0 (about 0.6 ulp
// by construction), exactly 0 below -708 and for -inf (see kernel_impl.inc). x must not be NaN.
void exp_nonpositive(const double* x, double* y, std::size_t n);

// The clone that kl_row and exp_nonpositive use here: "avx512", "avx2" or "baseline".
const char* active_clone();

// The clones, callable explicitly (the AVX2 ones only where cpu_has_avx2(), the AVX-512 ones
// only where cpu_has_avx512()).
namespace clones {
bool cpu_has_avx2();    // AVX2 and FMA
bool cpu_has_avx512();  // AVX2 and AVX-512F
RowResult kl_row_baseline(Row reference, Row candidate, std::size_t vocab, double* scratch,
                          const void* next_reference = nullptr,
                          const void* next_candidate = nullptr);
RowResult kl_row_avx2(Row reference, Row candidate, std::size_t vocab, double* scratch,
                      const void* next_reference = nullptr, const void* next_candidate = nullptr);
void exp_baseline(const double* x, double* y, std::size_t n);
void exp_avx2(const double* x, double* y, std::size_t n);
RowResult kl_row_avx512(Row reference, Row candidate, std::size_t vocab, double* scratch,
                        const void* next_reference = nullptr, const void* next_candidate = nullptr);
void exp_avx512(const double* x, double* y, std::size_t n);
}  // namespace clones

}  // namespace assay::compare
