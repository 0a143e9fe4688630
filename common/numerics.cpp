// The numerics verdict (numerics.h): every figure it uses is in the record, so that a verifier
// recomputes the same class, explanation and statistics from it.
#include "common/numerics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <vector>

#include "common/error.h"

namespace assay::common {
namespace {

[[noreturn]] void bad(const std::string& what) {
  throw Error("numerics.invalid", what);
}

double number(const Json& doc, const char* key, const std::string& where) {
  auto it = doc.find(key);
  if (it == doc.end() || !it->is_number()) bad(where + "." + key + " is not a number");
  return it->get<double>();
}

std::int64_t token(const Json& doc, const char* key, const std::string& where) {
  auto it = doc.find(key);
  if (it == doc.end() || !it->is_number_integer()) bad(where + "." + key + " is not an integer");
  return it->get<std::int64_t>();
}

// A member's logit of `id` from its candidates list.
double logit_of(const Json& member, std::int64_t id, const std::string& where) {
  auto list = member.find("candidates");
  if (list == member.end() || !list->is_array()) bad(where + ".candidates is not an array");
  for (const Json& c : *list)
    if (c.is_object() && c.value("token_id", Json()) == id) return number(c, "logit", where);
  bad(where + " has no logit for candidate token " + std::to_string(id));
}

std::string fmt(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

std::string steps(double v, double step) {
  return fmt(v) + " (" + fmt(v / step) + " bf16 steps)";
}

struct Candidate {
  std::int64_t id = 0;
  std::vector<std::string> engines;
};

std::string engines_of(const Candidate& c) {
  std::string out;
  for (const auto& e : c.engines) out += (out.empty() ? "" : ", ") + e;
  return out;
}

}  // namespace

double bf16_step(double v) {
  v = std::fabs(v);
  if (!(v >= std::ldexp(1.0, -126))) return std::ldexp(1.0, -133);
  int e = 0;
  std::frexp(v, &e);  // v = f 2^e with f in [0.5, 1): 2^(e-1) <= v < 2^e
  return std::ldexp(1.0, e - 1 - 7);
}

NumericsPolicy numerics_policy(const Json& doc, const std::string& where) {
  NumericsPolicy p;
  if (doc.is_null()) return p;
  auto take = [&](const char* key, double lo, double hi, double& out) {
    auto it = doc.find(key);
    if (it == doc.end()) return;
    if (!it->is_number() || it->get<double>() < lo || it->get<double>() > hi)
      throw Error("request.invalid", where + "." + key + " must be a number in [" + fmt(lo) + ", " +
                                         fmt(hi) + "], got " + it->dump());
    out = it->get<double>();
  };
  take("spread_factor", 1, 100, p.spread_factor);
  take("margin_steps", 0, 64, p.margin_steps);
  return p;
}

Json to_json(const NumericsPolicy& policy) {
  return Json{{"spread_factor", policy.spread_factor}, {"margin_steps", policy.margin_steps}};
}

std::vector<std::string> numerics_member_names(const Json& spec) {
  std::vector<std::string> names{"reference"};
  for (std::int64_t s = 0; s < spec.value("reduction_seeds", std::int64_t{16}); ++s)
    names.push_back("reduction:" + std::to_string(s));
  if (spec.value("sdpa", true)) names.push_back("sdpa");
  if (spec.value("kv_cache", true)) names.push_back("kv-cache");
  for (const Json& b : spec.value("batch_sizes", Json::array({4})))
    names.push_back("batched:" + std::to_string(b.get<std::int64_t>()));
  return names;
}

Json numerics_verdict(const Json& members, const Json& candidates, const Json& fp32,
                      const NumericsPolicy& policy) {
  if (!members.is_array() || members.empty()) bad("numerics.members is empty");
  if (!candidates.is_array() || candidates.empty()) bad("numerics.candidates is empty");
  // Candidates by token, engines in the request's order.
  std::vector<Candidate> cands;
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const std::string where = "numerics.candidates[" + std::to_string(i) + "]";
    std::int64_t id = token(candidates[i], "token_id", where);
    auto engine = candidates[i].value("engine", Json());
    if (!engine.is_string()) bad(where + ".engine is not a string");
    auto it = std::find_if(cands.begin(), cands.end(), [&](const auto& c) { return c.id == id; });
    if (it == cands.end()) it = cands.insert(cands.end(), Candidate{id, {}});
    it->engines.push_back(engine.get<std::string>());
  }
  auto is_candidate = [&](std::int64_t id) {
    return std::any_of(cands.begin(), cands.end(), [&](const auto& c) { return c.id == id; });
  };

  const std::size_t m_count = members.size();
  std::vector<std::int64_t> argmax(m_count);
  std::vector<double> top(m_count);
  bool unanimous = true, any_tie = false;
  std::map<std::int64_t, int> argmax_count;
  for (std::size_t m = 0; m < m_count; ++m) {
    const std::string where = "numerics.members[" + std::to_string(m) + "]";
    if (!members[m].is_object()) bad(where + " is not an object");
    argmax[m] = token(members[m], "argmax", where);
    top[m] = number(members[m], "argmax_logit", where);
    const Json tie = members[m].value("top_tie", Json(false));
    if (!tie.is_boolean()) bad(where + ".top_tie is not a boolean");
    any_tie = any_tie || tie.get<bool>();
    unanimous = unanimous && argmax[m] == argmax[0];
    ++argmax_count[argmax[m]];
  }
  const double step = bf16_step(top[0]);
  const std::int64_t ref = argmax[0];
  bool any_candidate_argmax = false;
  for (const auto& [id, n] : argmax_count) any_candidate_argmax |= is_candidate(id);

