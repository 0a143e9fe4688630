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

// A log axis scaled to the data: from the decade below the smallest positive value (one more
// below it when some values are exactly 0, drawn on that floor decade and labelled "0") to the
// decade above the largest, so that no point sits on an edge; `marks` (gate bounds) are kept
// inside it.
struct LogRange {
  double lo = -1, hi = 0;  // exponents
  bool zero_floor = false;

  LogRange(const std::vector<double>& values, const std::vector<double>& marks) {
    double pmin = 0, pmax = 0;
    for (const auto* set : {&values, &marks})
      for (double v : *set) {
        if (v > 0 && std::isfinite(v)) {
          pmin = pmin == 0 ? v : std::min(pmin, v);
          pmax = std::max(pmax, v);
        } else if (set == &values && v <= 0) {
          zero_floor = true;
        }
      }
    if (pmax > 0) {
      lo = std::floor(std::log10(pmin)) - (zero_floor ? 1 : 0);
      hi = std::floor(std::log10(pmax)) + 1;
    }
    if (hi - lo < 1) lo = hi - 1;
  }
  // Where v sits, in exponents: 0 and below on the floor.
  // Where v sits, in exponents: 0 and below on the floor, a non-finite value at the top.
  double at(double v) const { return !(v > 0) ? lo : std::isfinite(v) ? std::log10(v) : hi; }
  double fraction(double v) const { return std::clamp((at(v) - lo) / (hi - lo), 0.0, 1.0); }
};

// "1e-5", "1e0", "1e3": a decade's label, short enough to sit under a narrow bin.
std::string decade(int e) {
  return "1e" + std::to_string(e);
}

std::string log_axis(int left, int top, int w, int h, const LogRange& range, bool vertical) {
  std::ostringstream s;
  const double span = range.hi - range.lo;
  // At most about one label per 60 px (vertical: 30 px).
  const int room = vertical ? h / 30 : w / 60;
  const int step = std::max(1, static_cast<int>(std::ceil(span / std::max(1, room))));
  for (int e = static_cast<int>(std::ceil(range.lo)); e <= static_cast<int>(range.hi); e += step) {
    const double f = (e - range.lo) / span;
    const std::string label = range.zero_floor && e == static_cast<int>(range.lo) ? "0" : decade(e);
    if (vertical) {
      const double y = top + h - f * h;
      s << "<line class=\"grid\" x1=\"" << left << "\" y1=\"" << y << "\" x2=\"" << left + w
        << "\" y2=\"" << y << "\"/><text x=\"" << left - 4 << "\" y=\"" << y + 4
        << "\" text-anchor=\"end\">" << label << "</text>";
    } else {
      const double x = left + f * w;
      s << "<line class=\"grid\" x1=\"" << x << "\" y1=\"" << top << "\" x2=\"" << x << "\" y2=\""
        << top + h << "\"/><text x=\"" << x << "\" y=\"" << top + h + 14
        << "\" text-anchor=\"middle\">" << label << "</text>";
    }
  }
  return s.str();
}

// A gate on a KL statistic: its name, rule and bound, drawn on the KL axis.
struct KlGate {
  std::string label;
  double bound = 0;
};

std::vector<KlGate> kl_gates(const Json& r) {
  std::vector<KlGate> out;
  const Json& gates = r.value("gates", Json::object());
  if (!gates.is_object()) return out;
  for (const Json& t : gates.value("thresholds", Json::array())) {
    const Json& bound = t.value("bound", Json());
    if (!t.value("statistic", std::string()).starts_with("kl.") || !bound.is_number()) continue;
    out.push_back({get(t, {"name"}) + " " + get(t, {"comparison"}) + " " + text_of(bound),
                   bound.get<double>()});
  }
  return out;
}

