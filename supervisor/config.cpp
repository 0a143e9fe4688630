#include "supervisor/config.h"

#include <algorithm>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <unistd.h>

#include "common/error.h"
#include "common/fs.h"
#include "common/json.h"
#include "common/text.h"

namespace assay::supervisor {

using common::Error;
using common::Json;

contain::Mode mode_from_name(const std::string& name) {
  if (name == "auto") return contain::Mode::kAuto;
  if (name == "v2") return contain::Mode::kV2;
  if (name == "v1") return contain::Mode::kV1;
  if (name == "none") return contain::Mode::kNone;
  throw Error("config.invalid", "containment \"" + name + "\" is not auto, v2, v1 or none");
}

std::string_view mode_name(contain::Mode mode) {
  switch (mode) {
    case contain::Mode::kAuto:
      return "auto";
    case contain::Mode::kV2:
      return "v2";
    case contain::Mode::kV1:
      return "v1";
    case contain::Mode::kNone:
      return "none";
  }
  return "auto";
}

namespace {

template <typename T>
void take_uint(const Json& j, const char* key, T& out) {
  auto it = j.find(key);
  if (it == j.end()) return;
  if (!it->is_number_unsigned())
    throw Error("config.invalid", std::string("config.") + key +
                                      " must be a non-negative integer, got " + it->dump());
  out = it->get<T>();
}

void take_string(const Json& j, const char* key, std::string& out) {
  auto it = j.find(key);
  if (it == j.end()) return;
  if (!it->is_string())
    throw Error("config.invalid", std::string("config.") + key + " must be a string");
  out = it->get<std::string>();
}

std::filesystem::path self_dir() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return {};
  buf[n] = 0;
  return std::filesystem::path(buf).parent_path();
}

// Next to assayd (installed layout), or the build tree's sibling folder.
std::filesystem::path find_worker(const std::string& name, const std::string& build_folder) {
  auto dir = self_dir();
  for (auto candidate : {dir / name, dir.parent_path() / build_folder / name})
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  return dir / name;
}

}  // namespace

ListenAddress metrics_endpoint(const std::string& value) {
  auto refuse = [&](const std::string& why) {
    return Error("config.invalid",
                 "config.metrics_listen \"" + common::printable(value, 200) + "\" " + why);
  };
  auto colon = value.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == value.size())
    throw refuse("is not HOST:PORT (e.g. 127.0.0.1:9464)");
  std::string host = value.substr(0, colon), port = value.substr(colon + 1);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  if (host == "localhost") host = "127.0.0.1";
  unsigned long p = 0;
  if (port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos ||
      (p = std::stoul(port)) < 1 || p > 65535)
    throw refuse("has no port in 1..65535");
  in_addr v4{};
  in6_addr v6{};
  if (::inet_pton(AF_INET, host.c_str(), &v4) == 1) {
    if ((ntohl(v4.s_addr) >> 24) != 127)
      throw refuse("is not a loopback address: metrics are served to this host only");
  } else if (::inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    if (!IN6_IS_ADDR_LOOPBACK(&v6))
      throw refuse("is not a loopback address: metrics are served to this host only");
  } else {
    throw refuse("does not name a numeric IP address (or localhost)");
  }
  return {host, static_cast<std::uint16_t>(p)};
}

std::span<const std::string_view> config_keys() {
  static constexpr std::string_view kKeys[] = {"socket",
                                               "state_dir",
                                               "socket_group",
                                               "admin_group",
                                               "metrics_listen",
                                               "fingerprint_worker",
                                               "compare_worker",
                                               "oracle_worker",
                                               "hf_worker",
                                               "oracle_backend",
                                               "containment",
                                               "base_cgroup",
                                               "delegated",
                                               "worker_user",
                                               "allow_root_workers",
                                               "fingerprint_cache",
                                               "oracle_device",
                                               "device_slots",
                                               "max_queue",
                                               "max_connections",
                                               "max_body_bytes",
                                               "max_header_bytes",
                                               "read_timeout_ms",
                                               "idle_timeout_ms",
                                               "memory_reserve_bytes",
                                               "worker_timeout_seconds",
                                               "prompt_render_timeout_seconds",
                                               "worker_memory_max",
                                               "worker_memory_margin",
                                               "memory_events",
                                               "worker_pids_max",
                                               "max_connections_per_user",
                                               "max_event_streams",
                                               "max_buffered_bytes",
                                               "fingerprint_threads",
                                               "worker_threads",
                                               "preflight_retry_ms",
                                               "executor",
                                               "slurm",
                                               "resident_models"};
  return kKeys;
}

