// `assay report`'s page for a next-token result: the verdict, the candidates, a bar chart of the
// top-10 reference logits with the candidates marked (from the logits artifact beside the result
// when its sha256 matches, else from the result's own top tokens), and the model identity, oracle
// facts and containment evidence as tables.
#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <sstream>
#include <vector>

#include "client/report_html.h"
#include "common/identity.h"
#include "common/safetensors.h"

namespace assay::client::html {
namespace {

using common::Json;
namespace fs = std::filesystem;

struct Bar {
  std::int64_t token = 0;
  double logit = 0;
  std::int64_t rank = 0;
  std::string text;
  std::vector<std::string> engines;  // candidates naming this token
};

// The logits row of the artifact, when it is there and is the one the result names.
std::optional<std::vector<float>> read_logits(const Json& r, const fs::path& dir,
                                              std::string& note) {
  fs::path p = dir / "logits.safetensors";
  std::error_code ec;
  if (!fs::is_regular_file(p, ec)) {
    note = "logits.safetensors is not beside the result: the chart uses the result's top tokens";
    return std::nullopt;
  }
  std::string want = get(r, {"reference_artifact", "sha256"});
  std::string have = common::sha256_file_id(p);
  if (have != want) {
    note = "logits.safetensors beside the result hashes to " + have + ", not the result's " + want +
           ": not used";
    return std::nullopt;
  }
  auto f = common::SafetensorsFile::open(p);
  const common::TensorView* t = f.find("logits");
  if (!t && f.tensors().size() == 1) t = &f.tensors().front();
  if (!t || t->dtype != common::Dtype::kF32) {
    note = "logits.safetensors holds no F32 tensor \"logits\": not used";
    return std::nullopt;
  }
  std::vector<float> v(static_cast<std::size_t>(t->numel()));
  std::memcpy(v.data(), t->data, t->nbytes);
  note = "from logits.safetensors (" + have + ", " + std::to_string(v.size()) + " logits)";
  return v;
}

std::string logit_chart(const std::vector<Bar>& top, const std::vector<Bar>& outside) {
  const std::size_t rows = top.size() + outside.size() + (outside.empty() ? 0 : 1);
  const int row_h = 26, left = 190, width = 900, plot = width - left - 140;
  const int height = static_cast<int>(rows) * row_h + 40;
  double lo = 0, hi = 0;
  for (const auto* set : {&top, &outside})
    for (const Bar& b : *set) {
      lo = std::min(lo, b.logit);
      hi = std::max(hi, b.logit);
    }
  if (hi - lo <= 0) hi = lo + 1;
  auto x = [&](double v) { return left + (v - lo) / (hi - lo) * plot; };
  std::ostringstream s;
  s << "<svg role=\"img\" viewBox=\"0 0 " << width << " " << height << "\" width=\"" << width
    << "\" height=\"" << height << "\" xmlns=\"http://www.w3.org/2000/svg\">"
    << "<title>Top reference logits; candidates marked</title>";
  s << "<line class=\"axis\" x1=\"" << x(0) << "\" y1=\"10\" x2=\"" << x(0) << "\" y2=\""
    << height - 24 << "\"/>";
  int y = 14;
  auto bar = [&](const Bar& b) {
    const bool cand = !b.engines.empty();
    const double x0 = std::min(x(0), x(b.logit)), x1 = std::max(x(0), x(b.logit));
    std::string label =
        "#" + std::to_string(b.rank) + "  " + std::to_string(b.token) + " " +
        Json(b.text).dump(-1, ' ', false, Json::error_handler_t::replace);  // control bytes escaped
    if (label.size() > 30) label = label.substr(0, 29) + "…";
    s << "<text x=\"" << left - 8 << "\" y=\"" << y + 15 << "\" text-anchor=\"end\">" << esc(label)
      << "</text>";
    s << "<rect x=\"" << x0 << "\" y=\"" << y + 3 << "\" width=\"" << std::max(1.0, x1 - x0)
      << "\" height=\"" << row_h - 8 << "\" rx=\"3\" fill=\"" << (cand ? "#dc7633" : "#9fb3d9")
      << "\"" << (cand ? " stroke=\"#8e4413\" stroke-width=\"1.5\"" : "") << "/>";
    std::string right = fmt(b.logit, "%.4f");
    for (const auto& e : b.engines) right += "  ◀ " + e;
    s << "<text x=\"" << x1 + 6 << "\" y=\"" << y + 15 << "\""
      << (cand ? " style=\"font-weight:600;fill:#8e4413\"" : "") << ">" << esc(right) << "</text>";
    y += row_h;
  };
  for (const Bar& b : top) bar(b);
  if (!outside.empty()) {
    s << "<text x=\"" << left - 8 << "\" y=\"" << y + 15
      << "\" text-anchor=\"end\" style=\"font-style:italic\">outside the top 10</text>";
    s << "<line class=\"grid\" x1=\"" << left << "\" y1=\"" << y + 11 << "\" x2=\"" << left + plot
      << "\" y2=\"" << y + 11 << "\" stroke-dasharray=\"4 3\"/>";
    y += row_h;
    for (const Bar& b : outside) bar(b);
  }
  s << "<text x=\"" << left << "\" y=\"" << height - 8 << "\">logit " << fmt(lo, "%.3g")
    << "</text><text x=\"" << left + plot << "\" y=\"" << height - 8 << "\" text-anchor=\"end\">"
    << fmt(hi, "%.3g") << "</text></svg>";
  return s.str();
}

struct Chart {
  std::vector<Bar> top, outside;  // outside: candidates below the top 10, by rank
  std::string note;               // where the logits came from
};

// The chart's bars: the top-10 reference logits and the candidates outside them, from the
// artifact's logits row when it is usable, else from what the result itself holds.
Chart chart_of(const Json& r, const fs::path& dir) {
  const Json& o = r.value("oracle", Json::object());
  const Json cands = o.value("candidate_tokens", Json::array());
  std::map<std::int64_t, std::string> texts;
  for (const Json& t : o.value("top_tokens", Json::array()))
    texts[t.value("token_id", std::int64_t{-1})] = t.value("text", "");
  for (const Json& c : cands) texts[c.value("token_id", std::int64_t{-1})] = c.value("text", "");

  Chart chart;
  std::string& note = chart.note;
  std::vector<Bar>& top = chart.top;
  std::vector<Bar>& outside = chart.outside;
  if (auto logits = read_logits(r, dir, note)) {
    std::vector<std::int64_t> order(logits->size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<std::int64_t>(i);
    const std::size_t k = std::min<std::size_t>(10, order.size());
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                      [&](std::int64_t a, std::int64_t b) {
                        float la = (*logits)[static_cast<std::size_t>(a)];
                        float lb = (*logits)[static_cast<std::size_t>(b)];
                        return la > lb || (la == lb && a < b);
                      });
    auto rank_of = [&](float l) {
      std::int64_t n = 1;
      for (float x : *logits) n += x > l;
      return n;
    };
    for (std::size_t i = 0; i < k; ++i) {
      float l = (*logits)[static_cast<std::size_t>(order[i])];
      top.push_back({order[i], l, rank_of(l), texts.count(order[i]) ? texts[order[i]] : "", {}});
    }
    for (const Json& c : cands) {
      std::int64_t id = c.value("token_id", std::int64_t{-1});
      if (id < 0 || static_cast<std::size_t>(id) >= logits->size()) continue;
      auto it = std::find_if(top.begin(), top.end(), [&](const Bar& b) { return b.token == id; });
      if (it == top.end()) {
        it = std::find_if(outside.begin(), outside.end(),
                          [&](const Bar& b) { return b.token == id; });
        if (it == outside.end()) {
          float l = (*logits)[static_cast<std::size_t>(id)];
          outside.push_back({id, l, rank_of(l), texts[id], {}});
          it = outside.end() - 1;
        }
      }
      it->engines.push_back(c.value("engine", "?"));
    }
  } else {
    std::int64_t rank = 0;
    for (const Json& t : o.value("top_tokens", Json::array()))
      top.push_back({t.value("token_id", std::int64_t{0}),
                     t.value("logit", 0.0),
                     ++rank,
                     t.value("text", ""),
                     {}});
    for (const Json& c : cands) {
      std::int64_t id = c.value("token_id", std::int64_t{-1});
      auto it = std::find_if(top.begin(), top.end(), [&](const Bar& b) { return b.token == id; });
      if (it == top.end()) {
        outside.push_back(
            {id, c.value("logit", 0.0), c.value("rank", std::int64_t{0}), c.value("text", ""), {}});
        it = outside.end() - 1;
      }
      it->engines.push_back(c.value("engine", "?"));
    }
  }
  std::sort(outside.begin(), outside.end(),
            [](const Bar& a, const Bar& b) { return a.rank < b.rank; });

  return chart;
}

}  // namespace

std::string next_token_page(const Json& r, const fs::path& dir, const Prompt* prompt) {
  const Json& o = r.value("oracle", Json::object());
  const Json& v = r.value("verdict", Json::object());
  const Json cands = o.value("candidate_tokens", Json::array());
  const Chart chart = chart_of(r, dir);
  const std::string& note = chart.note;
  const std::vector<Bar>& top = chart.top;
  const std::vector<Bar>& outside = chart.outside;

  std::ostringstream b;
  const std::string winner = v.value("argmax_candidate", std::string("?"));
  b << "<h1>Next-token oracle verdict</h1><p class=\"sub\">job <code>" << esc(get(r, {"job_id"}))
    << "</code> · request <code>" << esc(get(r, {"request", "id"})) << "</code> · "
    << esc(get(r, {"created_at_utc"})) << "</p>";
  b << "<div class=\"verdict " << (winner == "neither" ? "bad" : "ok") << "\"><b>"
    << (winner == "neither" ? "Neither engine" : "Engine " + esc(winner))
    << "</b> produced the reference argmax: token <code>" << esc(get(v, {"argmax_token_id"}))
    << "</code> "
    << (get(o, {"argmax_text"}).empty() ? "" : "(" + visible(get(o, {"argmax_text"})) + ")")
    << ".<br>Top-logit margin <b>" << esc(get(o, {"top_logit_margin"})) << "</b>"
    << (o.value("top_logit_tie", false) ? " (a TIE)" : "") << " · candidate attribution "
    << (v.value("candidate_attribution_complete", false) ? "complete" : "INCOMPLETE") << "</div>";

  b << "<h2>Candidates</h2><table><tr><th>engine</th><th>token</th><th>text</th><th>logit</th>"
       "<th>rank</th><th>is argmax</th></tr>";
  for (const Json& c : cands)
    b << "<tr><td>" << esc(get(c, {"engine"})) << "</td><td class=\"num\">"
      << esc(get(c, {"token_id"})) << "</td><td class=\"mono\">" << visible(get(c, {"text"}))
      << "</td><td class=\"num\">" << esc(get(c, {"logit"})) << "</td><td class=\"num\">"
      << esc(get(c, {"rank"})) << "</td><td>" << esc(get(c, {"is_argmax"})) << "</td></tr>";
  b << "</table>";

  b << "<h2>Top-10 reference logits</h2><p class=\"sub\">" << esc(note)
    << ". Candidates are orange, with their engine; rank = 1 + logits strictly greater.</p>"
    << logit_chart(top, outside);
  b << "<table><tr><th>rank</th><th>token</th><th>text</th><th>logit</th><th>candidate "
       "of</th></tr>";
  for (const auto* set : {&top, &outside})
    for (const Bar& x : *set) {
      std::string engines;
      for (const auto& e : x.engines) engines += (engines.empty() ? "" : ", ") + e;
      b << "<tr><td class=\"num\">" << x.rank << "</td><td class=\"num\">" << x.token
        << "</td><td class=\"mono\">" << visible(x.text) << "</td><td class=\"num\">"
        << fmt(x.logit, "%.6f") << "</td><td>" << esc(engines) << "</td></tr>";
    }
  b << "</table>";

  if (r.contains("numerics")) b << numerics_section(r["numerics"]);
  b << prompt_section(prompt);

  b << "<h2>Model identity</h2>" << kv_table(r.value("model_identity", Json::object()));
  b << "<h2>Oracle</h2>";
  Json oracle_facts = Json::object();
  for (const char* k :
       {"architecture", "model_type", "vocab_size", "device", "dtype", "torch_version", "threads",
        "deterministic_algorithms", "tf32_allowed", "executable_sha256", "logits_sha256",
        "input_token_count", "forward_seconds"})
    if (o.contains(k)) oracle_facts[k] = o[k];
  b << kv_table(oracle_facts);
  b << "<h2>Containment evidence</h2>" << kv_table(r.value("containment", Json::object()));
  b << "<details open><summary>oracle process</summary>"
    << kv_table(o.value("process", Json::object())) << "</details>";
  b << "<h2>Record</h2>"
    << kv_table(Json{{"result_sha256", r.value("result_sha256", Json())},
                     {"signing key", get(r, {"supervisor", "key_id"})},
                     {"logits artifact", r.value("reference_artifact", Json())}});
  return page("assay verdict " + get(r, {"job_id"}), b.str());
}

}  // namespace assay::client::html
