#include "supervisor/api/routes.h"

#include <set>
#include <sstream>

#include "common/error.h"
#include "common/request.h"
#include "common/text.h"
#include "supervisor/pipelines/pipeline.h"

namespace assay::supervisor::api {

using common::Error;
using common::Json;

namespace {

std::string url_decode(std::string_view s) {
  auto hex = [](char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; };
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && hex(s[i + 1]) && hex(s[i + 2])) {
      out += static_cast<char>(std::stoi(std::string(s.substr(i + 1, 2)), nullptr, 16));
      i += 2;
    } else if (s[i] == '+') {
      out += ' ';
    } else {
      out += s[i];
    }
  }
  if (!common::is_valid_utf8(out))
    throw Error("api.bad_target", "request target part \"" + common::printable(s, 100) +
                                      "\" is not UTF-8 once decoded");
  return out;
}

struct Call {
  Service& service;
  const std::string& method;
  const Target& target;
  const std::string& body;
  const Peer& peer;
  const std::string& id() const { return target.segments.at(2); }
};

using Handler = Answer (*)(const Call&);

struct Route {
  std::vector<std::string_view> pattern;  // "*" matches one segment
  std::string_view method;
  Handler handler;
};

Answer no_query(const Call& c, Answer a) {
  if (!c.target.query.empty())
    throw Error("api.bad_query", "query parameter \"" +
                                     common::printable(c.target.query.begin()->first, 64) +
                                     "\" is not allowed here");
  return a;
}

Answer file_answer(std::filesystem::path file, std::string content_type) {
  Answer a;
  a.content_type = std::move(content_type);
  a.file = std::move(file);
  return a;
}

const std::vector<Route>& routes() {
  static const std::vector<Route> table{
      {{"metrics"},
       "GET",
       [](const Call& c) {
         Answer a{200, "text/plain; version=0.0.4", render_metrics(c.service), {}, {}, {}};
         return no_query(c, a);
       }},
      {{"v1", "health"},
       "GET",
       [](const Call& c) { return no_query(c, json_answer(200, c.service.health())); }},
      {{"v1", "info"},
       "GET",
       [](const Call& c) { return no_query(c, json_answer(200, c.service.info())); }},
      {{"v1", "jobs"},
       "POST",
       [](const Call& c) {
         try {
           Json document = common::parse_strict(c.body, {.max_bytes = common::kMaxRequestBytes});
           Submitted s = c.service.submit(document, c.target.query, c.peer);
           return json_answer(s.created ? 201 : 200, s.job);
         } catch (const Error& e) {
           // A submission that parses but cannot be taken as asked is unprocessable (422), a
           // body that is not JSON a bad request (400).
           Answer a = error_answer(e);
           if (a.status == 400 && e.code().rfind("json.", 0) != 0) a.status = 422;
           return a;
         }
       }},
      {{"v1", "fingerprint-cache", "refresh"},
       "POST",
       [](const Call& c) {
         auto it = c.target.query.find("model_dir");
         if (it == c.target.query.end() || c.target.query.size() != 1)
           throw Error("api.bad_query", "POST /v1/fingerprint-cache/refresh takes model_dir= only");
         return json_answer(200, c.service.refresh_fingerprint(it->second, c.peer));
       }},
      {{"v1", "jobs"},
       "GET",
       [](const Call& c) {
         std::optional<JobState> state;
         for (const auto& [k, v] : c.target.query) {
           if (k != "state")
             throw Error("api.bad_query", "unknown query parameter \"" + common::printable(k, 64) +
                                              "\" (only state=)");
           state = state_from_name(v);
         }
         return json_answer(200, c.service.list(state, c.peer));
       }},
      {{"v1", "jobs", "*"},
       "GET",
       [](const Call& c) {
         return no_query(
             c,
             Answer{200, "application/json", c.service.job_document(c.id(), c.peer), {}, {}, {}});
       }},
      {{"v1", "jobs", "*"},
       "DELETE",
       [](const Call& c) {
         auto [job, done] = c.service.cancel(c.id(), c.peer);
         return no_query(c, json_answer(done ? 200 : 202, job));
       }},
      {{"v1", "jobs", "*", "events"},
       "GET",
       [](const Call& c) {
         Answer a;
         a.stream_job = c.id();
         return no_query(c, a);
       }},
      {{"v1", "jobs", "*", "result"},
       "GET",
       [](const Call& c) {
         return no_query(
             c, file_answer(c.service.result_file(c.id(), "result", c.peer), "application/json"));
       }},
      {{"v1", "jobs", "*", "attestation"},
       "GET",
       [](const Call& c) {
         return no_query(c, file_answer(c.service.result_file(c.id(), "attestation", c.peer),
                                        "application/json"));
       }},
      {{"v1", "jobs", "*", "artifact"},
       "GET",
       [](const Call& c) {
         return no_query(c, file_answer(c.service.result_file(c.id(), "artifact", c.peer),
                                        "application/octet-stream"));
       }},
  };
  return table;
}

