// The terminal reports of finished jobs' results (format.h): trajectory, layer attribution,
// next-token and fidelity, for `assay show` and the kinds' own `show` commands.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>
#include <vector>

#include "client/format.h"
#include "client/format_detail.h"
#include "common/error.h"
#include "common/fidelity.h"
#include "common/json.h"

namespace assay::client {

using common::Json;
using namespace format_detail;

namespace {

std::string number(const Json& v, const char* fmt = "%.6g") {
  if (!v.is_number()) return scalar(v);
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, v.get<double>());
  return buf;
}

std::string model_line(const Json& side) {
  if (!side.is_object()) return "-";
  std::string s;
  if (const Json* label = find(side, {"label"})) s += scalar(*label) + ": ";
  if (side.value("kind", "") == "logits") {
    std::size_t n = side.contains("logits_files") ? side["logits_files"].size() : 0;
    return s + "logits supplied in " + std::to_string(n) + " file(s)";
  }
  const Json* mi = find(side, {"model_identity"});
  if (mi) s += field(*mi, {"id"}) + "  " + field(*mi, {"content_sha256"});
  if (const Json* dir = find(side, {"model_dir"})) s += "  (" + scalar(*dir) + ")";
  return s;
}

// Text bars for the histogram of assay-compare: "zero" and "negative" (rounding) counts, and
// counts[i] for KL in [edges[i-1], edges[i]) (bin 0 above 0, the last from the last edge up).
// Bins outside the first and last non-empty one are left out; the longest bar is 40 characters
// and any non-empty bin shows at least one.
std::string histogram_text(const Json& h) {
  if (!h.is_object() || !h.contains("counts") || !h["counts"].is_array() || !h.contains("edges") ||
      !h["edges"].is_array() || h["counts"].size() != h["edges"].size() + 1)
    return "";
  const Json& counts = h["counts"];
  const Json& edges = h["edges"];
  auto count = [](const Json& v) { return v.is_number_integer() ? v.get<std::uint64_t>() : 0; };
  std::vector<std::pair<std::string, std::uint64_t>> bins;
  if (count(h.value("negative", Json())) > 0)
    bins.emplace_back("< 0 (rounding)", count(h["negative"]));
  bins.emplace_back("= 0", count(h.value("zero", Json())));
  std::size_t first = counts.size(), last = 0;
  for (std::size_t i = 0; i < counts.size(); ++i)
    if (count(counts[i]) > 0) {
      first = std::min(first, i);
      last = i;
    }
  for (std::size_t i = first; i <= last && i < counts.size(); ++i) {
    std::string label = i == 0              ? "(0, " + number(edges[0], "%.0e") + ")"
                        : i == edges.size() ? ">= " + number(edges[i - 1], "%.0e")
                                            : "[" + number(edges[i - 1], "%.0e") + ", " +
                                                  number(edges[i], "%.0e") + ")";
    bins.emplace_back(label, count(counts[i]));
  }
  std::uint64_t most = 1;
  for (const auto& [label, n] : bins) most = std::max(most, n);
  std::vector<std::vector<std::string>> rows;
  for (const auto& [label, n] : bins) {
    std::size_t len = n == 0 ? 0 : std::max<std::size_t>(1, n * 40 / most);
    rows.push_back({"  " + label, std::string(len, '#'), std::to_string(n)});
  }
  return render_table(rows);
}

}  // namespace

namespace {

std::string top10_text(const Json& ref) {
  std::string s;
  for (const Json& t : ref.value("top10", Json::array()))
    s += (s.empty() ? "" : ", ") + t.value("token_id", Json()).dump() + ":" +
         number(t.value("logit", Json()));
  return s;
}

}  // namespace

