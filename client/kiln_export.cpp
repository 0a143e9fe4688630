#include "client/kiln_export.h"

#include <cmath>
#include <map>

#include "common/error.h"
#include "common/identity.h"
#include "common/json_schema.h"
#include "common/kiln_schemas.h"

namespace assay::client {

using common::Json;

namespace {

constexpr std::string_view kV2Schema = "kiln.rocm-hf-next-token-oracle.v2";

// Builds the record field by field; a field that is not a fact gets its reason and, so that the
// schema still sees the whole document, the value the run had (or null).
class Builder {
 public:
  explicit Builder(const Json& result) : result_(result) {}

  // The value at `pointer` of the result, or null.
  const Json& at(const char* pointer) const {
    static const Json null;
    Json::json_pointer p(pointer);
    return result_.contains(p) ? result_.at(p) : null;
  }
  void fact(const std::string& pointer, Json value) {
    record_[Json::json_pointer(pointer)] = value;
  }
  void not_a_fact(const std::string& pointer, Json value, const std::string& why) {
    record_[Json::json_pointer(pointer)] = std::move(value);
    reasons_[pointer] = why;
  }

  Json& record() { return record_; }
  const std::map<std::string, std::string>& reasons() const { return reasons_; }

 private:
  const Json& result_;
  Json record_ = Json::object();
  std::map<std::string, std::string> reasons_;
};

// Kiln's processEvidence from assay's containment evidence of one worker.
Json process_evidence(const Json& evidence) {
  Json n = evidence.is_object() ? evidence.value("normalised", Json::object()) : Json::object();
  return Json{{"elapsed_seconds", n.value("elapsed_seconds", Json(nullptr))},
              {"schema", "kiln.hf-process-containment.v1"},
              {"timeout_seconds", n.value("timeout_seconds", Json(nullptr))},
              {"worker_exit_code", n.value("exit_code", Json(nullptr))}};
}

// A field a transformers run records in its result (issue 24's backend), or why it is missing.
void from_result(Builder& b, const std::string& pointer, const char* result_pointer) {
  const Json& v = b.at(result_pointer);
  if (v.is_null())
    b.not_a_fact(pointer, nullptr,
                 std::string("the result records no ") + result_pointer + " for this run");
  else
    b.fact(pointer, v);
}

void source_section(Builder& b) {
  // Kiln's source is the clean tree that built and ran the oracle, its tree object, and what
  // origin/main named then, which Kiln requires to be that commit (a pushed tip).
  const Json& commit = b.at("/source/git_commit");
  const bool clean = b.at("/source/tree_modified") == false;
  if (!clean)
    b.not_a_fact("/source/commit", commit,
                 "assay was built from a modified tree of " + commit.dump() +
                     "; Kiln's record names a clean one");
  else
    b.fact("/source/commit", commit);
  const Json& tree = b.at("/source/git_tree");
  if (!tree.is_string())
    b.not_a_fact("/source/tree", nullptr, "the result records no tree object of assay's source");
  else if (!clean)
    b.not_a_fact(
        "/source/tree", tree,
        "the commit's tree " + tree.dump() + " is not the modified tree assay was built from");
  else
    b.fact("/source/tree", tree);
  const Json& origin_main = b.at("/source/origin_main");
  if (!origin_main.is_string())
    b.not_a_fact("/source/origin_main", nullptr,
                 "the checkout assay was built from had no origin/main");
  else if (origin_main != commit)
    b.not_a_fact("/source/origin_main", origin_main,
                 "origin/main named " + origin_main.dump() + " when assay was built from " +
                     commit.dump() + "; Kiln's record requires the pushed tip");
  else
    b.fact("/source/origin_main", origin_main);
}

void implementation_section(Builder& b, bool transformers) {
  const std::string why =
      "the run used assay-oracle (the libtorch C++ port); Kiln's record is of a transformers "
      "worker run by Python";
  if (!transformers) {
    b.not_a_fact("/implementation/hf_worker_sha256", nullptr, why);
    b.not_a_fact("/implementation/python_sha256", nullptr, why);
  } else {
    // The worker's Python script (assay-hf-worker is a wrapper that execs it) and the
    // interpreter, each as the worker hashed the file it ran from.
    from_result(b, "/implementation/hf_worker_sha256", "/oracle/executable_sha256");
    from_result(b, "/implementation/python_sha256", "/oracle/transformers/python/sha256");
  }
  b.fact("/implementation/process_runner_sha256",
         b.at("/implementation/executables/assayd-serve/sha256"));
}

void request_section(Builder& b, const KilnExportOptions& options) {
  if (options.contract_path)
    b.fact("/request/contract_path", *options.contract_path);
  else
    b.not_a_fact("/request/contract_path", nullptr,
                 "assay is not told where the request lives in Kiln's repository "
                 "(give --contract-path)");
  b.fact("/request/id", b.at("/request/id"));
  b.fact("/request/sha256", b.at("/request/sha256"));
  const Json& source = b.at("/request/source");
  if (b.at("/request/schema") != "kiln.hf-next-token-request.v1")
    b.not_a_fact("/request/source", source,
                 "the request was " + b.at("/request/schema").dump() +
                     ", not a Kiln request naming its receipts");
  else if (b.at("/request/receipts/checked") != true)
    b.not_a_fact("/request/source", source,
                 "the receipts the request names were not checked (" +
                     b.at("/request/receipts/reason").dump() +
                     "); Kiln's oracle refuses a request whose receipts it did not check");
  else
    b.fact("/request/source", source);
}

void fingerprint_section(Builder& b) {
  b.fact("/model_identity", b.at("/model_identity"));
  if (b.at("/model_identity/chat_template_hash").is_null())
    b.not_a_fact("/model_identity/chat_template_hash", nullptr,
                 "the model's tokenizer_config.json has no chat template to hash");
  b.fact("/model_fingerprint/implementation_sha256",
         b.at("/model_fingerprint/implementation_sha256"));
  b.not_a_fact("/model_fingerprint/python_sha256", nullptr,
               "assay-fingerprint is a C++ program; no Python ran");
  const Json& reused = b.at("/model_fingerprint/reused");
  if (reused.is_object())
    b.not_a_fact("/model_fingerprint/process", process_evidence(nullptr),
                 "no fingerprint process ran in this job: it reused the fingerprint job " +
                     reused.value("job", Json()).dump() +
                     " computed, every file of the model directory proven unchanged since");
  else
    b.fact("/model_fingerprint/process", process_evidence(b.at("/model_fingerprint/process")));
}

void containment_section(Builder& b) {
  const Json& available = b.at("/containment/host_memory/available_bytes_before");
  b.fact("/containment/host_available_before_gib",
         available.is_number() ? Json(available.get<std::uint64_t>() >> 30) : Json(nullptr));
  const Json& network = b.at("/oracle/process/network");
  bool forbidden = network.is_object() && network.value("namespace", "") == "private" &&
                   network.value("interfaces", Json::array()) == Json::array({"lo"});
  if (forbidden)
    b.fact("/containment/network", "forbidden");
  else
    b.not_a_fact("/containment/network", network,
                 "the oracle's network was " + network.dump() +
                     ", not a private namespace with loopback only");
  b.fact("/containment/service", process_evidence(b.at("/oracle/process")));
}

void oracle_section(Builder& b, bool transformers) {
  for (const char* k :
       {"attention_implementation", "argmax", "argmax_text", "deterministic_algorithms", "dtype",
        "duration_seconds", "input_token_count", "input_token_ids_sha256", "logits_sha256",
        "tf32_allowed", "top_logit_margin"})
    b.fact(std::string("/oracle/") + k, b.at((std::string("/oracle/") + k).c_str()));
  // Kiln's device is the accelerator's name ("AMD Radeon 8060S Graphics"); assay's `device` is
  // the device spec (cpu, cuda:0) and `device_name` the name.
  const Json& device_name = b.at("/oracle/device_name");
  if (device_name.is_string() && !device_name.get_ref<const std::string&>().empty())
    b.fact("/oracle/device", device_name);
  else
    b.not_a_fact("/oracle/device", nullptr, "the result records no device_name for the oracle");
  Json candidates = Json::array();
  for (const auto& c : b.at("/oracle/candidate_tokens"))
    candidates.push_back(Json{{"engine", c["engine"]},
                              {"token_id", c["token_id"]},
                              {"text", c["text"]},
                              {"logit", c["logit"]},
                              {"rank", c["rank"]}});
  b.fact("/oracle/candidate_tokens", candidates);
  Json top = Json::array();
  for (const auto& t : b.at("/oracle/top_tokens"))
    top.push_back(Json{{"token_id", t["token_id"]}, {"text", t["text"]}, {"logit", t["logit"]}});
  b.fact("/oracle/top_tokens", top);
  b.fact("/oracle/request_id", b.at("/request/id"));
  b.fact("/oracle/request_sha256", b.at("/request/sha256"));
  b.fact("/oracle/output_bytes", b.at("/reference_artifact/bytes"));
  b.fact("/oracle/vocab", b.at("/oracle/vocab_size"));
  b.fact("/oracle/torch_commit", b.at("/oracle/runtime/torch/git_commit"));
  b.fact("/oracle/torch_version", b.at("/oracle/runtime/torch/version_label"));
  const Json& hip = b.at("/oracle/runtime/torch/hip_version");
  if (hip.is_string())
    b.fact("/oracle/torch_hip_version", hip);
  else
    b.not_a_fact("/oracle/torch_hip_version", nullptr,
                 "the run's torch has no HIP (ROCm) version: " +
                     b.at("/oracle/runtime/torch/version_label").dump());

  const std::string port = "the run used assay's C++ port (libtorch backend), which imports no ";
  if (transformers) {
    from_result(b, "/oracle/transformers_version", "/oracle/transformers/version");
    from_result(b, "/oracle/modeling_sha256", "/oracle/transformers/modeling_sha256");
    from_result(b, "/oracle/configuration_sha256", "/oracle/transformers/configuration_sha256");
    b.fact("/oracle/linear_attention_implementation",
           b.at("/oracle/linear_attention_implementation"));
  } else {
    b.not_a_fact("/oracle/transformers_version", nullptr,
                 "the run used assay's C++ port (libtorch backend), not transformers");
    b.not_a_fact(
        "/oracle/modeling_sha256", nullptr,
        "Kiln's is the sha256 of transformers' modeling file; " + port + "transformers source");
    b.not_a_fact("/oracle/configuration_sha256", b.at("/oracle/configuration_sha256"),
                 "Kiln's is the sha256 of transformers' configuration file; assay's field of that "
                 "name hashes its execution configuration, and " +
                     port + "transformers source");
    b.not_a_fact("/oracle/linear_attention_implementation",
                 b.at("/oracle/linear_attention_implementation"),
                 "Kiln's is transformers' torch fallback; the run used assay's port (" +
                     b.at("/oracle/linear_attention_implementation").dump() + ")");
  }

  Json n = b.at("/oracle/process/normalised");
  if (!n.is_object()) n = Json::object();
  for (const char* k : {"memory_high_events", "memory_max_events", "memory_oom_events",
                        "memory_oom_kill_events", "memory_peak_bytes", "memory_swap_bytes"}) {
    Json v = n.value(k, Json(nullptr));
    if (v.is_null())
      b.not_a_fact(std::string("/oracle/") + k, nullptr,
                   "the kernel offered no such counter for the oracle's cgroup (" +
                       b.at("/oracle/process/mode").dump() + ")");
    else
      b.fact(std::string("/oracle/") + k, v);
  }
}

}  // namespace

KilnExport kiln_v2_record(const Json& result, const KilnExportOptions& options) {
  if (!result.is_object() || result.value("schema", "") != "assay.next-token-oracle-result.v1")
    throw common::Error("export.not_next_token",
                        "Kiln's v2 record is of a next-token result; this is " +
                            (result.is_object() ? result.value("schema", Json("no schema")).dump()
                                                : std::string("not a JSON object")));
  Builder b(result);
  const bool transformers = b.at("/oracle/backend") == "transformers";
  b.fact("/schema", std::string(kV2Schema));
  b.fact("/created_at_utc", b.at("/created_at_utc"));
  b.fact("/duration_seconds", b.at("/duration_seconds"));
  source_section(b);
  implementation_section(b, transformers);
  request_section(b, options);
  fingerprint_section(b);
  containment_section(b);
  oracle_section(b, transformers);
  b.fact("/reference_artifact/bytes", b.at("/reference_artifact/bytes"));
  b.fact("/reference_artifact/location", "local_ignored");
  b.fact("/reference_artifact/sha256", b.at("/reference_artifact/sha256"));
  b.fact("/verdict", b.at("/verdict"));

  KilnExport out;
  out.record = b.record();
  out.record["result_sha256"] = common::sha256_id(common::python_canonical(out.record));
  std::map<std::string, std::string> reasons = b.reasons();
  auto id = common::kiln_schema_id_for(kV2Schema);
  for (const auto& e : common::kiln_schemas().validate(out.record, *id)) {
    // A field with its own reason is said once, in assay's words; the rest in the schema's.
    bool explained = false;
    for (const auto& [pointer, why] : reasons)
      explained = explained || e.pointer == pointer || e.pointer.starts_with(pointer + "/");
    if (!explained) reasons[e.pointer.empty() ? "/" : e.pointer] = e.message;
  }
  for (const auto& [pointer, why] : reasons) out.false_fields.push_back(pointer + ": " + why);
  // The envelope is assay's: beside the record, bound to it and to the signed result it is from.
  if (const Json& n = b.at("/numerics"); n.is_object() && n.contains("verdict"))
    out.numerics = Json{
        {"schema", std::string(kKilnNumericsAddendum)},
        {"kiln_record",
         {{"schema", out.record["schema"]}, {"result_sha256", out.record["result_sha256"]}}},
        {"assay_result", {{"job_id", b.at("/job_id")}, {"result_sha256", b.at("/result_sha256")}}},
        {"numerics", n}};
  return out;
}

std::filesystem::path kiln_numerics_path(const std::filesystem::path& record) {
  return record.parent_path() / (record.stem().string() + ".assay-numerics.json");
}

std::string kiln_file_text(const Json& record) {
  // Python's indent=2 form is its compact canonical form with line breaks: a newline and the
  // depth's indent after each opening bracket and comma, before each closing one, and ": ".
  std::string compact = common::python_canonical(record);
  std::string out;
  int depth = 0;
  bool in_string = false;
  auto newline = [&](int d) { out += "\n" + std::string(static_cast<std::size_t>(2 * d), ' '); };
  for (std::size_t i = 0; i < compact.size(); ++i) {
    char c = compact[i];
    if (in_string) {
      out += c;
      if (c == '\\')
        out += compact[++i];  // ensure_ascii: the escaped char is ASCII
      else if (c == '"')
        in_string = false;
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        out += c;
        break;
      case '{':
      case '[':
        out += c;
        if (compact[i + 1] == (c == '{' ? '}' : ']')) {
          out += compact[++i];  // {} and [] stay on one line
        } else {
          newline(++depth);
        }
        break;
      case '}':
      case ']':
        newline(--depth);
        out += c;
        break;
      case ',':
        out += c;
        newline(depth);
        break;
      case ':':
        out += ": ";
        break;
      default:
        out += c;
    }
  }
  return out + "\n";
}

}  // namespace assay::client
