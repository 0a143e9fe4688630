// `assay verify --kiln` on a Kiln layer-attribution record: Kiln's own rules of it
// (rocm_hf_layer_attribution.py validate_result), each recomputed from what the record holds.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "client/verify_checks.h"
#include "common/json.h"

namespace assay::client::verify_detail {

namespace {

using common::Json;
using common::member;

// Python's math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12), as Kiln's validators compare a
// derived metric with the value they recompute.
bool kiln_close(double a, double b) {
  if (a == b) return true;
  if (std::isinf(a) || std::isinf(b)) return false;  // an infinity is close to itself only
  return std::fabs(a - b) <= std::max(1e-12 * std::max(std::fabs(a), std::fabs(b)), 1e-12);
}

// Kiln's name for boundary `i` of `count` (rocm_hf_layer_attribution.py): the embedding, each
// layer with its kind (every fourth layer full attention, the others Gated DeltaNet), the final
// norm.
std::string kiln_boundary_name(std::size_t i, std::size_t count) {
  if (i == 0) return "embedding";
  if (i + 1 == count) return "final_norm";
  char name[64];
  std::snprintf(name, sizeof name, "layer_%02zu_%s", i - 1,
                i % 4 == 0 ? "full_attention" : "linear_attention");
  return name;
}

}  // namespace

// Kiln's rules of a layer-attribution record (rocm_hf_layer_attribution.py validate_result),
// each recomputed from what the record holds: every boundary's name and index, each boundary's
// metrics consistent with one another (the relative error is the error over the reference's
// RMS), the largest growth of the relative error recomputed from the boundaries, and the parts
// that name the same thing agreeing. The absolute errors themselves need Kiln's rows, which the
// record does not keep.
void check_kiln_layer(const Json& doc, Checks& checks) {
  auto at = [&](std::initializer_list<const char*> path) -> const Json& {
    const Json* v = &doc;
    for (const char* k : path) v = &member(*v, k);
    return *v;
  };
  const Json& boundaries = at({"worker", "boundaries"});
  if (!boundaries.is_array() || boundaries.empty()) {
    checks.add("kiln.layer.boundaries", false, "worker.boundaries is not a non-empty array");
    return;
  }
  const std::size_t count = boundaries.size();
  std::vector<std::string> problems;
  std::vector<double> relative(count, 0.0);
  Json names = Json::array();
  for (std::size_t i = 0; i < count; ++i) {
    const Json& b = boundaries[i];
    std::string want = kiln_boundary_name(i, count);
    names.push_back(want);
    if (member(b, "index") != i || member(b, "name") != want)
      problems.push_back("boundary " + std::to_string(i) + " is " + member(b, "index").dump() +
                         " " + member(b, "name").dump() + ", not " + std::to_string(i) + " \"" +
                         want + "\"");
  }
  if (at({"reference", "evidence", "boundary_names"}) != names)
    problems.push_back("reference.evidence.boundary_names are not the boundaries' names");
  if (at({"reference", "evidence", "boundary_count"}) != count)
    problems.push_back("reference.evidence.boundary_count " +
                       at({"reference", "evidence", "boundary_count"}).dump() + ", not " +
                       std::to_string(count));
  checks.add("kiln.layer.boundaries", problems.empty(),
             problems.empty() ? std::to_string(count) + " boundaries, each named as Kiln names it"
                              : problems.front() +
                                    (problems.size() > 1
                                         ? " (and " + std::to_string(problems.size() - 1) + " more)"
                                         : ""));

  problems.clear();
  for (std::size_t i = 0; i < count; ++i) {
    const Json& b = boundaries[i];
    auto cosine = number_at(b, "cosine_similarity"), maximum = number_at(b, "max_abs_error"),
         mean = number_at(b, "mean_abs_error"), rms = number_at(b, "reference_root_mean_square"),
         rel = number_at(b, "relative_root_mean_square_error"),
         rmse = number_at(b, "root_mean_square_error");
    std::string where = "boundary " + std::to_string(i) + ": ";
    if (!cosine || !maximum || !mean || !rms || !rel || !rmse) {
      problems.push_back(where + "a metric is missing or not a number");
      continue;
    }
    relative[i] = *rel;
    if (!(*cosine >= -1 && *cosine <= 1)) problems.push_back(where + "cosine outside [-1, 1]");
    if (*maximum < 0 || *mean < 0 || *mean > *maximum)
      problems.push_back(where + "mean and max absolute errors are not 0 <= mean <= max");
    if (!(*rms > 0)) problems.push_back(where + "the reference's RMS is not positive");
    if (*rel < 0 || *rmse < 0)
      problems.push_back(where + "a negative error");
    else if (*rms > 0 && !kiln_close(*rel, *rmse / *rms))
      problems.push_back(where + "relative error " + repr(*rel) +
                         " is not the RMS error over the reference's RMS, " + repr(*rmse / *rms));
  }
  checks.add("kiln.layer.metrics", problems.empty(),
             problems.empty() ? "each boundary's metrics follow from one another"
                              : problems.front() +
                                    (problems.size() > 1
                                         ? " (and " + std::to_string(problems.size() - 1) + " more)"
                                         : ""));

  // The largest step of the relative error from one boundary to the next (from 0 before the
  // first); the lowest index among equal steps.
  std::size_t largest = 0;
  std::vector<double> deltas(count);
  for (std::size_t i = 0; i < count; ++i) {
    deltas[i] = relative[i] - (i ? relative[i - 1] : 0.0);
    if (deltas[i] > deltas[largest]) largest = i;
  }
  const Json& growth = at({"worker", "largest_relative_error_growth"});
  auto delta = number_at(growth, "relative_root_mean_square_error_delta");
  bool growth_ok = member(growth, "index") == largest && member(growth, "name") == names[largest] &&
                   delta && kiln_close(*delta, deltas[largest]);
  checks.add("kiln.layer.largest_growth", growth_ok,
             "recomputed: boundary " + std::to_string(largest) + " " + names[largest].dump() +
                 ", delta " + repr(deltas[largest]) +
                 (growth_ok ? "" : "; the record says " + growth.dump()));

  auto same = [&](const char* name, const Json& a, const char* a_name, const Json& b,
                  const char* b_name) { check_same(checks, name, a, a_name, b, b_name); };
  same("kiln.layer.last_rows_sha256", at({"worker", "hf_layer_last_rows_sha256"}),
       "worker.hf_layer_last_rows_sha256", at({"reference", "evidence", "layer_last_rows_sha256"}),
       "reference.evidence.layer_last_rows_sha256");
  same("kiln.layer.request_sha256", at({"reference", "evidence", "request_sha256"}),
       "reference.evidence.request_sha256", at({"request", "sha256"}), "request.sha256");
  same("kiln.layer.request_id", at({"worker", "request_id"}), "worker.request_id",
       at({"reference", "evidence", "request_id"}), "reference.evidence.request_id");
  same("kiln.layer.input_token_ids_sha256", at({"worker", "input_token_ids_sha256"}),
       "worker.input_token_ids_sha256", at({"reference", "evidence", "input_token_ids_sha256"}),
       "reference.evidence.input_token_ids_sha256");
  const Json& bytes = at({"reference", "bytes"});
  bool bytes_ok = bytes.is_number_integer() && bytes.get<std::int64_t>() > 0 &&
                  at({"reference", "evidence", "output_bytes"}) == bytes;
  checks.add(
      "kiln.layer.output_bytes", bytes_ok,
      "reference.bytes " + bytes.dump() + (bytes_ok ? " = " : " vs ") +
          "reference.evidence.output_bytes " +
          at({"reference", "evidence", "output_bytes"}).dump() +
          (bytes.is_number_integer() && bytes.get<std::int64_t>() <= 0 ? " (not positive)" : ""));
  same("kiln.origin_main", at({"source", "commit"}), "source.commit", at({"source", "origin_main"}),
       "source.origin_main");
  if (doc.contains("model_fingerprint"))
    same("kiln.python_sha256", at({"model_fingerprint", "python_sha256"}),
         "model_fingerprint.python_sha256", at({"implementation", "python_sha256"}),
         "implementation.python_sha256");
}

}  // namespace assay::client::verify_detail