std::string trajectory_report(const Json& r) {
  std::ostringstream o;
  const Json req = r.value("request", Json::object());
  o << "trajectory job " << field(r, {"job_id"}) << "  request \"" << field(req, {"id"})
    << "\"  prompt " << field(req, {"prompt_length"}) << " tokens\n";
  for (const Json& e : r.value("engines", Json::array())) {
    o << "  " << field(e, {"engine"}) << ": " << field(e, {"continuation_length"}) << " tokens, ";
    const Json& dep = e.value("departure", Json());
    if (!dep.is_object()) {
      o << "follows the reference argmax throughout\n";
      continue;
    }
    o << "first departure at index " << field(dep, {"index"}) << " (position "
      << field(dep, {"position"}) << "): token " << field(dep, {"engine_token_id"}) << " rank "
      << field(dep, {"engine_token_rank"}) << ", reference argmax "
      << field(dep, {"argmax_token_id"}) << " margin " << number(dep.value("margin", Json()))
      << "\n      reference top-10: " << top10_text(dep) << "\n";
  }
  const Json first = r.value("departed_first", Json());
  if (first.is_object()) {
    std::string names;
    for (const Json& n : first.value("engines", Json::array()))
      names += (names.empty() ? "" : ", ") + n.get<std::string>();
    o << "departed first: " << names << " (index " << field(first, {"index"}) << ")\n";
  } else {
    o << "departed first: none (every engine follows the reference argmax)\n";
  }
  const Json d = r.value("divergence", Json());
  if (d.is_object()) {
    o << "engines diverge at index " << field(d, {"index"}) << " (position "
      << field(d, {"position"}) << "): " << d.value("tokens", Json::object()).dump()
      << "; reference argmax " << field(d, {"argmax_token_id"}) << " margin "
      << number(d.value("margin", Json())) << " -> " << field(d, {"argmax_candidate"})
      << (d.value("candidate_attribution_complete", false) ? "" : " (attribution incomplete)")
      << "\n";
  } else {
    o << "engines: identical continuations\n";
  }
  return o.str();
}

namespace {

// The index of a result's {index, name} member, or -1 when it is null.
std::int64_t at_index(const Json& at) {
  return at.is_object() && at.contains("index") && at["index"].is_number_integer()
             ? at["index"].get<std::int64_t>()
             : -1;
}

std::string joined(const Json& names) {
  std::string s;
  for (const Json& n : names) s += (s.empty() ? "" : ", ") + scalar(n);
  return s;
}

}  // namespace

