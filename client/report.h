// `assay report`: one self-contained HTML page for a result (inline SVG and CSS, no script, no
// network), readable as plain HTML in a terminal browser too (every chart has a table beside it).
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/json.h"

namespace assay::client {

// A next-token result (assay.next-token-oracle-result.v1): the verdict, a bar chart of the top-10
// reference logits with the candidates marked (and their ranks when outside the top 10), the
// margin, the model identity and the containment evidence. A fidelity result
// (assay.fidelity-result.v1): gates, token-wise KL along positions per context, the KL histogram
// and its CDF on a log axis, the statistics table. The artifact beside the result
// (`artifact_dir`/logits.safetensors or kl.safetensors) is read when present and its sha256
// equals the result's; otherwise the charts use what the result itself holds. A layer-attribution
// result (assay.layer-attribution-result.v1): where the engine first leaves the reference and
// which departure decides the token, relative RMSE against depth on a log axis (exact zeros on a
// floor, omitted and undefined boundaries marked apart) with the first non-bitwise and the
// decisive boundary marked, and the per-boundary table. Throws
// Error("client.report") for a document of another schema. `verification` is shown at the top
// of the page (what was checked of the record before it was rendered), as verified or not.
struct Prompt;
std::string render_report(const common::Json& result, const std::filesystem::path& artifact_dir,
                          const std::string& verification, bool verified,
                          const Prompt* prompt = nullptr);

// What a next-token page shows of the prompt (report_prompt.cpp), from the request the job ran.
struct Prompt {
  std::string request_path;
  std::string request_sha256;
  common::Json messages;          // Kiln's prompt.messages, or null for an assay request
  common::Json template_options;  // Kiln's add_generation_prompt and template_kwargs, or null
  std::vector<std::int64_t> ids;  // input_token_ids
  std::size_t prompt_tokens = 0;  // the first ids; the rest are Kiln's continuation_prefix
  std::optional<std::string> rendering;  // the ids decoded: the chat template's rendering
  std::string rendering_note;            // the tokenizer that decoded them, or why none did
};

// Parses `request_file` (a next-token request) and checks it is the result's: its sha256 and
// its token ids' sha256 must be result.request's, else Error("client.report_request") naming
// both values; a file that is no valid next-token request throws
// Error("client.report_request_invalid"). The ids are decoded with `model_dir`'s tokenizer
// (default: the request's own model_dir) only when that tokenizer.json hashes to the result's
// tokenizer_hash; otherwise rendering is empty and rendering_note says why.
Prompt load_prompt(const common::Json& result, const std::filesystem::path& request_file,
                   const std::optional<std::filesystem::path>& model_dir);

}  // namespace assay::client
