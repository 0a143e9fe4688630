#include "supervisor/pipelines/documents.h"

#include <fstream>

#include <sys/stat.h>
#include <unistd.h>

#include <assay/build_info.h>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "common/text.h"
#include "supervisor/pipelines/admission.h"

namespace assay::supervisor {

using common::Error;
using common::Json;

std::string execution_dtype(const std::string& model_dir) {
  // Execute in the checkpoint's own dtype: float32 checkpoints in float32, the rest in bf16.
  std::string dtype = "bfloat16";
  try {
    Json cfg = common::parse_strict(
        read_no_links(std::filesystem::path(model_dir) / "config.json", 4 << 20));
    // Whatever the document holds (fuzz_model_config: a number, a string, a torch_dtype that is
    // not a string), this reads it without throwing; read_model_config refuses it by name.
    const Json& text = common::member(cfg, "text_config");
    const Json& c = text.is_object() && text.contains("torch_dtype") ? text : cfg;
    if (common::member(c, "torch_dtype") == "float32") dtype = "float32";
  } catch (const Error&) {
    // The oracle reports an unreadable config itself, naming the file.
  }
  return dtype;
}

Json read_model_config(const std::filesystem::path& model_dir) {
  auto cfg_path = model_dir / "config.json";
  try {
    return common::parse_strict(read_no_links(cfg_path, 4 << 20));
  } catch (const Error& e) {
    throw Error("request.bad_model", "cannot read " + cfg_path.string() + ": " + e.what());
  }
}

namespace {

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
  auto v = config_int(read_model_config(model_dir), "vocab_size");
  if (!v)
    throw Error("request.bad_model",
                (model_dir / "config.json").string() + " has no integer vocab_size");
  return *v;
}

std::int64_t read_hidden_size(const std::filesystem::path& model_dir) {
  auto v = config_int(read_model_config(model_dir), "hidden_size");
  if (!v || *v < 1)
    throw Error("request.bad_model",
                (model_dir / "config.json").string() + " has no positive integer hidden_size");
  return *v;
}

std::optional<std::int64_t> read_max_positions(const std::filesystem::path& model_dir) {
  return config_int(read_model_config(model_dir), "max_position_embeddings");
}

std::vector<std::int64_t> read_eos_token_ids(const std::filesystem::path& model_dir) {
  Json cfg = read_model_config(model_dir);
  std::vector<std::int64_t> ids;
  for (const Json* c : {&cfg, cfg.contains("text_config") ? &cfg["text_config"] : nullptr}) {
    if (!c || !c->is_object() || !c->contains("eos_token_id")) continue;
    const Json& v = (*c)["eos_token_id"];
    if (v.is_number_integer()) ids.push_back(v.get<std::int64_t>());
    if (v.is_array())
      for (const Json& e : v)
        if (e.is_number_integer()) ids.push_back(e.get<std::int64_t>());
  }
  return ids;
}

std::uint64_t estimate_required_bytes(const std::filesystem::path& model_dir, std::uint64_t tokens,
                                      std::optional<std::uint64_t> logit_rows) {
  std::uint64_t shard_bytes = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(model_dir, ec)) {
    std::error_code fec;
    if (e.is_regular_file(fec) && !e.is_symlink(fec) && e.path().extension() == ".safetensors")
      shard_bytes += e.file_size(fec);
  }
  if (ec)
    common::throw_errno("preflight.bad_model", "cannot list " + model_dir.string(), ec.value());
  // Weights are mapped in their stored dtype and, for bf16 and float32 checkpoints, executed in it
  // (execution_dtype): no copy. Without a readable config.json the dtype is unknown: assume half
  // the bytes get converted.
  double factor = 1.0;
  try {
    common::parse_strict(read_no_links(model_dir / "config.json", 4 << 20));
  } catch (const Error&) {
    factor = 1.5;
  }
  // Activations, the logits row and the runtime itself: a quarter of the weights + 256 MiB, and
  // what grows with the sequence.
  return static_cast<std::uint64_t>(static_cast<double>(shard_bytes) * factor) + shard_bytes / 4 +
         (256ull << 20) +
         estimate_sequence_bytes(model_dir, tokens, std::min(tokens, logit_rows.value_or(tokens)));
}

std::uint64_t estimate_sequence_bytes(const std::filesystem::path& model_dir, std::uint64_t tokens,
                                      std::uint64_t logit_rows) {
  if (tokens == 0) return 0;
  Json cfg;
  try {
    cfg = read_model_config(model_dir);
  } catch (const Error&) {
    return 0;  // the worker refuses such a checkpoint anyway
  }
  auto at_least = [](std::optional<std::int64_t> v, std::uint64_t min) {
    return v && *v > 0 ? std::max<std::uint64_t>(static_cast<std::uint64_t>(*v), min) : min;
  };
  const std::uint64_t heads = at_least(config_int(cfg, "num_attention_heads"), 1);
  const std::uint64_t vocab = at_least(config_int(cfg, "vocab_size"), 1);
  const std::uint64_t e = execution_dtype(model_dir) == "float32" ? 4 : 2;
  // Eager attention, one layer at a time: the scores and the weights in the execution dtype
  // while the float32 softmax is made (heads x T x T each), and the causal mask (T x T); then
  // the logits of every position in the execution dtype and as float32 (T x vocab).
  const double t = static_cast<double>(tokens);
  double bytes = static_cast<double>(heads) * t * t * static_cast<double>(2 * e + 4) +
                 t * t * static_cast<double>(e + 9) +
                 static_cast<double>(logit_rows) * static_cast<double>(vocab * (e + 4));
  return bytes >= 1.8e19 ? UINT64_MAX : static_cast<std::uint64_t>(bytes);
}

