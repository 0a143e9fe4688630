// The engine audit's statistic (audit.h). Deterministic double arithmetic in a fixed order, so
// that `assay verify` recomputes the record's figures bit for bit.
#include "common/audit.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

#include "common/error.h"
#include "common/identity.h"
#include "common/request_fields.h"

namespace assay::common {
namespace {

[[noreturn]] void bad(const std::string& what) {
  throw Error("audit.invalid", what);
}

std::string fmt(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

double figure(const Json& doc, const char* key, const std::string& where) {
  auto it = doc.find(key);
  if (it == doc.end() || !it->is_number()) bad(where + "." + key + " is not a number");
  double v = it->get<double>();
  if (!std::isfinite(v) || v < 0) bad(where + "." + key + " is " + it->dump() + ", not >= 0");
  return v;
}

// The continued fraction of the regularized incomplete beta function (modified Lentz).
double beta_fraction(double a, double b, double x) {
  constexpr double kTiny = 1e-300;
  const double qab = a + b, qap = a + 1, qam = a - 1;
  double c = 1, d = 1 - qab * x / qap;
  if (std::fabs(d) < kTiny) d = kTiny;
  d = 1 / d;
  double h = d;
  for (int m = 1; m <= 10000; ++m) {
    const double m2 = 2.0 * m;
    double aa = m * (b - m) * x / ((qam + m2) * (a + m2));
    d = 1 + aa * d;
    if (std::fabs(d) < kTiny) d = kTiny;
    c = 1 + aa / c;
    if (std::fabs(c) < kTiny) c = kTiny;
    d = 1 / d;
    h *= d * c;
    aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2));
    d = 1 + aa * d;
    if (std::fabs(d) < kTiny) d = kTiny;
    c = 1 + aa / c;
    if (std::fabs(c) < kTiny) c = kTiny;
    d = 1 / d;
    const double step = d * c;
    h *= step;
    if (std::fabs(step - 1) < 1e-15) break;
  }
  return h;
}

// I_x(a, b).
double incomplete_beta(double a, double b, double x) {
  if (x <= 0) return 0;
  if (x >= 1) return 1;
  const double front = std::exp(std::lgamma(a + b) - std::lgamma(a) - std::lgamma(b) +
                                a * std::log(x) + b * std::log1p(-x));
  if (x < (a + 1) / (a + b + 2)) return front * beta_fraction(a, b, x) / a;
  return 1 - front * beta_fraction(b, a, 1 - x) / b;
}

// t with P(T >= t) = q (0 < q < 0.5), by bisection.
double student_t_quantile_upper(double q, double df) {
  double lo = 0, hi = 1;
  while (student_t_upper(hi, df) > q) hi *= 2;
  for (int i = 0; i < 200 && hi - lo > 1e-12 * hi; ++i) {
    const double mid = (lo + hi) / 2;
    (student_t_upper(mid, df) > q ? lo : hi) = mid;
  }
  return (lo + hi) / 2;
}

}  // namespace

double student_t_upper(double t, double df) {
  if (std::isnan(t) || !(df > 0)) return std::numeric_limits<double>::quiet_NaN();
  if (std::isinf(t)) return t > 0 ? 0.0 : 1.0;
  const double tail = 0.5 * incomplete_beta(df / 2, 0.5, df / (df + t * t));
  return t >= 0 ? tail : 1 - tail;
}

AuditPolicy audit_policy(const Json& doc, const std::string& where) {
  AuditPolicy p;
  if (doc.is_null()) return p;
  if (!doc.is_object()) throw Error("request.invalid", where + " must be an object");
  if (auto it = doc.find("alpha"); it != doc.end()) {
    if (!it->is_number() || !(it->get<double>() > 0) || it->get<double>() > 0.5)
      throw Error("request.invalid",
                  where + ".alpha must be a number in (0, 0.5], got " + it->dump());
    p.alpha = it->get<double>();
  }
  return p;
}

Json to_json(const AuditPolicy& policy) {
  return Json{{"alpha", policy.alpha}};
}

