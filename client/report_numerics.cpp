// `assay report`'s bug-or-numerics views: a next-token result's envelope (the class in words, a
// strip plot of each candidate's logit across the legitimate executions with the reference and the
// float32 answer marked, the members' figures) and an engine audit's page (the class, the engine's
// distance from the model's arithmetic in units of the legitimate spread with its interval, per
// context and per member). Every value is read without trusting the document's shape: a figure
// that is missing draws nothing and reads "—".
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "client/report_html.h"

namespace assay::client::html {
namespace {

using common::Json;

const Json& at(const Json& j, const char* key) {
  return common::member(j, key);
}

const Json& list(const Json& j, const char* key) {
  static const Json kEmpty = Json::array();
  const Json& v = at(j, key);
  return v.is_array() ? v : kEmpty;
}

std::optional<double> number(const Json& v) {
  if (!v.is_number()) return std::nullopt;
  double d = v.get<double>();
  return std::isfinite(d) ? std::optional<double>(d) : std::nullopt;
}

std::optional<std::int64_t> integer(const Json& v) {
  if (!v.is_number_integer()) return std::nullopt;
  return v.get<std::int64_t>();
}

std::string class_words(const std::string& cls) {
  if (cls == "reference_decides")
    return "The reference decides: every legitimate execution picks the same token, and the other "
           "candidates trail it by more than the legitimate spread. The other engine's token is "
           "not a legitimate outcome of the model's arithmetic: a bug is likely.";
  if (cls == "numerically_tied")
    return "Numerically tied: legitimate executions disagree among the candidates, or the deficit "
           "is within their spread. Both tokens are legitimate outcomes; one state cannot tell a "
           "subtle bug from numerics (an engine audit over many states can).";
  if (cls == "neither") return "Neither: no legitimate execution's argmax is a candidate.";
  if (cls == "beyond_legitimate")
    return "Beyond legitimate: the engine is farther from the model's arithmetic than any "
           "legitimate execution measured, at the stated false-alarm rate. A bug is likely.";
  if (cls == "within_legitimate")
    return "Within legitimate: at this panel's power the engine cannot be told from a correct "
           "implementation.";
  return "class \"" + cls + "\"";
}

// Each candidate's logit in one member, by token id.
std::map<std::int64_t, double> candidate_logits(const Json& member) {
  std::map<std::int64_t, double> out;
  for (const Json& c : list(member, "candidates")) {
    auto id = integer(at(c, "token_id"));
    auto l = number(at(c, "logit"));
    if (id && l) out[*id] = *l;
  }
  return out;
}

// A small deterministic vertical offset per member, so that equal logits do not hide each other.
double jitter(std::size_t i) {
  static const double kOffsets[] = {0, -9, 9, -4.5, 4.5, -13, 13, -2, 2, -11, 11, -6.5, 6.5};
  return kOffsets[i % (sizeof kOffsets / sizeof kOffsets[0])];
}

std::string strip_plot(const Json& n) {
  const Json& verdict = at(n, "verdict");
  const Json& members = list(n, "members");
  const Json& fp32 = at(n, "fp32");
  const double step = number(at(verdict, "step")).value_or(0);
  struct Row {
    std::int64_t token;
    std::string label;
    std::vector<std::pair<std::string, double>> points;  // member name, logit
    std::optional<double> fp32;
    std::string right;
  };
  std::vector<Row> rows;
  for (const Json& c : list(verdict, "candidates")) {
    auto id = integer(at(c, "token_id"));
    if (!id) continue;
    Row row{*id, "token " + std::to_string(*id), {}, std::nullopt, ""};
    std::string engines;
    for (const Json& e : list(c, "engines"))
      if (e.is_string()) engines += (engines.empty() ? "" : ", ") + e.get<std::string>();
    if (!engines.empty()) row.label += " (" + engines + ")";
    for (const Json& m : members) {
      auto logits = candidate_logits(m);
      if (auto it = logits.find(*id); it != logits.end())
        row.points.push_back(
            {at(m, "name").is_string() ? at(m, "name").get<std::string>() : "?", it->second});
    }
    auto f = candidate_logits(fp32);
    if (auto it = f.find(*id); it != f.end()) row.fp32 = it->second;
    if (auto s = number(at(at(c, "logit"), "spread_steps")))
      row.right = "spread " + fmt(*s, "%.3g") + " steps";
    rows.push_back(std::move(row));
  }
  if (rows.empty()) return "<p class=\"sub\">No candidate figures to draw.</p>";
  double lo = INFINITY, hi = -INFINITY;
  for (const Row& r : rows) {
    for (const auto& [_, v] : r.points) lo = std::min(lo, v), hi = std::max(hi, v);
    if (r.fp32) lo = std::min(lo, *r.fp32), hi = std::max(hi, *r.fp32);
  }
  if (!std::isfinite(lo)) lo = 0, hi = 1;
  const double pad = step > 0 ? step : (hi - lo) * 0.05 + 1e-3;
  lo -= pad;
  hi += pad;
  if (hi - lo <= 0) hi = lo + 1;
  const int row_h = 54, left = 200, width = 900, plot = width - left - 150;
  const int height = static_cast<int>(rows.size()) * row_h + 70;
  auto x = [&](double v) { return left + (v - lo) / (hi - lo) * plot; };
  std::ostringstream s;
  s << "<svg role=\"img\" viewBox=\"0 0 " << width << " " << height << "\" width=\"" << width
    << "\" height=\"" << height << "\" xmlns=\"http://www.w3.org/2000/svg\">"
    << "<title>Each candidate's logit across the legitimate executions</title>";
  // The bf16 grid: one line per representable step, where there are few enough to read.
  if (step > 0 && (hi - lo) / step <= 80)
    for (double g = std::ceil(lo / step) * step; g <= hi; g += step)
      s << "<line x1=\"" << x(g) << "\" y1=\"8\" x2=\"" << x(g) << "\" y2=\"" << height - 52
        << "\" stroke=\"#e3e7ef\" stroke-width=\"1\"/>";
  int y = 10;
  for (const Row& r : rows) {
    const double mid = y + row_h / 2.0;
    s << "<text x=\"" << left - 10 << "\" y=\"" << mid + 5 << "\" text-anchor=\"end\">"
      << esc(r.label.size() > 32 ? r.label.substr(0, 31) + "…" : r.label) << "</text>";
    s << "<line x1=\"" << left << "\" y1=\"" << mid << "\" x2=\"" << left + plot << "\" y2=\""
      << mid << "\" stroke=\"#c9d1e0\" stroke-dasharray=\"3 3\"/>";
    std::size_t i = 0;
    for (const auto& [name, v] : r.points) {
      if (name == "reference") continue;
      const bool named = name == "sdpa" || name == "kv-cache" || name.starts_with("batched:");
      s << "<circle cx=\"" << x(v) << "\" cy=\"" << mid + jitter(++i) << "\" r=\"4.5\" fill=\""
        << (named ? "#27ae60" : "#3b6fd1") << "\" fill-opacity=\"0.75\"><title>" << esc(name)
        << ": " << fmt(v, "%.7g") << "</title></circle>";
    }
    if (r.fp32)
      s << "<rect x=\"" << x(*r.fp32) - 6 << "\" y=\"" << mid - 6
        << "\" width=\"12\" height=\"12\" fill=\"none\" stroke=\"#222\" stroke-width=\"2\"><title>"
        << "fp32: " << fmt(*r.fp32, "%.7g") << "</title></rect>";
    for (const auto& [name, v] : r.points)
      if (name == "reference")
        s << "<path d=\"M" << x(v) << " " << mid - 11 << " l9 11 l-9 11 l-9 -11 z\" "
          << "fill=\"#dc7633\" stroke=\"#8e4413\" stroke-width=\"1.5\"><title>reference: "
          << fmt(v, "%.7g") << "</title></path>";
    s << "<text x=\"" << left + plot + 10 << "\" y=\"" << mid + 5 << "\">" << esc(r.right)
      << "</text>";
    y += row_h;
  }
  s << "<text x=\"" << left << "\" y=\"" << height - 34 << "\">logit " << fmt(lo, "%.6g")
    << "</text><text x=\"" << left + plot << "\" y=\"" << height - 34 << "\" text-anchor=\"end\">"
    << fmt(hi, "%.6g") << "</text>";
  const int ly = height - 12;
  s << "<path d=\"M" << left << " " << ly - 8 << " l7 8 l-7 8 l-7 -8 z\" fill=\"#dc7633\"/>"
    << "<text x=\"" << left + 12 << "\" y=\"" << ly + 4 << "\">reference</text>"
    << "<circle cx=\"" << left + 110 << "\" cy=\"" << ly << "\" r=\"4.5\" fill=\"#3b6fd1\"/>"
    << "<text x=\"" << left + 120 << "\" y=\"" << ly + 4 << "\">reduction orders</text>"
    << "<circle cx=\"" << left + 270 << "\" cy=\"" << ly << "\" r=\"4.5\" fill=\"#27ae60\"/>"
    << "<text x=\"" << left + 280 << "\" y=\"" << ly + 4 << "\">sdpa, kv-cache, batched</text>"
    << "<rect x=\"" << left + 470 << "\" y=\"" << ly - 6
    << "\" width=\"12\" height=\"12\" fill=\"none\" stroke=\"#222\" stroke-width=\"2\"/>"
    << "<text x=\"" << left + 488 << "\" y=\"" << ly + 4 << "\">fp32 (not a member)</text>";
  if (step > 0)
    s << "<text x=\"" << left + plot / 2 << "\" y=\"" << height - 34
      << "\" text-anchor=\"middle\">grid: one bf16 step (" << fmt(step, "%.3g") << ")</text>";
  s << "</svg>";
  return s.str();
}

}  // namespace

std::string numerics_section(const Json& n) {
  std::ostringstream b;
  b << "<h2>Bug or numerics</h2>";
  if (!n.is_object() || !at(n, "verdict").is_object()) {
    // Asked for but not run: the result says why.
    b << "<p>The numerics envelope was not run: " << esc(get(n, {"reason"})) << "</p>";
    return b.str();
  }
  const Json& v = at(n, "verdict");
  const std::string cls = at(v, "class").is_string() ? at(v, "class").get<std::string>() : "?";
  b << "<div class=\"verdict " << (cls == "numerically_tied" ? "ok" : "bad") << "\"><b>" << esc(cls)
    << "</b>: " << esc(class_words(cls)) << "<br>" << esc(get(v, {"explanation"})) << "</div>";
  b << "<p class=\"sub\">" << esc(get(v, {"members"}))
    << " legitimate bf16 executions (the same weights and math as transformers' eager module, "
       "differing only in reduction order, kernel, cache use or batch composition). Each "
       "candidate's logit in each of them; the reference is the orange diamond, the float32 "
       "answer the square. Policy: spread factor "
    << esc(get(n, {"policy", "spread_factor"})) << ", margin "
    << esc(get(n, {"policy", "margin_steps"})) << " bf16 steps.</p>";
  b << strip_plot(n);
  b << "<table><tr><th>token</th><th>engines</th><th>argmax in</th><th>logit (ref)</th>"
       "<th>spread (steps)</th><th>gap min</th><th>gap max</th><th>threshold</th><th>beyond</th>"
       "</tr>";
  for (const Json& c : list(v, "candidates")) {
    std::string engines;
    for (const Json& e : list(c, "engines")) engines += (engines.empty() ? "" : ", ") + text_of(e);
    b << "<tr><td class=\"num\">" << esc(get(c, {"token_id"})) << "</td><td>" << esc(engines)
      << "</td><td class=\"num\">" << esc(get(c, {"argmax_members"})) << " of "
      << esc(get(v, {"members"})) << "</td><td class=\"num\">"
      << esc(get(c, {"logit", "reference"})) << "</td><td class=\"num\">"
      << esc(get(c, {"logit", "spread_steps"})) << "</td><td class=\"num\">"
      << esc(get(c, {"gap", "min"})) << "</td><td class=\"num\">" << esc(get(c, {"gap", "max"}))
      << "</td><td class=\"num\">" << esc(get(c, {"threshold"})) << "</td><td>"
      << esc(get(c, {"beyond"})) << "</td></tr>";
  }
  b << "</table>";
  b << "<details><summary>every member's figures</summary><table><tr><th>member</th>"
       "<th>argmax</th><th>top logit</th><th>margin</th><th>candidates (logit, rank)</th></tr>";
  auto member_row = [&](const Json& m) {
    std::string cands;
    for (const Json& c : list(m, "candidates"))
      cands += (cands.empty() ? "" : "; ") + text_of(at(c, "token_id")) + ": " +
               text_of(at(c, "logit")) + ", #" + text_of(at(c, "rank"));
    b << "<tr><td class=\"mono\">" << esc(get(m, {"name"})) << "</td><td class=\"num\">"
      << esc(get(m, {"argmax"})) << "</td><td class=\"num\">" << esc(get(m, {"argmax_logit"}))
      << "</td><td class=\"num\">" << esc(get(m, {"margin"})) << "</td><td class=\"mono\">"
      << esc(cands) << "</td></tr>";
  };
  for (const Json& m : list(n, "members")) member_row(m);
  if (at(n, "fp32").is_object()) member_row(at(n, "fp32"));
  b << "</table></details>";
  return b.str();
}

std::string audit_page(const Json& r, const std::filesystem::path&) {
  const Json& s = at(r, "statistics");
  const std::string cls = at(s, "class").is_string() ? at(s, "class").get<std::string>() : "?";
  std::ostringstream b;
  b << "<h1>Engine audit</h1><p class=\"sub\">engine <code>" << esc(get(r, {"engine", "name"}))
    << "</code> · job <code>" << esc(get(r, {"job_id"})) << "</code> · request <code>"
    << esc(get(r, {"request", "id"})) << "</code> · " << esc(get(r, {"created_at_utc"})) << "</p>";
  b << "<div class=\"verdict " << (cls == "beyond_legitimate" ? "bad" : "ok") << "\"><b>"
    << esc(cls) << "</b>: " << esc(class_words(cls)) << "<br>" << esc(get(s, {"explanation"}))
    << "</div>";

  // The engine's distance in units of the legitimate spread: its interval against 1, the
  // farthest legitimate execution, and each member's own ratio.
  const double ratio = number(at(s, "ratio")).value_or(0);
  const Json& ci = at(s, "ci95");
  const double lo = ci.is_array() && ci.size() == 2 ? number(ci[0]).value_or(ratio) : ratio;
  const double hi = ci.is_array() && ci.size() == 2 ? number(ci[1]).value_or(ratio) : ratio;
  struct Dot {
    std::string name;
    double ratio;
  };
  std::vector<Dot> dots;
  for (const Json& m : list(s, "members"))
    if (auto v = number(at(m, "ratio"))) dots.push_back({text_of(at(m, "name")), *v});
  const double top = std::max({1.5, hi * 1.15, ratio * 1.15});
  const int left = 200, width = 900, plot = width - left - 60;
  const int height = 90 + static_cast<int>(dots.size()) * 22 + 50;
  auto x = [&](double v) { return left + std::clamp(v / top, 0.0, 1.0) * plot; };
  std::ostringstream g;
  g << "<svg role=\"img\" viewBox=\"0 0 " << width << " " << height << "\" width=\"" << width
    << "\" height=\"" << height << "\" xmlns=\"http://www.w3.org/2000/svg\">"
    << "<title>The engine's distance in units of the legitimate spread</title>";
  g << "<rect x=\"" << left << "\" y=\"6\" width=\"" << x(1) - left << "\" height=\"" << height - 46
    << "\" fill=\"#eaf5ec\"/>";
  g << "<line x1=\"" << x(1) << "\" y1=\"6\" x2=\"" << x(1) << "\" y2=\"" << height - 40
    << "\" stroke=\"#27ae60\" stroke-width=\"2\"/>";
  g << "<text x=\"" << x(1) + 4 << "\" y=\"20\" style=\"fill:#1e8449\">1 = the farthest "
    << "legitimate execution</text>";
  int y = 44;
  const bool beyond = cls == "beyond_legitimate";
  const char* colour = beyond ? "#c0392b" : "#3b6fd1";
  g << "<text x=\"" << left - 10 << "\" y=\"" << y + 5 << "\" text-anchor=\"end\" "
    << "style=\"font-weight:600\">" << esc(get(r, {"engine", "name"}).substr(0, 28)) << "</text>";
  g << "<line x1=\"" << x(lo) << "\" y1=\"" << y << "\" x2=\"" << x(hi) << "\" y2=\"" << y
    << "\" stroke=\"" << colour << "\" stroke-width=\"4\"/>";
  for (double e : {lo, hi})
    g << "<line x1=\"" << x(e) << "\" y1=\"" << y - 9 << "\" x2=\"" << x(e) << "\" y2=\"" << y + 9
      << "\" stroke=\"" << colour << "\" stroke-width=\"3\"/>";
  g << "<circle cx=\"" << x(ratio) << "\" cy=\"" << y << "\" r=\"8\" fill=\"" << colour << "\"/>";
  g << "<text x=\"" << x(hi) + 12 << "\" y=\"" << y + 5 << "\">" << fmt(ratio, "%.3g") << "x ["
    << fmt(lo, "%.3g") << ", " << fmt(hi, "%.3g") << "]</text>";
  y += 40;
  for (const Dot& d : dots) {
    g << "<text x=\"" << left - 10 << "\" y=\"" << y + 5 << "\" text-anchor=\"end\">"
      << esc(d.name.substr(0, 28)) << "</text><circle cx=\"" << x(d.ratio) << "\" cy=\"" << y
      << "\" r=\"5\" fill=\"#27ae60\"/>";
    y += 22;
  }
  g << "<text x=\"" << left << "\" y=\"" << height - 14 << "\">0</text><text x=\"" << left + plot
    << "\" y=\"" << height - 14 << "\" text-anchor=\"end\">" << fmt(top, "%.3g")
    << "x the legitimate spread</text></svg>";
  b << "<h2>Distance from the model's arithmetic</h2><p class=\"sub\">RMS distance of each "
       "log-softmax from the model's float32 answer ("
    << esc(get(r, {"anchor"})) << "), over " << esc(get(s, {"positions"})) << " positions in "
    << esc(get(s, {"contexts"})) << " contexts, in units of the farthest legitimate execution ("
    << esc(get(s, {"unit_member"}))
    << "). The bar is the 95% interval; one-sided p = " << esc(get(s, {"test", "p_value"}))
    << " at alpha " << esc(get(s, {"test", "alpha"})) << ".</p>" << g.str();

  // Per context: the engine's ratio to the unit member there.
  std::size_t unit = 0;
  const Json& names = list(r, "members");
  for (std::size_t i = 0; i < names.size(); ++i)
    if (names[i] == at(s, "unit_member")) unit = i;
  b << "<h2>Per context</h2><table><tr><th>context</th><th>positions</th><th>engine sum</th>"
       "<th>unit member's sum</th><th>ratio</th><th>argmax differs</th></tr>";
  for (const Json& c : list(r, "contexts")) {
    const Json& sums = list(c, "member_sums");
    const double e = number(at(c, "engine_sum")).value_or(-1);
    const double u = unit < sums.size() ? number(sums[unit]).value_or(-1) : -1;
    std::string q = e >= 0 && u > 0 ? fmt(std::sqrt(e / u), "%.3g") : "—";
    b << "<tr><td class=\"mono\">" << esc(get(c, {"id"})) << "</td><td class=\"num\">"
      << esc(get(c, {"positions"})) << "</td><td class=\"num\">" << esc(get(c, {"engine_sum"}))
      << "</td><td class=\"num\">" << esc(u >= 0 ? fmt(u) : "—") << "</td><td class=\"num\">" << q
      << "</td><td class=\"num\">" << esc(get(c, {"argmax_differs"})) << "</td></tr>";
  }
  b << "</table>";
  b << "<h2>Members</h2><table><tr><th>member</th><th>sum</th><th>ratio to the unit</th></tr>";
  for (const Json& m : list(s, "members"))
    b << "<tr><td class=\"mono\">" << esc(get(m, {"name"})) << "</td><td class=\"num\">"
      << esc(get(m, {"sum"})) << "</td><td class=\"num\">" << esc(get(m, {"ratio"}))
      << "</td></tr>";
  b << "</table>";
  b << "<h2>Model identity</h2>" << kv_table(at(r, "model_identity"));
  b << "<h2>Containment evidence</h2>" << kv_table(at(r, "containment"));
  b << "<h2>Record</h2>"
    << kv_table(Json{{"result_sha256", at(r, "result_sha256")},
                     {"signing key", get(r, {"supervisor", "key_id"})},
                     {"audit artifact", at(r, "audit_artifact")}});
  return page("assay engine audit " + get(r, {"job_id"}), b.str());
}

}  // namespace assay::client::html
