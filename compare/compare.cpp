// The comparison itself (compare.h): every row of every context through the kernel, the
// per-context and overall summaries, the reproduction check, the statistics and gates, the
// assay.compare-output.v1 document and its token-wise KL artifact; and writing both.
#include "compare/compare.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "common/safetensors.h"
#include "common/worker_document.h"
#include "compare/kernel.h"
#include "compare/logits.h"
#include "compare/statistics.h"

namespace assay::compare {
namespace {

using common::Error;
using common::Json;

constexpr std::string_view kKlSchema = "assay.fidelity-kl.v1";

struct OpenedContext {
  const ContextSpec* spec;
  std::unique_ptr<Logits> reference, candidate, reproduction;
};

Json nullable(const std::optional<std::string>& s) {
  return s ? Json(*s) : Json(nullptr);
}

std::string dtype_text(Element e) {
  return e == Element::kF32 ? "F32" : "BF16";
}

template <typename T>
std::span<const std::byte> raw(const std::vector<T>& v) {
  return std::as_bytes(std::span<const T>(v));
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

Json input_dtypes(const std::vector<OpenedContext>& opened) {
  std::set<std::string> dtypes;
  for (const OpenedContext& o : opened)
    for (const Logits* l : {o.reference.get(), o.candidate.get(), o.reproduction.get()})
      if (l) dtypes.insert(dtype_text(l->element));
  return Json(std::vector<std::string>(dtypes.begin(), dtypes.end()));
}

// Opens every file, structure first (cheap), so that a bad shape in the last context is
// reported before any hashing or arithmetic; then the digests.
std::vector<OpenedContext> open_contexts(const CompareInput& input, const Options& options) {
  std::vector<OpenedContext> opened;
  for (const ContextSpec& spec : input.contexts) {
    OpenedContext o{&spec, nullptr, nullptr, nullptr};
    if (!options.digests && (spec.reference.sha256 || spec.candidate.sha256 || spec.reproduction))
      throw Error("compare.usage",
                  "--no-digests goes with neither sha256 values nor a reproduction");
    o.reference = std::make_unique<Logits>(spec.reference, "reference", spec.id);
    o.candidate = std::make_unique<Logits>(spec.candidate, "candidate", spec.id);
    if (spec.reproduction)
      o.reproduction = std::make_unique<Logits>(*spec.reproduction, "reproduction", spec.id);
    for (Logits* l : {o.reference.get(), o.candidate.get(), o.reproduction.get()})
      if (l) l->check_shape(spec.rows(), input.vocab_size);
    opened.push_back(std::move(o));
  }
  for (OpenedContext& o : opened)
    for (Logits* l : {o.reference.get(), o.candidate.get(), o.reproduction.get()}) {
      if (!l) continue;
      // The whole file's digest only where the input names one to check (a user's candidate
      // file); the tensor's raw-byte digest, which identifies the logits, always.
      l->hash(l->ref.sha256.has_value(), options.digests);
      if (l->ref.sha256) l->check_sha256();
    }
  return opened;
}

// What the comparison gathers row by row, in input order over every context.
struct Rows {
  Rows(std::size_t vocab_size, std::int64_t total)
      : vocab(vocab_size), scratch(scratch_size(vocab_size)) {
    kl.reserve(static_cast<std::size_t>(total));
    context_index.reserve(kl.capacity());
    position.reserve(kl.capacity());
    ref_argmax.reserve(kl.capacity());
    cand_argmax.reserve(kl.capacity());
  }
  std::size_t vocab;
  std::vector<double> kl, repro_kl;
  std::vector<std::int64_t> context_index, position, ref_argmax, cand_argmax, repro_argmax;
  std::vector<double> scratch;
  Series series;
  std::int64_t agree_total = 0;
  bool digests_equal = true;
};

void check_finite(const RowResult& r, const Logits& a, const Logits& b, std::size_t row,
                  std::int64_t pos, std::size_t vocab) {
  if (r.non_finite < 0) return;
  const Logits& bad = r.non_finite == 0 ? a : b;
  throw Error("compare.non_finite", bad.what + ": row " + std::to_string(row) + " (position " +
                                        std::to_string(pos) + "), column " +
                                        std::to_string(r.non_finite_column) + " is " +
                                        bad.value_text(row, vocab, r.non_finite_column) +
                                        "; non-finite logits fail the job (never clamped)");
}

// Δp of the reference's argmax and, where the next token is known, of that token, and both
// sides' negative log-likelihood of it.
void add_probabilities(const OpenedContext& o, const RowResult& r, std::size_t row,
                       std::int64_t pos, std::size_t vocab, Series& series) {
  // Log-probabilities exactly as the kernel's log-softmax; p = exp(log p) by the
  // kernel's exp, so equal rows give exactly equal probabilities.
  auto logp_r = [&](std::int64_t t) {
    return (o.reference->at(row, vocab, t) - r.reference_max) - r.reference_log_sum;
  };
  auto logp_c = [&](std::int64_t t) {
    return (o.candidate->at(row, vocab, t) - r.candidate_max) - r.candidate_log_sum;
  };
  double lp[4] = {logp_r(r.reference_argmax), logp_c(r.reference_argmax), 0, 0};
  const auto& ids = o.spec->token_ids;
  const bool next = ids && pos + 1 < static_cast<std::int64_t>(ids->size());
  if (next) {
    const std::int64_t t = (*ids)[static_cast<std::size_t>(pos + 1)];
    lp[2] = logp_r(t);
    lp[3] = logp_c(t);
  }
  double pr[4];
  exp_nonpositive(lp, pr, 4);
  series.delta_p_top.push_back(pr[1] - pr[0]);
  if (next) {
    series.delta_p_next.push_back(pr[3] - pr[2]);
    series.nll_reference.push_back(-lp[2]);
    series.nll_candidate.push_back(-lp[3]);
  }
}

struct Agreement {
  std::int64_t candidate = 0, reproduction = 0;
};

// One scored position: KL and argmaxes of reference vs candidate (and vs reproduction).
// `more`: another row of this context follows, to be read ahead while this one's arithmetic runs
// (a hint).
void compare_row(const OpenedContext& o, std::size_t ci, std::size_t row, std::int64_t pos,
                 bool more, Rows& rows, Agreement& agree) {
  const std::size_t vocab = rows.vocab;
  RowResult r = kl_row(o.reference->row(row, vocab), o.candidate->row(row, vocab), vocab,
                       rows.scratch.data(), more ? o.reference->row(row + 1, vocab).data : nullptr,
                       more ? o.candidate->row(row + 1, vocab).data : nullptr);
  check_finite(r, *o.reference, *o.candidate, row, pos, vocab);
  rows.kl.push_back(r.kl);
  rows.series.same_top.push_back(r.reference_argmax == r.candidate_argmax);
  add_probabilities(o, r, row, pos, vocab, rows.series);
  rows.context_index.push_back(static_cast<std::int64_t>(ci));
  rows.position.push_back(pos);
  rows.ref_argmax.push_back(r.reference_argmax);
  rows.cand_argmax.push_back(r.candidate_argmax);
  agree.candidate += r.reference_argmax == r.candidate_argmax;
  if (o.reproduction) {
    RowResult p = kl_row(o.reference->row(row, vocab), o.reproduction->row(row, vocab), vocab,
                         rows.scratch.data(), nullptr,
                         more ? o.reproduction->row(row + 1, vocab).data : nullptr);
    check_finite(p, *o.reference, *o.reproduction, row, pos, vocab);
    rows.repro_kl.push_back(p.kl);
    rows.repro_argmax.push_back(p.candidate_argmax);
    agree.reproduction += p.reference_argmax == p.candidate_argmax;
  }
}

// The context's reproduction summary; throws compare.internal when its logits digest equals the
// reference's but the comparison says they differ.
Json context_reproduction(const OpenedContext& o, const Rows& rows, std::size_t first,
                          std::int64_t n, std::int64_t repro_agree, bool& digests_equal) {
  const std::span<const double> ctx_repro(rows.repro_kl.data() + first,
                                          static_cast<std::size_t>(n));
  Stats s = summarize(ctx_repro);
  bool equal = *o.reproduction->tensor_sha256 == *o.reference->tensor_sha256;
  if (equal && (s.max != 0.0 || s.min != 0.0 || repro_agree != n))
    throw Error("compare.internal", "context '" + o.spec->id +
                                        "': the reproduction's logits digest equals the "
                                        "reference's (" +
                                        *o.reference->tensor_sha256 + ") but KL ranges over [" +
                                        num(s.min) + ", " + num(s.max) + "] with " +
                                        std::to_string(repro_agree) + "/" + std::to_string(n) +
                                        " argmaxes equal");
  digests_equal &= equal;
  return {{"sha256", *o.reproduction->tensor_sha256},
          {"file_sha256", nullable(o.reproduction->file_sha256)},
          {"dtype", dtype_text(o.reproduction->element)},
          {"digest_equal", equal},
          {"kl_max", s.max},
          {"kl_mean", s.mean},
          {"top1_agreement", static_cast<double>(repro_agree) / n},
          {"top1_agree_count", repro_agree}};
}

// Every row of context `ci`, then its summary for the output's "contexts".
Json compare_context(const OpenedContext& o, std::size_t ci, Rows& rows) {
  const std::size_t first = rows.kl.size();
  Agreement agree;
  std::size_t row = 0;
  for (const Range& range : o.spec->positions) {
    for (std::int64_t pos = range.begin; pos < range.end; ++pos, ++row) {
      const bool more = pos + 1 < range.end || &range != &o.spec->positions.back();
      compare_row(o, ci, row, pos, more, rows, agree);
    }
  }
  rows.agree_total += agree.candidate;
  const auto n = static_cast<std::int64_t>(row);
  const std::span<const double> ctx_kl(rows.kl.data() + first, row);
  Json reproduction = nullptr;
  if (o.reproduction)
    reproduction = context_reproduction(o, rows, first, n, agree.reproduction, rows.digests_equal);
  return {{"id", o.spec->id},
          {"positions", n},
          {"reference_sha256", nullable(o.reference->tensor_sha256)},
          {"reference_file_sha256", nullable(o.reference->file_sha256)},
          {"reference_dtype", dtype_text(o.reference->element)},
          {"candidate_sha256", nullable(o.candidate->tensor_sha256)},
          {"candidate_file_sha256", nullable(o.candidate->file_sha256)},
          {"candidate_dtype", dtype_text(o.candidate->element)},
          {"kl", to_json(summarize(ctx_kl))},
          {"top1_agreement", static_cast<double>(agree.candidate) / n},
          {"top1_agree_count", agree.candidate},
          {"reproduction", reproduction}};
}

// The output's "reproduction" over all contexts, and the reproduction gates this comparison can
// decide (null without a reproduction).
Json reproduction_summary(const Rows& rows, std::int64_t total, Json& gates) {
  Stats s = summarize(rows.repro_kl);
  std::int64_t agree = 0;
  for (std::size_t i = 0; i < rows.repro_argmax.size(); ++i)
    agree += rows.repro_argmax[i] == rows.ref_argmax[i];
  double top1 = static_cast<double>(agree) / static_cast<double>(total);
  // What this comparison can decide; the supervisor decides the other two from the capture
  // runs and the fingerprints (common::finalize_gates then recomputes the status).
  gates = {{"asserted_exact_zero", s.max == 0.0 && s.min == 0.0 && top1 == 1.0},
           {"head_digest_equal", rows.digests_equal},
           {"capture_content_digest_equal", nullptr},
           {"weights_identity_equal", nullptr}};
  return {{"kl", to_json(s)},
          {"top1_agreement", top1},
          {"top1_agree_count", agree},
          {"digests_equal", rows.digests_equal},
          {"confirmed", rows.digests_equal && s.max == 0.0 && s.min == 0.0 && top1 == 1.0}};
}

// The output's "scope": which positions were scored, and how many have a known next token.
Json scope_json(const CompareInput& input, std::int64_t total) {
  Json positions_per_context = Json::array();
  bool all_positions = true, ids_known = true;
  std::int64_t next_known = 0;
  for (const ContextSpec& spec : input.contexts) {
    positions_per_context.push_back(spec.rows());
    if (!spec.token_ids) {
      ids_known = false;
      continue;
    }
    const auto len = static_cast<std::int64_t>(spec.token_ids->size());
    all_positions &=
        spec.positions.size() == 1 && spec.positions[0].begin == 0 && spec.positions[0].end == len;
    for (const Range& range : spec.positions)
      next_known += std::max<std::int64_t>(0, std::min(range.end, len - 1) - range.begin);
  }
  return {{"contexts", input.contexts.size()},
          {"positions_per_context", positions_per_context},
          {"scored_positions", total},
          {"next_token_positions", ids_known ? Json(next_known) : Json(nullptr)},
          {"position_filter", ids_known && all_positions ? "all" : "request_ranges"},
          {"covers_full_panel", true}};
}

// The assay.fidelity-kl.v1 artifact: the per-position series as safetensors.
std::string kl_artifact(const CompareInput& input, const Rows& rows, std::int64_t total,
                        bool with_reproduction) {
  std::vector<common::TensorToWrite> tensors = {
      {"kl", common::Dtype::kF64, {total}, raw(rows.kl)},
      {"context_index", common::Dtype::kI64, {total}, raw(rows.context_index)},
      {"position", common::Dtype::kI64, {total}, raw(rows.position)},
      {"reference_argmax", common::Dtype::kI64, {total}, raw(rows.ref_argmax)},
      {"candidate_argmax", common::Dtype::kI64, {total}, raw(rows.cand_argmax)}};
  if (with_reproduction) {
    tensors.push_back({"reproduction_kl", common::Dtype::kF64, {total}, raw(rows.repro_kl)});
    tensors.push_back(
        {"reproduction_argmax", common::Dtype::kI64, {total}, raw(rows.repro_argmax)});
  }
  Json ids = Json::array();
  for (const ContextSpec& spec : input.contexts) ids.push_back(spec.id);
  return common::serialize_safetensors(
      tensors, {{"schema", std::string(kKlSchema)}, {"contexts", common::canonical(ids)}});
}

// The output's "comparator": how this estimator computes, for the receipt.
Json comparator_json(const std::vector<OpenedContext>& opened) {
  return {{"estimator", "assay-compare"},
          {"estimator_sha256", executable_sha256()},
          {"accumulation_dtype", "float64"},
          {"logprob_dtype", "float64"},
          {"input_dtypes", input_dtypes(opened)},
          {"kernel", active_clone()},
          {"fp_contract", "off"},
          {"exp_log", "own"},
          {"deterministic_algorithms", true},
          {"tf32", false},
          {"device", "cpu"},
          {"blas", "none"}};
}

}  // namespace

const std::string& executable_sha256() {
  // The link itself, not its target's path: that is the file this process runs.
  static const std::string id = [] {
    std::ifstream in("/proc/self/exe", std::ios::binary);
    if (!in) throw Error("compare.internal", "cannot open /proc/self/exe to hash the estimator");
    common::Sha256 h;
    std::vector<char> buf(1 << 20);
    while (in.read(buf.data(), static_cast<std::streamsize>(buf.size())) || in.gcount() > 0)
      h.update(buf.data(), static_cast<std::size_t>(in.gcount()));
    return common::identity(h.finish());
  }();
  return id;
}

Comparison compare(const CompareInput& input, const Options& options) {
  const auto start = std::chrono::steady_clock::now();
  const std::vector<OpenedContext> opened = open_contexts(input, options);

  std::int64_t total = 0;
  for (const ContextSpec& spec : input.contexts) total += spec.rows();
  const bool with_reproduction = !input.contexts.empty() && input.contexts[0].reproduction;
  Rows rows(static_cast<std::size_t>(input.vocab_size), total);
  Json contexts = Json::array();
  for (std::size_t ci = 0; ci < opened.size(); ++ci)
    contexts.push_back(compare_context(opened[ci], ci, rows));

  rows.series.kl = rows.kl;
  const Json statistics = statistics_json(rows.series);
  const Stats all = summarize(rows.kl);
  const std::size_t at = static_cast<std::size_t>(
      std::find(rows.kl.begin(), rows.kl.end(), all.max) - rows.kl.begin());
  Json reproduction = nullptr;
  Json reproduction_gates = nullptr;
  if (with_reproduction) reproduction = reproduction_summary(rows, total, reproduction_gates);
  Json gates = common::finalize_gates(
      {{"reproduction", reproduction_gates},
       {"thresholds", common::evaluate_thresholds(input.thresholds, statistics)}});

  Comparison out;
  out.kl_artifact = kl_artifact(input, rows, total, with_reproduction);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  out.document = {
      {"schema", protocol::kCompareOutput},
      {"vocab_size", input.vocab_size},
      {"positions", total},
      {"metrics",
       {{"kl", to_json(all)},
        {"max_at",
         {{"context", input.contexts[static_cast<std::size_t>(rows.context_index[at])].id},
          {"position", rows.position[at]}}},
        {"top1_agreement", static_cast<double>(rows.agree_total) / static_cast<double>(total)},
        {"top1_agree_count", rows.agree_total}}},
      {"contexts", contexts},
      {"reproduction", reproduction},
      {"histogram", histogram(rows.kl)},
      {"kl_file", input.kl_file},
      {"kl_file_sha256", common::sha256_id(out.kl_artifact)},
      {"kernel", active_clone()},
      {"comparison_kind", with_reproduction ? "reproduction_confirmation" : "candidate_comparison"},
      {"metric",
       {{"name", "mean_tokenwise_kld"},
        {"direction", "reference_to_candidate"},
        {"units", "nats"},
        {"higher_is_better", false},
        {"value", all.mean}}},
      {"scope", scope_json(input, total)},
      {"comparator", comparator_json(opened)},
      {"statistics", statistics},
      {"gates", gates},
      {"seconds", seconds}};
  return out;
}

void write_outputs(const Comparison& c, const std::filesystem::path& workdir,
                   const std::string& kl_file) {
  const std::filesystem::path kl_path = workdir / kl_file;
  common::atomic_write_file(kl_path, c.kl_artifact);
  try {
    common::write_worker_document(workdir / protocol::kOutputFile, c.document.dump(2) + "\n");
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove(kl_path, ec);
    throw;
  }
}

}  // namespace assay::compare