Json audit_statistics(const Json& members, const Json& contexts, const AuditPolicy& policy) {
  if (!members.is_array() || members.empty()) bad("members must be a non-empty array of names");
  for (const Json& m : members)
    if (!m.is_string()) bad("members holds " + m.dump() + ", not a name");
  if (!contexts.is_array() || contexts.size() < 2)
    bad("the test needs at least 2 contexts, got " +
        (contexts.is_array() ? std::to_string(contexts.size()) : std::string("none")));
  const std::size_t k = members.size(), n = contexts.size();
  std::vector<double> engine(n);
  std::vector<std::vector<double>> member(k, std::vector<double>(n));
  std::uint64_t positions = 0;
  for (std::size_t c = 0; c < n; ++c) {
    const std::string where = "contexts[" + std::to_string(c) + "]";
    const Json& ctx = contexts[c];
    if (!ctx.is_object()) bad(where + " is not an object");
    const Json& count = ctx.value("positions", Json());
    if (!count.is_number_unsigned() || count.get<std::uint64_t>() == 0)
      bad(where + ".positions is not a positive integer");
    positions += count.get<std::uint64_t>();
    engine[c] = figure(ctx, "engine_sum", where);
    const Json& sums = ctx.value("member_sums", Json());
    if (!sums.is_array() || sums.size() != k)
      bad(where + ".member_sums does not hold one figure per member (" + std::to_string(k) + ")");
    for (std::size_t m = 0; m < k; ++m) {
      if (!sums[m].is_number() || !std::isfinite(sums[m].get<double>()) ||
          sums[m].get<double>() < 0)
        bad(where + ".member_sums[" + std::to_string(m) + "] is " + sums[m].dump() + ", not >= 0");
      member[m][c] = sums[m].get<double>();
    }
  }
  // Sums in context order; the unit is the first member with the largest.
  auto total = [](const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return s;
  };
  std::vector<double> member_total(k);
  std::size_t unit = 0;
  for (std::size_t m = 0; m < k; ++m) {
    member_total[m] = total(member[m]);
    if (member_total[m] > member_total[unit]) unit = m;
  }
  const double a = total(engine), b = member_total[unit];
  if (!(b > 0)) bad("every member's distance to the float32 anchor is 0: there is no unit");
  const double r2 = a / b, nd = static_cast<double>(n);
  Json per_member = Json::array();
  for (std::size_t m = 0; m < k; ++m)
    per_member.push_back(Json{
        {"name", members[m]}, {"sum", member_total[m]}, {"ratio", std::sqrt(member_total[m] / b)}});

  // The paired differences and the residuals of the ratio, in context order.
  double mean = 0;
  for (std::size_t c = 0; c < n; ++c) mean += engine[c] - member[unit][c];
  mean /= nd;
  double var = 0, resid = 0;
  for (std::size_t c = 0; c < n; ++c) {
    const double d = engine[c] - member[unit][c] - mean;
    var += d * d;
    const double r = engine[c] - r2 * member[unit][c];
    resid += r * r;
  }
  var /= nd - 1;
  const double df = nd - 1;
  double t = 0, p = 0;
  if (var > 0) {
    t = mean / std::sqrt(var / nd);
    p = student_t_upper(t, df);
  } else {  // every context differs by the same amount: the sign decides
    t = mean > 0 ? std::numeric_limits<double>::infinity() : 0;
    p = mean > 0 ? 0.0 : 1.0;
  }
  const double se = std::sqrt(nd / (nd - 1) * resid) / b;
  const double q = student_t_quantile_upper(0.025, df);
  const double lo = std::sqrt(std::max(0.0, r2 - q * se)), hi = std::sqrt(r2 + q * se);
  const double ratio = std::sqrt(r2);
  const bool beyond = p < policy.alpha;
  const std::string unit_name = members[unit].get<std::string>();
  const std::string figures = fmt(ratio) + "x the legitimate spread (the RMS distance of " +
                              unit_name + ", the farthest legitimate execution measured, from " +
                              "the model's float32 answer), 95% CI [" + fmt(lo) + ", " + fmt(hi) +
                              "], one-sided p = " + fmt(p) + " over " + std::to_string(positions) +
                              " positions in " + std::to_string(n) + " contexts";
  Json test{{"t", std::isfinite(t) ? Json(t) : Json(nullptr)},
            {"df", df},
            {"p_value", p},
            {"alpha", policy.alpha}};
  return Json{{"contexts", n},
              {"positions", positions},
              {"unit_member", unit_name},
              {"members", std::move(per_member)},
              {"engine_sum", a},
              {"ratio", ratio},
              {"ci95", Json::array({lo, hi})},
              {"test", std::move(test)},
              {"class", beyond ? "beyond_legitimate" : "within_legitimate"},
              {"explanation",
               beyond ? "The engine is farther from the model's arithmetic than any legitimate "
                        "execution measured: " +
                            figures + " < alpha " + fmt(policy.alpha) + ". A bug is likely."
                      : "The engine is indistinguishable from a legitimate execution at this "
                        "panel's power: " +
                            figures + " (alpha " + fmt(policy.alpha) +
                            "). The interval's upper end is the largest excess it cannot "
                            "exclude; a larger panel narrows it."}};
}