void Config::load_file(const std::filesystem::path& path) {
  Json j = common::parse_strict(common::read_file(path, 1 << 20));
  if (!j.is_object()) throw Error("config.invalid", path.string() + " must hold a JSON object");
  for (auto it = j.begin(); it != j.end(); ++it)
    if (std::find(config_keys().begin(), config_keys().end(), it.key()) == config_keys().end())
      throw Error("json.unknown_field", "unknown field config/" + it.key() + " in " +
                                            path.string() +
                                            " (assayd serve --help lists the keys)");
  std::string s;
  if (take_string(j, "socket", s = socket.string()), !s.empty()) socket = s;
  if (take_string(j, "state_dir", s = state_dir.string()), !s.empty()) state_dir = s;
  take_string(j, "socket_group", socket_group);
  take_string(j, "metrics_listen", metrics_listen);
  if (!metrics_listen.empty()) metrics_endpoint(metrics_listen);  // refused here, by value
  take_string(j, "admin_group", admin_group);
  if (take_string(j, "fingerprint_worker", s = fingerprint_worker.string()), !s.empty())
    fingerprint_worker = s;
  if (take_string(j, "oracle_worker", s = oracle_worker.string()), !s.empty()) oracle_worker = s;
  if (take_string(j, "hf_worker", s = hf_worker.string()), !s.empty()) hf_worker = s;
  take_string(j, "oracle_backend", oracle_backend);
  if (oracle_backend != "libtorch" && oracle_backend != "transformers" && oracle_backend != "both")
    throw Error("config.invalid",
                "config.oracle_backend must be \"libtorch\", \"transformers\" or \"both\", got "
                "\"" +
                    oracle_backend + "\"");
  if (take_string(j, "compare_worker", s = compare_worker.string()), !s.empty()) compare_worker = s;
  if (j.contains("containment")) {
    take_string(j, "containment", s);
    containment.mode = mode_from_name(s);
  }
  take_string(j, "base_cgroup", containment.base_cgroup);
  if (auto it = j.find("delegated"); it != j.end()) {
    if (!it->is_boolean()) throw Error("config.invalid", "config.delegated must be a boolean");
    containment.delegated = it->get<bool>();
  }
  take_string(j, "worker_user", worker_user);
  if (auto it = j.find("fingerprint_cache"); it != j.end()) {
    if (!it->is_boolean() && !(it->is_string() && (*it == "on" || *it == "off")))
      throw Error("config.invalid",
                  "config.fingerprint_cache must be on|off or a boolean, got " + it->dump());
    fingerprint_cache = it->is_boolean() ? it->get<bool>() : *it == "on";
  }
  if (auto it = j.find("allow_root_workers"); it != j.end()) {
    if (!it->is_boolean())
      throw Error("config.invalid", "config.allow_root_workers must be a boolean");
    allow_root_workers = it->get<bool>();
  }
  take_string(j, "oracle_device", oracle_device);
  take_string(j, "executor", executor);
  if (auto it = j.find("slurm"); it != j.end()) load_slurm(*it);
  if (auto it = j.find("resident_models"); it != j.end()) load_resident(*it);
  load_limits(j);
}

void Config::load_resident(const Json& j) {
  if (!j.is_object()) throw Error("config.invalid", "config.resident_models must be an object");
  common::reject_unknown_fields(j, {"count", "memory_bytes", "idle_seconds"},
                                "config.resident_models");
  take_uint(j, "count", resident.count);
  if (resident.count > 64)
    throw Error("config.invalid", "config.resident_models.count must be in 0..64, got " +
                                      std::to_string(resident.count));
  if (auto it = j.find("memory_bytes"); it != j.end()) {
    std::uint64_t bytes = 0;
    take_uint(j, "memory_bytes", bytes);
    if (bytes < (64u << 20))
      throw Error("config.invalid",
                  "config.resident_models.memory_bytes must be at least 64 MiB, got " +
                      std::to_string(bytes));
    resident.memory_bytes = bytes;
  }
  if (auto it = j.find("idle_seconds"); it != j.end()) {
    if (!it->is_number() || !(it->get<double>() >= 1 && it->get<double>() <= 7 * 86400.0))
      throw Error(
          "config.invalid",
          "config.resident_models.idle_seconds must be a number in [1, 604800], got " + it->dump());
    resident.idle_seconds = it->get<double>();
  }
}