std::string kl_along_positions(const std::vector<std::string>& ids,
                               const std::vector<std::vector<KlPoint>>& per_context,
                               const std::vector<KlGate>& gates) {
  const int width = 900, height = 320, left = 60, top = 16, w = width - left - 20, h = height - 70;
  std::int64_t pmax = 1;
  std::vector<double> values, bounds;
  for (const auto& pts : per_context)
    for (const KlPoint& p : pts) {
      pmax = std::max(pmax, p.position);
      values.push_back(p.kl);
    }
  for (const KlGate& g : gates) bounds.push_back(g.bound);
  const LogRange range(values, bounds);
  std::ostringstream s;
  s << "<svg role=\"img\" viewBox=\"0 0 " << width << " " << height << "\" width=\"" << width
    << "\" height=\"" << height
    << "\" xmlns=\"http://www.w3.org/2000/svg\"><title>Token-wise KL "
       "along positions, per context (log scale)</title>"
    << log_axis(left, top, w, h, range, true);
  auto px = [&](double p) { return left + p / static_cast<double>(pmax) * w; };
  auto py = [&](double v) { return top + h - range.fraction(v) * h; };
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
  for (const KlGate& g : gates)
    s << "<line class=\"threshold\" x1=\"" << left << "\" y1=\"" << fmt(py(g.bound), "%.1f")
      << "\" x2=\"" << left + w << "\" y2=\"" << fmt(py(g.bound), "%.1f")
      << "\" stroke=\"#c0392b\" stroke-dasharray=\"6 4\" stroke-width=\"1.5\"/><text x=\""
      << left + w - 4 << "\" y=\"" << fmt(py(g.bound) - 4, "%.1f")
      << "\" text-anchor=\"end\" style=\"fill:#c0392b\">gate " << esc(g.label) << "</text>";
  s << "<text x=\"" << left + w << "\" y=\"" << top + h + 14 << "\" text-anchor=\"end\">position "
    << pmax << "</text><text x=\"" << left << "\" y=\"" << top + h + 14
    << "\">position 0</text><text x=\"" << left + w / 2 << "\" y=\"" << top + h + 14
    << "\" text-anchor=\"middle\">KL (nats) by position, log axis"
    << (range.zero_floor ? "; an exact 0 on the floor line" : "") << "</text></svg>";
  return s.str();
}

// Bins of the token-wise KL: from the artifact's values, 24 equal on a log axis over the data's
// own range (exact zeros in a bin of their own); without them, the result's decade histogram, cut
// to the bins that hold data and one either side.
std::string histogram_chart(const Json& h, const std::vector<double>& values) {
  std::vector<std::pair<std::string, std::int64_t>> bins;
  std::string unit;
  if (!values.empty()) {
    // 24 bins equal on a log axis from the smallest positive value to the largest.
    double lo = 0, hi = 0;
    bool any = false;
    std::int64_t zero = 0;
    for (double v : values) {
      if (v <= 0) ++zero;
      if (!(v > 0) || !std::isfinite(v)) continue;  // NaN and infinity are in no bin
      lo = any ? std::min(lo, std::log10(v)) : std::log10(v);
      hi = any ? std::max(hi, std::log10(v)) : std::log10(v);
      any = true;
    }
    const int n = hi > lo ? 24 : 1;
    const double width_e = hi > lo ? (hi - lo) / n : 1;
    std::vector<std::int64_t> count(static_cast<std::size_t>(n), 0);
    for (double v : values)
      if (v > 0 && std::isfinite(v))
        ++count[static_cast<std::size_t>(
            std::clamp(static_cast<int>((std::log10(v) - lo) / width_e), 0, n - 1))];
    if (zero > 0) bins.emplace_back("0", zero);
    for (int i = 0; i < n; ++i)
      bins.emplace_back(fmt(std::pow(10.0, lo + i * width_e), "%.2g"),
                        count[static_cast<std::size_t>(i)]);
    unit = "24 bins over the data's range, from kl.safetensors";
  } else {
    const Json& edges = h.value("edges", Json::array());
    const Json& counts = h.value("counts", Json::array());
    bins.emplace_back("0", h.value("zero", std::int64_t{0}));
    if (h.value("negative", std::int64_t{0}) > 0)
      bins.emplace_back("<0", h["negative"].get<std::int64_t>());
    std::vector<std::pair<std::string, std::int64_t>> decades;
    for (std::size_t i = 0; i < counts.size(); ++i) {
      auto e = [&](std::size_t k) {
        return decade(static_cast<int>(std::lround(std::log10(edges[k].get<double>()))));
      };
      decades.emplace_back(i == 0             ? "<" + e(0)
                           : i < edges.size() ? e(i - 1)
                                              : "≥" + e(i - 1),
                           counts[i].get<std::int64_t>());
    }
    std::size_t first = decades.size(), last = 0;
    for (std::size_t i = 0; i < decades.size(); ++i)
      if (decades[i].second > 0) first = std::min(first, i), last = i;
    if (first < decades.size())
      for (std::size_t i = first > 0 ? first - 1 : 0; i <= std::min(last + 1, decades.size() - 1);
           ++i)
        bins.push_back(decades[i]);
    unit = "the result's decade bins (kl.safetensors not beside it)";
  }
  std::int64_t most = 1;
  for (const auto& [l, n] : bins) most = std::max(most, n);
  const int width = 900, height = 240, left = 50, top = 14, h_ = height - 60;
  const double bw = static_cast<double>(width - left - 20) / static_cast<double>(bins.size());
  // Labels at least 44 px apart.
  const std::size_t every = std::max<std::size_t>(1, static_cast<std::size_t>(std::ceil(44 / bw)));
  std::ostringstream s;
  s << "<svg role=\"img\" viewBox=\"0 0 " << width << " " << height << "\" width=\"" << width
    << "\" height=\"" << height
    << "\" xmlns=\"http://www.w3.org/2000/svg\"><title>Histogram of "
       "token-wise KL</title>";
  for (std::size_t i = 0; i < bins.size(); ++i) {
    const double bh = static_cast<double>(bins[i].second) / static_cast<double>(most) * h_;
    const double x = left + bw * static_cast<double>(i);
    const bool zero_bin = bins[i].first == "0";
    s << "<rect x=\"" << x + 1 << "\" y=\"" << top + h_ - bh << "\" width=\""
      << std::max(1.0, bw - 2) << "\" height=\"" << bh << "\" fill=\""
      << (zero_bin ? "#2e9c6a" : "#3366cc") << "\"/>";
    if (bins[i].second > 0 && bw >= 18)
      s << "<text x=\"" << x + bw / 2 << "\" y=\"" << top + h_ - bh - 3
        << "\" text-anchor=\"middle\">" << bins[i].second << "</text>";
    if (!bins[i].first.empty() && (zero_bin || i % every == 0))
      s << "<text x=\"" << x << "\" y=\"" << top + h_ + 14 << "\" text-anchor=\"middle\">"
        << esc(bins[i].first) << "</text>";
  }
  s << "<text x=\"" << left << "\" y=\"" << height - 10
    << "\">KL (nats), bin lower edges on a log axis; green: exactly 0; " << esc(unit)
    << "</text></svg>";
  return s.str();
}