Json oracle_input(const std::string& model_dir, const common::NextTokenRequest& request,
                  const Json& candidates, const std::string& device, int threads) {
  std::string dtype = execution_dtype(model_dir);
  Json input{{"schema", protocol::kOracleInput},
             {"model_dir", model_dir},
             {"input_token_ids", request.input_token_ids},
             {"candidate_tokens", candidates},
             {"execution", {{"device", device}, {"dtype", dtype}, {"threads", threads}}}};
  // Kiln's prefix texts are checked against the tokenizer where the tokenizer is: the worker.
  if (!request.continuation_prefix.empty()) {
    Json prefix = Json::array();
    for (const auto& t : request.continuation_prefix)
      prefix.push_back(Json{{"token_id", t.token_id}, {"text", t.text}});
    input["continuation_prefix"] = std::move(prefix);
  }
  return input;
}

std::string oracle_artifact_name(const Json& output) {
  Json name = output.value("logits_file", Json());
  if (name.is_string()) {
    std::string n = name.get<std::string>();
    if (n.find('/') == std::string::npos && n != ".." && !n.empty()) return n;
    throw Error("worker.oracle_output",
                "oracle artifact name \"" + n + "\" is not a plain file name");
  }
  throw Error("worker.oracle_output", "oracle output has no logits_file");
}

Json oracle_section(const Json& output, const Json& evidence) {
  Json o = output;
  o.erase("loaded_libraries");  // hashed into the result's "implementation"
  o["process"] = evidence;
  return o;
}

Json source_section() {
  std::string commit = ASSAY_BUILD_GIT_COMMIT;
  std::string tree = ASSAY_BUILD_GIT_TREE;
  std::string origin_main = ASSAY_BUILD_GIT_ORIGIN_MAIN;
  int modified = ASSAY_BUILD_GIT_TREE_MODIFIED;
  std::string reason = ASSAY_BUILD_SOURCE_REASON;
  auto or_null = [](const std::string& s) { return s.empty() ? Json(nullptr) : Json(s); };
  return Json{{"version", ASSAY_BUILD_VERSION},
              {"git_commit", or_null(commit)},
              {"git_tree", or_null(tree)},
              {"origin_main", or_null(origin_main)},
              {"tree_modified", modified < 0 ? Json(nullptr) : Json(modified == 1)},
              {"reason", reason.empty() ? Json(nullptr) : Json(reason)}};
}

void check_configuration(const Json& output, const std::string& role) {
  const Json& configuration = output.value("configuration", Json());
  if (!configuration.is_object())
    throw Error("worker.oracle_output", role + " output.json has no configuration object");
  std::string want = common::sha256_canonical_id(configuration);
  if (output.value("configuration_sha256", Json()) != want)
    throw Error("worker.oracle_output", role + " output.json's configuration_sha256 " +
                                            output.value("configuration_sha256", Json()).dump() +
                                            " is not the canonical sha256 of its configuration, " +
                                            want);
}

Json make_verdict(const common::NextTokenRequest& request, const Json& output) {
  Json argmax = output.value("argmax", Json());
  if (!argmax.is_number_integer())
    throw Error("worker.oracle_output", "oracle output has no integer argmax: " + argmax.dump());
  std::int64_t top = argmax.get<std::int64_t>();
  // Kiln's rule: the argmax is an engine's only when exactly one candidate holds it; none, or
  // two engines with the same token, is "neither".
  std::vector<std::string> matching;
  for (const auto& c : request.candidates)
    if (c.token_id == top) matching.push_back(c.engine);
  std::string winner = matching.size() == 1 ? matching.front() : "neither";
  bool complete = matching.size() == 1;
  // Stricter than Kiln where Kiln's claim would not be a fact: with the top logit tied the
  // argmax is one of several tokens (the first index), so nothing is attributed completely; and
  // an output without a candidate's logit is not a complete account of the candidates.
  Json reported = output.value("candidate_tokens", Json::array());
  for (const auto& c : request.candidates) {
    bool seen = false;
    for (const auto& r : reported)
      if (r.is_object() && r.value("engine", "") == c.engine && r.contains("logit")) seen = true;
    complete = complete && seen;
  }
  Json margin = output.value("top_logit_margin", Json());
  if (!margin.is_number() || margin.get<double>() <= 0) complete = false;
  if (output.value("top_logit_tie", false)) complete = false;
  return Json{{"argmax_candidate", winner},
              {"argmax_token_id", top},
              {"candidate_attribution_complete", complete}};
}

std::string tail_file(const std::filesystem::path& path, std::size_t max_bytes) {
  // A worker's log, which the worker could have replaced: never followed (a symlink to a file
  // only root may read would put it in a job's error) nor waited on (a FIFO).
  common::UniqueFd fd;
  try {
    fd = common::open_regular(path);
  } catch (const Error& e) {
    return "(" + path.filename().string() + " is unusable: " + e.code() + ")";
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return "";
  auto size = static_cast<std::size_t>(st.st_size);
  // A few bytes more than asked, so the cut can fall between characters.
  std::size_t start = size > max_bytes + 4 ? size - max_bytes - 4 : 0;
  std::string s(size - start, '\0');
  ssize_t n = ::pread(fd.get(), s.data(), s.size(), static_cast<off_t>(start));
  s.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
  return common::printable_tail(s, max_bytes);
}

}  // namespace assay::supervisor
