#include "compare/trajectory.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <set>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/safetensors.h"
#include "common/trajectory.h"
#include "common/worker_document.h"
#include "compare/compare.h"

namespace assay::compare {
namespace {

using common::Error;
using common::Json;

constexpr std::int64_t kMaxVocab = std::int64_t{1} << 24;

[[noreturn]] void invalid(const std::string& where, const std::string& message) {
  throw Error("input.invalid", where + ": " + message);
}

std::string shown(const Json& v) {
  std::string s = v.dump();
  return s.size() > 80 ? s.substr(0, 77) + "..." : s;
}

void check_object(const Json& v, std::initializer_list<std::string_view> keys,
                  const std::string& where) {
  if (!v.is_object()) invalid(where, "must be an object, got " + shown(v));
  for (auto it = v.begin(); it != v.end(); ++it)
    if (std::find(keys.begin(), keys.end(), it.key()) == keys.end())
      invalid(where, "unknown field \"" + it.key() + "\"");
  for (std::string_view key : keys)
    if (!v.contains(key)) invalid(where, "missing field \"" + std::string(key) + "\"");
}

bool plain_file_name(const std::string& s) {
  return !s.empty() && s.size() <= 255 && s.front() != '.' &&
         std::all_of(s.begin(), s.end(), [](char c) {
           return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
         });
}

// One engine's capture: [rows, vocab] logits, read a row at a time from the mapping.
struct Capture {
  Capture(const TrajectoryEngine& e, std::int64_t vocab)
      : what("logits of engine \"" + e.engine + "\" (" + e.logits_path + ")"), file([&] {
          try {
            return common::SafetensorsFile::open(e.logits_path);
          } catch (const Error& err) {
            throw Error("compare.bad_file", what + ": " + err.what());
          }
        }()) {
    const common::TensorView* t = file.find("logits");
    if (!t) throw Error("compare.missing_tensor", what + " has no tensor \"logits\"");
    tensor = *t;
    if (tensor.dtype != common::Dtype::kF32 && tensor.dtype != common::Dtype::kBF16)
      throw Error(
          "compare.bad_dtype",
          what + ": dtype " + std::string(common::dtype_name(tensor.dtype)) + ", not F32 or BF16");
    auto rows = static_cast<std::int64_t>(e.token_ids.size());
    if (tensor.shape.size() != 2 || tensor.shape[0] != rows)
      throw Error("compare.bad_shape",
                  what + ": shape is not [" + std::to_string(rows) +
                      ", vocab] (one row per continuation token); rank " +
                      std::to_string(tensor.shape.size()) +
                      (tensor.shape.empty() ? "" : ", rows " + std::to_string(tensor.shape[0])));
    if (tensor.shape[1] != vocab)
      throw Error("compare.vocab_mismatch", what + " has " + std::to_string(tensor.shape[1]) +
                                                " columns but vocab_size is " +
                                                std::to_string(vocab));
    vocab_ = static_cast<std::size_t>(vocab);
    common::Sha256 h;
    h.update(tensor.data, tensor.nbytes);
    logits_sha256 = common::identity(h.finish());
  }

  // Row `r` widened exactly to float.
  void row(std::size_t r, std::vector<float>& out) const {
    out.resize(vocab_);
    if (tensor.dtype == common::Dtype::kF32) {
      std::memcpy(out.data(), tensor.data + r * vocab_ * 4, vocab_ * 4);
      return;
    }
    const std::byte* p = tensor.data + r * vocab_ * 2;
    for (std::size_t i = 0; i < vocab_; ++i) {
      std::uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      std::uint32_t w = static_cast<std::uint32_t>(h) << 16;
      std::memcpy(&out[i], &w, 4);
    }
  }