  Json per = Json::array();
  bool all_beyond = true;
  const Candidate* closest = nullptr;  // the other candidate nearest its threshold
  double closest_room = 0;
  for (const Candidate& c : cands) {
    double x_min = INFINITY, x_max = -INFINITY, g_min = INFINITY, g_max = -INFINITY;
    for (std::size_t m = 0; m < m_count; ++m) {
      double x = logit_of(members[m], c.id, "numerics.members[" + std::to_string(m) + "]");
      if (x > top[m])
        bad("numerics.members[" + std::to_string(m) + "]: candidate " + std::to_string(c.id) +
            "'s logit " + fmt(x) + " is above the member's top " + fmt(top[m]));
      x_min = std::min(x_min, x), x_max = std::max(x_max, x);
      g_min = std::min(g_min, top[m] - x), g_max = std::max(g_max, top[m] - x);
    }
    const double x_ref = logit_of(members[0], c.id, "numerics.members[0]");
    const bool leader = unanimous && c.id == ref;
    Json entry{{"token_id", c.id},
               {"engines", c.engines},
               {"argmax_members", argmax_count.count(c.id) ? argmax_count[c.id] : 0},
               {"logit",
                {{"reference", x_ref},
                 {"min", x_min},
                 {"max", x_max},
                 {"spread", x_max - x_min},
                 {"spread_steps",
                  (x_max - x_min) / bf16_step(std::max(std::fabs(x_min), std::fabs(x_max)))}}},
               {"gap",
                {{"reference", top[0] - x_ref},
                 {"min", g_min},
                 {"max", g_max},
                 {"spread", g_max - g_min}}}};
    if (!leader) {
      const double threshold = policy.spread_factor * (g_max - g_min) + policy.margin_steps * step;
      const bool beyond = g_min > threshold;
      entry["threshold"] = threshold;
      entry["beyond"] = beyond;
      all_beyond = all_beyond && beyond;
      if (!closest || g_min - threshold < closest_room)
        closest = &c, closest_room = g_min - threshold;
    } else {
      entry["threshold"] = nullptr;
      entry["beyond"] = nullptr;
    }
    per.push_back(std::move(entry));
  }

  std::string cls, why;
  const std::string count = std::to_string(m_count) + " bf16 members";
  if (!any_candidate_argmax) {
    cls = "neither";
    why = "no member's argmax is a candidate: the " + count + " pick ";
    std::string picked;
    for (const auto& [id, n] : argmax_count)
      picked += (picked.empty() ? "" : ", ") + std::to_string(id) + " (" + std::to_string(n) + ")";
    why += picked;
  } else if (!unanimous || any_tie) {
    cls = "numerically_tied";
    std::string picked;
    for (const auto& [id, n] : argmax_count)
      picked += (picked.empty() ? "" : ", ") + std::to_string(id) + " in " + std::to_string(n);
    why = unanimous ? "a member's top logit is tied, so its argmax is not decided by the logits"
                    : "the members disagree on the argmax: " + picked + " of the " + count +
                          "; each of those tokens is a legitimate outcome";
  } else if (!is_candidate(ref)) {
    cls = "neither";
    why = "every one of the " + count + " has argmax " + std::to_string(ref) +
          ", which no engine gave";
  } else {
    const Candidate& leader =
        *std::find_if(cands.begin(), cands.end(), [&](const auto& c) { return c.id == ref; });
    std::string lead = "every one of the " + count + " has argmax " + std::to_string(ref) + " (" +
                       engines_of(leader) + ")";
    if (!closest) {
      cls = "reference_decides";
      why = lead + ", and no engine gave another token";
    } else {
      const Json& e = *std::find_if(per.begin(), per.end(),
                                    [&](const Json& j) { return j["token_id"] == closest->id; });
      const std::string deficit =
          std::to_string(closest->id) + " (" + engines_of(*closest) + ") trails it by at least " +
          steps(e["gap"]["min"].get<double>(), step) +
          " across the members; the measured spread of that gap is " +
          steps(e["gap"]["spread"].get<double>(), step) + ", and the threshold " +
          fmt(policy.spread_factor) + " x spread + " + fmt(policy.margin_steps) + " step is " +
          steps(e["threshold"].get<double>(), step);
      if (all_beyond) {
        cls = "reference_decides";
        why = lead + "; " + deficit +
              ": that token is not a legitimate outcome of the model's arithmetic as sampled, "
              "which points at a bug in the engine that gave it";
      } else {
        cls = "numerically_tied";
        why = lead + ", but " + deficit +
              ": within it, a legitimate execution could pick that token, so this state cannot "
              "tell a bug from numerics";
      }
    }
  }

  Json fp32_doc = nullptr;
  if (!fp32.is_null()) {
    std::int64_t a = token(fp32, "argmax", "numerics.fp32");
    Json logits = Json::array();
    for (const Candidate& c : cands)
      logits.push_back(Json{{"token_id", c.id}, {"logit", logit_of(fp32, c.id, "numerics.fp32")}});
    fp32_doc =
        Json{{"argmax", a}, {"argmax_is_candidate", is_candidate(a)}, {"candidates", logits}};
  }
  return Json{{"class", cls},
              {"explanation", why},
              {"reference_argmax", ref},
              {"unanimous_argmax", unanimous && !any_tie ? Json(ref) : Json(nullptr)},
              {"members", m_count},
              {"step", step},
              {"candidates", std::move(per)},
              {"fp32", std::move(fp32_doc)}};
}

}  // namespace assay::common