std::string layer_report(const Json& r) {
  std::ostringstream o;
  const Json req = r.value("request", Json::object());
  const Json eng = r.value("engine", Json::object());
  const Json ref = r.value("reference", Json::object());
  const Json boundaries = r.value("boundaries", Json::array());
  const Json patching = r.value("patching", Json());
  const bool patched = patching.is_object();
  const Json tolerance = req.value("tolerance", Json::object()).value("relative_rmse", Json());
  const Json rows_file = eng.value("rows_file", Json::object());
  o << "layer-attribution job " << field(r, {"job_id"}) << "  request \"" << field(req, {"id"})
    << "\"  " << field(req, {"input_length"}) << " tokens, rows " << field(req, {"rows"})
    << ", tolerance " << number(tolerance) << " (relative RMSE)\n";
  o << "engine:     " << field(eng, {"name"});
  if (const Json* next = find(eng, {"next_token_id"})) o << ", next token " << scalar(*next);
  o << "; rows file " << field(rows_file, {"sha256"}) << " (" << field(rows_file, {"bytes"})
    << " bytes), " << field(eng, {"boundaries_given"}) << " of " << field(ref, {"boundary_count"})
    << " boundaries given";
  const Json omitted = eng.value("omitted", Json::array());
  if (!omitted.empty()) o << "; omitted: " << joined(omitted);
  o << "\nreference:  argmax " << field(ref, {"argmax_token_id"}) << " (logit "
    << number(ref.value("argmax_logit", Json())) << "), hidden " << field(ref, {"hidden_size"})
    << ", rows " << field(ref, {"rows_sha256"}) << "\n\n";

  const std::int64_t first_nb = at_index(r.value("first_non_bitwise", Json()));
  const std::int64_t first_over = at_index(r.value("first_over_tolerance", Json()));
  const std::int64_t growth = at_index(r.value("largest_growth", Json()));
  const std::int64_t flip = patched ? at_index(patching.value("first_flip", Json())) : -1;
  const std::int64_t hold = patched ? at_index(patching.value("last_hold", Json())) : -1;
  std::map<std::int64_t, Json> patched_at;  // by boundary index
  if (patched)
    for (const Json& p : patching.value("boundaries", Json::array()))
      patched_at[p.value("index", std::int64_t{-1})] = p;
  std::map<std::int64_t, Json> by_index;
  std::vector<std::vector<std::string>> rows{{"  #", "boundary", "bitwise", "cosine", "max abs",
                                              "mean abs", "RMSE", "ref RMS", "rel RMSE", "growth"}};
  if (patched) rows[0].push_back("patched argmax");
  for (const Json& b : boundaries) {
    const std::int64_t i = b.value("index", std::int64_t{-1});
    by_index[i] = b;
    const Json bitwise = b.value("bitwise_equal", Json());
    std::vector<std::string> row{"  " + field(b, {"index"}),
                                 field(b, {"name"}),
                                 !b.value("present", false) ? "omitted"
                                 : bitwise.is_boolean()     ? (bitwise.get<bool>() ? "yes" : "no")
                                                            : "-",
                                 number(b.value("cosine_similarity", Json()), "%.10g"),
                                 number(b.value("max_abs_error", Json()), "%.4g"),
                                 number(b.value("mean_abs_error", Json()), "%.4g"),
                                 number(b.value("root_mean_square_error", Json()), "%.4g"),
                                 number(b.value("reference_root_mean_square", Json()), "%.4g"),
                                 number(b.value("relative_root_mean_square_error", Json()), "%.4g"),
                                 number(b.value("relative_rmse_growth", Json()), "%+.3g")};
    if (patched) {
      auto p = patched_at.find(i);
      row.push_back(p == patched_at.end()
                        ? "-"
                        : field(p->second, {"argmax_token_id"}) +
                              (p->second.value("becomes_candidate", false) ? " (engine's)" : ""));
    }
    std::vector<std::string> marks;
    if (i == first_nb) marks.push_back("first non-bitwise");
    if (i == first_over) marks.push_back("first over tolerance");
    if (i == growth) marks.push_back("largest growth");
    if (i == hold) marks.push_back("last hold");
    if (i == flip) marks.push_back("first flip");
    std::string mark;
    for (const auto& m : marks) mark += (mark.empty() ? "<- " : ", ") + m;
    row.push_back(mark);
    rows.push_back(std::move(row));
  }
  o << render_table(rows) << "\n";

  auto named = [&](std::int64_t i) {
    return std::to_string(i) + " " + (by_index.count(i) ? field(by_index[i], {"name"}) : "?");
  };
  auto metric = [&](std::int64_t i, const char* key, const char* f) {
    return by_index.count(i) ? number(by_index[i].value(key, Json()), f) : "-";
  };
  o << "first non-bitwise:    "
    << (first_nb < 0 ? "none: every boundary the engine gave is bitwise equal" : named(first_nb))
    << "\n";
  // The rows that would narrow it: the boundaries inside it the engine did not give.
  const Json narrow = r.value("narrow_with", Json::array());
  if (narrow.is_array() && !narrow.empty())
    o << "  narrow it with rows at: " << joined(narrow) << "\n";
  o << "first over tolerance: "
    << (first_over < 0 ? "none: no relative RMSE above " + number(tolerance)
                       : named(first_over) + " (relative RMSE " +
                             metric(first_over, "relative_root_mean_square_error", "%.4g") + " > " +
                             number(tolerance) + ")")
    << "\n";
  o << "largest growth:       "
    << (growth < 0 ? "none: relative RMSE never grows"
                   : named(growth) + " (" + metric(growth, "relative_rmse_growth", "%+.3g") + ")")
    << "\n";
  if (!patched) {
    o << "patching: not requested\n";
  } else {
    const std::string candidate = field(patching, {"candidate_token_id"});
    const std::string argmax = field(patching, {"reference_argmax_token_id"});
    std::int64_t rounded = 0;
    for (const auto& [i, p] : patched_at) rounded += p.value("rounded_elements", std::int64_t{0});
    o << "patching: engine's token " << candidate << ", reference argmax " << argmax << "; "
      << field(patching, {"forwards"}) << " forwards"
      << (patching.value("search", Json()) == "bisect" ? " (bisection)" : "") << " in "
      << format_seconds(patching.value("seconds", 0.0));
    if (rounded > 0) o << "; " << rounded << " engine elements rounded to the model's dtype";
    o << "\n  last hold:  "
      << (hold < 0 ? "none before the first flip" : named(hold) + " (argmax stays " + argmax + ")")
      << "\n  first flip: "
      << (flip < 0 ? "none: no single substitution makes the argmax the engine's token"
                   : named(flip) + " (argmax becomes " + candidate + ")")
      << "\n";
    if (flip >= 0)
      o << "  the decisive departure is "
        << (hold < 0 ? "at or before " + named(flip)
                     : "after " + named(hold) + ", at or before " + named(flip))
        << "\n";
  }
  o << "\nresult_sha256 " << field(r, {"result_sha256"}) << "\n";
  return o.str();
}