bool matches(const Route& r, const std::vector<std::string>& segments) {
  if (r.pattern.size() != segments.size()) return false;
  for (std::size_t i = 0; i < segments.size(); ++i)
    if (r.pattern[i] != "*" && r.pattern[i] != segments[i]) return false;
  return true;
}

}  // namespace

Target parse_target(const std::string& target) {
  Target t;
  auto q = target.find('?');
  std::string_view path = std::string_view(target).substr(0, q);
  for (std::size_t pos = 0; pos <= path.size();) {
    auto slash = path.find('/', pos);
    auto seg = path.substr(pos, slash == std::string_view::npos ? path.npos : slash - pos);
    if (!seg.empty()) t.segments.push_back(url_decode(seg));
    if (slash == std::string_view::npos) break;
    pos = slash + 1;
  }
  if (q == std::string::npos) return t;
  std::string_view query = std::string_view(target).substr(q + 1);
  for (std::size_t pos = 0; pos <= query.size();) {
    auto amp = query.find('&', pos);
    auto kv = query.substr(pos, amp == std::string_view::npos ? query.npos : amp - pos);
    if (!kv.empty()) {
      auto eq = kv.find('=');
      std::string k = url_decode(kv.substr(0, eq));
      std::string v = eq == std::string_view::npos ? "" : url_decode(kv.substr(eq + 1));
      if (!t.query.emplace(k, v).second)
        throw Error("api.bad_query",
                    "query parameter \"" + common::printable(k, 64) + "\" appears twice");
    }
    if (amp == std::string_view::npos) break;
    pos = amp + 1;
  }
  return t;
}

Answer route(Service& service, const std::string& method, const std::string& target,
             const std::string& body, const Peer& peer) {
  try {
    Target t = parse_target(target);
    const std::string& m = method == "HEAD" ? std::string("GET") : method;
    std::string allow;
    for (const Route& r : routes()) {
      if (!matches(r, t.segments)) continue;
      if (r.method == m) return r.handler(Call{service, m, t, body, peer});
      allow += (allow.empty() ? "" : ", ") + std::string(r.method);
      if (r.method == "GET") allow += ", HEAD";
    }
    std::string where = common::printable(target, 200);
    const auto& seg = t.segments;
    if (allow.empty() && seg.size() >= 3 && seg[0] == "v1" && seg[1] == "jobs" &&
        !valid_job_id(seg[2]))
      return error_answer(
          400, "api.bad_job_id",
          "job id \"" + common::printable(seg[2], 64) + "\" is not j-<24 hex digits>");
    if (allow.empty()) return error_answer(404, "api.not_found", "no route for " + where);
    Answer a = error_answer(405, "api.method_not_allowed",
                            common::printable(method, 20) + " is not allowed on " + where +
                                " (allowed: " + allow + ")");
    a.allow = allow;
    return a;
  } catch (const Error& e) {
    if (e.code() == "supervisor.internal") ++service.metrics().internal_errors;
    return error_answer(e);
  } catch (const std::exception& e) {
    ++service.metrics().internal_errors;
    return internal_error(e);
  }
}

