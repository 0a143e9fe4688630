// The one writer and the one reader of assay.process-containment.v1. The reader checks what
// the schema says (required and unknown fields, types, enums, constants, minimums), so that a
// document it accepts is one to_json could have written.
#include "supervisor/contain/evidence.h"

#include <algorithm>
#include <climits>
#include <initializer_list>
#include <string_view>

#include "common/error.h"
#include "common/protocol.h"

namespace assay::contain {

namespace {

using common::Json;

Json opt(const std::optional<std::uint64_t>& v) {
  return v ? Json(*v) : Json(nullptr);
}
Json opt(const std::optional<std::string>& v) {
  return v ? Json(*v) : Json(nullptr);
}
Json opt(const std::optional<int>& v) {
  return v ? Json(*v) : Json(nullptr);
}
Json opt(const std::optional<double>& v) {
  return v ? Json(*v) : Json(nullptr);
}

constexpr const char* kNormalisedFields[] = {
    "memory_high_events",     "memory_max_events", "memory_oom_events",
    "memory_oom_kill_events", "memory_peak_bytes", "memory_swap_bytes",
    "elapsed_seconds",        "timeout_seconds",   "exit_code"};

Json normalised_json(const NormalisedEvidence& n) {
  return Json{{"memory_high_events", opt(n.memory_high_events)},
              {"memory_max_events", opt(n.memory_max_events)},
              {"memory_oom_events", opt(n.memory_oom_events)},
              {"memory_oom_kill_events", opt(n.memory_oom_kill_events)},
              {"memory_peak_bytes", opt(n.memory_peak_bytes)},
              {"memory_swap_bytes", opt(n.memory_swap_bytes)},
              {"elapsed_seconds", opt(n.elapsed_seconds)},
              {"timeout_seconds", opt(n.timeout_seconds)},
              {"exit_code", opt(n.exit_code)},
              {"sources", n.sources}};
}

Json counter_json(const Counter& c) {
  if (c.keys) {
    Json o = Json::object();
    for (const auto& [k, v] : *c.keys) o[k] = opt(v);
    return o;
  }
  return opt(c.value);
}

Json limits_json(const Limits& l) {
  return Json{{"memory_max", opt(l.memory_max)}, {"memory_high", opt(l.memory_high)},
              {"swap_max", opt(l.swap_max)},     {"pids_max", opt(l.pids_max)},
              {"timeout_ms", l.timeout.count()}, {"kill_grace_ms", l.kill_grace.count()}};
}

std::string hex64(std::uint64_t v) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) out[static_cast<std::size_t>(i)] = kHex[v & 0xf];
  return out;
}

Json capabilities_json(const Capabilities& c) {
  return Json{{"inheritable", hex64(c.inheritable)},
              {"permitted", hex64(c.permitted)},
              {"effective", hex64(c.effective)},
              {"bounding", hex64(c.bounding)},
              {"ambient", hex64(c.ambient)}};
}

Json seccomp_json(const SeccompEvidence& s) {
  return Json{{"policy_sha256", s.policy_sha256},
              {"arch", s.arch},
              {"denied", s.denied},
              {"enosys", s.enosys},
              {"clone_namespace_flags", "EPERM"},
              {"other_architectures", "EPERM"}};
}

Json stream_json(const StreamEvidence& s) {
  return Json{{"path", opt(s.path)}, {"bytes", s.bytes}, {"dropped_bytes", s.dropped_bytes}};
}

// A JSON value at a dotted path ("exit.code"), read as the schema allows it; every error names
// the path.
class Field {
 public:
  Field(const Json& value, std::string path) : v_(value), path_(std::move(path)) {}

  [[noreturn]] void fail(const std::string& what) const {
    std::string got = v_.dump();
    if (got.size() > 80) got = got.substr(0, 77) + "...";
    std::string where = path_.empty() ? "evidence" : "evidence field \"" + path_ + "\"";
    throw common::Error("contain.bad_evidence", where + ": " + what + ", got " + got);
  }

  bool is_null() const { return v_.is_null(); }

