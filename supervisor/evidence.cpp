#include "supervisor/evidence.h"

#include <fstream>

#include "common/error.h"
#include "common/fs.h"
#include "common/protocol.h"

namespace assay::supervisor {

using common::Error;
using common::Json;

namespace {

// The first of `keys` present in `j` (dotted paths allowed), or null.
Json pick(const Json& j, std::initializer_list<const char*> paths) {
  for (const char* path : paths) {
    const Json* cur = &j;
    std::string p = path;
    std::size_t start = 0;
    bool found = true;
    while (found) {
      auto dot = p.find('.', start);
      std::string key = p.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      if (!cur->is_object() || !cur->contains(key)) {
        found = false;
        break;
      }
      cur = &(*cur)[key];
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
    if (found && !cur->is_null()) return *cur;
  }
  return nullptr;
}

}  // namespace

Outcome judge_evidence(const Json& ev) {
  Outcome o;
  o.timed_out = pick(ev, {"timed_out", "timeout.timed_out"}) == Json(true);
  o.oom_killed = pick(ev, {"oom_killed", "memory.oom_killed"}) == Json(true);
  Json code = pick(ev, {"exit_code", "exit.code", "status.exit_code"});
  Json signal = pick(ev, {"exit.signal_name", "exit.signal", "signal"});
  Json error = pick(ev, {"error", "spawn_error"});
  if (o.timed_out) {
    o.reason = "timed out and was killed";
  } else if (o.oom_killed) {
    o.reason = "was OOM-killed (memory limit reached)";
  } else if (!signal.is_null()) {
    o.reason =
        "was killed by signal " + (signal.is_string() ? signal.get<std::string>() : signal.dump());
  } else if (code.is_number_integer() && code.get<int>() == 0) {
    o.ok = true;
  } else if (code.is_number_integer()) {
    o.reason = "exited with code " + code.dump();
  } else {
    o.reason = "left no exit status in its evidence" + (error.is_null() ? "" : ": " + error.dump());
  }
  return o;
}

std::string execution_dtype(const std::string& model_dir) {
  // Execute in the checkpoint's own dtype: float32 checkpoints in float32, the rest in bf16.
  std::string dtype = "bfloat16";
  try {
    Json cfg = common::parse_strict(
        common::read_file(std::filesystem::path(model_dir) / "config.json", 4 << 20));
    const Json& c = cfg.contains("text_config") && cfg["text_config"].contains("torch_dtype")
                        ? cfg["text_config"]
                        : cfg;
    if (c.value("torch_dtype", std::string()) == "float32") dtype = "float32";
  } catch (const Error&) {
    // The oracle reports an unreadable config itself, naming the file.
  }
  return dtype;
}

namespace {

Json read_config(const std::filesystem::path& model_dir) {
  auto cfg_path = model_dir / "config.json";
  try {
    return common::parse_strict(common::read_file(cfg_path, 4 << 20));
  } catch (const Error& e) {
    throw Error("request.bad_model", "cannot read " + cfg_path.string() + ": " + e.what());
  }
}

// The integer `key` at the top level of config.json or in its text_config.
std::optional<std::int64_t> config_int(const Json& cfg, const char* key) {
  for (const Json* c : {&cfg, cfg.contains("text_config") ? &cfg["text_config"] : nullptr}) {
    if (c && c->is_object() && c->contains(key) && (*c)[key].is_number_integer())
      return (*c)[key].get<std::int64_t>();
  }
  return std::nullopt;
}

}  // namespace

std::int64_t read_vocab_size(const std::filesystem::path& model_dir) {
  auto v = config_int(read_config(model_dir), "vocab_size");
  if (!v)
    throw Error("request.bad_model", (model_dir / "config.json").string() +
                                         " has no integer vocab_size");
  return *v;
}

std::optional<std::int64_t> read_max_positions(const std::filesystem::path& model_dir) {
  return config_int(read_config(model_dir), "max_position_embeddings");
}

Json oracle_input(const std::string& model_dir, const common::NextTokenRequest& request,
                  const Json& candidates, const std::string& device, int threads) {
  std::string dtype = execution_dtype(model_dir);
  return Json{{"schema", protocol::kOracleInput},
              {"model_dir", model_dir},
              {"input_token_ids", request.input_token_ids},
              {"candidate_tokens", candidates},
              {"execution", {{"device", device}, {"dtype", dtype}, {"threads", threads}}}};
}

std::string oracle_artifact_name(const Json& output) {
  Json name = pick(output, {"artifact.path", "artifact", "logits_file", "logits_path"});
  if (name.is_string()) {
    std::string n = name.get<std::string>();
    if (n.find('/') == std::string::npos && n != ".." && !n.empty()) return n;
    throw Error("worker.oracle_output",
                "oracle artifact name \"" + n + "\" is not a plain file name");
  }
  return "logits.safetensors";
}

Json oracle_section(const Json& output, const Json& evidence) {
  Json o = output;
  o["process"] = evidence;
  return o;
}

Json make_verdict(const common::NextTokenRequest& request, const Json& output) {
  Json argmax = pick(output, {"argmax.token_id", "argmax"});
  if (!argmax.is_number_integer())
    throw Error("worker.oracle_output", "oracle output has no integer argmax: " + argmax.dump());
  std::int64_t top = argmax.get<std::int64_t>();
  std::string winner = "neither";
  for (const auto& c : request.candidates)
    if (c.token_id == top) winner = c.engine;
  bool complete = true;
  Json reported = output.value("candidate_tokens", Json::array());
  for (const auto& c : request.candidates) {
    bool seen = false;
    for (const auto& r : reported)
      if (r.is_object() && r.value("engine", "") == c.engine && r.contains("logit")) seen = true;
    complete = complete && seen;
  }
  Json margin = pick(output, {"top_logit_margin"});
  if (!margin.is_number() || margin.get<double>() <= 0) complete = false;
  if (output.value("top_logit_tie", false)) complete = false;
  return Json{{"argmax_candidate", winner},
              {"argmax_token_id", top},
              {"candidate_attribution_complete", complete}};
}

std::string tail_file(const std::filesystem::path& path, std::size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  in.seekg(0, std::ios::end);
  auto size = static_cast<std::size_t>(in.tellg());
  std::size_t start = size > max_bytes ? size - max_bytes : 0;
  in.seekg(static_cast<std::streamoff>(start));
  std::string s(size - start, '\0');
  in.read(s.data(), static_cast<std::streamsize>(s.size()));
  return s;
}

}  // namespace assay::supervisor