std::string next_token_report(const Json& r) {
  using common::member;
  const Json& oracle = member(r, "oracle");
  const Json& verdict = member(r, "verdict");
  // A token's text as a JSON string: quoted, control bytes visible (\u0019), never raw.
  auto text = [](const Json& t) { return t.is_string() ? t.dump() : std::string("-"); };
  auto exact = [](const Json& v) { return v.is_number() ? v.dump() : scalar(v); };
  auto list = [](const Json& v) { return v.is_array() ? v : Json::array(); };
  std::ostringstream o;
  o << "next-token job " << field(r, {"job_id"}) << "  request \""
    << field(member(r, "request"), {"id"}) << "\"\n";
  const std::string winner = field(verdict, {"argmax_candidate"});
  o << "verdict:    "
    << (winner.empty() || winner == "neither" ? std::string("neither engine") : winner)
    << " produced the reference argmax (token " << scalar(member(oracle, "argmax")) << " "
    << text(member(oracle, "argmax_text")) << ")";
  if (oracle.value("top_logit_tie", false)) o << "; the reference's top logits tie";
  o << "\nmargin:     " << exact(member(oracle, "top_logit_margin"))
    << " between the reference's top two logits\n";
  const Json& identity = member(r, "model_identity");
  o << "model:      " << field(identity, {"id"}) << "  " << field(identity, {"content_sha256"})
    << "\n\n";

  const Json top = list(member(oracle, "top_tokens"));
  const Json& best = top.empty() ? Json() : member(top[0], "logit");
  std::vector<std::vector<std::string>> rows{
      {"ENGINE", "TOKEN", "TEXT", "LOGIT", "RANK", "GAP TO ARGMAX"}};
  for (const Json& c : list(member(oracle, "candidate_tokens"))) {
    const Json& logit = member(c, "logit");
    const std::string gap = best.is_number() && logit.is_number()
                                ? Json(logit.get<double>() - best.get<double>()).dump()
                                : std::string("-");
    rows.push_back({field(c, {"engine"}) + (c.value("is_argmax", false) ? " *" : ""),
                    field(c, {"token_id"}), text(member(c, "text")), exact(logit),
                    field(c, {"rank"}), gap});
  }
  o << render_table(rows) << "(* the reference argmax)\n\nreference top tokens\n";
  std::vector<std::vector<std::string>> ranked{{"RANK", "TOKEN", "TEXT", "LOGIT"}};
  for (std::size_t i = 0; i < top.size(); ++i)
    ranked.push_back({std::to_string(i + 1), field(top[i], {"token_id"}),
                      text(member(top[i], "text")), exact(member(top[i], "logit"))});
  o << render_table(ranked);

  const Json& norm = member(member(oracle, "process"), "normalised");
  auto seconds = [](const Json& v) {
    return v.is_number() ? format_duration(v.get<double>()) : std::string("-");
  };
  auto bytes = [](const Json& v) {
    return v.is_number() ? format_bytes(v.get<double>()) : std::string("-");
  };
  o << "\noracle:     " << field(oracle, {"architecture"}) << ", " << field(oracle, {"dtype"})
    << " on " << field(oracle, {"device"});
  if (const std::string name = field(oracle, {"device_name"}); !name.empty())
    o << " (" << name << ")";
  o << ", " << field(oracle, {"threads"}) << " thread(s), torch "
    << field(oracle, {"torch_version"}) << "\n            load "
    << seconds(member(oracle, "load_seconds")) << ", forward "
    << seconds(member(oracle, "forward_seconds")) << ", worker "
    << seconds(member(norm, "elapsed_seconds")) << "; memory peak "
    << bytes(member(norm, "memory_peak_bytes")) << " (cgroup), RSS "
    << bytes(member(oracle, "peak_rss_bytes")) << "\n";
  if (const Json& n = member(member(r, "numerics"), "verdict"); n.is_object())
    o << "numerics:   " << field(n, {"class"}) << ": " << field(n, {"explanation"}) << "\n";
  return o.str();
}