  std::string what;
  common::SafetensorsFile file;
  common::TensorView tensor;
  std::string logits_sha256;  // the tensor's raw bytes: equals the capture's logits_sha256
  std::size_t vocab_ = 0;
};

struct RowFacts {
  std::int64_t argmax = 0;
  float top1 = 0, top2 = 0;
  bool tied = false;
  std::int64_t token = 0;
  float token_logit = 0;
  std::int64_t token_rank = 0;  // 1 + the number of strictly larger logits
};

RowFacts row_facts(const std::vector<float>& v, std::int64_t token, const std::string& what,
                   std::size_t row) {
  RowFacts f;
  f.token = token;
  f.token_logit = v[static_cast<std::size_t>(token)];
  float best = -INFINITY, second = -INFINITY;
  std::int64_t arg = -1, at_best = 0;
  for (std::size_t i = 0; i < v.size(); ++i) {
    float x = v[i];
    if (!std::isfinite(x))
      throw Error("compare.non_finite", what + ": row " + std::to_string(row) + ", column " +
                                            std::to_string(i) + " is " +
                                            (std::isnan(x) ? "NaN"
                                             : x > 0       ? "+Inf"
                                                           : "-Inf"));
    if (x > best) {
      second = best;
      best = x;
      arg = static_cast<std::int64_t>(i);
      at_best = 1;
    } else if (x == best) {
      ++at_best;
      second = x;
    } else if (x > second) {
      second = x;
    }
    if (x > f.token_logit) ++f.token_rank;
  }
  f.token_rank += 1;
  f.argmax = arg;
  f.top1 = best;
  f.top2 = second;
  f.tied = at_best > 1;
  return f;
}

// The k largest logits, largest first, the lower token id first among equals.
Json top_k(const std::vector<float>& v, int k) {
  std::vector<std::int64_t> idx(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) idx[i] = static_cast<std::int64_t>(i);
  auto n = std::min<std::size_t>(static_cast<std::size_t>(k), v.size());
  std::partial_sort(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(n), idx.end(),
                    [&](std::int64_t a, std::int64_t b) {
                      float x = v[static_cast<std::size_t>(a)], y = v[static_cast<std::size_t>(b)];
                      return x > y || (x == y && a < b);
                    });
  Json out = Json::array();
  for (std::size_t i = 0; i < n; ++i)
    out.push_back(Json{{"token_id", idx[i]}, {"logit", v[static_cast<std::size_t>(idx[i])]}});
  return out;
}

// The reference at one row of one capture, as the result reports it.
Json reference_at(const Capture& c, std::size_t row, const RowFacts& f) {
  std::vector<float> v;
  c.row(row, v);
  return Json{{"argmax_token_id", f.argmax},
              {"argmax_logit", f.top1},
              {"argmax_tied", f.tied},
              {"margin", static_cast<double>(f.top1) - static_cast<double>(f.top2)},
              {"top10", top_k(v, common::kTrajectoryTopK)}};
}

template <typename T>
std::span<const std::byte> raw(const std::vector<T>& v) {
  return std::as_bytes(std::span<const T>(v));
}

}  // namespace

TrajectoryInput parse_trajectory_input(const Json& doc, const std::string& where) {
  check_object(doc, {"schema", "vocab_size", "prompt_length", "artifact_file", "engines"}, where);
  if (doc["schema"] != Json(common::kCompareTrajectoryInput))
    invalid(where + ".schema", shown(doc["schema"]) + " is not \"" +
                                   std::string(common::kCompareTrajectoryInput) + "\"");
  TrajectoryInput in;
  const Json& vocab = doc["vocab_size"];
  if (!vocab.is_number_integer() || vocab.get<std::int64_t>() < 2 ||
      vocab.get<std::int64_t>() > kMaxVocab)
    invalid(where + ".vocab_size",
            shown(vocab) + " is not an integer in 2.." + std::to_string(kMaxVocab));
  in.vocab_size = vocab.get<std::int64_t>();
  const Json& p = doc["prompt_length"];
  if (!p.is_number_integer() || p.get<std::int64_t>() < 1)
    invalid(where + ".prompt_length", shown(p) + " is not a positive integer");
  in.prompt_length = p.get<std::int64_t>();
  const Json& a = doc["artifact_file"];
  if (!a.is_string() || !plain_file_name(a.get<std::string>()) ||
      !a.get<std::string>().ends_with(".safetensors"))
    invalid(where + ".artifact_file", shown(a) + " is not a plain *.safetensors file name");
  in.artifact_file = a.get<std::string>();
  const Json& engines = doc["engines"];
  if (!engines.is_array() || engines.size() < 2 || engines.size() > common::kMaxTrajectoryEngines)
    invalid(where + ".engines", "must be an array of 2.." +
                                    std::to_string(common::kMaxTrajectoryEngines) +
                                    " engines, got " + shown(engines));
  std::set<std::string> names;
  for (std::size_t i = 0; i < engines.size(); ++i) {
    std::string w = where + ".engines[" + std::to_string(i) + "]";
    check_object(engines[i], {"engine", "token_ids", "logits"}, w);
    TrajectoryEngine e;
    if (!engines[i]["engine"].is_string() || engines[i]["engine"].get<std::string>().empty())
      invalid(w + ".engine", shown(engines[i]["engine"]) + " is not a non-empty string");
    e.engine = engines[i]["engine"].get<std::string>();
    if (!names.insert(e.engine).second)
      invalid(w + ".engine", "\"" + e.engine + "\" is named twice");
    const Json& ids = engines[i]["token_ids"];
    if (!ids.is_array() || ids.empty())
      invalid(w + ".token_ids", "must be a non-empty array, got " + shown(ids));
    for (std::size_t k = 0; k < ids.size(); ++k) {
      if (!ids[k].is_number_integer() || ids[k].get<std::int64_t>() < 0 ||
          ids[k].get<std::int64_t>() >= in.vocab_size)
        invalid(w + ".token_ids[" + std::to_string(k) + "]",
                shown(ids[k]) + " is not a token id in [0, " + std::to_string(in.vocab_size) + ")");
      e.token_ids.push_back(ids[k].get<std::int64_t>());
    }
    const Json& f = engines[i]["logits"];
    if (!f.is_string() || !plain_file_name(f.get<std::string>()))
      invalid(w + ".logits", shown(f) + " is not a plain file name in the workspace");
    e.logits_path = f.get<std::string>();
    in.engines.push_back(std::move(e));
  }
  return in;
}

TrajectoryAnalysis analyse_trajectory(const TrajectoryInput& in) {
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::unique_ptr<Capture>> caps;
  for (const auto& e : in.engines) caps.push_back(std::make_unique<Capture>(e, in.vocab_size));

  std::vector<std::vector<RowFacts>> facts(in.engines.size());
  std::vector<float> row;
  std::vector<common::TensorToWrite> tensors;
  // Kept alive until the artifact is serialised.
  std::vector<std::vector<std::int64_t>> i64s;
  std::vector<std::vector<double>> f64s;
  std::vector<std::vector<float>> f32s;
  i64s.reserve(in.engines.size() * 2);
  f64s.reserve(in.engines.size());
  f32s.reserve(in.engines.size() * 3);
  Json engines = Json::array();
  std::optional<std::int64_t> earliest;
  for (std::size_t e = 0; e < in.engines.size(); ++e) {
    const TrajectoryEngine& eng = in.engines[e];
    const Capture& cap = *caps[e];
    std::vector<std::int64_t> argmax, rank;
    std::vector<double> margin;
    std::vector<float> argmax_logit, token_logit;
    std::optional<std::size_t> departure;
    for (std::size_t r = 0; r < eng.token_ids.size(); ++r) {
      cap.row(r, row);
      RowFacts f = row_facts(row, eng.token_ids[r], cap.what, r);
      facts[e].push_back(f);
      argmax.push_back(f.argmax);
      rank.push_back(f.token_rank);
      margin.push_back(static_cast<double>(f.top1) - static_cast<double>(f.top2));
      argmax_logit.push_back(f.top1);
      token_logit.push_back(f.token_logit);
      if (!departure && f.token != f.argmax) departure = r;
    }
    std::int64_t agreed = 0;
    for (const RowFacts& f : facts[e]) agreed += f.token == f.argmax;
    Json dep = nullptr;
    std::string prefix = "engine" + std::to_string(e) + ".";
    if (departure) {
      const RowFacts& f = facts[e][*departure];
      dep = reference_at(cap, *departure, f);
      dep["index"] = *departure;
      dep["position"] = in.prompt_length - 1 + static_cast<std::int64_t>(*departure);
      dep["engine_token_id"] = f.token;
      dep["engine_token_logit"] = f.token_logit;
      dep["engine_token_rank"] = f.token_rank;
      auto d = static_cast<std::int64_t>(*departure);
      if (!earliest || d < *earliest) earliest = d;
      // The full logits only where the engine departed.
      cap.row(*departure, row);
      f32s.push_back(row);
      tensors.push_back(
          {prefix + "departure_logits", common::Dtype::kF32, {in.vocab_size}, raw(f32s.back())});
    }
    engines.push_back(
        Json{{"engine", eng.engine},
             {"continuation_length", eng.token_ids.size()},
             {"scored_positions",
              Json::array({Json::array(
                  {in.prompt_length - 1,
                   in.prompt_length - 1 + static_cast<std::int64_t>(eng.token_ids.size())})})},
             {"logits_sha256", cap.logits_sha256},
             {"tokens_matching_argmax", agreed},
             {"first_departure", departure ? Json(*departure) : Json(nullptr)},
             {"departure", dep}});
    auto n = static_cast<std::int64_t>(eng.token_ids.size());
    i64s.push_back(std::move(argmax));
    tensors.push_back({prefix + "argmax", common::Dtype::kI64, {n}, raw(i64s.back())});
    f64s.push_back(std::move(margin));
    tensors.push_back({prefix + "margin", common::Dtype::kF64, {n}, raw(f64s.back())});
    i64s.push_back(std::move(rank));
    tensors.push_back({prefix + "token_rank", common::Dtype::kI64, {n}, raw(i64s.back())});
    f32s.push_back(std::move(argmax_logit));
    tensors.push_back({prefix + "argmax_logit", common::Dtype::kF32, {n}, raw(f32s.back())});
    f32s.push_back(std::move(token_logit));
    tensors.push_back({prefix + "token_logit", common::Dtype::kF32, {n}, raw(f32s.back())});
  }
  // The spans point into vectors that grew meanwhile: point them at the final storage (the
  // tensors of one dtype were pushed in the order of their vectors).
  {
    std::size_t i = 0, d = 0, f = 0;
    for (auto& t : tensors) {
      if (t.dtype == common::Dtype::kI64)
        t.data = raw(i64s[i++]);
      else if (t.dtype == common::Dtype::kF64)
        t.data = raw(f64s[d++]);
      else
        t.data = raw(f32s[f++]);
    }
  }

  Json departed_first = nullptr;
  if (earliest) {
    Json names = Json::array();
    for (const Json& e : engines)
      if (e["first_departure"] == Json(*earliest)) names.push_back(e["engine"]);
    departed_first = Json{{"index", *earliest}, {"engines", names}};
  }

  // Where the continuations first differ: every engine shares the prefix before it, so the
  // reference's state there is the same for all of them.
  std::size_t shortest = SIZE_MAX, longest = 0;
  for (const auto& e : in.engines) {
    shortest = std::min(shortest, e.token_ids.size());
    longest = std::max(longest, e.token_ids.size());
  }
  std::optional<std::size_t> d;
  for (std::size_t i = 0; i < shortest && !d; ++i)
    for (const auto& e : in.engines)
      if (e.token_ids[i] != in.engines[0].token_ids[i]) d = i;
  if (!d && longest != shortest) d = shortest;
  Json divergence = nullptr;
  if (d) {
    Json tokens = Json::object(), by_capture = Json::object();
    std::optional<std::size_t> ref;
    bool every_engine_has_token = true;
    for (std::size_t e = 0; e < in.engines.size(); ++e) {
      const auto& ids = in.engines[e].token_ids;
      if (*d < ids.size()) {
        tokens[in.engines[e].engine] = ids[*d];
        by_capture[in.engines[e].engine] = facts[e][*d].argmax;
        if (!ref) ref = e;
      } else {
        tokens[in.engines[e].engine] = nullptr;  // this engine's continuation ended before
        every_engine_has_token = false;
      }
    }
    const RowFacts& f = facts[*ref][*d];
    bool captures_agree = true;
    for (auto it = by_capture.begin(); it != by_capture.end(); ++it)
      captures_agree &= *it == Json(f.argmax);
    Json matching = Json::array();
    for (const auto& e : in.engines)
      if (*d < e.token_ids.size() && e.token_ids[*d] == f.argmax) matching.push_back(e.engine);
    divergence = reference_at(*caps[*ref], *d, f);
    divergence["index"] = *d;
    divergence["position"] = in.prompt_length - 1 + static_cast<std::int64_t>(*d);
    divergence["tokens"] = tokens;
    divergence["reference_from"] = in.engines[*ref].engine;
    divergence["argmax_by_capture"] = by_capture;
    divergence["argmax_engines"] = matching;
    // Kiln's rule, as in a next-token verdict: an engine's only when it alone chose the argmax.
    divergence["argmax_candidate"] = matching.size() == 1 ? matching[0] : Json("neither");
    divergence["candidate_attribution_complete"] =
        !f.tied && captures_agree && every_engine_has_token && matching.size() == 1;
  }

  Json names = Json::array();
  for (const auto& e : in.engines) names.push_back(e.engine);
  TrajectoryAnalysis out;
  out.artifact =
      common::serialize_safetensors(tensors, {{"schema", "assay.trajectory-artifact.v1"},
                                              {"engines", names.dump()},
                                              {"prompt_length", std::to_string(in.prompt_length)}});
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  out.document = Json{{"schema", common::kCompareTrajectoryOutput},
                      {"vocab_size", in.vocab_size},
                      {"prompt_length", in.prompt_length},
                      {"engines", engines},
                      {"departed_first", departed_first},
                      {"divergence", divergence},
                      {"artifact_file", in.artifact_file},
                      {"artifact_sha256", common::sha256_id(out.artifact)},
                      {"estimator_sha256", executable_sha256()},
                      {"seconds", seconds}};
  return out;
}

void write_trajectory_outputs(const TrajectoryAnalysis& a, const std::filesystem::path& workdir,
                              const std::string& artifact_file) {
  const std::filesystem::path path = workdir / artifact_file;
  common::atomic_write_file(path, a.artifact);
  try {
    common::write_worker_document(workdir / "output.json", a.document.dump(2) + "\n");
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove(path, ec);
    throw;
  }
}

}  // namespace assay::compare
