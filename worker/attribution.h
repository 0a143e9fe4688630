// The layers command (layer-attribution jobs): one forward that keeps the rows of every named
// boundary (model.h Probe), and with a patch input one more forward per boundary with the
// engine's rows substituted there. Input assay.oracle-layers-input.v1, output
// assay.oracle-layers-output.v1 (schemas/oracle-layers-*.schema.json).
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/json.h"
#include "common/layers.h"
#include "worker/next_token.h"

namespace assay::oracle {

struct LayersInput {
  std::filesystem::path model_dir;
  ModelFds model_fds;
  std::vector<std::int64_t> token_ids;
  common::LayerRows rows = common::LayerRows::kLast;
  Execution execution;
  struct Patch {
    int fd = -1;                          // the engine's rows file
    std::vector<std::string> boundaries;  // in forward order
    std::int64_t candidate_token_id = 0;
    std::string sha256;  // the request's digest of the file; empty: not checked before the load
  };
  std::optional<Patch> patch;
};

// Throws common::Error("input.invalid" / "json.unknown_field") naming the field.
LayersInput parse_layers_input(const common::Json& doc);

// Runs the command: DIR/layers.safetensors and DIR/output.json. Throws common::Error
// ("request.bad_layer_rows" names a patch tensor that is missing, of the wrong shape or dtype,
// or not finite).
void run_layers(const LayersInput& in, const std::filesystem::path& workdir);

}  // namespace assay::oracle
