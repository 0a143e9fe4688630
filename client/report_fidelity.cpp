// `assay report`'s page for a fidelity receipt: identities and the metric, the gates, the
// reproduction, token-wise KL along positions per context (from kl.safetensors beside the result
// when its sha256 matches), the KL histogram and its CDF on a log axis, the statistics table and
// the record. The SVG charts and their log axes are here.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <utility>
#include <vector>

#include "client/report_html.h"
#include "common/fidelity.h"
#include "common/identity.h"
#include "common/safetensors.h"

namespace assay::client::html {
namespace {

using common::Json;
namespace fs = std::filesystem;

const char* kPalette[] = {"#3366cc", "#dc7633", "#2e9c6a", "#9b59b6",
                          "#c0392b", "#16a2b8", "#7f8c8d", "#b7950b"};

struct KlPoint {
  std::int64_t position;
  double kl;
};

constexpr double kFloor = 1e-16;  // KL 0 and below are drawn on the floor of the log axis

double log_y(double v) {
  return std::log10(std::max(v, kFloor));
}

std::string log_axis(int left, int top, int w, int h, double lo_exp, double hi_exp, bool vertical) {
  std::ostringstream s;
  const double span = hi_exp - lo_exp;
  const int step = span > 12 ? 2 : 1;
  for (int e = static_cast<int>(std::ceil(lo_exp)); e <= static_cast<int>(hi_exp); e += step) {
    const double f = (e - lo_exp) / span;
    if (vertical) {
      const double y = top + h - f * h;
      s << "<line class=\"grid\" x1=\"" << left << "\" y1=\"" << y << "\" x2=\"" << left + w
        << "\" y2=\"" << y << "\"/><text x=\"" << left - 4 << "\" y=\"" << y + 4
        << "\" text-anchor=\"end\">1e" << e << "</text>";
    } else {
      const double x = left + f * w;
      s << "<line class=\"grid\" x1=\"" << x << "\" y1=\"" << top << "\" x2=\"" << x << "\" y2=\""
        << top + h << "\"/><text x=\"" << x << "\" y=\"" << top + h + 14
        << "\" text-anchor=\"middle\">1e" << e << "</text>";
    }
  }
  return s.str();
}

std::string kl_along_positions(const std::vector<std::string>& ids,
                               const std::vector<std::vector<KlPoint>>& per_context) {
  const int width = 900, height = 320, left = 60, top = 16, w = width - left - 20, h = height - 70;
  std::int64_t pmax = 1;
  double hi = kFloor;
  for (const auto& pts : per_context)
    for (const KlPoint& p : pts) {
      pmax = std::max(pmax, p.position);
      hi = std::max(hi, p.kl);
    }
  const double lo_e = std::log10(kFloor), hi_e = std::max(std::ceil(std::log10(hi)), lo_e + 1);
  std::ostringstream s;
  s << "<svg role=\"img\" viewBox=\"0 0 " << width << " " << height << "\" width=\"" << width
    << "\" height=\"" << height
    << "\" xmlns=\"http://www.w3.org/2000/svg\"><title>Token-wise KL "
       "along positions, per context (log scale)</title>"
    << log_axis(left, top, w, h, lo_e, hi_e, true);
  auto px = [&](double p) { return left + p / static_cast<double>(pmax) * w; };
  auto py = [&](double v) { return top + h - (log_y(v) - lo_e) / (hi_e - lo_e) * h; };
  for (std::size_t c = 0; c < per_context.size(); ++c) {
    const char* color = kPalette[c % std::size(kPalette)];
    std::string path;
    for (const KlPoint& p : per_context[c])
      path += (path.empty() ? "M" : " L") + fmt(px(static_cast<double>(p.position)), "%.1f") + " " +
              fmt(py(p.kl), "%.1f");
    s << "<path d=\"" << path << "\" fill=\"none\" stroke=\"" << color
      << "\" stroke-width=\"1.3\" opacity=\"0.85\"/>";
    for (const KlPoint& p : per_context[c])
      s << "<circle cx=\"" << fmt(px(static_cast<double>(p.position)), "%.1f") << "\" cy=\""
        << fmt(py(p.kl), "%.1f") << "\" r=\"2\" fill=\"" << color << "\"/>";
    s << "<rect x=\"" << left + 10 + 150 * static_cast<int>(c % 5) << "\" y=\""
      << height - 22 - 0 * 16 << "\" width=\"10\" height=\"10\" fill=\"" << color
      << "\"/><text x=\"" << left + 24 + 150 * static_cast<int>(c % 5) << "\" y=\"" << height - 13
      << "\">" << esc(ids[c].substr(0, 20)) << "</text>";
  }
  s << "<text x=\"" << left + w << "\" y=\"" << top + h + 14 << "\" text-anchor=\"end\">position "
    << pmax << "</text><text x=\"" << left << "\" y=\"" << top + h + 14
    << "\">position 0</text><text x=\"" << left + w / 2 << "\" y=\"" << top + h + 14
    << "\" text-anchor=\"middle\">KL (nats) by position; 0 drawn at 1e-16</text></svg>";
  return s.str();
}

std::string histogram_chart(const Json& h) {
  const Json& edges = h.value("edges", Json::array());
  const Json& counts = h.value("counts", Json::array());
  std::vector<std::pair<std::string, std::int64_t>> bins;
  bins.emplace_back("0", h.value("zero", std::int64_t{0}));
  if (h.value("negative", std::int64_t{0}) > 0)
    bins.emplace_back("<0", h["negative"].get<std::int64_t>());
  for (std::size_t i = 0; i < counts.size(); ++i) {
    std::string label = i == 0             ? "<" + fmt(edges[0].get<double>(), "%.0e")
                        : i < edges.size() ? fmt(edges[i - 1].get<double>(), "%.0e")
                                           : "≥" + fmt(edges[i - 1].get<double>(), "%.0e");
    bins.emplace_back(label, counts[i].get<std::int64_t>());
  }
  std::int64_t most = 1;
  for (const auto& [l, n] : bins) most = std::max(most, n);
  const int width = 900, height = 240, left = 50, top = 14, h_ = height - 60;
  const double bw = static_cast<double>(width - left - 20) / static_cast<double>(bins.size());
  std::ostringstream s;
  s << "<svg role=\"img\" viewBox=\"0 0 " << width << " " << height << "\" width=\"" << width
    << "\" height=\"" << height
    << "\" xmlns=\"http://www.w3.org/2000/svg\"><title>Histogram of "
       "token-wise KL, decade bins</title>";
  for (std::size_t i = 0; i < bins.size(); ++i) {
    const double bh = static_cast<double>(bins[i].second) / static_cast<double>(most) * h_;
    const double x = left + bw * static_cast<double>(i);
    s << "<rect x=\"" << x + 2 << "\" y=\"" << top + h_ - bh << "\" width=\"" << bw - 4
      << "\" height=\"" << bh << "\" fill=\"" << (i == 0 ? "#2e9c6a" : "#3366cc") << "\"/>";
    if (bins[i].second > 0)
      s << "<text x=\"" << x + bw / 2 << "\" y=\"" << top + h_ - bh - 3
        << "\" text-anchor=\"middle\">" << bins[i].second << "</text>";
    s << "<text x=\"" << x + bw / 2 << "\" y=\"" << top + h_ + 14 << "\" text-anchor=\"middle\">"
      << esc(bins[i].first) << "</text>";
  }
  s << "<text x=\"" << left << "\" y=\"" << height - 10
    << "\">KL (nats), bin lower edge; green: exactly 0</text></svg>";
  return s.str();
}

std::string cdf_chart(std::vector<double> kl) {
  std::sort(kl.begin(), kl.end());
  const int width = 900, height = 260, left = 60, top = 14, w = width - left - 20, h = height - 50;
  double hi = kFloor;
  for (double v : kl) hi = std::max(hi, v);
  const double lo_e = std::log10(kFloor), hi_e = std::max(std::ceil(std::log10(hi)), lo_e + 1);
  auto px = [&](double v) { return left + (log_y(v) - lo_e) / (hi_e - lo_e) * w; };
  std::ostringstream s;
  s << "<svg role=\"img\" viewBox=\"0 0 " << width << " " << height << "\" width=\"" << width
    << "\" height=\"" << height
    << "\" xmlns=\"http://www.w3.org/2000/svg\"><title>Cumulative "
       "distribution of token-wise KL, log axis</title>"
    << log_axis(left, top, w, h, lo_e, hi_e, false);
  for (int q = 0; q <= 4; ++q) {
    const double y = top + h - q / 4.0 * h;
    s << "<text x=\"" << left - 4 << "\" y=\"" << y + 4 << "\" text-anchor=\"end\">" << q * 25
      << "%</text>";
  }
  std::string path = "M" + fmt(left, "%.1f") + " " + fmt(top + h, "%.1f");
  const double n = static_cast<double>(kl.size());
  for (std::size_t i = 0; i < kl.size(); ++i) {
    const double x = px(kl[i]);
    path += " L" + fmt(x, "%.1f") + " " + fmt(top + h - static_cast<double>(i) / n * h, "%.1f");
    path += " L" + fmt(x, "%.1f") + " " + fmt(top + h - static_cast<double>(i + 1) / n * h, "%.1f");
  }
  path += " L" + fmt(left + w, "%.1f") + " " + fmt(top, "%.1f");
  s << "<path d=\"" << path << "\" fill=\"none\" stroke=\"#3366cc\" stroke-width=\"2\"/>"
    << "<text x=\"" << left + w / 2 << "\" y=\"" << height - 6
    << "\" text-anchor=\"middle\">KL (nats), log axis; 0 drawn at 1e-16 · fraction of positions "
       "with KL ≤ x</text></svg>";
  return s.str();
}

std::string gates_html(const Json& g) {
  const std::string status = g.value("status", std::string("?"));
  std::ostringstream b;
  b << "<div class=\"verdict "
    << (status == "passed"   ? "ok"
        : status == "failed" ? "bad"
                             : "neutral")
    << "\">Gates: <b>" << esc(status) << "</b>";
  if (g.contains("failed") && !g["failed"].empty()) {
    b << " — failed:";
    for (const Json& f : g["failed"]) b << " <code>" << esc(f.get<std::string>()) << "</code>";
  }
  b << "</div><table><tr><th>gate</th><th>rule</th><th>observed</th><th>result</th></tr>";
  auto cell = [](const Json& v) {
    return v.is_null()     ? std::string("<span class=\"undecided\">undecided</span>")
           : v.get<bool>() ? std::string("<span class=\"pass\">passed</span>")
                           : std::string("<span class=\"fail\">FAILED</span>");
  };
  if (g.contains("reproduction") && g["reproduction"].is_object())
    for (auto it = g["reproduction"].begin(); it != g["reproduction"].end(); ++it)
      b << "<tr><td><code>" << esc(it.key()) << "</code></td><td>reproduction</td><td></td><td>"
        << cell(*it) << "</td></tr>";
  for (const Json& t : g.value("thresholds", Json::array()))
    b << "<tr><td><code>" << esc(get(t, {"name"})) << "</code></td><td class=\"mono\">"
      << esc(get(t, {"statistic"}) + " " + get(t, {"comparison"}) + " " + get(t, {"bound"}))
      << "</td><td class=\"num\">" << esc(get(t, {"observed"})) << "</td><td>" << cell(t["passed"])
      << "</td></tr>";
  return b.str() + "</table>";
}

std::string stats_table(const Json& cmp) {
  std::ostringstream b;
  const Json& s = cmp.value("statistics", Json());
  if (!s.is_object()) {
    b << "<table>";
    for (auto it = cmp["metrics"]["kl"].begin(); it != cmp["metrics"]["kl"].end(); ++it)
      b << "<tr><td>KL " << esc(it.key()) << "</td><td class=\"num\">" << esc(text_of(*it))
        << "</td></tr>";
    return b.str() + "</table>";
  }
  auto row = [&](const std::string& label, const Json& v, const Json& se = Json(),
                 double scale = 1) {
    b << "<tr><td>" << esc(label) << "</td><td class=\"num\">"
      << (v.is_number() ? fmt(scale * v.get<double>(), "%.6g") : std::string("—"))
      << "</td><td class=\"num\">"
      << (se.is_number() ? "± " + fmt(scale * se.get<double>(), "%.3g") : std::string(""))
      << "</td></tr>";
  };
  b << "<table><tr><th>statistic</th><th>value</th><th>standard error</th></tr>";
  const Json& kl = s["kl"];
  row("KL mean (nats)", kl["mean"], kl["standard_error"]);
  for (auto [label, key] :
       {std::pair{"KL max", "max"}, std::pair{"KL 99.9%", "p99_9"}, std::pair{"KL 99%", "p99"},
        std::pair{"KL 95%", "p95"}, std::pair{"KL 90%", "p90"}, std::pair{"KL median", "median"},
        std::pair{"KL 10%", "p10"}, std::pair{"KL 5%", "p5"}, std::pair{"KL 1%", "p1"},
        std::pair{"KL 0.1%", "p0_1"}, std::pair{"KL min", "min"}})
    row(label, kl[key]);
  row("same top token (%)", s["same_top"]["fraction"], s["same_top"]["standard_error"], 100);
  for (auto [label, key] : {std::pair{"Δp next token", "delta_p_next"},
                            std::pair{"Δp reference's top token", "delta_p_top"}}) {
    const Json& d = s[key];
    if (!d.is_object()) continue;
    row(std::string(label) + " mean (%)", d["mean"], d["standard_error"], 100);
    row(std::string(label) + " RMS (%)", d["rms"], d["rms_standard_error"], 100);
    b << "<tr><td>" << esc(std::string(label) + " min / median / max (%)")
      << "</td><td class=\"num\">" << fmt(100 * d["min"].get<double>(), "%.4g") << " / "
      << fmt(100 * d["median"].get<double>(), "%.4g") << " / "
      << fmt(100 * d["max"].get<double>(), "%.4g") << "</td><td></td></tr>";
  }
  const Json& p = s["perplexity"];
  if (p.is_object()) {
    row("PPL reference", p["reference"]["ppl"], p["reference"]["ppl_standard_error"]);
    row("PPL candidate", p["candidate"]["ppl"], p["candidate"]["ppl_standard_error"]);
    row("PPL ratio candidate/reference", p["ratio"]["value"], p["ratio"]["standard_error"]);
    row("ln PPL ratio", p["ln_ratio"]["value"], p["ln_ratio"]["standard_error"]);
    row("PPL difference", p["difference"]["value"], p["difference"]["standard_error"]);
    row("correlation of ln PPL (%)", p["ln_ppl_correlation"], Json(), 100);
  }
  b << "</table><details><summary>the same, as llama.cpp prints it</summary><pre>"
    << esc(common::llama_cpp_block(s)) << "</pre></details>";
  return b.str();
}

// Token-wise KL per context from kl.safetensors beside the result, when its sha256 is the
// result's; `all` stays empty otherwise.
struct TokenwiseKl {
  std::vector<std::string> ids;  // the contexts, in the comparison's order
  std::vector<std::vector<KlPoint>> per_context;
  std::vector<double> all;
  std::string note;  // where the values came from
};

TokenwiseKl read_tokenwise_kl(const Json& r, const Json& cmp, const fs::path& dir) {
  TokenwiseKl t;
  std::vector<std::string>& ids = t.ids;
  for (const Json& c : cmp.value("contexts", Json::array())) ids.push_back(c.value("id", "?"));
  std::vector<std::vector<KlPoint>>& per_context = t.per_context;
  per_context.resize(ids.size());
  std::vector<double>& all = t.all;
  std::string& note = t.note;
  fs::path art = dir / "kl.safetensors";
  std::error_code ec;
  if (fs::is_regular_file(art, ec) &&
      common::sha256_file_id(art) == get(r, {"kl_artifact", "sha256"})) {
    auto f = common::SafetensorsFile::open(art);
    const auto* kl = f.find("kl");
    const auto* ci = f.find("context_index");
    const auto* pos = f.find("position");
    if (kl && ci && pos && kl->dtype == common::Dtype::kF64 && kl->numel() == ci->numel() &&
        kl->numel() == pos->numel()) {
      const auto n = static_cast<std::size_t>(kl->numel());
      all.resize(n);
      std::vector<std::int64_t> c(n), p(n);
      std::memcpy(all.data(), kl->data, kl->nbytes);
      std::memcpy(c.data(), ci->data, ci->nbytes);
      std::memcpy(p.data(), pos->data, pos->nbytes);
      for (std::size_t i = 0; i < n; ++i)
        if (c[i] >= 0 && static_cast<std::size_t>(c[i]) < per_context.size())
          per_context[static_cast<std::size_t>(c[i])].push_back({p[i], all[i]});
      note = "from kl.safetensors (" + get(r, {"kl_artifact", "sha256"}) + ")";
    }
  }
  return t;
}

}  // namespace

std::string fidelity_page(const Json& r, const fs::path& dir) {
  const Json& cmp = r.value("comparison", Json::object());
  std::ostringstream b;
  b << "<h1>Fidelity receipt</h1><p class=\"sub\">job <code>" << esc(get(r, {"job_id"}))
    << "</code> · request <code>" << esc(get(r, {"request", "id"})) << "</code> · "
    << esc(get(r, {"comparison_kind"}) == "—" ? std::string("") : get(r, {"comparison_kind"}))
    << " · " << esc(get(r, {"created_at_utc"})) << "</p>";
  const std::string label = get(r, {"candidate", "label"});
  b << "<table class=\"kv\"><tr><td>reference</td><td class=\"mono\">"
    << esc(get(r, {"reference", "model_identity", "id"})) << " "
    << esc(get(r, {"reference", "model_identity", "content_sha256"}))
    << "</td></tr><tr><td>candidate</td><td class=\"mono\">"
    << esc(label == "—" ? "" : label + " · ") << esc(get(r, {"candidate", "model_identity", "id"}))
    << " " << esc(get(r, {"candidate", "model_identity", "content_sha256"}))
    << "</td></tr><tr><td>metric</td><td>mean token-wise KL(reference ‖ candidate) = <b>"
    << esc(get(cmp, {"metrics", "kl", "mean"})) << "</b> nats (lower is better), top-1 agreement "
    << esc(get(cmp, {"metrics", "top1_agreement"})) << "</td></tr><tr><td>scope</td><td>"
    << esc(get(r, {"panel", "scored_positions"})) << " scored positions in "
    << (r.contains("panel") ? r["panel"].value("contexts", Json::array()).size() : 0)
    << " context(s), vocab " << esc(get(r, {"panel", "vocab_size"})) << "</td></tr>";
  if (r.contains("comparator"))
    b << "<tr><td>estimator</td><td class=\"mono\">" << esc(get(r, {"comparator", "estimator"}))
      << " " << esc(get(r, {"comparator", "estimator_sha256"})) << " (fp64, "
      << esc(get(r, {"comparator", "kernel"})) << ")</td></tr>";
  b << "</table>";
  if (r.contains("gates") && r["gates"].is_object())
    b << "<h2>Gates</h2>" << gates_html(r["gates"]);
  const Json& rep = r.value("reproduction", Json());
  if (rep.is_object())
    b << "<p>Reproduction (the reference captured again in a separate run): <b>"
      << (rep.value("confirmed", false) ? "confirmed" : "NOT confirmed") << "</b>, max KL "
      << esc(get(rep, {"kl", "max"})) << ", digests "
      << (rep.value("digests_equal", false) ? "equal" : "differ") << ".</p>";

  const TokenwiseKl tokenwise = read_tokenwise_kl(r, cmp, dir);
  const std::vector<double>& all = tokenwise.all;
  b << "<h2>Token-wise KL along positions</h2>";
  if (all.empty())
    b << "<p class=\"sub\">kl.safetensors (with the result's sha256) is not beside the result: "
         "no per-position chart.</p>";
  else
    b << "<p class=\"sub\">" << esc(tokenwise.note) << "</p>"
      << kl_along_positions(tokenwise.ids, tokenwise.per_context);
  b << "<table><tr><th>context</th><th>positions</th><th>mean KL</th><th>max KL</th><th>p99 "
       "KL</th><th>top-1</th></tr>";
  for (const Json& c : cmp.value("contexts", Json::array()))
    b << "<tr><td>" << esc(get(c, {"id"})) << "</td><td class=\"num\">"
      << esc(get(c, {"positions"})) << "</td><td class=\"num\">" << esc(get(c, {"kl", "mean"}))
      << "</td><td class=\"num\">" << esc(get(c, {"kl", "max"})) << "</td><td class=\"num\">"
      << esc(get(c, {"kl", "p99"})) << "</td><td class=\"num\">" << esc(get(c, {"top1_agreement"}))
      << "</td></tr>";
  b << "</table>";
  b << "<h2>KL histogram</h2>" << histogram_chart(cmp.value("histogram", Json::object()));
  if (!all.empty()) b << "<h2>KL cumulative distribution (log axis)</h2>" << cdf_chart(all);
  b << "<h2>Statistics</h2>" << stats_table(cmp);
  b << "<h2>Record</h2>"
    << kv_table(Json{{"result_sha256", r.value("result_sha256", Json())},
                     {"signing key", get(r, {"supervisor", "key_id"})},
                     {"request sha256", get(r, {"request", "sha256"})},
                     {"panel sha256", get(r, {"request", "panel_sha256"})},
                     {"kl artifact", r.value("kl_artifact", Json())},
                     {"containment", r.value("containment", Json())}});
  return page("assay fidelity " + get(r, {"job_id"}), b.str());
}

}  // namespace assay::client::html