  // An object with exactly `keys`; returns a Field per key on demand.
  const Field& object(std::initializer_list<const char*> keys) const {
    if (!v_.is_object()) fail("expected an object");
    for (const char* k : keys) {
      if (!v_.contains(k)) {
        throw common::Error("contain.bad_evidence", "evidence field \"" + sub(k) + "\" is missing");
      }
    }
    for (const auto& item : v_.items()) {
      // Not a structured binding: clang before 16 cannot capture one in the lambda.
      const std::string& k = item.key();
      if (std::none_of(keys.begin(), keys.end(), [&](const char* want) { return k == want; })) {
        throw common::Error("contain.bad_evidence",
                            "evidence field \"" + sub(k) + "\" is not in the schema");
      }
    }
    return *this;
  }
  Field operator[](const std::string& key) const {
    if (!v_.is_object()) fail("expected an object");
    if (!v_.contains(key)) {
      throw common::Error("contain.bad_evidence", "evidence field \"" + sub(key) + "\" is missing");
    }
    return Field(v_[key], sub(key));
  }

  bool boolean() const {
    if (!v_.is_boolean()) fail("expected true or false");
    return v_.get<bool>();
  }
  std::string string() const {
    if (!v_.is_string()) fail("expected a string");
    return v_.get<std::string>();
  }
  std::string one_of(std::initializer_list<const char*> allowed) const {
    std::string s = string();
    if (std::none_of(allowed.begin(), allowed.end(), [&](const char* a) { return s == a; })) {
      fail("not an allowed value");
    }
    return s;
  }
  std::int64_t integer(std::int64_t min, std::int64_t max) const {
    if (!v_.is_number_integer()) fail("expected an integer");
    if (v_.is_number_unsigned() && v_.get<std::uint64_t>() > static_cast<std::uint64_t>(max)) {
      fail("out of range");
    }
    auto i = v_.get<std::int64_t>();
    if (i < min || i > max) fail("out of range");
    return i;
  }
  std::uint64_t count() const {
    if (!v_.is_number_integer()) fail("expected a non-negative integer");
    if (!v_.is_number_unsigned() && v_.get<std::int64_t>() < 0) {
      fail("expected a non-negative integer");
    }
    return v_.get<std::uint64_t>();
  }
  std::optional<std::uint64_t> count_or_null() const {
    if (is_null()) return std::nullopt;
    return count();
  }
  std::optional<std::string> string_or_null() const {
    if (is_null()) return std::nullopt;
    return string();
  }
  std::optional<int> int_or_null() const {
    if (is_null()) return std::nullopt;
    return static_cast<int>(integer(INT_MIN, INT_MAX));
  }
  std::vector<std::string> strings() const {
    if (!v_.is_array()) fail("expected an array of strings");
    std::vector<std::string> out;
    for (std::size_t i = 0; i < v_.size(); ++i) {
      out.push_back(Field(v_[i], path_ + "." + std::to_string(i)).string());
    }
    return out;
  }
  // Each member of an object, whatever its key.
  template <typename F>
  void each_member(F&& f) const {
    if (!v_.is_object()) fail("expected an object");
    for (const auto& [k, v] : v_.items()) f(k, Field(v, sub(k)));
  }
  void constant(const Json& want) const {
    if (v_ != want) fail("expected " + want.dump());
  }
  const Json& json() const { return v_; }

 private:
  std::string sub(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }

  const Json& v_;
  std::string path_;
};

// "2024-05-01T12:00:00.123Z", as the schema's pattern has it.
bool is_timestamp(const std::string& s) {
  constexpr std::string_view kShape = "dddd-dd-ddTdd:dd:dd.dddZ";  // d: a digit
  if (s.size() != kShape.size()) return false;
  for (std::size_t i = 0; i < s.size(); ++i) {
    bool ok = kShape[i] == 'd' ? (s[i] >= '0' && s[i] <= '9') : s[i] == kShape[i];
    if (!ok) return false;
  }
  return true;
}

