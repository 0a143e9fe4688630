#include "client/format.h"
#include "client/format_detail.h"

#include "common/fidelity.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>
#include <vector>

#include "common/error.h"
#include "common/json.h"

namespace assay::client {

using common::Json;

namespace format_detail {

std::string scalar(const Json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_null()) return "-";
  return v.dump();
}

const Json* find(const Json& o, std::initializer_list<const char*> keys) {
  for (const char* k : keys)
    if (o.is_object() && o.contains(k) && !o[k].is_null()) return &o[k];
  return nullptr;
}

std::string field(const Json& o, std::initializer_list<const char*> keys) {
  const Json* v = find(o, keys);
  return v ? scalar(*v) : "";
}

std::string render_table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<std::size_t> width;
  for (const auto& r : rows)
    for (std::size_t i = 0; i < r.size(); ++i) {
      if (width.size() <= i) width.push_back(0);
      width[i] = std::max(width[i], r[i].size());
    }
  std::string out;
  for (const auto& r : rows) {
    std::string line;
    for (std::size_t i = 0; i < r.size(); ++i) {
      line += r[i];
      if (i + 1 < r.size()) line += std::string(width[i] - r[i].size() + 2, ' ');
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  return out;
}

}  // namespace format_detail

namespace {

using namespace format_detail;

std::string verdict_text(const Json& job) {
  const Json* v = find(job, {"verdict"});
  if (!v && find(job, {"result"})) v = find(*find(job, {"result"}), {"verdict"});
  if (!v || !v->is_object()) return "";
  std::string s = field(*v, {"argmax_candidate"});
  if (const Json* t = find(*v, {"argmax_token_id"})) s += " (token " + scalar(*t) + ")";
  return s;
}

}  // namespace

std::string job_id(const Json& job) {
  const Json* id = find(job, {"id", "job_id"});
  if (!id || !id->is_string())
    throw common::Error("client.bad_response",
                        "assayd's job document has no \"id\": " + job.dump().substr(0, 200));
  return id->get<std::string>();
}

std::string job_state(const Json& job) {
  return field(job, {"state"});
}

bool state_is_final(const std::string& s) {
  return state_is_success(s) || s == "failed" || s == "cancelled" || s == "canceled" ||
         s == "refused" || s == "rejected";
}

bool state_is_success(const std::string& s) {
  return s == "succeeded" || s == "done" || s == "completed";
}

std::string format_seconds(double s) {
  char buf[32];
  if (s < 60) {
    std::snprintf(buf, sizeof buf, "%.1fs", s);
  } else if (s < 3600) {
    std::snprintf(buf, sizeof buf, "%dm%02ds", static_cast<int>(s) / 60, static_cast<int>(s) % 60);
  } else {
    std::snprintf(buf, sizeof buf, "%dh%02dm", static_cast<int>(s) / 3600,
                  static_cast<int>(s) / 60 % 60);
  }
  return buf;
}

std::string format_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  char buf[32];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%.0f B", b);
  else
    std::snprintf(buf, sizeof buf,
                  b < 10    ? "%.2f %s"
                  : b < 100 ? "%.1f %s"
                            : "%.0f %s",
                  b, units[u]);
  return buf;
}

