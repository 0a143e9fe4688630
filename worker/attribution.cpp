#include "worker/attribution.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <set>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "common/request.h"
#include "common/safetensors.h"
#include "common/worker_document.h"
#include "worker/run.h"

namespace assay::oracle {

using common::Error;
using common::Json;

namespace {

// "layers.N.<block>.<operator>" (docs/operators.md), as opposed to a layer-level boundary.
bool is_operator(const std::string& boundary) {
  return boundary.starts_with("layers.") && std::count(boundary.begin(), boundary.end(), '.') >= 3;
}

}  // namespace

LayersInput parse_layers_input(const Json& doc) {
  const std::string where = "input.json";
  if (!doc.is_object()) throw Error("input.invalid", where + ": not an object");
  common::reject_unknown_fields(
      doc,
      {"schema", "model_dir", "model_fds", "token_ids", "rows", "operators", "execution", "patch"},
      where);
  std::string schema = common::require_string(doc, "schema", where);
  if (schema != common::kOracleLayersInput)
    throw Error("input.invalid", where + ": schema \"" + schema + "\" is not \"" +
                                     std::string(common::kOracleLayersInput) + "\"");
  LayersInput in;
  in.model_dir = common::require_string(doc, "model_dir", where);
  if (!in.model_dir.is_absolute())
    throw Error("input.invalid",
                where + ": model_dir \"" + in.model_dir.string() + "\" must be an absolute path");
  in.model_fds = parse_optional_model_fds(doc, where);
  const Json& ids = common::require(doc, "token_ids", where);
  if (!ids.is_array() || ids.empty())
    throw Error("input.invalid", where + ": token_ids must be a non-empty array");
  for (std::size_t k = 0; k < ids.size(); ++k) {
    if (!ids[k].is_number_integer())
      throw Error("input.invalid", where + ": token_ids[" + std::to_string(k) +
                                       "] is not an integer: " + ids[k].dump());
    in.token_ids.push_back(ids[k].get<std::int64_t>());
  }
  std::string rows = common::require_string(doc, "rows", where);
  if (rows != "last" && rows != "all")
    throw Error("input.invalid", where + ": rows \"" + rows + "\" is not \"last\" or \"all\"");
  in.rows = rows == "last" ? common::LayerRows::kLast : common::LayerRows::kAll;
  if (auto it = doc.find("operators"); it != doc.end()) {
    if (!it->is_array()) throw Error("input.invalid", where + ": operators must be an array");
    for (const Json& n : *it) {
      if (!n.is_string() || !is_operator(n.get<std::string>()))
        throw Error("input.invalid",
                    where + ": operators holds " + n.dump().substr(0, 80) +
                        ", not an operator-level boundary (layers.N.<block>.<operator>)");
      in.operators.push_back(n.get<std::string>());
    }
  }
  in.execution = parse_execution(common::require(doc, "execution", where), where + " execution");
  if (auto it = doc.find("patch"); it != doc.end() && !it->is_null()) {
    const std::string w = where + " patch";
    if (!it->is_object()) throw Error("input.invalid", w + ": not an object");
    common::reject_unknown_fields(
        *it, {"fd", "boundaries", "candidate_token_id", "sha256", "search"}, w);
    LayersInput::Patch p;
    p.fd = static_cast<int>(common::require_int(*it, "fd", w));
    if (p.fd < 3) throw Error("input.invalid", w + ": fd " + std::to_string(p.fd) + " is below 3");
    const Json& names = common::require(*it, "boundaries", w);
    if (!names.is_array() || names.empty())
      throw Error("input.invalid", w + ": boundaries must be a non-empty array");
    for (const Json& n : names) {
      if (!n.is_string()) throw Error("input.invalid", w + ": boundaries holds " + n.dump());
      p.boundaries.push_back(n.get<std::string>());
    }
    p.candidate_token_id = common::require_int(*it, "candidate_token_id", w);
    if (it->contains("sha256")) {
      p.sha256 = common::require_string(*it, "sha256", w);
      if (!common::is_identity(p.sha256))
        throw Error("input.invalid", w + ": sha256 \"" + p.sha256 + "\" is not a digest");
    }
    if (it->contains("search")) {
      std::string search = common::require_string(*it, "search", w);
      if (search != "every" && search != "bisect")
        throw Error("input.invalid",
                    w + ": search \"" + search + "\" is not \"every\" or \"bisect\"");
      p.search = search == "bisect" ? LayersInput::Patch::Search::kBisect
                                    : LayersInput::Patch::Search::kEvery;
    }
    if (in.rows != common::LayerRows::kAll)
      throw Error("input.invalid", w + ": patching needs rows \"all\"");
    in.patch = std::move(p);
  }
  return in;
}

namespace {

// Keeps each boundary's rows, F32 on the CPU: bf16 values widened, never re-rounded.
// Operator-level boundaries are kept only when named in `operators`; each value [1, T, ...] is
// kept as [R, width] (trailing dims flattened).
class CaptureProbe final : public Probe {
 public:
  // keep_inputs: also hold each decoder layer's input as the forward computed it (the
  // "embedding" and "layers.N" values themselves, all positions), for patching to start from.
  CaptureProbe(bool last_only, bool keep_inputs, const std::vector<std::string>& operators)
      : last_only_(last_only), keep_inputs_(keep_inputs), operators_(operators) {}
  at::Tensor at(const std::string& boundary, const at::Tensor& value) override {
    if (keep_inputs_ && (boundary == "embedding" || (boundary.starts_with("layers.") &&
                                                     boundary.find('.', 7) == std::string::npos)))
      layer_inputs.push_back(value);
    if (is_operator(boundary) &&
        std::find(operators_.begin(), operators_.end(), boundary) == operators_.end())
      return value;
    at::Tensor rows = value[0].reshape({value.size(1), -1});
    if (last_only_) rows = rows.narrow(0, rows.size(0) - 1, 1);
    names.push_back(boundary);
    // copy = true: a float32 value is copied too, never kept as a view of the forward's tensor.
    this->rows.push_back(
        rows.to(at::kCPU).to(at::kFloat, /*non_blocking=*/false, /*copy=*/true).contiguous());
    return value;
  }
  std::vector<std::string> names;
  std::vector<at::Tensor> rows;
  std::vector<at::Tensor> layer_inputs;  // [i]: decoder layer i's input; [L]: the final norm's