bool is_sha256_id(const std::string& s) {
  return s.size() == 71 && s.starts_with("sha256:") &&
         std::all_of(s.begin() + 7, s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

bool is_worker_name(const std::string& s) {
  auto allowed = [](char c, bool first) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           (!first && (c == '.' || c == '-'));
  };
  if (s.empty() || s.size() > 200 || !allowed(s[0], true)) return false;
  return std::all_of(s.begin() + 1, s.end(), [&](char c) { return allowed(c, false); });
}

Counter read_counter(const Field& f) {
  Counter c;
  if (f.is_null()) return c;
  if (f.json().is_object()) {
    c.keys.emplace();
    f.each_member([&](const std::string& k, const Field& v) { (*c.keys)[k] = v.count_or_null(); });
    return c;
  }
  c.value = f.count();
  return c;
}

// A "counters" object: kernel file name -> counter.
Counters read_counters(const Field& f) {
  Counters out;
  f.each_member([&](const std::string& k, const Field& v) { out[k] = read_counter(v); });
  return out;
}

Json counters_json(const Counters& counters) {
  Json out = Json::object();
  for (const auto& [file, c] : counters) out[file] = counter_json(c);
  return out;
}

StreamEvidence read_stream(const Field& f) {
  f.object({"path", "bytes", "dropped_bytes"});
  return {f["path"].string_or_null(), f["bytes"].count(), f["dropped_bytes"].count()};
}

Limits read_limits(const Field& f) {
  f.object({"memory_max", "memory_high", "swap_max", "pids_max", "timeout_ms", "kill_grace_ms"});
  Limits l;
  l.memory_max = f["memory_max"].count_or_null();
  l.memory_high = f["memory_high"].count_or_null();
  l.swap_max = f["swap_max"].count_or_null();
  l.pids_max = f["pids_max"].count_or_null();
  l.timeout = std::chrono::milliseconds(f["timeout_ms"].integer(1, INT64_MAX));
  l.kill_grace = std::chrono::milliseconds(f["kill_grace_ms"].integer(0, INT64_MAX));
  return l;
}

// 16 lowercase hex digits, as /proc/PID/status shows a capability set.
std::uint64_t read_hex64(const Field& f) {
  std::string s = f.string();
  std::uint64_t v = 0;
  if (s.size() != 16) f.fail("expected 16 lowercase hex digits");
  for (char c : s) {
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) f.fail("expected 16 lowercase hex digits");
    v = v << 4 | static_cast<std::uint64_t>(d);
  }
  return v;
}

Capabilities read_capabilities(const Field& f) {
  f.object({"inheritable", "permitted", "effective", "bounding", "ambient"});
  return {read_hex64(f["inheritable"]), read_hex64(f["permitted"]), read_hex64(f["effective"]),
          read_hex64(f["bounding"]), read_hex64(f["ambient"])};
}

SeccompEvidence read_seccomp(const Field& f) {
  f.object({"policy_sha256", "arch", "denied", "enosys", "clone_namespace_flags",
            "other_architectures"});
  SeccompEvidence s;
  s.policy_sha256 = f["policy_sha256"].string();
  if (!is_sha256_id(s.policy_sha256)) f["policy_sha256"].fail("expected sha256:<64 hex>");
  s.arch = f["arch"].one_of({"x86_64", "aarch64"});
  s.denied = f["denied"].strings();
  s.enosys = f["enosys"].strings();
  f["clone_namespace_flags"].constant("EPERM");
  f["other_architectures"].constant("EPERM");
  return s;
}