void Config::load_slurm(const Json& j) {
  if (!j.is_object()) throw Error("config.invalid", "config.slurm must be an object");
  common::reject_unknown_fields(j,
                                {"shared_dir", "partition", "account", "qos", "sbatch_args",
                                 "node_assayd", "contain_args", "oracle_gpus", "poll_ms", "pool"},
                                "config.slurm");
  std::string s;
  if (take_string(j, "shared_dir", s = slurm.shared_dir.string()), !s.empty()) slurm.shared_dir = s;
  take_string(j, "partition", slurm.partition);
  take_string(j, "account", slurm.account);
  take_string(j, "qos", slurm.qos);
  if (take_string(j, "node_assayd", s = slurm.node_assayd.string()), !s.empty())
    slurm.node_assayd = s;
  for (auto [key, out] : {std::pair{"sbatch_args", &slurm.sbatch_args},
                          std::pair{"contain_args", &slurm.contain_args}}) {
    auto it = j.find(key);
    if (it == j.end()) continue;
    if (!it->is_array())
      throw Error("config.invalid", std::string("config.slurm.") + key + " must be an array");
    out->clear();
    for (const Json& a : *it) {
      if (!a.is_string())
        throw Error("config.invalid",
                    std::string("config.slurm.") + key + " holds a non-string: " + a.dump());
      out->push_back(a.get<std::string>());
    }
  }
  take_uint(j, "oracle_gpus", slurm.oracle_gpus);
  take_uint(j, "poll_ms", slurm.poll_ms);
  if (auto it = j.find("pool"); it != j.end()) load_pool(*it);
}

void Config::load_pool(const Json& j) {
  if (!j.is_object()) throw Error("config.invalid", "config.slurm.pool must be an object");
  common::reject_unknown_fields(
      j,
      {"nodes", "listen", "idle_seconds", "sbatch_args", "memory_bytes", "time_minutes",
       "resident_models", "start_timeout_seconds", "partition", "gpus"},
      "config.slurm.pool");
  auto& pool = slurm.pool;
  take_uint(j, "nodes", pool.nodes);
  take_string(j, "listen", pool.listen);
  take_string(j, "partition", pool.partition);
  take_uint(j, "gpus", pool.gpus);
  take_uint(j, "memory_bytes", pool.memory_bytes);
  take_uint(j, "time_minutes", pool.time_minutes);
  take_uint(j, "resident_models", pool.resident_models);
  for (auto [key, out] : {std::pair{"idle_seconds", &pool.idle_seconds},
                          std::pair{"start_timeout_seconds", &pool.start_timeout_seconds}}) {
    auto it = j.find(key);
    if (it == j.end()) continue;
    if (!it->is_number() || !(it->get<double>() >= 1 && it->get<double>() <= 7 * 86400.0))
      throw Error("config.invalid", std::string("config.slurm.pool.") + key +
                                        " must be a number in [1, 604800], got " + it->dump());
    *out = it->get<double>();
  }
  if (auto it = j.find("sbatch_args"); it != j.end()) {
    if (!it->is_array())
      throw Error("config.invalid", "config.slurm.pool.sbatch_args must be an array");
    pool.sbatch_args.clear();
    for (const Json& a : *it) {
      if (!a.is_string())
        throw Error("config.invalid",
                    "config.slurm.pool.sbatch_args holds a non-string: " + a.dump());
      pool.sbatch_args.push_back(a.get<std::string>());
    }
  }
}