std::string cdf_chart(std::vector<double> kl, const std::vector<KlGate>& gates) {
  std::sort(kl.begin(), kl.end());
  const int width = 900, height = 260, left = 60, top = 14, w = width - left - 20, h = height - 50;
  std::vector<double> bounds;
  for (const KlGate& g : gates) bounds.push_back(g.bound);
  const LogRange range(kl, bounds);
  auto px = [&](double v) { return left + range.fraction(v) * w; };
  std::ostringstream s;
  s << "<svg role=\"img\" viewBox=\"0 0 " << width << " " << height << "\" width=\"" << width
    << "\" height=\"" << height
    << "\" xmlns=\"http://www.w3.org/2000/svg\"><title>Cumulative "
       "distribution of token-wise KL, log axis</title>"
    << log_axis(left, top, w, h, range, false);
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
  s << "<path d=\"" << path << "\" fill=\"none\" stroke=\"#3366cc\" stroke-width=\"2\"/>";
  for (const KlGate& g : gates)
    s << "<line class=\"threshold\" x1=\"" << fmt(px(g.bound), "%.1f") << "\" y1=\"" << top
      << "\" x2=\"" << fmt(px(g.bound), "%.1f") << "\" y2=\"" << top + h
      << "\" stroke=\"#c0392b\" stroke-dasharray=\"6 4\" stroke-width=\"1.5\"/><text x=\""
      << fmt(px(g.bound) + (px(g.bound) > left + 0.7 * w ? -4 : 4), "%.1f") << "\" y=\"" << top + 12
      << "\" text-anchor=\"" << (px(g.bound) > left + 0.7 * w ? "end" : "start")
      << "\" style=\"fill:#c0392b\">gate " << esc(g.label) << "</text>";
  s << "<text x=\"" << left + w / 2 << "\" y=\"" << height - 6
    << "\" text-anchor=\"middle\">KL (nats), log axis"
    << (range.zero_floor ? "; an exact 0 at the floor" : "")
    << " · fraction of positions with KL ≤ x</text></svg>";
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
      << kl_along_positions(tokenwise.ids, tokenwise.per_context, kl_gates(r));
  b << "<table><tr><th>context</th><th>positions</th><th>mean KL</th><th>max KL</th><th>p99 "
       "KL</th><th>top-1</th></tr>";
  for (const Json& c : cmp.value("contexts", Json::array()))
    b << "<tr><td>" << esc(get(c, {"id"})) << "</td><td class=\"num\">"
      << esc(get(c, {"positions"})) << "</td><td class=\"num\">" << esc(get(c, {"kl", "mean"}))
      << "</td><td class=\"num\">" << esc(get(c, {"kl", "max"})) << "</td><td class=\"num\">"
      << esc(get(c, {"kl", "p99"})) << "</td><td class=\"num\">" << esc(get(c, {"top1_agreement"}))
      << "</td></tr>";
  b << "</table>";
  b << "<h2>KL histogram</h2>" << histogram_chart(cmp.value("histogram", Json::object()), all);
  if (!all.empty())
    b << "<h2>KL cumulative distribution (log axis)</h2>" << cdf_chart(all, kl_gates(r));
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