SpawnEvidence read_spawn(const Field& f) {
  f.object({"method", "argv", "workdir", "environment_keys", "uid", "gid", "no_new_privs",
            "dumpable_before_exec", "rlimits", "stdin", "pass_fds", "capabilities", "seccomp"});
  SpawnEvidence s;
  s.method = f["method"].one_of({"clone3-into-cgroup", "clone3-self-attach", "clone-self-attach",
                                 "clone3-pipe-gate", "clone-pipe-gate"});
  s.argv = f["argv"].strings();
  if (s.argv.empty()) f["argv"].fail("expected at least one element");
  s.workdir = f["workdir"].string();
  s.environment_keys = f["environment_keys"].strings();
  if (!f["uid"].is_null()) s.uid = static_cast<uid_t>(f["uid"].integer(0, UINT32_MAX));
  if (!f["gid"].is_null()) s.gid = static_cast<gid_t>(f["gid"].integer(0, UINT32_MAX));
  f["no_new_privs"].constant(true);
  Field rl = f["rlimits"];
  rl.object({"core", "nofile"});
  rl["core"].constant(0);
  s.rlimit_nofile = static_cast<std::uint64_t>(rl["nofile"].integer(1, INT64_MAX));
  f["stdin"].constant("/dev/null");
  f["dumpable_before_exec"].constant(false);
  s.pass_fds = static_cast<std::uint32_t>(f["pass_fds"].integer(0, UINT32_MAX));
  s.capabilities = read_capabilities(f["capabilities"]);
  s.seccomp = read_seccomp(f["seccomp"]);
  return s;
}

CgroupEvidence read_cgroup(const Field& f) {
  f.object({"path", "hierarchies", "removed"});
  CgroupEvidence c;
  c.path = f["path"].string();
  f["hierarchies"].each_member(
      [&](const std::string& k, const Field& v) { c.hierarchies[k] = v.string(); });
  c.removed = f["removed"].boolean();
  return c;
}

// "network", "pid_namespace" and "mounts", each null or an object.
void read_namespaces(const Field& doc, Evidence& e) {
  if (Field f = doc["network"]; !f.is_null()) {
    f.object({"namespace", "interfaces"});
    e.network = NetworkEvidence{f["namespace"].one_of({"private", "shared"}) == "private",
                                f["interfaces"].strings()};
  }
  if (Field f = doc["pid_namespace"]; !f.is_null()) {
    f.object({"namespace"});
    e.pid_namespace_private = f["namespace"].one_of({"private", "shared"}) == "private";
  }
  if (Field f = doc["mounts"]; !f.is_null()) {
    f.object({"namespace", "proc", "sys", "hidden", "absent"});
    f["namespace"].constant("private");
    f["proc"].constant("pid-namespace");
    f["sys"].constant("network-namespace");
    e.mounts = MountsEvidence{f["hidden"].strings(), f["absent"].strings()};
  }
}

}  // namespace

Json NetworkEvidence::to_json() const {
  return Json{{"namespace", private_namespace ? "private" : "shared"}, {"interfaces", interfaces}};
}