 private:
  bool last_only_, keep_inputs_;
  const std::vector<std::string>& operators_;
};

// The decoder layer a boundary belongs to: 0 for "embedding" (substituted before layer 0),
// N for "layers.N[.part]", `layers` for "norm".
std::int64_t layer_of(const std::string& boundary, std::int64_t layers) {
  if (boundary == "embedding") return 0;
  if (boundary == "norm") return layers;
  return std::stoll(boundary.substr(7, boundary.find('.', 7) - 7));
}

// Substitutes the engine's rows [T, width] at named boundaries, each in the dtype the forward
// has there and with the strides of the forward's own tensor.
class PatchProbe final : public Probe {
 public:
  void add(const std::string& boundary, at::Tensor engine) {
    engine_[boundary] = std::move(engine);
  }
  at::Tensor at(const std::string& boundary, const at::Tensor& value) override {
    auto it = engine_.find(boundary);
    if (it == engine_.end()) return value;
    const at::Tensor& engine = it->second;
    if (value.size(1) != engine.size(0) || value.numel() != engine.numel())
      throw Error("request.bad_layer_rows", "tensor \"" + boundary + "\" has shape " +
                                                c10::str(engine.sizes()) + ", the forward has " +
                                                c10::str(value.sizes()) + " there");
    at::Tensor converted = engine.to(value.scalar_type()).to(value.device());
    rounded += at::ne(converted.to(at::kCPU).to(at::kFloat), engine.to(at::kFloat))
                   .sum()
                   .item<std::int64_t>();
    at::Tensor substituted = at::empty_like(value);
    substituted.copy_(converted.reshape(value.sizes()));
    seen.insert(boundary);
    return substituted;
  }
  std::set<std::string> seen;
  std::int64_t rounded = 0;

