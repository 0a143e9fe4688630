// `assay report`'s pages for a trajectory result (where each engine's greedy continuation first
// left the reference argmax, and where the engines first differ) and for a next-token batch (the
// verdicts of its states, its oracle runs). Both check the artifact beside the result against
// the digest the result names before saying anything about it.
#include <algorithm>
#include <map>
#include <sstream>
#include <vector>

#include "client/format.h"
#include "client/report_html.h"
#include "common/identity.h"

namespace assay::client::html {
namespace {

using common::Json;
namespace fs = std::filesystem;

// Whether `name` beside the result is the artifact the result names under `key`.
std::string artifact_note(const Json& r, const char* key, const fs::path& dir) {
  const std::string name = get(r, {key, "name"}) == "—" ? "" : get(r, {key, "name"});
  const fs::path p = dir / (name.empty() ? std::string("artifact") : name);
  std::error_code ec;
  if (name.empty() || !fs::is_regular_file(p, ec))
    return "the artifact " + (name.empty() ? std::string("(unnamed)") : name) +
           " is not beside the result: only the result's own figures are shown";
  const std::string have = common::sha256_file_id(p), want = get(r, {key, "sha256"});
  return have == want ? name + " beside the result is the result's artifact (" + have + ")"
                      : name + " beside the result hashes to " + have + ", not the result's " +
                            want + ": not the artifact of this result";
}

// A process's evidence in a few humanised words: exit, time, CPU, memory peak.
std::string process_line(const Json& p) {
  if (!p.is_object()) return "—";
  std::ostringstream s;
  const Json& exit = p.value("exit", Json::object());
  s << (exit.value("code", Json()).is_number() ? "exit " + text_of(exit["code"])
                                               : "signal " + get(exit, {"signal_name"}));
  const Json& n = p.value("normalised", Json::object());
  if (n.value("elapsed_seconds", Json()).is_number())
    s << ", " << format_duration(n["elapsed_seconds"].get<double>());
  const Json& cpu = p.value("cpu", Json::object());
  if (cpu.value("user_usec", Json()).is_number() && cpu.value("system_usec", Json()).is_number())
    s << ", CPU "
      << format_duration((cpu["user_usec"].get<double>() + cpu["system_usec"].get<double>()) / 1e6);
  const Json& peak = n.value("memory_peak_bytes", Json());
  s << ", memory peak "
    << (peak.is_number() ? format_bytes(peak.get<double>()) : std::string("— (no cgroup)"));
  s << ", containment " << get(p, {"mode"});
  return s.str();
}

// One track per engine: a cell per continuation token, green while it is the reference argmax,
// red at its first departure, grey after it.
std::string trajectory_chart(const Json& engines) {
  // A record names its own lengths: at most kMaxCells are drawn, whatever it says.
  constexpr std::size_t kMaxCells = 4096;
  auto length = [&](const Json& e) {
    const Json& n = e.value("continuation_length", Json());
    return n.is_number_unsigned() ? std::min<std::size_t>(n.get<std::size_t>(), kMaxCells) : 0;
  };
  std::size_t longest = 1;
  for (const Json& e : engines) longest = std::max(longest, length(e));
  const int left = 110, top = 28, row_h = 34, width = 900;
  const double cell = std::min(40.0, (width - left - 20.0) / static_cast<double>(longest));
  const int height = top + static_cast<int>(engines.size()) * row_h + 30;
  std::ostringstream s;
  s << "<svg role=\"img\" viewBox=\"0 0 " << width << " " << height << "\" width=\"" << width
    << "\" height=\"" << height << "\" xmlns=\"http://www.w3.org/2000/svg\">"
    << "<title>Each engine's continuation against the reference argmax</title>";
  const std::size_t step = longest > 40 ? (longest + 19) / 20 : 1;
  for (std::size_t i = 0; i < longest; i += step)
    s << "<text x=\"" << left + (static_cast<double>(i) + 0.5) * cell << "\" y=\"" << top - 8
      << "\" text-anchor=\"middle\">" << i << "</text>";
  int y = top;
  for (const Json& e : engines) {
    const std::size_t n = length(e);
    const Json& dep = e.value("departure", Json());
    const std::int64_t first = dep.is_object() && dep.value("index", Json()).is_number_integer()
                                   ? dep["index"].get<std::int64_t>()
                                   : -1;
    s << "<text x=\"" << left - 8 << "\" y=\"" << y + row_h / 2 + 4 << "\" text-anchor=\"end\">"
      << esc(get(e, {"engine"})) << "</text>";
    for (std::size_t i = 0; i < n; ++i) {
      const auto k = static_cast<std::int64_t>(i);
      const char* fill = first < 0 || k < first ? "#2e9e5b" : k == first ? "#c0392b" : "#c9ced6";
      s << "<rect x=\"" << left + static_cast<double>(i) * cell + 1 << "\" y=\"" << y + 4
        << "\" width=\"" << std::max(1.0, cell - 2) << "\" height=\"" << row_h - 10 << "\" fill=\""
        << fill << "\"><title>" << esc(get(e, {"engine"})) << " index " << i
        << (first < 0 || k < first ? ": the reference argmax"
            : k == first           ? ": first departure"
                                   : ": after the departure")
        << "</title></rect>";
    }
    y += row_h;
  }
  s << "<text x=\"" << left << "\" y=\"" << height - 8
    << "\">green: the reference argmax · red: the first departure · grey: after it · index in "
       "the continuation</text></svg>";
  return s.str();
}

std::string top10_cells(const Json& dep) {
  std::string s;
  for (const Json& t : dep.value("top10", Json::array()))
    s += (s.empty() ? "" : ", ") + text_of(t.value("token_id", Json())) + " (" +
         text_of(t.value("logit", Json())) + ")";
  return s.empty() ? "—" : s;
}

std::string engines_of(const Json& names) {
  std::string s;
  for (const Json& n : names) s += (s.empty() ? "" : ", ") + text_of(n);
  return s;
}

}  // namespace

std::string trajectory_page(const Json& r, const fs::path& dir) {
  const Json engines = r.value("engines", Json::array());
  const Json& first = r.value("departed_first", Json());
  const Json& d = r.value("divergence", Json());
  std::ostringstream b;
  b << "<h1>Trajectory: where each engine left the reference</h1><p class=\"sub\">job <code>"
    << esc(get(r, {"job_id"})) << "</code> · request <code>" << esc(get(r, {"request", "id"}))
    << "</code> · prompt " << esc(get(r, {"request", "prompt_length"})) << " tokens · model "
    << esc(get(r, {"model_identity", "id"})) << " · " << esc(get(r, {"created_at_utc"})) << "</p>";
  b << "<div class=\"verdict " << (first.is_object() ? "bad" : "ok") << "\">";
  if (first.is_object())
    b << "<b>" << esc(engines_of(first.value("engines", Json::array())))
      << "</b> departed first from the reference's greedy path, at index <b>"
      << esc(get(first, {"index"})) << "</b> of the continuation.";
  else
    b << "Every engine follows the reference argmax throughout.";
  if (d.is_object()) {
    std::string tokens;
    const Json tokens_by_engine = d.value("tokens", Json::object());
    for (const auto& [engine, token] : tokens_by_engine.items())
      tokens += (tokens.empty() ? "" : ", ") + engine + " " + text_of(token);
    b << "<br>The engines first differ at index <b>" << esc(get(d, {"index"})) << "</b> (position "
      << esc(get(d, {"position"})) << "): " << esc(tokens)
      << "; the reference argmax there is <code>" << esc(get(d, {"argmax_token_id"}))
      << "</code>, margin " << esc(get(d, {"margin"})) << " → <b>"
      << esc(get(d, {"argmax_candidate"})) << "</b>"
      << (d.value("candidate_attribution_complete", false) ? "" : " (attribution incomplete)")
      << ".";
  } else {
    b << "<br>The engines' continuations are identical.";
  }
  b << "</div>";
  b << "<h2>Continuations against the reference argmax</h2>" << trajectory_chart(engines);
  b << "<h2>First departures</h2><table><tr><th>engine</th><th>tokens</th><th>matching "
       "argmax</th><th>first departure</th><th>engine token (rank, logit)</th><th>reference "
       "argmax (logit)</th><th>margin</th></tr>";
  for (const Json& e : engines) {
    const Json& dep = e.value("departure", Json());
    b << "<tr><td>" << esc(get(e, {"engine"})) << "</td><td class=\"num\">"
      << esc(get(e, {"continuation_length"})) << "</td><td class=\"num\">"
      << esc(get(e, {"tokens_matching_argmax"})) << "</td>";
    if (dep.is_object())
      b << "<td class=\"num\">index " << esc(get(dep, {"index"})) << " (position "
        << esc(get(dep, {"position"})) << ")</td><td class=\"num\">"
        << esc(get(dep, {"engine_token_id"})) << " (rank " << esc(get(dep, {"engine_token_rank"}))
        << ", " << esc(get(dep, {"engine_token_logit"})) << ")</td><td class=\"num\">"
        << esc(get(dep, {"argmax_token_id"})) << " (" << esc(get(dep, {"argmax_logit"}))
        << (dep.value("argmax_tied", false) ? ", tied" : "") << ")</td><td class=\"num\">"
        << esc(get(dep, {"margin"})) << "</td>";
    else
      b << "<td colspan=\"4\">none: it follows the reference argmax throughout</td>";
    b << "</tr>";
  }
  b << "</table>";
  b << "<details><summary>the reference's top 10 at each departure</summary><table>";
  for (const Json& e : engines)
    if (e.value("departure", Json()).is_object())
      b << "<tr><td>" << esc(get(e, {"engine"})) << "</td><td class=\"mono\">"
        << esc(top10_cells(e["departure"])) << "</td></tr>";
  if (d.is_object())
    b << "<tr><td>where they differ</td><td class=\"mono\">" << esc(top10_cells(d)) << "</td></tr>";
  b << "</table></details>";
  if (r.contains("numerics")) b << numerics_section(r["numerics"]);
  b << "<h2>Model identity</h2>" << kv_table(r.value("model_identity", Json::object()));
  b << "<h2>Workers</h2><table><tr><th>step</th><th>evidence</th></tr>";
  for (const Json& e : engines)
    b << "<tr><td>capture " << esc(get(e, {"engine"})) << "</td><td>"
      << esc(process_line(e.value("capture", Json::object()).value("process", Json())))
      << "</td></tr>";
  b << "<tr><td>compare</td><td>"
    << esc(process_line(r.value("comparison", Json::object()).value("process", Json())))
    << "</td></tr></table>";
  b << "<h2>Record</h2><p class=\"sub\">" << esc(artifact_note(r, "trajectory_artifact", dir))
    << "</p>"
    << kv_table(Json{{"result_sha256", r.value("result_sha256", Json())},
                     {"signing key", get(r, {"supervisor", "key_id"})},
                     {"artifact", r.value("trajectory_artifact", Json())}});
  return page("assay trajectory " + get(r, {"job_id"}), b.str());
}

std::string batch_page(const Json& r, const fs::path& dir) {
  const Json& counts = r.value("counts", Json::object());
  const Json by = counts.value("argmax_candidate", Json::object());
  const Json states = r.value("states", Json::array());
  std::ostringstream b;
  b << "<h1>Next-token batch</h1><p class=\"sub\">job <code>" << esc(get(r, {"job_id"}))
    << "</code> · request <code>" << esc(get(r, {"request", "id"})) << "</code> · model "
    << esc(get(r, {"model_identity", "id"})) << " · " << esc(get(r, {"created_at_utc"})) << "</p>";
  std::string verdicts;
  for (const auto& [engine, n] : by.items())
    verdicts += (verdicts.empty() ? "" : ", ") + engine + " " + text_of(n);
  const bool all_ok = counts.value("failed", 0) == 0;
  b << "<div class=\"verdict " << (all_ok ? "neutral" : "bad") << "\"><b>"
    << esc(get(counts, {"states"})) << " states</b>: " << esc(get(counts, {"succeeded"}))
    << " succeeded, " << esc(get(counts, {"failed"}))
    << " failed.<br>Which engine produced the reference argmax: "
    << esc(verdicts.empty() ? "—" : verdicts) << ".</div>";

  // Bars: states per verdict.
  double most = 1;
  for (const auto& [engine, n] : by.items())
    if (n.is_number()) most = std::max(most, n.get<double>());
  const int left = 110, row_h = 26, width = 900, plot = width - left - 80;
  const int height = static_cast<int>(by.size()) * row_h + 20;
  b << "<h2>Verdicts</h2><svg role=\"img\" viewBox=\"0 0 " << width << " " << height
    << "\" width=\"" << width << "\" height=\"" << height
    << "\" xmlns=\"http://www.w3.org/2000/svg\"><title>States per verdict</title>";
  int y = 10;
  for (const auto& [engine, n] : by.items()) {
    const double w = n.is_number() ? n.get<double>() / most * plot : 0;
    b << "<text x=\"" << left - 8 << "\" y=\"" << y + 16 << "\" text-anchor=\"end\">" << esc(engine)
      << "</text><rect x=\"" << left << "\" y=\"" << y + 3 << "\" width=\"" << std::max(1.0, w)
      << "\" height=\"" << row_h - 8 << "\" fill=\""
      << (engine == "neither" ? "#c0392b" : "#3b6fd1") << "\"/><text x=\"" << left + w + 6
      << "\" y=\"" << y + 16 << "\">" << esc(text_of(n)) << "</text>";
    y += row_h;
  }
  b << "</svg>";

  b << "<h2>States</h2><table><tr><th>#</th><th>request</th><th>state</th><th>verdict</th>"
       "<th>argmax token</th><th>job (its own signed result)</th></tr>";
  for (const Json& s : states)
    b << "<tr><td class=\"num\">" << esc(get(s, {"index"})) << "</td><td>"
      << esc(get(s, {"request_id"})) << "</td><td>" << esc(get(s, {"state"})) << "</td><td>"
      << esc(get(s, {"argmax_candidate"})) << "</td><td class=\"num\">"
      << esc(get(s, {"argmax_token_id"})) << "</td><td class=\"mono\">" << esc(get(s, {"job_id"}))
      << (s.contains("error") ? " " + esc(get(s, {"error", "code"})) : "") << "</td></tr>";
  b << "</table>";
  b << "<h2>Oracle runs</h2><table><tr><th>attempt</th><th>ended</th><th>evidence</th></tr>";
  for (const Json& run : r.value("oracle_runs", Json::array()))
    b << "<tr><td class=\"num\">" << esc(get(run, {"attempt"})) << "</td><td>"
      << esc(get(run, {"exit"})) << "</td><td>" << esc(process_line(run.value("process", Json())))
      << "</td></tr>";
  b << "</table>";
  b << "<h2>Model identity</h2>" << kv_table(r.value("model_identity", Json::object()));
  b << "<h2>Record</h2><p class=\"sub\">" << esc(artifact_note(r, "states_artifact", dir)) << "</p>"
    << kv_table(Json{{"result_sha256", r.value("result_sha256", Json())},
                     {"signing key", get(r, {"supervisor", "key_id"})},
                     {"artifact", r.value("states_artifact", Json())}});
  return page("assay batch " + get(r, {"job_id"}), b.str());
}

}  // namespace assay::client::html
