#include "worker/capture.h"

#include "common/error.h"
#include "common/protocol.h"

namespace assay::oracle {

using common::Error;
using common::Json;

CaptureInput parse_capture_input(const Json& doc) {
  const std::string where = "input.json";
  if (!doc.is_object()) throw Error("input.invalid", where + ": not an object");
  common::reject_unknown_fields(
      doc, {"schema", "model_dir", "model_fds", "contexts", "execution", "block_positions"}, where);
  std::string schema = common::require_string(doc, "schema", where);
  if (schema != protocol::kOracleCaptureInput) {
    throw Error("input.invalid", where + ": schema \"" + schema + "\" is not \"" +
                                     std::string(protocol::kOracleCaptureInput) + "\"");
  }
  CaptureInput in;
  in.model_dir = common::require_string(doc, "model_dir", where);
  if (!in.model_dir.is_absolute()) {
    throw Error("input.invalid",
                where + ": model_dir \"" + in.model_dir.string() + "\" must be an absolute path");
  }
  in.model_fds = parse_optional_model_fds(doc, where);
  const Json& contexts = common::require(doc, "contexts", where);
  if (!contexts.is_array() || contexts.empty()) {
    throw Error("input.invalid", where + ": contexts must be a non-empty array");
  }
  for (std::size_t i = 0; i < contexts.size(); ++i) {
    std::string w = where + " contexts[" + std::to_string(i) + "]";
    const Json& c = contexts[i];
    if (!c.is_object()) throw Error("input.invalid", w + ": not an object");
    common::reject_unknown_fields(c, {"id", "token_ids", "positions"}, w);
    CaptureContext ctx;
    ctx.id = common::require_string(c, "id", w);
    const Json& ids = common::require(c, "token_ids", w);
    if (!ids.is_array() || ids.empty()) {
      throw Error("input.invalid", w + ": token_ids must be a non-empty array");
    }
    for (std::size_t k = 0; k < ids.size(); ++k) {
      if (!ids[k].is_number_integer()) {
        throw Error("input.invalid", w + ": token_ids[" + std::to_string(k) +
                                         "] is not an integer: " + ids[k].dump());
      }
      ctx.token_ids.push_back(ids[k].get<std::int64_t>());
    }
    ctx.positions = common::parse_position_ranges(common::require(c, "positions", w),
                                                  static_cast<std::int64_t>(ctx.token_ids.size()),
                                                  w + ": positions", "input.invalid");
    in.contexts.push_back(std::move(ctx));
  }
  in.execution = parse_execution(common::require(doc, "execution", where), where + " execution");
  if (doc.contains("block_positions")) {
    std::int64_t b = common::require_int(doc, "block_positions", where);
    if (b < 1 || b > common::kMaxBlockPositions) {
      throw Error("input.invalid", where + ": block_positions " + std::to_string(b) +
                                       " is outside [1, " +
                                       std::to_string(common::kMaxBlockPositions) + "]");
    }
    in.block_positions = b;
  }
  return in;
}

std::string capture_file_name(std::size_t index) {
  return "capture-" + std::to_string(index) + ".safetensors";
}

}  // namespace assay::oracle