 private:
  std::map<std::string, at::Tensor> engine_;
};

// The group a boundary belongs to for patching: -1 for "embedding", N for "layers.N[...]",
// `layers` for "norm".
std::int64_t group_of(const std::string& boundary, std::int64_t layers) {
  if (boundary == "embedding") return -1;
  if (boundary == "norm") return layers;
  return std::stoll(boundary.substr(7, boundary.find('.', 7) - 7));
}

// Boundaries that are outputs of one operator and are substituted together: RoPE rotates q
// and k at once.
std::string sibling_of(const std::string& boundary) {
  for (auto [a, b] : {std::pair{".self_attn.q_rotary", ".self_attn.k_rotary"},
                      std::pair{".self_attn.k_rotary", ".self_attn.q_rotary"}})
    if (boundary.ends_with(a)) return boundary.substr(0, boundary.size() - std::strlen(a)) + b;
  return "";
}

// What a forward patched at given[k] substitutes (indices into `given`, in forward order): the
// engine's state at that point, as far as its file gives it: its output of the previous layer
// (the patched layer's input), its rows at every boundary of the patched layer up to and
// including given[k], and given[k]'s siblings. Substituting one tensor alone would mix the
// engine's value with the reference's on a parallel branch (q with the reference's k, the MLP's
// gate with the reference's up, a block's output with the reference's residual), which is
// neither's state.
std::vector<std::size_t> patch_set(const std::vector<std::string>& given, std::size_t k,
                                   std::int64_t layers) {
  const std::int64_t group = group_of(given[k], layers);
  const std::string previous = group == -1  ? ""
                               : group == 0 ? "embedding"
                                            : "layers." + std::to_string(group - 1);
  const std::string sibling = sibling_of(given[k]);
  std::vector<std::size_t> out;
  for (std::size_t j = 0; j < given.size(); ++j)
    if ((group_of(given[j], layers) == group && j <= k) || given[j] == previous ||
        given[j] == sibling)
      out.push_back(j);
  return out;
}

// The last position's F32 logits of hidden states [1, T, hidden], computed over all T rows as
// next-token computes them (a GEMM may pick other kernels for one row).
at::Tensor last_logits(Model& model, const at::Tensor& hidden) {
  at::Tensor logits = model.lm_head(hidden);
  return logits[0].to(at::kFloat).to(at::kCPU).contiguous()[-1].contiguous();
}

// The lowest id among the largest logits; Error("oracle.non_finite_logits") on a NaN.
std::int64_t argmax_of(const at::Tensor& last, const std::string& what) {
  const float* v = last.data_ptr<float>();
  std::int64_t best = 0;
  for (std::int64_t i = 0; i < last.numel(); ++i) {
    if (std::isnan(v[i]))
      throw Error("oracle.non_finite_logits", what + ": logit " + std::to_string(i) + " is NaN");
    if (v[i] > v[best]) best = i;
  }
  return best;
}

std::string f32_sha256(const at::Tensor& t) {
  return common::sha256_id(t.data_ptr<float>(), static_cast<std::size_t>(t.numel()) * 4);
}

// The engine's rows of one boundary as a [T, width] tensor, checked.
at::Tensor engine_rows(const common::SafetensorsFile& file, const std::string& name, std::int64_t t,
                       std::int64_t hidden) {
  auto bad = [&](const std::string& m) {
    throw Error("request.bad_layer_rows", "the engine's rows file: tensor \"" + name + "\" " + m);
  };
  const common::TensorView* v = file.find(name);
  if (!v) bad("is missing (it was named for patching)");
  if (v->shape != std::vector<std::int64_t>{t, hidden})
    bad("has shape " + c10::str(c10::IntArrayRef(v->shape)) + ", not [" + std::to_string(t) + ", " +
        std::to_string(hidden) + "]");
  at::ScalarType dtype;
  if (v->dtype == common::Dtype::kF32)
    dtype = at::kFloat;
  else if (v->dtype == common::Dtype::kBF16)
    dtype = at::kBFloat16;
  else
    bad("has dtype " + std::string(common::dtype_name(v->dtype)) + ", not F32 or BF16");
  at::Tensor rows =
      at::from_blob(const_cast<std::byte*>(v->data), {t, hidden}, at::TensorOptions(dtype)).clone();
  at::Tensor finite = at::isfinite(rows.to(at::kFloat));
  if (!finite.all().item<bool>()) {
    auto at_ = at::nonzero(at::logical_not(finite))[0];
    bad("is not finite at row " + std::to_string(at_[0].item<std::int64_t>()) + ", column " +
        std::to_string(at_[1].item<std::int64_t>()));
  }
  return rows;
}

}  // namespace

void run_layers(const LayersInput& in, const std::filesystem::path& dir) {
  // The engine's file is the request's before anything is loaded: one changed since submission
  // fails the job now, not after the reference forward and every patched one.
  std::optional<common::SafetensorsFile> rows_file;
  std::string rows_sha;
  if (in.patch) {
    rows_file.emplace(common::SafetensorsFile::open_fd(in.patch->fd, "the engine's rows file"));
    rows_sha = common::sha256_id(rows_file->image().data(), rows_file->image().size());
    if (!in.patch->sha256.empty() && rows_sha != in.patch->sha256)
      throw Error("job.bytes_mismatch", "the engine's rows file has " + rows_sha +
                                            ", not the request's " + in.patch->sha256 +
                                            ": it changed after submission; nothing was computed");
  }
  ModelFiles files = open_model_files(in.model_dir, in.model_fds);
  ExecOptions options = prepare_execution(in.execution, files);
  auto t0 = Clock::now();
  LoadedModel loaded = load_model(files, options, io_threads());
  double load_seconds = seconds_since(t0);
  Model& model = *loaded.model;
  const std::int64_t vocab = model.vocab_size(), hidden = model.hidden_size();
  const auto t = static_cast<std::int64_t>(in.token_ids.size());
  check_token_ids(in.token_ids, vocab, "token_ids");
  if (in.patch && (in.patch->candidate_token_id < 0 || in.patch->candidate_token_id >= vocab))
    throw Error("request.invalid_token_id", "patch.candidate_token_id " +
                                                std::to_string(in.patch->candidate_token_id) +
                                                " is outside [0, " + std::to_string(vocab) + ")");

  c10::InferenceMode guard;
  at::Tensor input = at::tensor(in.token_ids, at::kLong).unsqueeze(0).to(options.device);
  auto t1 = Clock::now();
  CaptureProbe capture(in.rows == common::LayerRows::kLast, in.patch.has_value(), in.operators);
  at::Tensor last = last_logits(model, model.hidden_states(input, &capture));
  double forward_seconds = seconds_since(t1);
  std::int64_t argmax = argmax_of(last, "the reference forward");
  if (in.patch && static_cast<std::int64_t>(capture.layer_inputs.size()) != model.layer_count() + 1)
    throw Error("oracle.internal",
                "the forward passed " + std::to_string(capture.layer_inputs.size()) +
                    " layer inputs, not " + std::to_string(model.layer_count() + 1));

  for (const std::string& op : in.operators)
    if (std::find(capture.names.begin(), capture.names.end(), op) == capture.names.end())
      throw Error("request.bad_layer_rows",
                  "operator \"" + op + "\" is not a boundary of this " + model.architecture() +
                      " forward (docs/operators.md lists each architecture's operators)");

  const std::string ids_sha = common::token_ids_sha256(in.token_ids);
  Json boundaries = Json::array();
  std::vector<common::TensorToWrite> tensors;
  for (std::size_t i = 0; i < capture.names.size(); ++i) {
    const at::Tensor& r = capture.rows[i];
    std::vector<std::int64_t> shape{r.size(0), r.size(1)};
    if (!is_operator(capture.names[i]) && shape[1] != hidden)
      throw Error("oracle.internal", "boundary " + capture.names[i] + " has rows " +
                                         c10::str(r.sizes()) + ", hidden_size is " +
                                         std::to_string(hidden));
    boundaries.push_back(Json{
        {"index", i}, {"name", capture.names[i]}, {"shape", shape}, {"sha256", f32_sha256(r)}});
    tensors.push_back({capture.names[i],
                       common::Dtype::kF32,
                       shape,
                       {reinterpret_cast<const std::byte*>(r.data_ptr<float>()),
                        static_cast<std::size_t>(r.numel()) * sizeof(float)}});
  }
  common::write_safetensors(
      dir / common::kLayerArtifactFileName, tensors,
      {{"input_token_ids_sha256", ids_sha}, {"rows", std::string(layer_rows_name(in.rows))}});

  Json patching = nullptr;
  if (in.patch) {
    const common::SafetensorsFile& file = *rows_file;
    using Search = LayersInput::Patch::Search;
    const bool bisect = in.patch->search == Search::kBisect;
    // Every named boundary, checked before any forward; its index among the captured ones.
    std::vector<std::size_t> order;
    for (const std::string& name : in.patch->boundaries) {
      auto index = std::find(capture.names.begin(), capture.names.end(), name);
      if (index == capture.names.end())
        throw Error("request.bad_layer_rows",
                    "patch boundary \"" + name + "\" is not a boundary of this model");
      order.push_back(static_cast<std::size_t>(index - capture.names.begin()));
      if (order.size() > 1 && order.back() <= order[order.size() - 2])
        throw Error("input.invalid", "patch.boundaries are not distinct and in forward order");
    }
    const std::string logits_sha = f32_sha256(last);
    std::map<std::size_t, Json> rows_done;  // by position in patch.boundaries
    std::int64_t forwards = 0;
    auto tp = Clock::now();
    // Each given boundary's rows, read and checked once; whether they are the reference's.
    std::vector<at::Tensor> engine(order.size());
    std::vector<bool> bitwise(order.size());
    for (std::size_t k = 0; k < order.size(); ++k) {
      const at::Tensor& reference = capture.rows[order[k]];
      engine[k] = engine_rows(file, in.patch->boundaries[k], t, reference.size(1));
      bitwise[k] = at::equal(engine[k].to(at::kFloat), reference);
    }
    const std::int64_t layers = model.layer_count();
    auto patched = [&](std::size_t k) -> bool {  // one forward patched at boundary k
      const std::string& name = in.patch->boundaries[k];
      auto tb = Clock::now();
      PatchProbe probe;
      // From the patched boundary's layer on, given that layer's input: the engine's when its
      // file has the previous layer's output, else the reference's own.
      std::int64_t first = layer_of(name, layers);
      at::Tensor h = capture.layer_inputs.at(static_cast<std::size_t>(first));
      const std::string input = name == "embedding" ? "embedding"
                                : first == 0        ? "embedding"
                                                    : "layers." + std::to_string(first - 1);
      std::vector<std::string> substituted;
      for (std::size_t j : patch_set(in.patch->boundaries, k, layers)) {
        const std::string& b = in.patch->boundaries[j];
        substituted.push_back(b);
        probe.add(b, engine[j]);
        if (b == input) h = probe.at(b, h);
      }
      at::Tensor logits = last_logits(model, model.hidden_states_from(first, h, &probe));
      std::int64_t argmax = argmax_of(logits, "the forward patched at " + name);
      if (probe.seen.size() != substituted.size())
        throw Error("oracle.internal", "the forward patched at \"" + name + "\" passed " +
                                           std::to_string(probe.seen.size()) + " of the " +
                                           std::to_string(substituted.size()) +
                                           " boundaries it substitutes");
      ++forwards;
      bool flips = argmax == in.patch->candidate_token_id;
      rows_done[k] = Json{{"index", order[k]},
                          {"name", name},
                          {"computed", true},
                          {"substituted", substituted},
                          {"argmax_token_id", argmax},
                          {"becomes_candidate", flips},
                          {"logits_sha256", f32_sha256(logits)},
                          {"seconds", seconds_since(tb)},
                          {"rounded_elements", probe.rounded}};
      return flips;
    };
    if (!bisect) {
      for (std::size_t k = 0; k < order.size(); ++k) patched(k);
    } else {
      // A forward whose substitutions are all the reference's own rows bit for bit is the
      // reference forward, which holds the reference's argmax: not run.
      std::vector<std::size_t> departed;
      for (std::size_t k = 0; k < order.size(); ++k) {
        std::vector<std::string> substituted;
        bool same = true;
        for (std::size_t j : patch_set(in.patch->boundaries, k, layers)) {
          substituted.push_back(in.patch->boundaries[j]);
          same = same && bitwise[j];
        }
        if (!same) {
          departed.push_back(k);
          continue;
        }
        rows_done[k] = Json{{"index", order[k]},
                            {"name", in.patch->boundaries[k]},
                            {"computed", false},
                            {"substituted", substituted},
                            {"argmax_token_id", argmax},
                            {"becomes_candidate", argmax == in.patch->candidate_token_id},
                            {"logits_sha256", logits_sha},
                            {"seconds", 0.0},
                            {"rounded_elements", 0}};
      }
      // The first departed boundary whose substitution gives the candidate: the last one first
      // (none flips when it does not), then halving the bracket.
      if (!departed.empty() && patched(departed.back())) {
        std::size_t lo = 0, hi = departed.size() - 1;
        while (lo < hi) {
          std::size_t mid = lo + (hi - lo) / 2;
          if (patched(departed[mid]))
            hi = mid;
          else
            lo = mid + 1;
        }
      }
    }
    Json done = Json::array();
    for (auto& [k, row] : rows_done) done.push_back(std::move(row));
    patching = Json{{"candidate_token_id", in.patch->candidate_token_id},
                    {"file_sha256", rows_sha},
                    {"search", bisect ? "bisect" : "every"},
                    {"forwards", forwards},
                    {"seconds", seconds_since(tp)},
                    {"boundaries", std::move(done)}};
  }

  Json out{{"schema", common::kOracleLayersOutput},
           {"architecture", model.architecture()},
           {"model_type", loaded.model_type},
           {"rows", layer_rows_name(in.rows)},
           {"input_token_count", t},
           {"input_token_ids_sha256", ids_sha},
           {"hidden_size", hidden},
           {"vocab_size", vocab},
           {"rows_file", common::kLayerArtifactFileName},
           {"boundaries", std::move(boundaries)},
           {"logits_sha256", f32_sha256(last)},
           {"argmax_token_id", argmax},
           {"argmax_logit", last.data_ptr<float>()[argmax]},
           {"patching", std::move(patching)},
           {"bytes_used", bytes_used(files, loaded.weight_files)}};
  add_execution_report(out, options, in.execution.threads, model.attention_implementation(),
                       model.linear_attention_implementation());
  out["load_seconds"] = load_seconds;
  out["forward_seconds"] = forward_seconds;
  out["peak_rss_bytes"] = peak_rss_bytes();
  out["duration_seconds"] = seconds_since(kStart);
  common::write_worker_document(dir / protocol::kOutputFile, out.dump(2) + "\n");
}

}  // namespace assay::oracle
