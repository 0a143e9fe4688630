// The numerics envelope step and the result's section (numerics.h).
#include "supervisor/pipelines/numerics.h"

#include <algorithm>
#include <map>

#include "common/error.h"
#include "common/numerics.h"
#include "common/text.h"
#include "supervisor/pipelines/documents.h"

namespace assay::supervisor {

using common::Error;
using common::Json;

namespace {

constexpr std::string_view kNumericsInput = "assay.numerics-input.v1";
constexpr std::string_view kNumericsOutput = "assay.numerics-output.v1";
constexpr std::size_t kTopK = 5;

void check_output(const Json& out, const Json& spec, const Json& states) {
  auto bad = [](const std::string& what) {
    throw Error("worker.numerics_output", "numerics output.json " + what);
  };
  // Read without trusting its shape: every part is checked before it is read.
  if (!out.is_object()) bad("is not a JSON object");
  if (out.value("schema", Json()) != kNumericsOutput)
    bad("has schema " + common::printable(out.value("schema", Json()).dump(), 80) + ", not " +
        std::string(kNumericsOutput));
  const Json& got = out.value("states", Json());
  if (!got.is_array() || got.size() != states.size())
    bad("has " + std::string(got.is_array() ? std::to_string(got.size()) : "no") + " states for " +
        std::to_string(states.size()));
  const std::vector<std::string> want = common::numerics_member_names(spec);
  for (std::size_t i = 0; i < got.size(); ++i) {
    const std::string where = "states[" + std::to_string(i) + "]";
    if (!got[i].is_object()) bad(where + " is not an object");
    if (got[i].value("index", Json()) != states[i]["index"]) bad(where + " is another state");
    const Json& members = got[i].value("members", Json());
    std::vector<std::string> names;
    if (members.is_array())
      for (const Json& m : members)
        names.push_back(m.is_object() && m.value("name", Json()).is_string()
                            ? m["name"].get<std::string>()
                            : std::string());
    if (names != want)
      bad(where + " has members other than the " + std::to_string(want.size()) + " asked for");
    if (spec.value("fp32", true) != got[i].contains("fp32"))
      bad(where + (spec.value("fp32", true) ? " lacks" : " has") + " the fp32 figures");
    if (got[i].contains("fp32") && !got[i]["fp32"].is_object())
      bad(where + "'s fp32 figures are not an object");
  }
}

}  // namespace

Step numerics_step(const Config& config, const std::string& model_dir,
                   std::function<Json()> oracle_input, Json spec, Json states,
                   const FingerprintRun& fingerprint, Json& output,
                   std::optional<contain::Evidence>& evidence) {
  return Step{
      .role = "numerics",
      .worker = config.hf_worker,
      .mode = "envelope",
      .model_dir = model_dir,
      .open_files = {},
      .input =
          [oracle_input, spec, states] {
            Json in = oracle_input();
            in["schema"] = kNumericsInput;
            for (const char* key : {"input_token_ids", "candidate_tokens", "continuation_prefix"})
              in.erase(key);
            in["states"] = states;
            in["numerics"] = spec;
            return in;
          },
      .move_in = {},
      .accept =
          [&output, &evidence, &fingerprint, spec, states](Json out, const contain::Evidence& e) {
            check_bytes_used(out, fingerprint, "numerics");
            check_output(out, spec, states);
            output = std::move(out);
            evidence = e;
          }};
}

std::uint64_t numerics_required_bytes(const std::string& model_dir, std::uint64_t tokens,
                                      const Json& spec) {
  std::uint64_t batch = 1;
  for (const Json& b : spec.value("batch_sizes", Json::array()))
    batch = std::max<std::uint64_t>(batch, b.get<std::uint64_t>());
  const std::uint64_t weights = estimate_required_bytes(model_dir, 0);
  const std::uint64_t sequence = estimate_sequence_bytes(model_dir, tokens, tokens);
  return 3 * weights + (spec.value("fp32", true) ? 2 * weights : 0) + batch * sequence +
         (1ull << 30);
}

Json reference_member(const Json& oracle) {
  auto bad = [](const std::string& what) {
    throw Error("worker.oracle_output", "oracle output.json " + what);
  };
  const Json top_tokens = oracle.value("top_tokens", Json());
  if (!top_tokens.is_array() || top_tokens.empty() || !top_tokens[0].is_object())
    bad("has no top_tokens");
  Json top = Json::array();
  for (std::size_t i = 0; i < top_tokens.size() && i < kTopK; ++i)
    top.push_back(Json{{"token_id", top_tokens[i].value("token_id", Json())},
                       {"logit", top_tokens[i].value("logit", Json())}});
  std::map<std::int64_t, Json> by_token;  // one entry per token, by id, as the worker writes
  for (const Json& c : oracle.value("candidate_tokens", Json::array())) {
    if (!c.is_object() || !c.value("token_id", Json()).is_number_integer())
      bad("has a candidate without an integer token_id");
    by_token[c["token_id"].get<std::int64_t>()] = Json{{"token_id", c["token_id"]},
                                                       {"logit", c.value("logit", Json())},
                                                       {"rank", c.value("rank", Json())}};
  }
  Json candidates = Json::array();
  for (auto& [id, c] : by_token) candidates.push_back(std::move(c));
  return Json{{"name", "reference"},
              {"argmax", oracle.value("argmax", Json())},
              {"argmax_logit", top_tokens[0].value("logit", Json())},
              {"top_tie", oracle.value("top_logit_tie", false)},
              {"margin", oracle.value("top_logit_margin", Json(nullptr))},
              {"top", std::move(top)},
              {"candidates", std::move(candidates)},
              {"logits_sha256", oracle.value("logits_sha256", Json())}};
}

Json numerics_worker_section(const Json& worker, const contain::Evidence& evidence) {
  return Json{{"numerics_module_sha256", worker.value("numerics_module_sha256", Json(nullptr))},
              {"executable_sha256", worker.value("executable_sha256", Json(nullptr))},
              {"transformers", worker.value("transformers", Json(nullptr))},
              {"threads", worker.value("threads", Json(nullptr))},
              {"load_seconds", worker.value("load_seconds", Json(nullptr))},
              {"forward_seconds", worker.value("forward_seconds", Json(nullptr))},
              {"process", evidence.to_json()}};
}

Json numerics_section_own_reference(const Json& spec, const Json& candidates, const Json& state,
                                    const Json& worker, const contain::Evidence& evidence,
                                    const std::string& reference) {
  Json members = state.value("members", Json::array());
  const common::NumericsPolicy policy = common::numerics_policy(spec, "request.numerics");
  const Json fp32 = state.value("fp32", Json(nullptr));
  Json verdict = common::numerics_verdict(members, candidates, fp32, policy);
  return Json{{"requested", spec},
              {"policy", common::to_json(policy)},
              {"candidates", candidates},
              {"members", std::move(members)},
              {"fp32", fp32},
              {"reference", reference},
              {"verdict", std::move(verdict)},
              {"worker", numerics_worker_section(worker, evidence)}};
}

Json numerics_section(const Json& spec, const Json& candidates, const Json& oracle,
                      const Json& state, const Json& worker, const contain::Evidence& evidence) {
  Json members = Json::array({reference_member(oracle)});
  bool same = false;
  for (Json m : state.value("members", Json::array())) {
    if (m.value("name", "") == "reference") {
      same = m.value("logits_sha256", Json()) == oracle.value("logits_sha256", Json());
      if (same) continue;
      m["name"] = "reference:transformers";
    }
    members.push_back(std::move(m));
  }
  const common::NumericsPolicy policy = common::numerics_policy(spec, "request.numerics");
  const Json fp32 = state.value("fp32", Json(nullptr));
  Json verdict = common::numerics_verdict(members, candidates, fp32, policy);
  return Json{{"requested", spec},
              {"policy", common::to_json(policy)},
              {"candidates", candidates},
              {"members", std::move(members)},
              {"fp32", fp32},
              {"transformers_reference_bitwise_equal", same},
              {"verdict", std::move(verdict)},
              {"worker", numerics_worker_section(worker, evidence)}};
}

}  // namespace assay::supervisor