using request_fields::field;
using request_fields::invalid;
using request_fields::only_fields;
using request_fields::string_field;

std::size_t AuditRequest::positions() const {
  std::size_t n = 0;
  for (const auto& c : contexts) n += c.token_ids.size();
  return n;
}

std::vector<std::string> AuditRequest::member_names() const {
  std::vector<std::string> names{"reference"};
  for (int s = 0; s < reduction_seeds; ++s) names.push_back("reduction:" + std::to_string(s));
  if (sdpa) names.push_back("sdpa");
  return names;
}

void AuditRequest::check_vocab(std::int64_t vocab_size) const {
  for (std::size_t c = 0; c < contexts.size(); ++c)
    for (std::size_t i = 0; i < contexts[c].token_ids.size(); ++i)
      if (contexts[c].token_ids[i] >= vocab_size)
        throw Error("request.invalid_token_id",
                    "request.panel.contexts[" + std::to_string(c) + "].token_ids[" +
                        std::to_string(i) + "] = " + std::to_string(contexts[c].token_ids[i]) +
                        " is not below the model's vocab_size " + std::to_string(vocab_size));
}

namespace {

std::string absolute_path(const Json& obj, std::string_view key, const std::string& where) {
  std::string path = string_field(obj, key, where, 4096);
  if (path.front() != '/' || path.find('\0') != std::string::npos)
    invalid(where + "." + std::string(key) + " \"" + path + "\" is not an absolute path");
  return path;
}

}  // namespace