std::string format_duration(double s) {
  if (s >= 60) return format_seconds(s);
  char buf[32];
  if (s < 1e-3)
    std::snprintf(buf, sizeof buf, "%.0f us", s * 1e6);
  else if (s < 1)
    std::snprintf(buf, sizeof buf, "%.3g ms", s * 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.3g s", s);
  return buf;
}

std::string describe_object(const Json& o) {
  if (!o.is_object()) return o.dump(2) + "\n";
  std::vector<std::vector<std::string>> rows;
  std::string blocks;  // multi-line strings (a PEM key) go below the table, unindented
  for (const auto& [k, v] : o.items()) {
    if (v.is_string() && v.get<std::string>().find('\n') != std::string::npos) {
      std::string text = v.get<std::string>();
      blocks += k + ":\n" + text + (text.ends_with('\n') ? "" : "\n");
      continue;
    }
    rows.push_back({k + ":", v.is_structured() ? v.dump() : scalar(v)});
  }
  return render_table(rows) + blocks;
}

std::string describe_job(const Json& job) {
  if (!job.is_object()) return job.dump(2) + "\n";
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> shown;
  auto add = [&](const std::string& label, const std::string& value) {
    if (!value.empty()) rows.push_back({label + ":", value});
  };
  for (const char* k : {"id", "state", "phase"}) {
    add(k, field(job, {k}));
    shown.push_back(k);
  }
  add("verdict", verdict_text(job));
  shown.push_back("verdict");
  // Bug or numerics: the envelope's class, in words.
  if (const Json* n = find(job, {"numerics"}); n && n->is_object())
    add("numerics", field(*n, {"class"}) + ": " + field(*n, {"explanation"}));
  shown.push_back("numerics");
  if (const Json* a = find(job, {"audit"}); a && a->is_object())
    add("audit", field(*a, {"class"}) + ": " + field(*a, {"explanation"}));
  shown.push_back("audit");
  if (const Json* e = find(job, {"error"})) {
    add("error",
        e->is_object() ? field(*e, {"message"}) + " [" + field(*e, {"code"}) + "]" : scalar(*e));
    shown.push_back("error");
  }
  // The event history and the API links are for programs (--json), not for the table.
  shown.push_back("events");
  shown.push_back("links");
  for (const auto& [k, v] : job.items()) {
    if (std::find(shown.begin(), shown.end(), k) != shown.end() || v.is_null()) continue;
    add(k, v.is_structured() ? v.dump() : scalar(v));
  }
  return render_table(rows);
}

std::string jobs_table(const Json& doc) {
  const Json* jobs = doc.is_array() ? &doc : find(doc, {"jobs"});
  if (!jobs || !jobs->is_array())
    throw common::Error("client.bad_response",
                        "assayd's job list is not {\"jobs\": [...]}: " + doc.dump().substr(0, 200));
  // The verdict column only when the daemon's summaries carry verdicts.
  bool verdicts = std::any_of(jobs->begin(), jobs->end(),
                              [](const Json& j) { return !verdict_text(j).empty(); });
  std::vector<std::vector<std::string>> rows{{"ID", "STATE", "PHASE", "SUBMITTED"}};
  if (verdicts) rows[0].push_back("VERDICT");
  for (const Json& j : *jobs) {
    rows.push_back({field(j, {"id", "job_id"}), field(j, {"state"}), field(j, {"phase"}),
                    field(j, {"created_at_utc", "submitted_at_utc", "created_at"})});
    if (verdicts) rows.back().push_back(verdict_text(j));
  }
  if (jobs->empty()) return "no jobs\n";
  return render_table(rows);
}

std::string checks_table(const VerifyReport& report) {
  std::vector<std::vector<std::string>> rows;
  for (const Check& c : report.checks) rows.push_back({c.ok ? "ok" : "FAIL", c.name, c.detail});
  return render_table(rows);
}

void Progress::update(const Json& doc) {
  if (!doc.is_object()) return;
  if (auto s = field(doc, {"state"}); !s.empty()) state = s;
  if (auto p = field(doc, {"phase"}); !p.empty()) phase = p;
  detail = field(doc, {"message", "detail", "reason"});
  if (const Json* pr = find(doc, {"progress"})) {
    if (pr->is_number()) {
      fraction = pr->get<double>();
    } else if (pr->is_object()) {
      const Json* done = find(*pr, {"done", "current"});
      const Json* total = find(*pr, {"total"});
      if (done && total && done->is_number() && total->is_number() && total->get<double>() > 0)
        fraction = done->get<double>() / total->get<double>();
      if (auto m = field(*pr, {"message", "stage"}); !m.empty()) detail = m;
    }
  }
}

std::string progress_line(const std::string& id, const Progress& p, double elapsed) {
  std::string line = "job " + id + "  " + (p.state.empty() ? "?" : p.state);
  if (!p.phase.empty() && p.phase != p.state) line += "  " + p.phase;
  line += "  " + format_seconds(elapsed);
  if (p.fraction) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "  %.0f%%", std::clamp(*p.fraction, 0.0, 1.0) * 100);
    line += buf;
  }
  if (!p.detail.empty()) line += "  " + p.detail;
  return line;
}

std::optional<std::string> public_key_pem(const Json& info) {
  for (const Json* o : {&info, find(info, {"key"}), find(info, {"signing_key"})}) {
    if (!o) continue;
    std::string pem = field(*o, {"public_key_pem", "public_key"});
    if (pem.find("-----BEGIN PUBLIC KEY-----") != std::string::npos) return pem;
  }
  return std::nullopt;
}

std::string key_id_of(const Json& info) {
  for (const Json* o : {&info, find(info, {"key"}), find(info, {"signing_key"})})
    if (o)
      if (auto id = field(*o, {"key_id"}); !id.empty()) return id;
  return "";
}

}  // namespace assay::client