void Config::load_limits(const Json& j) {
  unsigned slots = device_slots;
  take_uint(j, "device_slots", slots);
  device_slots = static_cast<int>(slots);
  take_uint(j, "max_queue", max_queue);
  take_uint(j, "max_connections", max_connections);
  take_uint(j, "max_body_bytes", max_body_bytes);
  take_uint(j, "max_header_bytes", max_header_bytes);
  take_uint(j, "read_timeout_ms", read_timeout_ms);
  take_uint(j, "idle_timeout_ms", idle_timeout_ms);
  take_uint(j, "memory_reserve_bytes", memory_reserve_bytes);
  take_uint(j, "preflight_retry_ms", preflight_retry_ms);
  take_uint(j, "worker_pids_max", worker_pids_max);
  take_uint(j, "max_connections_per_user", max_connections_per_user);
  take_uint(j, "max_event_streams", max_event_streams);
  take_uint(j, "max_buffered_bytes", max_buffered_bytes);
  if (auto it = j.find("worker_memory_margin"); it != j.end()) {
    if (!it->is_number())
      throw Error("config.invalid",
                  "config.worker_memory_margin must be a number, got " + it->dump());
    worker_memory_margin = it->get<double>();
  }
  if (auto it = j.find("memory_events"); it != j.end())
    memory_events = common::memory_policy_from(*it, "config.memory_events", "config.invalid");
  unsigned threads = fingerprint_threads;
  take_uint(j, "fingerprint_threads", threads);
  fingerprint_threads = static_cast<int>(threads);
  unsigned intra = static_cast<unsigned>(worker_threads);
  take_uint(j, "worker_threads", intra);
  if (intra > 1024)
    throw Error("config.invalid", "config.worker_threads must be 0 (every CPU) to 1024, got " +
                                      std::to_string(intra));
  worker_threads = static_cast<int>(intra);
  if (auto it = j.find("worker_timeout_seconds"); it != j.end()) {
    if (!it->is_number())
      throw Error("config.invalid", "config.worker_timeout_seconds must be a number");
    worker_timeout_seconds = it->get<double>();
  }
  if (auto it = j.find("prompt_render_timeout_seconds"); it != j.end()) {
    if (!it->is_number())
      throw Error("config.invalid",
                  "config.prompt_render_timeout_seconds must be a number, got " + it->dump());
    prompt_render_timeout_seconds = it->get<double>();
  }
  if (auto it = j.find("worker_memory_max"); it != j.end() && !it->is_null()) {
    std::uint64_t v = 0;
    take_uint(j, "worker_memory_max", v);
    worker_memory_max = v;
  }
}

void Config::finalize() {
  if (state_dir.empty()) throw Error("config.invalid", "--state-dir is required");
  if (!state_dir.is_absolute()) state_dir = std::filesystem::absolute(state_dir);
  if (!socket.empty() && !socket.is_absolute()) socket = std::filesystem::absolute(socket);
  if (fingerprint_worker.empty())
    fingerprint_worker = find_worker("assay-fingerprint", "fingerprint");
  if (oracle_worker.empty()) oracle_worker = find_worker("assay-oracle", "worker");
  if (compare_worker.empty()) compare_worker = find_worker("assay-compare", "compare");
  if (hf_worker.empty()) hf_worker = find_worker("assay-hf-worker", "worker");
  // Workers are exec'd by absolute path (the worker's cwd is its workspace).
  for (auto* w : {&fingerprint_worker, &oracle_worker, &compare_worker, &hf_worker})
    if (!w->is_absolute()) *w = std::filesystem::absolute(*w);
  if (device_slots < 1 || device_slots > 64)
    throw Error("config.invalid",
                "device_slots must be in 1..64, got " + std::to_string(device_slots));
  if (max_queue < 1) throw Error("config.invalid", "max_queue must be at least 1");
  if (max_connections < 1) throw Error("config.invalid", "max_connections must be at least 1");
  if (max_body_bytes < 1024)
    throw Error("config.invalid",
                "max_body_bytes must be at least 1024, got " + std::to_string(max_body_bytes));
  if (!(worker_memory_margin >= 1.0 && worker_memory_margin <= 100.0))
    throw Error("config.invalid", "worker_memory_margin must be in [1, 100], got " +
                                      std::to_string(worker_memory_margin));
  if (worker_pids_max < 16)
    throw Error("config.invalid",
                "worker_pids_max must be at least 16, got " + std::to_string(worker_pids_max));
  if (max_connections_per_user < 1 || max_event_streams < 1)
    throw Error("config.invalid", "max_connections_per_user and max_event_streams must be >= 1");
  if (max_buffered_bytes < max_body_bytes)
    throw Error("config.invalid", "max_buffered_bytes (" + std::to_string(max_buffered_bytes) +
                                      ") must be at least max_body_bytes (" +
                                      std::to_string(max_body_bytes) + ")");
  if (!socket.empty()) {
    std::error_code ec;
    if (!std::filesystem::is_directory(socket.parent_path(), ec))
      throw Error("config.invalid", "the socket's directory " + socket.parent_path().string() +
                                        " does not exist (or is not a directory)");
  }
  if (worker_timeout_seconds <= 0)
    throw Error("config.invalid", "worker_timeout_seconds must be positive, got " +
                                      std::to_string(worker_timeout_seconds));
  if (!(prompt_render_timeout_seconds > 0))
    throw Error("config.invalid", "prompt_render_timeout_seconds must be positive, got " +
                                      std::to_string(prompt_render_timeout_seconds));
  finalize_executor();
}

