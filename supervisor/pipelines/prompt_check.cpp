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

// The worker's output is read without trusting its shape (fuzz_worker_output: a
// first_difference or a files entry that is not an object).
using common::member;

void accept_prompt(const Json& output, const FingerprintRun& fingerprint,
                   const common::NextTokenRequest& request, Json& out) {
  const Json& identity = fingerprint.identity();
  const Json& files = member(output, "files");
  if (!files.is_object())
    throw Error("worker.prompt_output", "the prompt check's files is " +
                                            common::printable(files.dump(), 80) +
                                            ", not an object of the tokenizer files it read");
  const Json& tokenizer = member(member(files, "tokenizer.json"), "sha256");
  if (tokenizer != member(identity, "tokenizer_hash"))
    throw Error("job.bytes_mismatch", "the prompt check rendered with tokenizer.json " +
                                          tokenizer.dump() + " but the fingerprint hashed " +
                                          member(identity, "tokenizer_hash").dump());
  const Json& used = member(output, "chat_template_sha256");
  if (used != member(identity, "chat_template_hash"))
    throw Error("job.bytes_mismatch", "the prompt check rendered with chat template " +
                                          used.dump() + " but the fingerprint hashed " +
                                          member(identity, "chat_template_hash").dump());
  if (member(output, "match") != true) {
    const Json& d = member(output, "first_difference");
    const Json& version = member(output, "transformers_version");
    throw Error("request.prompt_mismatch",
                "request.prompt.token_ids differ from the model's chat template rendering of "
                "request.prompt.messages (transformers " +
                    (version.is_string() ? common::printable(version.get<std::string>(), 40)
                                         : std::string("?")) +
                    " apply_chat_template, add_generation_prompt " +
                    member(member(request.document, "prompt"), "add_generation_prompt").dump() +
                    ", " + member(member(request.document, "prompt"), "template_kwargs").dump() +
                    ") at index " + member(d, "index").dump() + ": the request has " +
                    id_and_text(member(d, "request_id"), member(d, "request_text")) +
                    ", the rendering " +
                    id_and_text(member(d, "rendered_id"), member(d, "rendered_text")) + "; " +
                    std::to_string(member(member(request.document, "prompt"), "token_ids").size()) +
                    " ids in the request, " + member(output, "token_count").dump() + " rendered");
  }
  out = Json{{"checked", true},
             {"renderer",
              {{"transformers_version", member(output, "transformers_version")},
               {"tokenizers_version", member(output, "tokenizers_version")},
               {"tokenizer_class", member(output, "tokenizer_class")}}},
             {"files", files},
             {"chat_template_sha256", used},
             {"rendered_text_sha256", member(output, "rendered_text_sha256")},
             {"token_count", member(output, "token_count")},
             {"token_ids_sha256", member(output, "token_ids_sha256")}};
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
