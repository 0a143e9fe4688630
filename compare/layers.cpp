#include "compare/layers.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "common/error.h"
#include "common/identity.h"
#include "common/layers.h"
#include "common/safetensors.h"

namespace assay::compare {

using common::Error;
using common::Json;

LayersInput parse_layers_input(const Json& doc, const std::string& where) {
  auto bad = [&](const std::string& m) { throw Error("input.invalid", where + ": " + m); };
  if (!doc.is_object()) bad("not an object");
  common::reject_unknown_fields(doc, {"schema", "reference", "engine", "boundaries", "tolerance"},
                                where);
  if (common::require_string(doc, "schema", where) != common::kCompareLayersInput)
    bad("schema is not " + std::string(common::kCompareLayersInput));
  LayersInput in;
  in.reference = common::require_string(doc, "reference", where);
  if (in.reference.find('/') != std::string::npos)
    bad("reference \"" + in.reference + "\" must be a file name of the workspace");
  const Json& e = common::require(doc, "engine", where);
  common::reject_unknown_fields(e, {"fd", "path", "sha256"}, where + " engine");
  in.engine_fd = static_cast<int>(common::require_int(e, "fd", where + " engine"));
  if (in.engine_fd < 3) bad("engine.fd " + std::to_string(in.engine_fd) + " is below 3");
  in.engine_path = e.value("path", "fd " + std::to_string(in.engine_fd));
  in.engine_sha256 = common::require_string(e, "sha256", where + " engine");
  const Json& bs = common::require(doc, "boundaries", where);
  if (!bs.is_array() || bs.empty()) bad("boundaries must be a non-empty array");
  for (const Json& b : bs) {
    common::reject_unknown_fields(b, {"name", "sha256"}, where + " boundaries[]");
    in.boundaries.push_back({common::require_string(b, "name", where + " boundaries[]"),
                             common::require_string(b, "sha256", where + " boundaries[]")});
  }
  const Json& t = common::require(doc, "tolerance", where);
  if (!t.is_number() || !(t.get<double>() >= 0)) bad("tolerance must be a number >= 0");
  in.tolerance = t.get<double>();
  return in;
}

namespace {

float bf16_to_f32(std::uint16_t v) {
  std::uint32_t bits = static_cast<std::uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// A tensor's values as F32 (BF16 widened exactly), in row-major order.
std::vector<float> as_f32(const common::TensorView& t) {
  std::vector<float> out(static_cast<std::size_t>(t.numel()));
  if (t.dtype == common::Dtype::kF32) {
    std::memcpy(out.data(), t.data, out.size() * sizeof(float));
  } else {
    for (std::size_t i = 0; i < out.size(); ++i) {
      std::uint16_t v;
      std::memcpy(&v, t.data + 2 * i, 2);
      out[i] = bf16_to_f32(v);
    }
  }
  return out;
}

std::string f32_sha256(const std::vector<float>& v) {
  return common::sha256_id(v.data(), v.size() * sizeof(float));
}

Json at_json(std::size_t index, const std::string& name) {
  return Json{{"index", index}, {"name", name}};
}

}  // namespace

Json compare_layers(const LayersInput& in) {
  auto t0 = std::chrono::steady_clock::now();
  common::SafetensorsFile reference = common::SafetensorsFile::open(in.reference);
  common::SafetensorsFile engine =
      in.engine_fd >= 0 ? common::SafetensorsFile::open_fd(in.engine_fd, in.engine_path)
                        : common::SafetensorsFile::open(in.engine_path);
  std::string engine_sha = common::sha256_id(engine.image().data(), engine.image().size());
  if (in.engine_sha256 && engine_sha != *in.engine_sha256)
    throw Error("compare.file_changed", "the engine's rows file " + in.engine_path + " hashes to " +
                                            engine_sha + ", not the request's " +
                                            *in.engine_sha256);

  Json rows = Json::array();
  Json first_non_bitwise = nullptr, first_over = nullptr, largest = nullptr;
  std::optional<Json> previous_rel;
  double largest_growth = 0;
  std::size_t given = 0;
  for (std::size_t i = 0; i < in.boundaries.size(); ++i) {
    const auto& b = in.boundaries[i];
    const common::TensorView* r = reference.find(b.name);
    if (!r || r->dtype != common::Dtype::kF32 || r->shape.size() != 2)
      throw Error("compare.reference_changed",
                  "the reference rows file has no F32 [R, hidden] tensor \"" + b.name + "\"");
    std::vector<float> ref = as_f32(*r);
    if (f32_sha256(ref) != b.sha256)
      throw Error("compare.reference_changed",
                  "reference tensor \"" + b.name + "\" is not the one the oracle reported");
    Json row{{"index", i},
             {"name", b.name},
             {"present", false},
             {"bitwise_equal", nullptr},
             {"cosine_similarity", nullptr},
             {"max_abs_error", nullptr},
             {"mean_abs_error", nullptr},
             {"root_mean_square_error", nullptr},
             {"reference_root_mean_square", nullptr},
             {"relative_root_mean_square_error", nullptr},
             {"relative_rmse_growth", nullptr},
             {"reference_sha256", b.sha256},
             {"engine_sha256", nullptr},
             {"engine_dtype", nullptr}};
    const common::TensorView* e = engine.find(b.name);
    if (!e) {
      rows.push_back(std::move(row));
      continue;
    }
    ++given;
    const std::int64_t n_rows = r->shape[0], hidden = r->shape[1];
    bool shape_ok = (e->shape == std::vector<std::int64_t>{n_rows, hidden}) ||
                    (n_rows == 1 && e->shape == std::vector<std::int64_t>{hidden});
    if (!shape_ok || (e->dtype != common::Dtype::kF32 && e->dtype != common::Dtype::kBF16))
      throw Error("request.bad_layer_rows",
                  "the engine's tensor \"" + b.name + "\" is " +
                      std::string(common::dtype_name(e->dtype)) + " of " +
                      std::to_string(e->shape.size()) + " dims; the reference's is F32 [" +
                      std::to_string(n_rows) + ", " + std::to_string(hidden) + "]");
    std::vector<float> eng = as_f32(*e);
    // Kiln's metrics in float64 over every element.
    double dot = 0, ref_sq = 0, eng_sq = 0, abs_sum = 0, max_abs = 0, diff_sq = 0;
    bool bitwise = std::memcmp(ref.data(), eng.data(), ref.size() * sizeof(float)) == 0;
    for (std::size_t k = 0; k < ref.size(); ++k) {
      if (!std::isfinite(eng[k]))
        throw Error("request.bad_layer_rows",
                    "the engine's tensor \"" + b.name + "\" is " +
                        (std::isnan(eng[k]) ? "NaN" : "infinite") + " at row " +
                        std::to_string(static_cast<std::int64_t>(k) / hidden) + ", column " +
                        std::to_string(static_cast<std::int64_t>(k) % hidden));
      double x = ref[k], y = eng[k], d = y - x;
      dot += x * y;
      ref_sq += x * x;
      eng_sq += y * y;
      abs_sum += std::fabs(d);
      max_abs = std::max(max_abs, std::fabs(d));
      diff_sq += d * d;
    }
    const auto n = static_cast<double>(ref.size());
    double rmse = std::sqrt(diff_sq / n), ref_rms = std::sqrt(ref_sq / n);
    // 1 when both rows are zero, 0 when one is (torch's convention: no direction to share).
    double cosine = ref_sq == 0 && eng_sq == 0 ? 1.0
                    : ref_sq == 0 || eng_sq == 0
                        ? 0.0
                        : std::clamp(dot / (std::sqrt(ref_sq) * std::sqrt(eng_sq)), -1.0, 1.0);
    Json rel = rmse == 0 ? Json(0.0) : ref_rms == 0 ? Json(nullptr) : Json(rmse / ref_rms);
    row["present"] = true;
    row["bitwise_equal"] = bitwise;
    row["cosine_similarity"] = cosine;
    row["max_abs_error"] = max_abs;
    row["mean_abs_error"] = abs_sum / n;
    row["root_mean_square_error"] = rmse;
    row["reference_root_mean_square"] = ref_rms;
    row["relative_root_mean_square_error"] = rel;
    row["engine_sha256"] = f32_sha256(eng);
    row["engine_dtype"] = std::string(common::dtype_name(e->dtype));
    if (!bitwise && first_non_bitwise.is_null()) first_non_bitwise = at_json(i, b.name);
    if (rel.is_number()) {
      double v = rel.get<double>();
      if (v > in.tolerance && first_over.is_null()) {
        first_over = at_json(i, b.name);
        first_over["relative_root_mean_square_error"] = v;
      }
      // Growth since the previous present boundary (none when either relative error is null).
      if (previous_rel && previous_rel->is_number()) {
        double growth = v - previous_rel->get<double>();
        row["relative_rmse_growth"] = growth;
        if (growth > largest_growth) {
          largest_growth = growth;
          largest = at_json(i, b.name);
          largest["relative_rmse_growth"] = growth;
        }
      }
    }
    previous_rel = rel;
    rows.push_back(std::move(row));
  }
  // A name in the engine's file that is not a boundary of the reference.
  for (const common::TensorView& t : engine.tensors()) {
    bool known = false;
    for (const auto& b : in.boundaries) known = known || b.name == t.name;
    if (!known)
      throw Error("request.bad_layer_rows", "the engine's rows file has tensor \"" +
                                                t.name.substr(0, 200) +
                                                "\", which is not a boundary of this model");
  }
  if (given == 0) throw Error("request.bad_layer_rows", "the engine's rows file holds no boundary");
  return Json{
      {"schema", common::kCompareLayersOutput},
      {"engine_file_sha256", engine_sha},
      {"engine_file_bytes", engine.file_size()},
      {"reference_file_sha256",
       common::sha256_id(reference.image().data(), reference.image().size())},
      {"boundaries", std::move(rows)},
      {"first_non_bitwise", std::move(first_non_bitwise)},
      {"first_over_tolerance", std::move(first_over)},
      {"largest_growth", std::move(largest)},
      {"seconds", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()}};
}

}  // namespace assay::compare
