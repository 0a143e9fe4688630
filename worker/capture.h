// The capture command's input without the model: assay.oracle-capture-input.v1 (the reference
// or candidate side of a fidelity job: full-vocabulary logits at the scored positions of every
// panel context, written in blocks of positions).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "common/fidelity.h"
#include "common/json.h"
#include "worker/next_token.h"

namespace assay::oracle {

struct CaptureContext {
  std::string id;
  std::vector<std::int64_t> token_ids;
  common::PositionRanges positions;
};

struct CaptureInput {
  std::filesystem::path model_dir;
  ModelFds model_fds;
  std::vector<CaptureContext> contexts;
  Execution execution;
  std::int64_t block_positions = common::kDefaultBlockPositions;
};

// Throws common::Error("input.invalid" / "json.unknown_field") naming the field.
CaptureInput parse_capture_input(const common::Json& doc);

// The file a context's logits go to inside the workspace: "capture-<index>.safetensors".
std::string capture_file_name(std::size_t index);

}  // namespace assay::oracle
