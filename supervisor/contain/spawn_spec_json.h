// The assay.contain-spec.v1 document: a contain::SpawnSpec as JSON, written by the Slurm executor
// on the head and read by `assayd contain --spec FILE` on a compute node. One writer
// (spawn_spec_to_json) and one strict reader (spawn_spec_from_json), header-only so that the
// statically linked `assayd` (assay_contain + assay_base) needs nothing more.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/json.h"
#include "supervisor/contain/contain.h"

namespace assay::contain {

inline constexpr const char* kContainSpecSchema = "assay.contain-spec.v1";

namespace spec_json_detail {

inline common::Json optional_u64(const std::optional<std::uint64_t>& v) {
  return v ? common::Json(*v) : common::Json(nullptr);
}

[[noreturn]] inline void bad(const std::string& field, const std::string& why) {
  throw common::Error("contain.bad_spec",
                      std::string(kContainSpecSchema) + " field \"" + field + "\" " + why);
}

inline const common::Json& field(const common::Json& o, const std::string& key) {
  auto it = o.find(key);
  if (it == o.end()) bad(key, "is missing");
  return *it;
}

inline std::string string_field(const common::Json& o, const std::string& key) {
  const auto& v = field(o, key);
  if (!v.is_string()) bad(key, "is not a string");
  return v.get<std::string>();
}

inline std::optional<std::string> nullable_string(const common::Json& o, const std::string& key) {
  const auto& v = field(o, key);
  if (v.is_null()) return std::nullopt;
  if (!v.is_string()) bad(key, "is neither a string nor null");
  return v.get<std::string>();
}

inline std::optional<std::uint64_t> nullable_u64(const common::Json& o, const std::string& key) {
  const auto& v = field(o, key);
  if (v.is_null()) return std::nullopt;
  if (!v.is_number_unsigned()) bad(key, "is neither a non-negative integer nor null");
  return v.get<std::uint64_t>();
}

inline std::uint64_t u64_field(const common::Json& o, const std::string& key) {
  const auto& v = field(o, key);
  if (!v.is_number_unsigned()) bad(key, "is not a non-negative integer");
  return v.get<std::uint64_t>();
}

inline std::vector<std::string> strings(const common::Json& o, const std::string& key) {
  const auto& v = field(o, key);
  if (!v.is_array()) bad(key, "is not an array");
  std::vector<std::string> out;
  for (const auto& s : v) {
    if (!s.is_string()) bad(key, "has an element that is not a string");
    out.push_back(s.get<std::string>());
  }
  return out;
}

inline void only(const common::Json& o, const std::vector<std::string>& allowed,
                 const std::string& where) {
  for (auto it = o.begin(); it != o.end(); ++it)
    if (std::find(allowed.begin(), allowed.end(), it.key()) == allowed.end())
      bad(where + it.key(), "is not a field of this document");
}

}  // namespace spec_json_detail

inline common::Json spawn_spec_to_json(const SpawnSpec& spec) {
  using spec_json_detail::optional_u64;
  common::Json hidden = common::Json::array();
  for (const auto& p : spec.hidden_paths) hidden.push_back(p.string());
  auto path_or_null = [](const std::filesystem::path& p) {
    return p.empty() ? common::Json(nullptr) : common::Json(p.string());
  };
  common::Json doc{
      {"schema", kContainSpecSchema},
      {"name", spec.name},
      {"argv", spec.argv},
      {"workdir", spec.workdir.string()},
      {"env", spec.env},
      {"stdout_path", path_or_null(spec.stdout_path)},
      {"stderr_path", path_or_null(spec.stderr_path)},
      {"output_cap_bytes", spec.output_cap_bytes},
      {"hidden_paths", hidden},
      {"uid", spec.uid ? common::Json(*spec.uid) : common::Json(nullptr)},
      {"gid", spec.gid ? common::Json(*spec.gid) : common::Json(nullptr)},
      {"nofile", spec.nofile},
      {"limits",
       {{"memory_max", optional_u64(spec.limits.memory_max)},
        {"memory_high", optional_u64(spec.limits.memory_high)},
        {"swap_max", optional_u64(spec.limits.swap_max)},
        {"pids_max", optional_u64(spec.limits.pids_max)},
        {"timeout_ms", static_cast<std::uint64_t>(spec.limits.timeout.count())},
        {"kill_grace_ms", static_cast<std::uint64_t>(spec.limits.kill_grace.count())}}},
  };
  if (!spec.node_env.empty()) doc["node_env"] = spec.node_env;
  return doc;
}

// Strict: throws common::Error("contain.bad_spec", ...) naming the field on a missing, unknown or
// mistyped field, a relative argv[0] or workdir, or an empty argv or name.
inline SpawnSpec spawn_spec_from_json(const common::Json& j) {
  using namespace spec_json_detail;
  if (!j.is_object()) bad("(document)", "is not an object");
  only(j,
       {"schema", "name", "argv", "workdir", "env", "stdout_path", "stderr_path",
        "output_cap_bytes", "hidden_paths", "uid", "gid", "nofile", "limits", "node_env"},
       "");
  if (string_field(j, "schema") != kContainSpecSchema)
    bad("schema", "is not \"" + std::string(kContainSpecSchema) + "\"");
  SpawnSpec spec;
  spec.name = string_field(j, "name");
  if (spec.name.empty() || spec.name.find('/') != std::string::npos || spec.name == "." ||
      spec.name == "..")
    bad("name", "\"" + spec.name + "\" is not a cgroup leaf name");
  spec.argv = strings(j, "argv");
  if (spec.argv.empty() || !spec.argv[0].starts_with('/'))
    bad("argv", "must start with an absolute path");
  spec.workdir = string_field(j, "workdir");
  if (!spec.workdir.is_absolute())
    bad("workdir", "\"" + spec.workdir.string() + "\" is not absolute");
  spec.env = strings(j, "env");
  for (const auto& kv : spec.env)
    if (kv.find('=') == std::string::npos || kv.front() == '=')
      bad("env", "\"" + kv + "\" is not KEY=VALUE");
  if (j.contains("node_env")) {
    spec.node_env = strings(j, "node_env");
    for (const auto& key : spec.node_env)
      if (key.empty() || key.find('=') != std::string::npos || key == "PATH")
        bad("node_env", "\"" + key + "\" is not a variable name (PATH excluded)");
  }
  spec.stdout_path = nullable_string(j, "stdout_path").value_or("");
  spec.stderr_path = nullable_string(j, "stderr_path").value_or("");
  spec.output_cap_bytes = u64_field(j, "output_cap_bytes");
  for (const auto& p : strings(j, "hidden_paths")) spec.hidden_paths.emplace_back(p);
  if (auto uid = nullable_u64(j, "uid")) spec.uid = static_cast<uid_t>(*uid);
  if (auto gid = nullable_u64(j, "gid")) spec.gid = static_cast<gid_t>(*gid);
  spec.nofile = u64_field(j, "nofile");
  const auto& limits = field(j, "limits");
  if (!limits.is_object()) bad("limits", "is not an object");
  only(limits, {"memory_max", "memory_high", "swap_max", "pids_max", "timeout_ms", "kill_grace_ms"},
       "limits.");
  spec.limits.memory_max = nullable_u64(limits, "memory_max");
  spec.limits.memory_high = nullable_u64(limits, "memory_high");
  spec.limits.swap_max = nullable_u64(limits, "swap_max");
  spec.limits.pids_max = nullable_u64(limits, "pids_max");
  auto timeout = u64_field(limits, "timeout_ms");
  auto grace = u64_field(limits, "kill_grace_ms");
  if (timeout == 0 || timeout > 7ULL * 24 * 3600 * 1000)
    bad("limits.timeout_ms", "must be in [1, 604800000]");
  if (grace == 0 || grace > 7ULL * 24 * 3600 * 1000)
    bad("limits.kill_grace_ms", "must be in [1, 604800000]");
  spec.limits.timeout = std::chrono::milliseconds(timeout);
  spec.limits.kill_grace = std::chrono::milliseconds(grace);
  return spec;
}

}  // namespace assay::contain