Json Evidence::to_json() const {
  Json e;
  e["schema"] = std::string(protocol::kProcessContainment);
  e["name"] = name;
  e["mode"] = mode;
  e["orphan"] = orphan;
  e["cgroup"] = cgroup ? Json{{"path", cgroup->path},
                              {"hierarchies", cgroup->hierarchies},
                              {"removed", cgroup->removed}}
                       : Json(nullptr);
  if (spawn) {
    e["spawn"] = Json{{"method", spawn->method},
                      {"argv", spawn->argv},
                      {"workdir", spawn->workdir},
                      {"environment_keys", spawn->environment_keys},
                      {"uid", spawn->uid ? Json(*spawn->uid) : Json(nullptr)},
                      {"gid", spawn->gid ? Json(*spawn->gid) : Json(nullptr)},
                      {"no_new_privs", true},
                      {"dumpable_before_exec", false},
                      {"rlimits", Json{{"core", 0}, {"nofile", spawn->rlimit_nofile}}},
                      {"stdin", "/dev/null"},
                      {"pass_fds", spawn->pass_fds},
                      {"capabilities", capabilities_json(spawn->capabilities)},
                      {"seccomp", seccomp_json(spawn->seccomp)}};
  } else {
    e["spawn"] = nullptr;
  }
  e["limits"] = limits ? limits_json(*limits) : Json(nullptr);
  e["network"] = network ? network->to_json() : Json(nullptr);
  e["pid_namespace"] = pid_namespace_private
                           ? Json{{"namespace", *pid_namespace_private ? "private" : "shared"}}
                           : Json(nullptr);
  e["mounts"] = mounts ? Json{{"namespace", "private"},
                              {"proc", "pid-namespace"},
                              {"sys", "network-namespace"},
                              {"hidden", mounts->hidden},
                              {"absent", mounts->absent}}
                       : Json(nullptr);
  e["started_at"] = opt(started_at);
  e["wall_usec"] = opt(wall_usec);
  e["exit"] = exit ? Json{{"code", opt(exit->code)},
                          {"signal", opt(exit->signal)},
                          {"signal_name", opt(exit->signal_name)},
                          {"core_dumped", exit->core_dumped}}
                   : Json(nullptr);
  e["cpu"] = Json{{"user_usec", opt(cpu.user_usec)},
                  {"system_usec", opt(cpu.system_usec)},
                  {"cgroup_usage_usec", opt(cpu.cgroup_usage_usec)}};
  e["timed_out"] = timed_out;
  e["cancelled"] = cancelled;
  e["sigterm_sent"] = sigterm_sent;
  e["cgroup_killed"] = cgroup_killed;
  e["kill_scope"] = kill_scope;
  e["leftover_processes_killed"] = leftover_processes_killed;
  e["oom_killed"] = oom_killed ? Json(*oom_killed) : Json(nullptr);
  e["memory"] = Json{{"peak_bytes", opt(memory_peak_bytes)},
                     {"swap_current_bytes", opt(memory_swap_current_bytes)},
                     {"swap_peak_bytes", opt(memory_swap_peak_bytes)}};
  e["pids_peak"] = opt(pids_peak);
  e["normalised"] = normalised_json(normalised());
  e["counters"] = counters ? counters_json(*counters) : Json(nullptr);
  e["output"] = output ? Json{{"stdout", stream_json(output->out)},
                              {"stderr", stream_json(output->err)},
                              {"cap_bytes", output->cap_bytes}}
                       : Json(nullptr);
  e["errors"] = errors;
  if (executor) e["executor"] = *executor;
  if (resident) {
    Json start =
        resident->counters_at_start ? counters_json(*resident->counters_at_start) : Json(nullptr);
    e["resident"] =
        Json{{"worker", resident->worker},           {"loaded_at", resident->loaded_at},
             {"jobs_before", resident->jobs_before}, {"started_at", resident->started_at},
             {"counters_at_start", start},           {"reset", resident->reset}};
  }
  return e;
}