void Config::finalize_executor() {
  if (executor == "local") return;
  if (executor != "slurm")
    throw Error("config.invalid", "executor \"" + executor + "\" is not local or slurm");
  const auto& shared = slurm.shared_dir;
  if (shared.empty() || !shared.is_absolute())
    throw Error("config.invalid",
                "executor slurm needs slurm.shared_dir, an absolute path (got \"" +
                    shared.string() + "\")");
  std::error_code ec;
  if (!std::filesystem::is_directory(shared, ec))
    throw Error("config.invalid", "slurm.shared_dir " + shared.string() + " is not a directory");
  // The workspaces must not expose the state directory (the signing key, other jobs), nor live
  // inside it.
  auto inside = [](const std::filesystem::path& a, const std::filesystem::path& b) {
    auto rel = a.lexically_normal().lexically_relative(b.lexically_normal());
    return !rel.empty() && *rel.begin() != "..";
  };
  if (inside(shared, state_dir) || inside(state_dir, shared))
    throw Error("config.invalid", "slurm.shared_dir " + shared.string() +
                                      " and the state directory " + state_dir.string() +
                                      " must not contain one another (the signing key stays "
                                      "off the shared file system)");
  if (slurm.poll_ms < 50 || slurm.poll_ms > 600'000)
    throw Error("config.invalid",
                "slurm.poll_ms must be in 50..600000, got " + std::to_string(slurm.poll_ms));
  if (slurm.oracle_gpus > 64)
    throw Error("config.invalid",
                "slurm.oracle_gpus must be in 0..64, got " + std::to_string(slurm.oracle_gpus));
  const auto& pool = slurm.pool;
  if (pool.nodes == 0) return;
  if (pool.nodes > 1024)
    throw Error("config.invalid",
                "slurm.pool.nodes must be in 0..1024, got " + std::to_string(pool.nodes));
  const auto colon = pool.listen.rfind(':');
  if (pool.listen.empty() || colon == std::string::npos || colon == 0 ||
      pool.listen.find_first_not_of("0123456789", colon + 1) != std::string::npos ||
      colon + 1 == pool.listen.size() || pool.listen.size() - colon > 6 ||
      std::stoul(pool.listen.substr(colon + 1)) > 65535)
    throw Error("config.invalid",
                "slurm.pool.listen must be \"ADDRESS:PORT\" (an address the nodes reach this host "
                "at; port 0: any free one), got \"" +
                    pool.listen + "\"");
  if (pool.gpus > 64)
    throw Error("config.invalid",
                "slurm.pool.gpus must be in 0..64, got " + std::to_string(pool.gpus));
  if (pool.resident_models < 1 || pool.resident_models > 64)
    throw Error("config.invalid", "slurm.pool.resident_models must be in 1..64, got " +
                                      std::to_string(pool.resident_models));
  if (pool.memory_bytes < (64ULL << 20))
    throw Error("config.invalid", "slurm.pool.memory_bytes must be at least 64 MiB, got " +
                                      std::to_string(pool.memory_bytes));
}

std::string Config::describe() const {
  Json j{{"socket", socket.string()},
         {"state_dir", state_dir.string()},
         {"fingerprint_worker", fingerprint_worker.string()},
         {"oracle_worker", oracle_worker.string()},
         {"hf_worker", hf_worker.string()},
         {"oracle_backend", oracle_backend},
         {"compare_worker", compare_worker.string()},
         {"containment", mode_name(containment.mode)},
         {"executor", executor},
         {"device_slots", device_slots},
         {"resident_models", resident.count},
         {"max_queue", max_queue}};
  return j.dump();
}

}  // namespace assay::supervisor
