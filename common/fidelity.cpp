#include "common/fidelity.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

#include "common/error.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "common/request_fields.h"

namespace assay::common {
namespace {

using namespace request_fields;

// only_fields for a value that must be an object first.
void object_fields(const Json& obj, std::initializer_list<std::string_view> allowed,
                   const std::string& where) {
  if (!obj.is_object()) invalid(where + " must be an object, got " + obj.dump().substr(0, 80));
  only_fields(obj, allowed, where);
}

std::string absolute_path(const Json& obj, std::string_view key, const std::string& where) {
  std::string p = string_field(obj, key, where, 4096);
  std::string name = where + "." + std::string(key);
  if (p.front() != '/') invalid(name + " \"" + p + "\" is not an absolute path");
  if (p.find('\0') != std::string::npos) invalid(name + " contains a NUL byte");
  return p;
}

ModelSide model_side(const Json& obj, const std::string& where, bool with_label) {
  if (with_label)
    object_fields(obj, {"model_dir", "model_identity", "label"}, where);
  else
    object_fields(obj, {"model_dir", "model_identity"}, where);
  ModelSide side;
  side.model_dir = absolute_path(obj, "model_dir", where);
  while (side.model_dir.size() > 1 && side.model_dir.back() == '/') side.model_dir.pop_back();
  if (auto mi = obj.find("model_identity"); mi != obj.end()) {
    validate_model_identity(*mi, where + ".model_identity");
    side.model_identity = *mi;
  }
  return side;
}

std::vector<PanelContext> parse_panel(const Json& panel) {
  object_fields(panel, {"contexts"}, "request.panel");
  const Json& contexts = field(panel, "contexts", "request.panel");
  if (!contexts.is_array() || contexts.empty() || contexts.size() > kMaxPanelContexts)
    invalid("request.panel.contexts must be an array of 1.." + std::to_string(kMaxPanelContexts) +
            " contexts");
  std::vector<PanelContext> out;
  std::set<std::string> ids;
  std::size_t total_tokens = 0;
  for (std::size_t i = 0; i < contexts.size(); ++i) {
    std::string where = "request.panel.contexts[" + std::to_string(i) + "]";
    object_fields(contexts[i], {"id", "token_ids", "positions"}, where);
    PanelContext c;
    c.id = contexts[i].contains("id") ? string_field(contexts[i], "id", where, 128)
                                      : "c" + std::to_string(i);
    if (!ids.insert(c.id).second) invalid(where + ".id \"" + c.id + "\" appears twice");
    c.token_ids = parse_token_id_array(contexts[i], "token_ids", where, /*allow_empty=*/false);
    total_tokens += c.token_ids.size();
    if (total_tokens > kMaxPanelTokens)
      invalid("request.panel holds more than " + std::to_string(kMaxPanelTokens) + " tokens");
    Json positions = contexts[i].contains("positions") ? contexts[i]["positions"] : Json("all");
    c.positions = parse_position_ranges(positions, static_cast<std::int64_t>(c.token_ids.size()),
                                        where + ".positions");
    c.scored = count_positions(c.positions);
    out.push_back(std::move(c));
  }
  return out;
}

struct ThresholdKind {
  std::string_view name;
  std::string_view statistic;  // "group.field" in the statistics object
  bool upper;                  // max_*: observed <= bound
  bool absolute;               // compare |observed|
};

constexpr ThresholdKind kThresholdKinds[] = {
    {"max_abs_mean_delta_p", "delta_p_next.mean", true, true},
    {"max_kl_max", "kl.max", true, false},
    {"max_kl_p99", "kl.p99", true, false},
    {"max_kl_p99_9", "kl.p99_9", true, false},
    {"max_mean_kl", "kl.mean", true, false},
    {"max_ppl_ratio", "perplexity.ratio.value", true, false},
    {"max_rms_delta_p", "delta_p_next.rms", true, false},
    {"min_ln_ppl_correlation", "perplexity.ln_ppl_correlation", false, false},
    {"min_top1_agreement", "same_top.fraction", false, false},
};

const ThresholdKind* threshold_kind(std::string_view name) {
  for (const auto& k : kThresholdKinds)
    if (k.name == name) return &k;
  return nullptr;
}

// The value at a dotted path, or null when any step is missing or null.
Json lookup(const Json& root, std::string_view path) {
  const Json* at = &root;
  while (!path.empty()) {
    auto dot = path.find('.');
    std::string key(path.substr(0, dot));
    if (!at->is_object() || !at->contains(key)) return nullptr;
    at = &(*at)[key];
    path = dot == std::string_view::npos ? std::string_view() : path.substr(dot + 1);
  }
  return *at;
}

}  // namespace

std::vector<Threshold> parse_thresholds(const Json& value, std::string_view where,
                                        std::string_view code) {
  std::string w(where);
  if (!value.is_object())
    throw Error(std::string(code),
                w + " must be an object of bounds, got " + value.dump().substr(0, 80));
  std::vector<Threshold> out;
  for (auto it = value.begin(); it != value.end(); ++it) {
    if (!threshold_kind(it.key())) {
      std::string names;
      for (const auto& k : kThresholdKinds)
        names += (names.empty() ? "" : ", ") + std::string(k.name);
      throw Error(std::string(code),
                  w + "." + it.key() + " is not a known threshold (known: " + names + ")");
    }
    if (!it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() < 0)
      throw Error(std::string(code), w + "." + it.key() + " must be a finite number >= 0, got " +
                                         it->dump().substr(0, 80));
    out.push_back({it.key(), it->get<double>()});
  }
  std::sort(out.begin(), out.end(),
            [](const Threshold& a, const Threshold& b) { return a.name < b.name; });
  return out;
}

Json thresholds_json(const std::vector<Threshold>& thresholds) {
  Json out = Json::object();
  for (const auto& t : thresholds) out[t.name] = t.bound;
  return out;
}

Json evaluate_thresholds(const std::vector<Threshold>& thresholds, const Json& statistics) {
  Json out = Json::array();
  for (const auto& t : thresholds) {
    const ThresholdKind& k = *threshold_kind(t.name);
    Json observed = lookup(statistics, k.statistic);
    bool passed = false;
    if (observed.is_number()) {
      double v = observed.get<double>();
      if (k.absolute) v = std::fabs(v);
      passed = k.upper ? v <= t.bound : v >= t.bound;
    } else {
      observed = nullptr;
    }
    out.push_back(Json{{"name", t.name},
                       {"statistic", std::string(k.statistic)},
                       {"comparison", k.upper ? (k.absolute ? "abs<=" : "<=") : ">="},
                       {"bound", t.bound},
                       {"observed", observed},
                       {"passed", passed}});
  }
  return out;
}

Json finalize_gates(Json gates) {
  // The gates come from the compare worker's output: each part is checked before it is read
  // (fuzz_worker_output: a threshold without "passed" reached a const operator[]).
  if (!gates.is_object())
    throw Error("fidelity.bad_gates", "gates is " + gates.dump().substr(0, 80) + ", not an object");
  Json failed = Json::array();
  bool pending = false, any = false;
  if (gates.contains("reproduction") && !gates["reproduction"].is_null()) {
    if (!gates["reproduction"].is_object())
      throw Error("fidelity.bad_gates", "gates.reproduction is not an object");
    for (auto it = gates["reproduction"].begin(); it != gates["reproduction"].end(); ++it) {
      any = true;
      if (it->is_null())
        pending = true;
      else if (!it->is_boolean())
        throw Error("fidelity.bad_gates",
                    "gates.reproduction." + it.key() + " is neither true, false nor null");
      else if (!it->get<bool>())
        failed.push_back(it.key());
    }
  }
  if (gates.contains("thresholds") && !gates["thresholds"].is_null()) {
    if (!gates["thresholds"].is_array())
      throw Error("fidelity.bad_gates", "gates.thresholds is not a list");
    std::size_t i = 0;
    for (const Json& g : gates["thresholds"]) {
      any = true;
      auto passed = g.is_object() ? g.find("passed") : g.end();
      auto name = g.is_object() ? g.find("name") : g.end();
      if (!g.is_object() || passed == g.end() || !passed->is_boolean() || name == g.end() ||
          !name->is_string())
        throw Error("fidelity.bad_gates", "gates.thresholds[" + std::to_string(i) +
                                              "] has no boolean \"passed\" and string \"name\"");
      if (!passed->get<bool>()) failed.push_back(*name);
      ++i;
    }
  }
  gates["status"] = !failed.empty() ? "failed" : pending ? "incomplete" : any ? "passed" : "none";
  gates["failed"] = failed;
  return gates;
}

namespace {

std::string printf_text(const char* format, double a, double b = 0) {
  char buf[128];
  std::snprintf(buf, sizeof buf, format, a, b);
  return buf;
}

double num_or_nan(const Json& v) {
  return v.is_number() ? v.get<double>() : std::nan("");
}

// "%10.6lf ± %10.6lf" with n/a for a null standard error.
std::string pm(const Json& value, const Json& se, const char* vf, const char* sf,
               const char* suffix = "") {
  std::string out = printf_text(vf, num_or_nan(value));
  out += " ± ";
  out += se.is_number() ? printf_text(sf, se.get<double>()) : std::string("n/a");
  return out + suffix;
}

}  // namespace

std::string llama_cpp_block(const Json& s) {
  std::string o;
  const Json& ppl = s.value("perplexity", Json());
  if (ppl.is_object()) {
    const Json &q = ppl["candidate"], &b = ppl["reference"];
    o += "====== Perplexity statistics ======\n";
    o += "Mean PPL(Q)                   : " +
         pm(q["ppl"], q["ppl_standard_error"], "%10.6lf", "%10.6lf") + "\n";
    o += "Mean PPL(base)                : " +
         pm(b["ppl"], b["ppl_standard_error"], "%10.6lf", "%10.6lf") + "\n";
    o += "Cor(ln(PPL(Q)), ln(PPL(base))): " +
         (ppl["ln_ppl_correlation"].is_number()
              ? printf_text("%6.2f%%", 100.0 * ppl["ln_ppl_correlation"].get<double>())
              : std::string("   n/a")) +
         "\n";
    for (auto [label, key] : {std::pair{"Mean ln(PPL(Q)/PPL(base))     : ", "ln_ratio"},
                              std::pair{"Mean PPL(Q)/PPL(base)         : ", "ratio"},
                              std::pair{"Mean PPL(Q)-PPL(base)         : ", "difference"}})
      o += std::string(label) +
           pm(ppl[key]["value"], ppl[key]["standard_error"], "%10.6lf", "%10.6lf") + "\n";
    o += "(" + std::to_string(ppl["tokens"].get<std::int64_t>()) +
         " scored positions with a known next token)\n\n";
  }
  const Json& kl = s.value("kl", Json::object());
  o += "====== KL divergence statistics ======\n";
  o += "Mean    KLD: " +
       pm(kl.value("mean", Json()), kl.value("standard_error", Json()), "%10.6lf", "%10.6lf") +
       "\n";
  for (auto [label, key] : {std::pair{"Maximum KLD: ", "max"}, std::pair{"99.9%   KLD: ", "p99_9"},
                            std::pair{"99.0%   KLD: ", "p99"}, std::pair{"95.0%   KLD: ", "p95"},
                            std::pair{"90.0%   KLD: ", "p90"}, std::pair{"Median  KLD: ", "median"},
                            std::pair{"10.0%   KLD: ", "p10"}, std::pair{" 5.0%   KLD: ", "p5"},
                            std::pair{" 1.0%   KLD: ", "p1"}, std::pair{" 0.1%   KLD: ", "p0_1"},
                            std::pair{"Minimum KLD: ", "min"}})
    o += std::string(label) + printf_text("%10.6lf", num_or_nan(kl.value(key, Json()))) + "\n";

  const bool next = s.value("delta_p_next", Json()).is_object();
  const Json& dp = next ? s["delta_p_next"] : s.value("delta_p_top", Json::object());
  o += "\n====== Token probability statistics ======\n";
  if (!next) o += "(Δp of the reference's top token: no next tokens known)\n";
  if (dp.is_object()) {
    auto pct = [](const Json& v) { return v.is_number() ? Json(100.0 * v.get<double>()) : v; };
    o += "Mean    Δp: " + pm(pct(dp["mean"]), pct(dp["standard_error"]), "%6.3lf", "%5.3lf", " %") +
         "\n";
    for (auto [label, key] : {std::pair{"Maximum Δp: ", "max"}, std::pair{"99.9%   Δp: ", "p99_9"},
                              std::pair{"99.0%   Δp: ", "p99"}, std::pair{"95.0%   Δp: ", "p95"},
                              std::pair{"90.0%   Δp: ", "p90"}, std::pair{"75.0%   Δp: ", "p75"},
                              std::pair{"Median  Δp: ", "median"}, std::pair{"25.0%   Δp: ", "p25"},
                              std::pair{"10.0%   Δp: ", "p10"}, std::pair{" 5.0%   Δp: ", "p5"},
                              std::pair{" 1.0%   Δp: ", "p1"}, std::pair{" 0.1%   Δp: ", "p0_1"},
                              std::pair{"Minimum Δp: ", "min"}})
      o += std::string(label) + printf_text("%6.3lf%%", 100.0 * num_or_nan(dp[key])) + "\n";
    o += "RMS Δp    : " +
         pm(pct(dp["rms"]), pct(dp["rms_standard_error"]), "%6.3lf", "%5.3lf", " %") + "\n";
  }
  const Json& top = s.value("same_top", Json::object());
  auto pct = [](const Json& v) { return v.is_number() ? Json(100.0 * v.get<double>()) : v; };
  o += "Same top p: " +
       pm(pct(top.value("fraction", Json())), pct(top.value("standard_error", Json())), "%6.3lf",
          "%5.3lf", " %") +
       "\n";
  if (next) {
    const Json& t = s["delta_p_top"];
    o += "(Δp of the reference's top token: mean " +
         printf_text("%.3lf%%", 100.0 * num_or_nan(t["mean"])) + ", RMS " +
         printf_text("%.3lf%%", 100.0 * num_or_nan(t["rms"])) + ")\n";
  }
  return o;
}

std::string gates_text(const Json& g) {
  std::string o = "====== Gates ======\nstatus: " + g.value("status", std::string("?"));
  if (g.contains("failed") && !g["failed"].empty()) {
    o += " (failed:";
    for (const Json& f : g["failed"]) o += " " + f.get<std::string>();
    o += ")";
  }
  o += "\n";
  if (g.contains("reproduction") && g["reproduction"].is_object())
    for (auto it = g["reproduction"].begin(); it != g["reproduction"].end(); ++it) {
      std::string name = it.key();
      name.resize(std::max<std::size_t>(name.size(), 30), ' ');
      o += "  " + name + " " +
           (it->is_null()     ? "undecided"
            : it->get<bool>() ? "passed"
                              : "FAILED") +
           "\n";
    }
  if (g.contains("thresholds"))
    for (const Json& t : g["thresholds"]) {
      std::string name = t["name"].get<std::string>();
      name.resize(std::max<std::size_t>(name.size(), 30), ' ');
      char line[256];
      std::snprintf(line, sizeof line, "%s %s %s %.6g, observed %s", name.c_str(),
                    t["statistic"].get<std::string>().c_str(),
                    t["comparison"].get<std::string>().c_str(), t["bound"].get<double>(),
                    t["observed"].is_number()
                        ? printf_text("%.6g", t["observed"].get<double>()).c_str()
                        : "not measured");
      o += "  " + std::string(line) + "  " + (t["passed"].get<bool>() ? "passed" : "FAILED") + "\n";
    }
  return o;
}

PositionRanges parse_position_ranges(const Json& value, std::int64_t length, std::string_view where,
                                     std::string_view code) {
  std::string w(where);
  auto bad = [&](const std::string& message) { throw Error(std::string(code), w + message); };
  if (value.is_string()) {
    if (value.get<std::string>() != "all")
      bad(" must be \"all\" or an array of [begin, end) ranges, got " + value.dump());
    return {{0, length}};
  }
  if (!value.is_array() || value.empty())
    bad(" must be \"all\" or a non-empty array of [begin, end) ranges");
  PositionRanges out;
  for (std::size_t i = 0; i < value.size(); ++i) {
    const Json& r = value[i];
    std::string ri = "[" + std::to_string(i) + "]";
    if (!r.is_array() || r.size() != 2 || !r[0].is_number_integer() || !r[1].is_number_integer())
      bad(ri + " must be a [begin, end) pair of integers, got " + r.dump().substr(0, 80));
    std::int64_t b = r[0].get<std::int64_t>(), e = r[1].get<std::int64_t>();
    if (b < 0 || e > length || b >= e)
      bad(ri + " = " + r.dump() + " is not a non-empty range inside [0, " + std::to_string(length) +
          ")");
    if (!out.empty() && b < out.back().second)
      bad(ri + " = " + r.dump() +
          " overlaps or precedes the range before it; ranges must be "
          "sorted and disjoint");
    out.emplace_back(b, e);
  }
  return out;
}

std::int64_t count_positions(const PositionRanges& ranges) {
  std::int64_t n = 0;
  for (const auto& [b, e] : ranges) n += e - b;
  return n;
}

Json position_ranges_json(const PositionRanges& ranges) {
  Json out = Json::array();
  for (const auto& [b, e] : ranges) out.push_back(Json::array({b, e}));
  return out;
}

std::int64_t FidelityRequest::scored_positions() const {
  std::int64_t n = 0;
  for (const auto& c : panel) n += c.scored;
  return n;
}

void FidelityRequest::check_vocab(std::int64_t vocab_size) const {
  for (std::size_t i = 0; i < panel.size(); ++i)
    for (std::size_t k = 0; k < panel[i].token_ids.size(); ++k)
      if (panel[i].token_ids[k] >= vocab_size)
        throw Error("request.invalid_token_id",
                    "request.panel.contexts[" + std::to_string(i) + "].token_ids[" +
                        std::to_string(k) + "] = " + std::to_string(panel[i].token_ids[k]) +
                        " is outside the model's vocabulary of " + std::to_string(vocab_size));
}

void FidelityRequest::check_context_length(std::int64_t max_positions) const {
  for (std::size_t i = 0; i < panel.size(); ++i)
    if (static_cast<std::int64_t>(panel[i].token_ids.size()) > max_positions)
      throw Error("request.too_long",
                  "request.panel.contexts[" + std::to_string(i) + "] (\"" + panel[i].id +
                      "\") has " + std::to_string(panel[i].token_ids.size()) +
                      " tokens, more than the model's context of " + std::to_string(max_positions));
}

FidelityRequest parse_fidelity_request(std::string_view text) {
  ParseLimits limits;
  limits.max_bytes = kMaxRequestBytes;
  return validate_fidelity_request(parse_strict(text, limits));
}

FidelityRequest validate_fidelity_request(const Json& doc) {
  if (!doc.is_object()) invalid("the request must be a JSON object");
  const Json& schema = field(doc, "schema", "request");
  if (!schema.is_string() || schema.get<std::string>() != protocol::kFidelityRequest)
    throw Error("request.unknown_schema", "request.schema " + schema.dump().substr(0, 80) +
                                              " is not \"" +
                                              std::string(protocol::kFidelityRequest) + "\"");
  object_fields(doc,
                {"schema", "id", "reference", "candidate", "panel", "reproduction_confirmation",
                 "block_positions", "limits", "thresholds"},
                "request");
  FidelityRequest r;
  r.schema = protocol::kFidelityRequest;
  r.id = string_field(doc, "id", "request", 256);
  r.reference = model_side(field(doc, "reference", "request"), "request.reference", false);

  const Json& cand = field(doc, "candidate", "request");
  if (!cand.is_object()) invalid("request.candidate must be an object");
  bool has_dir = cand.contains("model_dir"), has_logits = cand.contains("logits");
  if (has_dir == has_logits)
    invalid(
        "request.candidate must have exactly one of model_dir (a checkpoint to capture) and "
        "logits (files you supply)");
  if (has_dir) {
    r.candidate_model = model_side(cand, "request.candidate", true);
  } else {
    object_fields(cand, {"logits", "label"}, "request.candidate");
  }
  if (cand.contains("label"))
    r.candidate_label = string_field(cand, "label", "request.candidate", 128);

  r.panel = parse_panel(field(doc, "panel", "request"));

  if (has_logits) {
    const Json& files = cand["logits"];
    if (!files.is_array() || files.size() != r.panel.size())
      invalid("request.candidate.logits must be an array with one file per panel context (" +
              std::to_string(r.panel.size()) + "), got " +
              (files.is_array() ? std::to_string(files.size()) + " entries" : files.type_name()));
    std::set<std::string> paths;
    for (std::size_t i = 0; i < files.size(); ++i) {
      std::string where = "request.candidate.logits[" + std::to_string(i) + "]";
      object_fields(files[i], {"path", "sha256"}, where);
      CandidateLogitsFile f;
      f.path = absolute_path(files[i], "path", where);
      f.sha256 = string_field(files[i], "sha256", where, 71);
      if (!is_identity(f.sha256))
        invalid(where + ".sha256 \"" + f.sha256 + "\" is not sha256:<64 lowercase hex>");
      if (!paths.insert(f.path).second) invalid(where + ".path \"" + f.path + "\" is named twice");
      r.candidate_logits.push_back(std::move(f));
    }
  }

  if (auto it = doc.find("reproduction_confirmation"); it != doc.end()) {
    if (!it->is_boolean())
      invalid("request.reproduction_confirmation must be true or false, got " + it->dump());
    r.reproduction_confirmation = it->get<bool>();
  }
  if (auto it = doc.find("block_positions"); it != doc.end()) {
    if (!it->is_number_integer() || it->get<std::int64_t>() < 1 ||
        it->get<std::int64_t>() > kMaxBlockPositions)
      invalid("request.block_positions must be an integer in [1, " +
              std::to_string(kMaxBlockPositions) + "], got " + it->dump());
    r.block_positions = it->get<std::int64_t>();
  }
  if (auto it = doc.find("thresholds"); it != doc.end())
    r.thresholds = parse_thresholds(*it, "request.thresholds");
  r.limits = parse_request_limits(doc);
  r.request_sha256 = sha256_canonical_id(doc);
  r.panel_sha256 = sha256_canonical_id(doc["panel"]);
  r.document = doc;
  return r;
}

}  // namespace assay::common