std::string fidelity_report(const Json& r) {
  std::ostringstream o;
  const Json req = r.value("request", Json::object());
  const Json panel = r.value("panel", Json::object());
  const Json cmp = r.value("comparison", Json::object());
  const Json metrics = cmp.value("metrics", Json::object());
  const Json kl = metrics.value("kl", Json::object());
  o << "fidelity job " << field(r, {"job_id"}) << "  request \"" << field(req, {"id"}) << "\"\n"
    << "reference:  " << model_line(r.value("reference", Json())) << "\n"
    << "candidate:  " << model_line(r.value("candidate", Json())) << "\n"
    << "panel:      " << (panel.contains("contexts") ? panel["contexts"].size() : 0)
    << " context(s), " << field(panel, {"scored_positions"}) << " scored positions, vocab "
    << field(panel, {"vocab_size"}) << "\n\n"
    << "KL(reference || candidate) per position, nats (fp64, full vocabulary)\n";
  std::vector<std::vector<std::string>> rows;
  for (const char* k : {"mean", "median", "p95", "p99", "p99_9", "max"}) {
    std::string label = k == std::string("p99_9") ? "p99.9" : k;
    std::string value = number(kl.value(k, Json()));
    if (label == "max" && metrics.contains("max_at"))
      value += "  (context " + field(metrics["max_at"], {"context"}) + ", position " +
               field(metrics["max_at"], {"position"}) + ")";
    rows.push_back({"  " + label, value});
  }
  rows.push_back({"  top-1 agreement", number(metrics.value("top1_agreement", Json())) + "  (" +
                                           field(metrics, {"top1_agree_count"}) + " of " +
                                           field(panel, {"scored_positions"}) + ")"});
  o << render_table(rows);

  const Json rep = r.value("reproduction", Json());
  if (rep.is_object()) {
    bool confirmed = rep.value("confirmed", false);
    o << "reproduction: " << (confirmed ? "confirmed" : "NOT CONFIRMED")
      << " (second reference capture: digests "
      << (rep.value("digests_equal", false) ? "equal" : "differ") << ", max KL "
      << number(rep.value("kl", Json::object()).value("max", Json())) << ", top-1 agreement "
      << number(rep.value("top1_agreement", Json())) << ")\n";
  } else {
    o << "reproduction: not requested\n";
  }

  if (cmp.contains("contexts") && cmp["contexts"].is_array()) {
    std::vector<std::vector<std::string>> ctx{
        {"  context", "positions", "mean KL", "max KL", "p99 KL", "top-1"}};
    for (const Json& c : cmp["contexts"]) {
      const Json ckl = c.value("kl", Json::object());
      ctx.push_back({"  " + field(c, {"id"}), field(c, {"positions"}),
                     number(ckl.value("mean", Json())), number(ckl.value("max", Json())),
                     number(ckl.value("p99", Json())), number(c.value("top1_agreement", Json()))});
    }
    o << "\nper context\n" << render_table(ctx);
  }
  std::string hist = histogram_text(cmp.value("histogram", Json()));
  if (!hist.empty()) o << "\ntoken-wise KL histogram\n" << hist;
  if (cmp.contains("statistics") && cmp["statistics"].is_object())
    o << "\n" << common::llama_cpp_block(cmp["statistics"]);
  if (r.contains("comparator") && r["comparator"].is_object())
    o << "\nestimator: " << field(r["comparator"], {"estimator"}) << " "
      << field(r["comparator"], {"estimator_sha256"}) << " (fp64, "
      << field(r["comparator"], {"kernel"}) << " kernel)\n";
  if (r.contains("gates") && r["gates"].is_object()) o << "\n" << common::gates_text(r["gates"]);
  o << "\nresult_sha256 " << field(r, {"result_sha256"}) << "\n";
  return o.str();
}

}  // namespace assay::client
