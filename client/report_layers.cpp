// `assay report`'s page for a layer-attribution result: where the engine first leaves the
// reference and (with patching) which departure decides the token, relative RMSE against depth
// on a log axis with those boundaries marked, the operators of the first departing block across
// (block_drilldown), the per-boundary table, and the engine, reference, model identity and
// containment evidence. Every string of the result goes through esc().
#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <sstream>
#include <vector>

#include "client/report_html.h"
#include "common/identity.h"
#include "common/layers.h"

namespace assay::client::html {
namespace {

using common::Json;
namespace fs = std::filesystem;

// One boundary as the chart sees it.
struct Point {
  std::int64_t index = 0;
  std::string name;
  enum Kind { kPositive, kZero, kUndefined, kOmitted } kind = kOmitted;
  double value = 0;  // relative RMSE, for kPositive
  bool bitwise = false;
  bool over = false;  // above the tolerance
};

std::int64_t at_index(const Json& at) {
  return at.is_object() && at.contains("index") && at["index"].is_number_integer()
             ? at["index"].get<std::int64_t>()
             : -1;
}

std::vector<Point> points_of(const Json& r, double tolerance) {
  std::vector<Point> pts;
  for (const Json& b : r.value("boundaries", Json::array())) {
    Point p{.index = b.value("index", std::int64_t{0}), .name = b.value("name", std::string())};
    const Json rel = b.value("relative_root_mean_square_error", Json());
    p.bitwise = b.value("bitwise_equal", Json()) == Json(true);
    if (!b.value("present", false)) {
      p.kind = Point::kOmitted;
    } else if (!rel.is_number()) {
      p.kind = Point::kUndefined;  // the reference's rows are all zero, the engine's are not
    } else if (rel.get<double>() <= 0) {
      p.kind = Point::kZero;
    } else {
      p.kind = Point::kPositive;
      p.value = rel.get<double>();
      p.over = p.value > tolerance;
    }
    pts.push_back(std::move(p));
  }
  return pts;
}

// The decades the axis spans: lo is one decade below the smallest nonzero value (where exact
// zeros are drawn, so no value shares the floor with them), hi covers the largest value and the
// tolerance.
struct Decades {
  int lo, hi;
};
Decades decades_of(const std::vector<Point>& pts, double tolerance) {
  double smallest = 0, largest = 0;
  for (const Point& p : pts)
    if (p.kind == Point::kPositive) {
      smallest = smallest == 0 ? p.value : std::min(smallest, p.value);
      largest = std::max(largest, p.value);
    }
  if (tolerance > 0) largest = std::max(largest, tolerance);
  int hi = largest > 0 ? static_cast<int>(std::ceil(std::log10(largest))) : 0;
  int lo = smallest > 0 ? static_cast<int>(std::floor(std::log10(smallest))) - 1 : hi - 6;
  lo = std::max(lo, -40);
  if (hi < lo + 2) hi = lo + 2;
  return {lo, hi};
}

// A step of 1, 2 or 5 times a power of ten giving at most ~12 ticks over n boundaries.
std::int64_t tick_step(std::int64_t n) {
  for (std::int64_t scale = 1;; scale *= 10)
    for (std::int64_t m : {1, 2, 5})
      if (n / (m * scale) <= 12) return m * scale;
}

std::string rel_rmse_chart(const Json& r, const std::vector<Point>& pts, double tolerance) {
  const int width = 900, height = 400, left = 70, right = 24, top = 52, h = 250;
  const int w = width - left - right, omitted_y = top + h + 20;
  const Decades d = decades_of(pts, tolerance);
  const std::int64_t n = std::max<std::int64_t>(1, static_cast<std::int64_t>(pts.size()));
  auto px = [&](std::int64_t i) {
    return left +
           (n == 1 ? w / 2.0 : static_cast<double>(i) / static_cast<double>(n - 1) * (w - 16) + 8);
  };
  auto py = [&](double log_v) { return top + h - (log_v - d.lo) / (d.hi - d.lo) * h; };
  auto y_of = [&](const Point& p) {
    return p.kind == Point::kPositive ? py(std::log10(p.value)) : py(d.lo);
  };
  std::ostringstream s;
  s << "<svg role=\"img\" viewBox=\"0 0 " << width << " " << height << "\" width=\"" << width
    << "\" height=\"" << height
    << "\" xmlns=\"http://www.w3.org/2000/svg\"><title>Relative RMSE against depth, log "
       "axis</title>";

  // The patching bracket: the cause lies after last_hold, at or before first_flip.
  const Json& patching = r.value("patching", Json());
  const std::int64_t flip = at_index(patching.is_object() ? patching.value("first_flip", Json())
                                                          : Json()),
                     hold = at_index(patching.is_object() ? patching.value("last_hold", Json())
                                                          : Json());
  if (flip >= 0) {
    const double x0 = hold >= 0 ? px(hold) : left, x1 = px(flip);
    s << "<rect class=\"bracket\" x=\"" << fmt(x0, "%.1f") << "\" y=\"" << top << "\" width=\""
      << fmt(std::max(2.0, x1 - x0), "%.1f") << "\" height=\"" << h
      << "\" fill=\"#8e44ad\" opacity=\"0.10\"/>";
  }

  // The log axis: a grid line per decade above the floor; the floor itself is 0.
  for (int e = d.lo + 1; e <= d.hi; ++e)
    s << "<line class=\"grid\" x1=\"" << left << "\" y1=\"" << fmt(py(e), "%.1f") << "\" x2=\""
      << left + w << "\" y2=\"" << fmt(py(e), "%.1f") << "\"/><text x=\"" << left - 6 << "\" y=\""
      << fmt(py(e) + 4, "%.1f") << "\" text-anchor=\"end\">1e" << e << "</text>";
  s << "<line class=\"floor\" x1=\"" << left << "\" y1=\"" << fmt(py(d.lo), "%.1f") << "\" x2=\""
    << left + w << "\" y2=\"" << fmt(py(d.lo), "%.1f")
    << "\" stroke=\"#2e9c6a\" stroke-dasharray=\"5 4\"/><text x=\"" << left - 6 << "\" y=\""
    << fmt(py(d.lo) + 4, "%.1f") << "\" text-anchor=\"end\">0</text>";
  s << "<line class=\"axis\" x1=\"" << left << "\" y1=\"" << top << "\" x2=\"" << left << "\" y2=\""
    << top + h << "\"/>";
  if (tolerance > 0) {
    const double ty = py(std::log10(tolerance));
    s << "<line class=\"tolerance\" x1=\"" << left << "\" y1=\"" << fmt(ty, "%.1f") << "\" x2=\""
      << left + w << "\" y2=\"" << fmt(ty, "%.1f")
      << "\" stroke=\"#dc7633\" stroke-dasharray=\"8 4\"/><text x=\"" << left + w - 4 << "\" y=\""
      << fmt(ty - 4, "%.1f") << "\" text-anchor=\"end\" style=\"fill:#a04f12\">tolerance "
      << fmt(tolerance, "%.3g") << "</text>";
  }

  // The x axis: boundary indices; omitted boundaries in a strip of their own below it.
  const std::int64_t step = tick_step(n);
  for (std::int64_t i = 0; i < n; i += step)
    s << "<text x=\"" << fmt(px(i), "%.1f") << "\" y=\"" << omitted_y + 22
      << "\" text-anchor=\"middle\">" << i << "</text>";
  s << "<text x=\"" << left - 6 << "\" y=\"" << omitted_y + 4
    << "\" text-anchor=\"end\">omitted</text><line class=\"grid\" x1=\"" << left << "\" y1=\""
    << omitted_y << "\" x2=\"" << left + w << "\" y2=\"" << omitted_y << "\"/>";

  // Markers for the first non-bitwise boundary and the decisive one, labelled at the top.
  auto marker = [&](std::int64_t i, const char* cls, const char* color, int row,
                    const std::string& label) {
    if (i < 0) return;
    const double x = px(i);
    const bool right_half = x > left + w / 2.0;
    s << "<line class=\"" << cls << "\" x1=\"" << fmt(x, "%.1f") << "\" y1=\"" << top - 6 - 16 * row
      << "\" x2=\"" << fmt(x, "%.1f") << "\" y2=\"" << top + h << "\" stroke=\"" << color
      << "\" stroke-width=\"2\"/><text x=\"" << fmt(x + (right_half ? -4 : 4), "%.1f") << "\" y=\""
      << top - 10 - 16 * row << "\" text-anchor=\"" << (right_half ? "end" : "start")
      << "\" style=\"font-weight:600;fill:" << color << "\">" << esc(label) << "</text>";
  };
  auto name_at = [&](std::int64_t i) {
    for (const Point& p : pts)
      if (p.index == i) return p.name;
    return std::string("?");
  };
  const std::int64_t first_nb = at_index(r.value("first_non_bitwise", Json()));
  marker(first_nb, "first-non-bitwise", "#b3261e", 1,
         "first non-bitwise: " + std::to_string(first_nb) + " " + name_at(first_nb));
  marker(flip, "decisive", "#8e44ad", 0,
         "decisive (first flip): " + std::to_string(flip) + " " + name_at(flip));

  // The line joins neighbouring boundaries only: an omitted or undefined one breaks it.
  std::string path;
  bool pen = false;
  for (const Point& p : pts) {
    if (p.kind == Point::kOmitted || p.kind == Point::kUndefined) {
      pen = false;
      continue;
    }
    path += (pen ? " L" : (path.empty() ? "M" : " M")) + fmt(px(p.index), "%.1f") + " " +
            fmt(y_of(p), "%.1f");
    pen = true;
  }
  if (!path.empty())
    s << "<path d=\"" << path << "\" fill=\"none\" stroke=\"#3366cc\" stroke-width=\"1.5\"/>";
  const std::int64_t growth = at_index(r.value("largest_growth", Json()));
  for (const Point& p : pts) {
    const std::string x = fmt(px(p.index), "%.1f");
    const std::string tip = "<title>" + std::to_string(p.index) + " " + esc(p.name) + ": " +
                            (p.kind == Point::kPositive    ? "relative RMSE " + fmt(p.value, "%.4g")
                             : p.kind == Point::kZero      ? "relative RMSE 0"
                             : p.kind == Point::kUndefined ? "relative RMSE undefined"
                                                           : "omitted by the engine") +
                            "</title>";
    const std::string data = " data-index=\"" + std::to_string(p.index) + "\"";
    switch (p.kind) {
      case Point::kOmitted:
        s << "<path class=\"pt omitted\"" << data << " d=\"M" << fmt(px(p.index) - 4, "%.1f") << " "
          << omitted_y - 4 << " l8 8 m0 -8 l-8 8\" stroke=\"#7f8c8d\" stroke-width=\"2\">" << tip
          << "</path>";
        break;
      case Point::kUndefined:
        s << "<path class=\"pt undefined\"" << data << " d=\"M" << x << " " << top
          << " l-5 9 h10 z\""
          << " fill=\"#b3261e\">" << tip << "</path>";
        break;
      case Point::kZero:
      case Point::kPositive: {
        const char* fill = p.bitwise ? "#2e9c6a" : p.over ? "#dc7633" : "#3366cc";
        s << "<circle class=\"pt " << (p.kind == Point::kZero ? "zero" : "value") << "\"" << data
          << " cx=\"" << x << "\" cy=\"" << fmt(y_of(p), "%.1f") << "\" r=\"3.5\" fill=\"" << fill
          << "\">" << tip << "</circle>";
        if (p.index == growth)
          s << "<circle class=\"growth\" cx=\"" << x << "\" cy=\"" << fmt(y_of(p), "%.1f")
            << "\" r=\"8\" fill=\"none\" stroke=\"#dc7633\" stroke-width=\"1.5\"/>";
      }
    }
  }

  // The legend.
  const int ly = height - 12;
  s << "<circle cx=\"" << left + 6 << "\" cy=\"" << ly - 4
    << "\" r=\"3.5\" fill=\"#2e9c6a\"/><text x=\"" << left + 14 << "\" y=\"" << ly
    << "\">bitwise equal</text><circle cx=\"" << left + 116 << "\" cy=\"" << ly - 4
    << "\" r=\"3.5\" fill=\"#3366cc\"/><text x=\"" << left + 124 << "\" y=\"" << ly
    << "\">differs</text><circle cx=\"" << left + 186 << "\" cy=\"" << ly - 4
    << "\" r=\"3.5\" fill=\"#dc7633\"/><text x=\"" << left + 194 << "\" y=\"" << ly
    << "\">over tolerance</text><circle cx=\"" << left + 296 << "\" cy=\"" << ly - 4
    << "\" r=\"7\" fill=\"none\" stroke=\"#dc7633\"/><text x=\"" << left + 308 << "\" y=\"" << ly
    << "\">largest growth</text><path d=\"M" << left + 412 << " " << ly - 8 << " l-5 9 h10 z\""
    << " fill=\"#b3261e\"/><text x=\"" << left + 422 << "\" y=\"" << ly
    << "\">undefined (reference RMS 0)</text><text x=\"" << left + w << "\" y=\"" << ly
    << "\" text-anchor=\"end\">boundary index (0: embedding)</text></svg>";
  return s.str();
}

std::string boundary_table(const Json& r) {
  const Json& patching = r.value("patching", Json());
  const bool patched = patching.is_object();
  std::map<std::int64_t, Json> patched_at;
  if (patched)
    for (const Json& p : patching.value("boundaries", Json::array()))
      patched_at[p.value("index", std::int64_t{-1})] = p;
  const std::int64_t first_nb = at_index(r.value("first_non_bitwise", Json()));
  const std::int64_t first_over = at_index(r.value("first_over_tolerance", Json()));
  const std::int64_t growth = at_index(r.value("largest_growth", Json()));
  const std::int64_t flip = patched ? at_index(patching.value("first_flip", Json())) : -1;
  const std::int64_t hold = patched ? at_index(patching.value("last_hold", Json())) : -1;

  std::ostringstream b;
  b << "<table "
       "class=\"layers\"><tr><th>#</th><th>boundary</th><th>bitwise</th><th>cosine</th><th>max "
       "abs</th><th>mean abs</th><th>RMSE</th><th>ref RMS</th><th>rel RMSE</th><th>growth</th>"
    << (patched ? "<th>patched argmax</th>" : "") << "<th></th></tr>";
  auto num = [](const Json& v, const char* f) {
    return v.is_number() ? fmt(v.get<double>(), f) : std::string("—");
  };
  for (const Json& x : r.value("boundaries", Json::array())) {
    const std::int64_t i = x.value("index", std::int64_t{-1});
    const Json bitwise = x.value("bitwise_equal", Json());
    std::vector<std::string> marks;
    if (i == first_nb) marks.push_back("first non-bitwise");
    if (i == first_over) marks.push_back("first over tolerance");
    if (i == growth) marks.push_back("largest growth");
    if (i == hold) marks.push_back("last hold");
    if (i == flip) marks.push_back("first flip: decisive");
    std::string mark;
    for (const auto& m : marks) mark += (mark.empty() ? "" : ", ") + m;
    b << "<tr" << (marks.empty() ? "" : " class=\"marked\"") << "><td class=\"num\">" << i
      << "</td><td class=\"mono\">" << esc(get(x, {"name"})) << "</td><td>"
      << (!x.value("present", false) ? "<span class=\"undecided\">omitted</span>"
          : bitwise.is_boolean()     ? (bitwise.get<bool>() ? "<span class=\"pass\">yes</span>"
                                                            : "<span class=\"fail\">no</span>")
                                     : "—")
      << "</td><td class=\"num\">" << num(x.value("cosine_similarity", Json()), "%.10g")
      << "</td><td class=\"num\">" << num(x.value("max_abs_error", Json()), "%.4g")
      << "</td><td class=\"num\">" << num(x.value("mean_abs_error", Json()), "%.4g")
      << "</td><td class=\"num\">" << num(x.value("root_mean_square_error", Json()), "%.4g")
      << "</td><td class=\"num\">" << num(x.value("reference_root_mean_square", Json()), "%.4g")
      << "</td><td class=\"num\">"
      << num(x.value("relative_root_mean_square_error", Json()), "%.4g")
      << "</td><td class=\"num\">" << num(x.value("relative_rmse_growth", Json()), "%+.3g")
      << "</td>";
    if (patched) {
      auto p = patched_at.find(i);
      b << "<td class=\"num\">"
        << (p == patched_at.end()
                ? std::string("—")
                : esc(get(p->second, {"argmax_token_id"})) +
                      (p->second.value("becomes_candidate", false) ? " (engine's)" : ""))
        << "</td>";
    }
    b << "<td>" << esc(mark) << "</td></tr>";
  }
  return b.str() + "</table>";
}

// Whether layers.safetensors beside the result is the artifact the result names.
std::string artifact_note(const Json& r, const fs::path& dir) {
  const fs::path p = dir / std::string(common::kLayerArtifactFileName);
  std::error_code ec;
  if (!fs::is_regular_file(p, ec)) return "layers.safetensors is not beside the result";
  const std::string want = get(r, {"layers_artifact", "sha256"});
  const std::string have = common::sha256_file_id(p);
  return have == want
             ? "layers.safetensors beside the result is the result's artifact (" + have + ")"
             : "layers.safetensors beside the result hashes to " + have + ", not the result's " +
                   want;
}

// The drill-down across: the first departing block's operators (docs/operators.md), one bar per
// boundary inside it, its relative RMSE on a log scale; bitwise-equal ones drawn as such, those
// the engine did not give listed as the rows that would narrow it.
std::string block_drilldown(const Json& r) {
  const Json& first = r.value("first_non_bitwise", Json());
  if (!first.is_object() || !first.value("name", Json()).is_string()) return "";
  const std::string name = first["name"].get<std::string>();
  std::string block;
  for (const char* part : {".self_attn", ".mlp", ".linear_attn"}) {
    auto at = name.find(part);
    if (name.starts_with("layers.") && at != std::string::npos)
      block = name.substr(0, at + std::string(part).size());
  }
  const Json narrow = r.value("narrow_with", Json::array());
  if (block.empty() && (!narrow.is_array() || narrow.empty())) return "";
  std::vector<Json> inside;  // copies: r.value() returns one
  for (const Json& b : r.value("boundaries", Json::array())) {
    const std::string n = b.is_object() ? b.value("name", std::string()) : std::string();
    if (!block.empty() && (n == block || n.starts_with(block + "."))) inside.push_back(b);
  }
  std::ostringstream o;
  o << "<h2>Inside " << esc(block.empty() ? name : block)
    << "</h2><p class=\"sub\">Depth runs down the chart above; this runs across the block where "
       "the engine first leaves the reference: each of its operators' relative RMSE (log "
       "scale, 1e-8 to 1), bitwise-equal ones in green.</p>";
  if (!inside.empty()) {
    const int row = 22, label = 300, width = 400;
    o << "<svg class=\"drill\" width=\"" << label + width + 80 << "\" height=\""
      << row * static_cast<int>(inside.size()) + 10 << "\" role=\"img\">";
    for (std::size_t i = 0; i < inside.size(); ++i) {
      const Json& b = inside[i];
      const int y = static_cast<int>(i) * row + 4;
      const Json rel = b.value("relative_root_mean_square_error", Json());
      const bool present = b.value("present", false);
      const bool bitwise = b.value("bitwise_equal", Json()) == Json(true);
      double frac = 0;
      if (rel.is_number() && rel.get<double>() > 0)
        frac = std::clamp((std::log10(rel.get<double>()) + 8) / 8, 0.02, 1.0);
      o << "<text x=\"0\" y=\"" << y + 14 << "\" class=\"mono\">"
        << esc(b.value("name", std::string())) << "</text>";
      if (!present)
        o << "<text x=\"" << label << "\" y=\"" << y + 14 << "\">not given</text>";
      else if (bitwise)
        o << "<rect x=\"" << label << "\" y=\"" << y + 4 << "\" width=\"6\" height=\"12\" "
          << "fill=\"#2a7\"/><text x=\"" << label + 12 << "\" y=\"" << y + 14
          << "\">bitwise</text>";
      else
        o << "<rect x=\"" << label << "\" y=\"" << y + 4 << "\" width=\""
          << static_cast<int>(frac * width) << "\" height=\"12\" fill=\"#c33\"/><text x=\""
          << label + static_cast<int>(frac * width) + 6 << "\" y=\"" << y + 14 << "\">"
          << (rel.is_number() ? fmt(rel.get<double>(), "%.3g") : std::string("undefined"))
          << "</text>";
    }
    o << "</svg>";
  }
  if (narrow.is_array() && !narrow.empty()) {
    o << "<p>The engine gave this without the boundaries inside it. Its rows at these would "
         "narrow the departure, with no rerun but the engine's capture:</p><ul>";
    for (const Json& n : narrow)
      o << "<li><code>" << esc(n.is_string() ? n.get<std::string>() : n.dump()) << "</code></li>";
    o << "</ul>";
  }
  return o.str();
}

std::string at_text(const Json& at) {
  return get(at, {"index"}) + " " + get(at, {"name"});
}

}  // namespace

std::string layers_page(const Json& r, const fs::path& dir) {
  const Json& req = r.value("request", Json::object());
  const Json& eng = r.value("engine", Json::object());
  const Json& patching = r.value("patching", Json());
  const Json tol = req.value("tolerance", Json::object()).value("relative_rmse", Json());
  const double tolerance = tol.is_number() ? tol.get<double>() : 0;
  const std::vector<Point> pts = points_of(r, tolerance);
  const Json& first_nb = r.value("first_non_bitwise", Json());
  const Json& first_over = r.value("first_over_tolerance", Json());
  const Json& growth = r.value("largest_growth", Json());

  std::ostringstream b;
  b << "<h1>Layer attribution</h1><p class=\"sub\">job <code>" << esc(get(r, {"job_id"}))
    << "</code> · request <code>" << esc(get(req, {"id"})) << "</code> · "
    << esc(get(req, {"input_length"})) << " tokens, rows " << esc(get(req, {"rows"})) << " · "
    << esc(get(r, {"created_at_utc"})) << "</p>";
  b << "<div class=\"verdict " << (first_nb.is_object() ? "bad" : "ok") << "\">Engine <b>"
    << esc(get(eng, {"name"})) << "</b> ";
  if (first_nb.is_object())
    b << "first leaves the reference at boundary <code>" << esc(at_text(first_nb))
      << "</code> (its rows are not bitwise equal).";
  else
    b << "matches the reference bit for bit at every boundary it gave.";
  b << "<br>Relative RMSE "
    << (first_over.is_object() ? "first exceeds the tolerance " + esc(text_of(tol)) + " at <code>" +
                                     esc(at_text(first_over)) + "</code>"
                               : "never exceeds the tolerance " + esc(text_of(tol)))
    << "; it grows most at "
    << (growth.is_object() ? "<code>" + esc(at_text(growth)) + "</code>" : std::string("none"))
    << ".";
  if (patching.is_object()) {
    const Json& flip = patching.value("first_flip", Json());
    const Json& hold = patching.value("last_hold", Json());
    const std::string cand = esc(get(patching, {"candidate_token_id"}));
    const std::string ref = esc(get(patching, {"reference_argmax_token_id"}));
    b << "<br>";
    if (flip.is_object())
      b << "Decisive: with the engine's rows substituted at <code>" << esc(at_text(flip))
        << "</code> the reference's argmax becomes the engine's token <code>" << cand
        << "</code> (not <code>" << ref << "</code>)"
        << (hold.is_object() ? "; at <code>" + esc(at_text(hold)) +
                                   "</code> it does not: the cause lies after it, at or before "
                                   "the first flip."
                             : std::string("; the cause lies at or before it."));
    else
      b << "No single substitution makes the reference's argmax the engine's token <code>" << cand
        << "</code>.";
  }
  b << "</div>";

  std::int64_t zeros = 0, omitted = 0, undefined = 0;
  for (const Point& p : pts) {
    zeros += p.kind == Point::kZero;
    omitted += p.kind == Point::kOmitted;
    undefined += p.kind == Point::kUndefined;
  }
  const Decades d = decades_of(pts, tolerance);
  b << "<h2>Relative RMSE against depth</h2><p class=\"sub\">Relative RMSE (RMSE / reference RMS, "
       "Kiln's definition) per boundary on a log axis. A relative RMSE of exactly 0 ("
    << zeros << " here) is drawn on the dashed floor line at 1e" << d.lo
    << ", a decade below the smallest nonzero value. Boundaries the engine omitted (" << omitted
    << " here) are crosses below the axis, undefined values (reference RMS 0; " << undefined
    << " here) triangles at the top: neither is interpolated. Red line: the first non-bitwise "
       "boundary; purple: the decisive one (patching's first flip), with the bracket after the "
       "last hold shaded.</p>"
    << rel_rmse_chart(r, pts, tolerance);
  b << block_drilldown(r);
  b << "<h2>Per boundary</h2>" << boundary_table(r);
  if (patching.is_object()) {
    Json facts = Json::object();
    for (const char* k : {"candidate_token_id", "reference_argmax_token_id", "forwards", "seconds",
                          "first_flip", "last_hold"})
      if (patching.contains(k)) facts[k] = patching[k];
    b << "<h2>Patching</h2>" << kv_table(facts);
  }
  b << "<h2>Engine</h2>" << kv_table(eng);
  Json reference = r.value("reference", Json::object());
  const Json output = reference.value("output", Json::object());
  const Json process = reference.value("process", Json::object());
  reference.erase("output");
  reference.erase("process");
  b << "<h2>Reference</h2>" << kv_table(reference)
    << "<details><summary>the oracle's output</summary>" << kv_table(output) << "</details>"
    << "<details><summary>the reference run's process</summary>" << kv_table(process)
    << "</details>";
  b << "<h2>Model identity</h2>" << kv_table(r.value("model_identity", Json::object()));
  b << "<h2>Containment evidence</h2>" << kv_table(r.value("containment", Json::object()));
  b << "<h2>Record</h2><p class=\"sub\">" << esc(artifact_note(r, dir)) << "</p>"
    << kv_table(Json{{"result_sha256", r.value("result_sha256", Json())},
                     {"signing key", get(r, {"supervisor", "key_id"})},
                     {"request sha256", get(req, {"sha256"})},
                     {"input token ids sha256", get(req, {"input_token_ids_sha256"})},
                     {"layers artifact", r.value("layers_artifact", Json())}});
  return page("assay layer attribution " + get(r, {"job_id"}), b.str());
}

}  // namespace assay::client::html