Evidence Evidence::from_json(const Json& document) {
  // "executor" (the head's addition to a node's document) and "resident" (a resident worker's
  // job) are the optional members.
  Json json = document;
  std::optional<Json> executor;
  if (auto it = json.find("executor"); it != json.end()) {
    executor = *it;
    json.erase("executor");
  }
  std::optional<Json> resident;
  if (auto it = json.find("resident"); it != json.end()) {
    resident = *it;
    json.erase("resident");
  }
  Field doc(json, "");
  doc.object({"schema",        "name",          "mode",       "orphan",
              "cgroup",        "spawn",         "limits",     "network",
              "pid_namespace", "mounts",        "started_at", "wall_usec",
              "exit",          "cpu",           "timed_out",  "cancelled",
              "sigterm_sent",  "cgroup_killed", "kill_scope", "leftover_processes_killed",
              "oom_killed",    "memory",        "pids_peak",  "normalised",
              "counters",      "output",        "errors"});
  doc["schema"].constant(std::string(protocol::kProcessContainment));
  Evidence e;
  e.name = doc["name"].string();
  if (!is_worker_name(e.name)) doc["name"].fail("not a worker name");
  e.mode = doc["mode"].one_of({"cgroup-v2", "cgroup-v1", "none"});
  e.orphan = doc["orphan"].boolean();

  if (Field f = doc["cgroup"]; !f.is_null()) e.cgroup = read_cgroup(f);
  if (Field f = doc["spawn"]; !f.is_null()) e.spawn = read_spawn(f);
  if (Field f = doc["limits"]; !f.is_null()) e.limits = read_limits(f);
  read_namespaces(doc, e);
  e.started_at = doc["started_at"].string_or_null();
  if (e.started_at && !is_timestamp(*e.started_at)) {
    doc["started_at"].fail("expected a UTC time like 2024-05-01T12:00:00.123Z");
  }
  e.wall_usec = doc["wall_usec"].count_or_null();
  if (Field f = doc["exit"]; !f.is_null()) {
    f.object({"code", "signal", "signal_name", "core_dumped"});
    e.exit = ExitStatus{f["code"].int_or_null(), f["signal"].int_or_null(),
                        f["signal_name"].string_or_null(), f["core_dumped"].boolean()};
  }
  Field cpu = doc["cpu"];
  cpu.object({"user_usec", "system_usec", "cgroup_usage_usec"});
  e.cpu = CpuEvidence{cpu["user_usec"].count_or_null(), cpu["system_usec"].count_or_null(),
                      cpu["cgroup_usage_usec"].count_or_null()};
  e.timed_out = doc["timed_out"].boolean();
  e.cancelled = doc["cancelled"].boolean();
  e.sigterm_sent = doc["sigterm_sent"].boolean();
  e.cgroup_killed = doc["cgroup_killed"].boolean();
  e.kill_scope = doc["kill_scope"].one_of({"cgroup", "process-group"});
  e.leftover_processes_killed =
      static_cast<int>(doc["leftover_processes_killed"].integer(0, INT_MAX));
  if (!doc["oom_killed"].is_null()) e.oom_killed = doc["oom_killed"].boolean();
  Field memory = doc["memory"];
  memory.object({"peak_bytes", "swap_current_bytes", "swap_peak_bytes"});
  e.memory_peak_bytes = memory["peak_bytes"].count_or_null();
  e.memory_swap_current_bytes = memory["swap_current_bytes"].count_or_null();
  e.memory_swap_peak_bytes = memory["swap_peak_bytes"].count_or_null();
  e.pids_peak = doc["pids_peak"].count_or_null();
  if (Field f = doc["counters"]; !f.is_null()) e.counters = read_counters(f);
  if (Field f = doc["output"]; !f.is_null()) {
    f.object({"stdout", "stderr", "cap_bytes"});
    e.output =
        OutputEvidence{read_stream(f["stdout"]), read_stream(f["stderr"]), f["cap_bytes"].count()};
  }
  e.errors = doc["errors"].strings();
  if (executor && !executor->is_null()) {
    const Json kind = executor->is_object() ? executor->value("kind", Json()) : Json();
    if (kind != "slurm" && kind != "slurm-pool")
      throw common::Error("contain.bad_evidence",
                          "evidence field \"executor\" is not the Slurm executor's or a Slurm "
                          "pool's object");
    e.executor = *executor;
  }
  if (resident) {
    Field f(*resident, "resident");
    f.object({"worker", "loaded_at", "jobs_before", "started_at", "counters_at_start", "reset"});
    ResidentEvidence r;
    r.worker = f["worker"].string();
    r.loaded_at = f["loaded_at"].string();
    r.jobs_before = f["jobs_before"].count();
    r.started_at = f["started_at"].string();
    for (const char* k : {"loaded_at", "started_at"})
      if (!is_timestamp(f[k].string()))
        f[k].fail("expected a UTC time like 2024-05-01T12:00:00.123Z");
    if (Field c = f["counters_at_start"]; !c.is_null()) r.counters_at_start = read_counters(c);
    r.reset = f["reset"].strings();
    e.resident = std::move(r);
  }
  // Derived, never stored: a document whose "normalised" differs from its raw fields was not
  // written by to_json.
  Field normalised = doc["normalised"];
  normalised.object({"memory_high_events", "memory_max_events", "memory_oom_events",
                     "memory_oom_kill_events", "memory_peak_bytes", "memory_swap_bytes",
                     "elapsed_seconds", "timeout_seconds", "exit_code", "sources"});
  Json want = normalised_json(e.normalised());
  for (const char* k : kNormalisedFields) {
    if (normalised[k].json() != want[k])
      normalised[k].fail("expected " + want[k].dump() + " (derived from the raw counters)");
  }
  if (normalised["sources"].json() != want["sources"])
    normalised["sources"].fail("expected " + want["sources"].dump());
  return e;
}

}  // namespace assay::contain