AuditRequest validate_audit_request(const Json& doc) {
  if (!doc.is_object()) invalid("the request must be a JSON object");
  const Json& schema = field(doc, "schema", "request");
  if (!schema.is_string() || schema.get<std::string>() != kAuditRequest)
    throw Error("request.unknown_schema", "request.schema " + schema.dump().substr(0, 80) +
                                              " is not \"" + std::string(kAuditRequest) + "\"");
  only_fields(doc,
              {"schema", "id", "model_dir", "model_identity", "engine", "panel", "audit", "limits"},
              "request");
  AuditRequest r;
  r.schema = kAuditRequest;
  r.id = string_field(doc, "id", "request", 256);
  r.model_dir = absolute_path(doc, "model_dir", "request");
  while (r.model_dir.size() > 1 && r.model_dir.back() == '/') r.model_dir.pop_back();
  if (auto mi = doc.find("model_identity"); mi != doc.end()) {
    validate_model_identity(*mi, "request.model_identity");
    r.model_identity = *mi;
  }
  const Json& engine = field(doc, "engine", "request");
  if (!engine.is_object())
    invalid("request.engine must be an object, got " + engine.dump().substr(0, 80));
  only_fields(engine, {"name", "logits"}, "request.engine");
  r.engine = string_field(engine, "name", "request.engine", 64);
  for (unsigned char ch : r.engine)
    if (ch < 0x20 || ch > 0x7e)
      invalid("request.engine.name \"" + r.engine + "\" is not printable ASCII");
  const Json& files = field(engine, "logits", "request.engine");
  const Json& panel = field(doc, "panel", "request");
  if (!panel.is_object())
    invalid("request.panel must be an object, got " + panel.dump().substr(0, 80));
  only_fields(panel, {"contexts"}, "request.panel");
  const Json& contexts = field(panel, "contexts", "request.panel");
  if (!contexts.is_array() || contexts.size() < 2 || contexts.size() > kMaxAuditContexts)
    invalid(
        "request.panel.contexts must be an array of 2.." + std::to_string(kMaxAuditContexts) +
        " contexts (the test compares contexts), got " +
        (contexts.is_array() ? std::to_string(contexts.size()) : contexts.dump().substr(0, 80)));
  if (!files.is_array() || files.size() != contexts.size())
    invalid("request.engine.logits must hold one file per panel context (" +
            std::to_string(contexts.size()) + "), got " +
            (files.is_array() ? std::to_string(files.size()) : files.dump().substr(0, 80)));
  std::vector<std::string> ids;
  for (std::size_t i = 0; i < contexts.size(); ++i) {
    const std::string where = "request.panel.contexts[" + std::to_string(i) + "]";
    const Json& c = contexts[i];
    if (!c.is_object()) invalid(where + " must be an object, got " + c.dump().substr(0, 80));
    only_fields(c, {"id", "token_ids"}, where);
    AuditContext ctx;
    ctx.id = c.contains("id") ? string_field(c, "id", where, 128) : "c" + std::to_string(i);
    for (const auto& seen : ids)
      if (seen == ctx.id) invalid(where + ".id \"" + ctx.id + "\" is not unique");
    ids.push_back(ctx.id);
    ctx.token_ids = parse_token_id_array(c, "token_ids", where, false);
    const std::string file_where = "request.engine.logits[" + std::to_string(i) + "]";
    const Json& f = files[i];
    if (!f.is_object()) invalid(file_where + " must be an object, got " + f.dump().substr(0, 80));
    only_fields(f, {"path", "sha256"}, file_where);
    ctx.logits_path = absolute_path(f, "path", file_where);
    ctx.logits_sha256 = string_field(f, "sha256", file_where, 71);
    if (!is_identity(ctx.logits_sha256))
      invalid(file_where + ".sha256 \"" + ctx.logits_sha256 +
              "\" is not \"sha256:\" and 64 lowercase hex digits");
    r.contexts.push_back(std::move(ctx));
  }
  if (r.positions() > kMaxAuditPositions)
    invalid("request.panel has " + std::to_string(r.positions()) + " positions, more than " +
            std::to_string(kMaxAuditPositions));
  if (auto it = doc.find("audit"); it != doc.end()) {
    if (!it->is_object()) invalid("request.audit must be an object, got " + it->dump());
    only_fields(*it, {"reduction_seeds", "sdpa", "alpha"}, "request.audit");
    if (auto s = it->find("reduction_seeds"); s != it->end()) {
      if (!s->is_number_integer() || s->get<std::int64_t>() < 1 ||
          s->get<std::int64_t>() > kMaxAuditReductionSeeds)
        invalid("request.audit.reduction_seeds must be an integer in 1.." +
                std::to_string(kMaxAuditReductionSeeds) + ", got " + s->dump());
      r.reduction_seeds = s->get<int>();
    }
    if (auto s = it->find("sdpa"); s != it->end()) {
      if (!s->is_boolean()) invalid("request.audit.sdpa must be true or false, got " + s->dump());
      r.sdpa = s->get<bool>();
    }
    if (it->contains("alpha"))
      r.policy = audit_policy(Json{{"alpha", (*it)["alpha"]}}, "request.audit");
  }
  r.limits = parse_request_limits(doc);
  r.request_sha256 = sha256_canonical_id(doc);
  r.document = doc;
  return r;
}

}  // namespace assay::common