std::string render_metrics(Service& service) {
  std::ostringstream o;
  o << "# HELP assay_build_info Build information.\n# TYPE assay_build_info gauge\n"
    << "assay_build_info{version=\"" << ASSAY_VERSION << "\",backend=\"" << service.backend()
    << "\"} 1\n";
  auto counts = service.job_counts();
  constexpr JobState kStates[] = {JobState::kQueued, JobState::kRunning, JobState::kSucceeded,
                                  JobState::kFailed, JobState::kCancelled};
  std::map<JobState, int> jobs;  // a batch is one job; its states are its parts
  for (const auto& [key, n] : counts)
    if (key.first != kBatchStateKind) jobs[key.second] += n;
  o << "# HELP assay_jobs Jobs by state (a batch counts once; its states are in "
       "assay_jobs_by_kind).\n# TYPE assay_jobs gauge\n";
  for (auto s : kStates) o << "assay_jobs{state=\"" << state_name(s) << "\"} " << jobs[s] << "\n";
  o << "# HELP assay_jobs_by_kind Jobs by kind and state; kind next-token-batch-state counts "
       "the states of batches.\n# TYPE assay_jobs_by_kind gauge\n";
  std::set<std::string> kind_names{std::string(kBatchStateKind)};
  for (const JobKind& k : kinds()) kind_names.insert(std::string(k.name));
  for (const std::string& kind : kind_names)
    for (auto s : kStates)
      o << "assay_jobs_by_kind{kind=\"" << kind << "\",state=\"" << state_name(s) << "\"} "
        << (counts.count({kind, s}) ? counts.at({kind, s}) : 0) << "\n";
  o << "# HELP assay_queue_depth Jobs waiting for a device slot.\n# TYPE assay_queue_depth gauge\n"
    << "assay_queue_depth " << service.queue_depth() << "\n";
  const Metrics& m = service.metrics();
  auto counter = [&](const char* name, const char* help, std::uint64_t v) {
    o << "# HELP " << name << " " << help << "\n# TYPE " << name << " counter\n"
      << name << " " << v << "\n";
  };
  counter("assay_submissions_total", "Jobs accepted.", m.submissions);
  counter("assay_duplicate_submissions_total", "Submissions answered with an existing job.",
          m.duplicates);
  counter("assay_rejected_submissions_total", "Submissions refused as invalid.", m.rejected);
  counter("assay_queue_full_total", "Submissions refused because the queue was full.",
          m.queue_full);
  counter("assay_preflight_refusals_total", "Jobs failed by the memory preflight.",
          m.preflight_refusals);
  counter("assay_preflight_waits_total", "Times the preflight kept a job queued.",
          m.preflight_waits);
  counter("assay_oom_kills_total", "Workers killed by the OOM killer.", m.oom_kills);
  counter("assay_timeouts_total", "Workers killed at their timeout.", m.timeouts);
  counter("assay_connections_refused_total", "Connections refused at a connection limit.",
          m.connections_refused);
  counter("assay_store_write_failures_total", "Writes to the state directory that failed.",
          m.store_write_failures);
  counter("assay_internal_errors_total",
          "Internal errors (supervisor.internal): API requests answered 500 and jobs failed by "
          "a fault of assayd's own.",
          m.internal_errors);
  counter("assay_slurm_steps_submitted_total", "Worker steps submitted to Slurm (executor slurm).",
          m.slurm_submitted);
  std::map<std::string, int> slurm_states;
  for (const auto& [name, state] : m.slurm_steps) ++slurm_states[state];
  o << "# HELP assay_slurm_steps Worker steps in Slurm now, by Slurm job state.\n"
       "# TYPE assay_slurm_steps gauge\n";
  for (const auto& [state, n] : slurm_states)
    o << "assay_slurm_steps{state=\"" << state << "\"} " << n << "\n";
  if (!m.pool_nodes.empty()) {
    o << "# HELP assay_pool_nodes Nodes of the Slurm worker pool now: free, busy, launching "
         "(submitted, not yet dialled in).\n# TYPE assay_pool_nodes gauge\n";
    for (const auto& [state, n] : m.pool_nodes)
      o << "assay_pool_nodes{state=\"" << state << "\"} " << n << "\n";
    counter("assay_pool_nodes_lost_total",
            "Pool nodes lost (channel closed or silent) while assayd ran.", m.pool_nodes_lost);
  }
  o << "# HELP assay_duration_seconds Job and phase durations (quantile over the last "
    << Durations::kWindow << ").\n# TYPE assay_duration_seconds summary\n";
  for (const auto& [phase, d] : m.durations)
    o << "assay_duration_seconds{phase=\"" << phase << "\",quantile=\"0.5\"} " << d.median() << "\n"
      << "assay_duration_seconds_sum{phase=\"" << phase << "\"} " << d.sum << "\n"
      << "assay_duration_seconds_count{phase=\"" << phase << "\"} " << d.count << "\n";
  return o.str();
}

}  // namespace assay::supervisor::api
