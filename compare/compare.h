// Fidelity comparison: KL(reference || candidate) per scored position over a panel of contexts,
// from logits safetensors files, in fp64 over the full vocabulary (the kernel is kernel.h).
// The worker `assay-compare run` is parse_input + compare + write_outputs.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/fidelity.h"
#include "common/json.h"

namespace assay::compare {

struct LogitsFileRef {
  // Absolute, or relative to the workspace (the cwd); "" when the file comes as a descriptor.
  std::string path;
  std::optional<std::string> sha256;  // of the whole file, "sha256:<hex>"; checked when set
  int fd = -1;  // a descriptor assayd opened for this worker (a file the worker may not open)
};

struct Range {
  std::int64_t begin = 0;  // half-open [begin, end)
  std::int64_t end = 0;
};

struct ContextSpec {
  std::string id;
  std::vector<Range> positions;  // sorted, disjoint, non-empty; logits rows are these in order
  LogitsFileRef reference;
  LogitsFileRef candidate;
  std::optional<LogitsFileRef> reproduction;  // a second capture of the reference
  // The context's token ids, when known: then position p's next token is token_ids[p + 1]
  // (p + 1 < size), which gives Δp of the actual next token and the perplexities.
  std::optional<std::vector<std::int64_t>> token_ids;
  std::int64_t rows() const;
};

struct CompareInput {
  std::int64_t vocab_size = 0;
  std::string kl_file;  // a plain file name in the workdir
  std::vector<ContextSpec> contexts;
  std::vector<common::Threshold> thresholds;  // caller-supplied bounds, gates of the output
};

// Validates an assay.compare-input.v1 document (strict: unknown fields are refused).
// Throws Error("input.invalid") naming the field and the value. `where` prefixes messages.
CompareInput parse_input(const common::Json& doc, const std::string& where);

// The input `assay-compare kl` builds: one context "c0" holding every row of `reference`
// (whose shape gives the rows and the vocabulary).
CompareInput input_for_files(const std::string& reference, const std::string& candidate,
                             const std::optional<std::string>& reproduction);

struct Stats {
  double mean = 0, median = 0, p95 = 0, p99 = 0, p99_9 = 0, max = 0, min = 0;
};
// numpy.percentile's default ('linear') method on ascending `sorted`, bit for bit:
// h = (n-1) q, a = x[floor h], b = x[floor h + 1], t = h - floor h,
// a + (b-a) t when t < 0.5, else b - (b-a)(1-t). pct in [0, 100].
double percentile(std::span<const double> sorted, double pct);
// median = percentile 50; mean from a compensated (Neumaier) sum. values must be non-empty.
Stats summarize(std::span<const double> values);
common::Json to_json(const Stats& s);

// Token-wise KL histogram: exact zeros, negatives (rounding of KL ~ 0), then decade bins.
// edges = 1e-15, 1e-14, ..., 1e2; counts[0] = (0, 1e-15), counts[i] = [edges[i-1], edges[i]),
// counts[18] = [1e2, inf).
common::Json histogram(std::span<const double> kl);

struct Options {
  // false (only `assay-compare kl --no-digests`): no sha256 is computed and the digest fields
  // are null; refused with expected sha256 values or a reproduction.
  bool digests = true;
};

struct Comparison {
  common::Json document;    // assay.compare-output.v1
  std::string kl_artifact;  // the kl.safetensors image whose sha256 the document holds
};

// sha256 of /proc/self/exe, "sha256:<hex>": the estimator identity in "comparator".
const std::string& executable_sha256();

// Opens and validates every file (structure first, then digests), compares every row, and
// builds the output document with "kl_file" = input.kl_file. Throws Error with codes
// compare.bad_file, compare.missing_tensor, compare.bad_dtype, compare.bad_shape,
// compare.vocab_mismatch, compare.sha_mismatch, compare.non_finite (input errors) and
// compare.internal (a reproduction with equal digests and non-zero KL).
Comparison compare(const CompareInput& input, const Options& options = {});

// Writes <workdir>/<kl_file> and then <workdir>/output.json, both atomically; if output.json
// cannot be written the kl file is removed again.
void write_outputs(const Comparison& c, const std::filesystem::path& workdir,
                   const std::string& kl_file);

}  // namespace assay::compare
