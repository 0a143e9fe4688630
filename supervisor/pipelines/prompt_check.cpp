#include "supervisor/pipelines/prompt_check.h"

#include <unistd.h>

#include "common/error.h"
#include "common/text.h"

namespace assay::supervisor {

using common::Error;
using common::Json;

bool prompt_check_applies(const common::NextTokenRequest& request) {
  return request.kind == common::RequestKind::kKiln && request.model_identity &&
         !request.model_identity->value("chat_template_hash", Json()).is_null();
}

Json prompt_check_skipped(const common::NextTokenRequest& request, bool batch_state) {
  std::string reason = batch_state && prompt_check_applies(request)
                           ? "the states of a batch are not rendered with the chat template; "
                             "submit this dispute alone to check its prompt"
                       : request.kind != common::RequestKind::kKiln
                           ? "an assay request carries token ids only, no chat to render"
                           : "the model has no chat template (model_identity.chat_template_hash "
                             "is null): there is nothing to render the messages with";
  return Json{{"checked", false}, {"reason", reason}};
}

bool prompt_check_available(const Config& config) {
  return ::access(config.hf_worker.c_str(), X_OK) == 0;
}

Json prompt_check_unavailable(const Config& config) {
  return Json{{"checked", false},
              {"reason", "assay-hf-worker (transformers) is not installed on this host (" +
                             config.hf_worker.string() +
                             "): the ids were not compared with the chat template's rendering"}};
}

namespace {

std::string id_and_text(const Json& id, const Json& text) {
  if (id.is_null()) return "nothing (the ids end here)";
  return id.dump() + " (" + common::printable(text.dump(), 80) + ")";
}

void accept_prompt(const Json& output, const FingerprintRun& fingerprint,
                   const common::NextTokenRequest& request, Json& out) {
  const Json& identity = fingerprint.identity();
  Json files = output.value("files", Json::object());  // not const: operator[] stays defined
  Json tokenizer = files.contains("tokenizer.json") ? files["tokenizer.json"]["sha256"] : Json();
  if (tokenizer != identity.value("tokenizer_hash", Json()))
    throw Error("job.bytes_mismatch", "the prompt check rendered with tokenizer.json " +
                                          tokenizer.dump() + " but the fingerprint hashed " +
                                          identity.value("tokenizer_hash", Json()).dump());
  Json used = output.value("chat_template_sha256", Json());
  if (used != identity.value("chat_template_hash", Json()))
    throw Error("job.bytes_mismatch", "the prompt check rendered with chat template " +
                                          used.dump() + " but the fingerprint hashed " +
                                          identity.value("chat_template_hash", Json()).dump());
  if (output.value("match", false) != true) {
    const Json d = output.value("first_difference", Json::object());
    throw Error("request.prompt_mismatch",
                "request.prompt.token_ids differ from the model's chat template rendering of "
                "request.prompt.messages (transformers " +
                    output.value("transformers_version", std::string("?")) +
                    " apply_chat_template, add_generation_prompt " +
                    request.document["prompt"]["add_generation_prompt"].dump() + ", " +
                    request.document["prompt"]["template_kwargs"].dump() + ") at index " +
                    d.value("index", Json()).dump() + ": the request has " +
                    id_and_text(d.value("request_id", Json()), d.value("request_text", Json())) +
                    ", the rendering " +
                    id_and_text(d.value("rendered_id", Json()), d.value("rendered_text", Json())) +
                    "; " + std::to_string(request.document["prompt"]["token_ids"].size()) +
                    " ids in the request, " + output.value("token_count", Json()).dump() +
                    " rendered");
  }
  out = Json{{"checked", true},
             {"renderer",
              {{"transformers_version", output.value("transformers_version", Json())},
               {"tokenizers_version", output.value("tokenizers_version", Json())},
               {"tokenizer_class", output.value("tokenizer_class", Json())}}},
             {"files", files},
             {"chat_template_sha256", used},
             {"rendered_text_sha256", output.value("rendered_text_sha256", Json())},
             {"token_count", output.value("token_count", Json())},
             {"token_ids_sha256", output.value("token_ids_sha256", Json())}};
}

}  // namespace

Step prompt_check_step(const Config& config, const std::string& model_dir,
                       const common::NextTokenRequest& request, const FingerprintRun& fingerprint,
                       Json& out) {
  return Step{.role = "prompt",
              .worker = config.hf_worker,
              .mode = "render-prompt",
              .model_dir = model_dir,
              .open_files = {},
              .input =
                  [&request, model_dir] {
                    const Json& prompt = request.document["prompt"];
                    return Json{{"schema", "assay.prompt-check-input.v1"},
                                {"model_dir", model_dir},
                                {"messages", prompt["messages"]},
                                {"add_generation_prompt", prompt["add_generation_prompt"]},
                                {"template_kwargs", prompt["template_kwargs"]},
                                {"token_ids", prompt["token_ids"]}};
                  },
              .move_in = {},
              .accept =
                  [&request, &fingerprint, &out](Json output, const contain::Evidence&) {
                    accept_prompt(output, fingerprint, request, out);
                  },
              .timeout_cap = std::chrono::milliseconds(
                  static_cast<long long>(config.prompt_render_timeout_seconds * 1000)),
              .timeout_cap_key = "prompt_render_timeout_seconds"};
}

}  // namespace assay::supervisor
