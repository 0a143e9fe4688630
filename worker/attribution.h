// The layers command (layer-attribution jobs): one forward that keeps the rows of every named
// boundary (model.h Probe; operator-level ones when named), and with a patch input more forwards
// with the engine's rows substituted (every boundary, or a bisection). Input
// assay.oracle-layers-input.v1, output assay.oracle-layers-output.v1
// (schemas/oracle-layers-*.schema.json).
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
  // Operator-level boundaries to keep besides every layer-level one (docs/operators.md).
  std::vector<std::string> operators;
  Execution execution;
  struct Patch {
    int fd = -1;                          // the engine's rows file
    std::vector<std::string> boundaries;  // in forward order
    std::int64_t candidate_token_id = 0;
    std::string sha256;  // the request's digest of the file; empty: not checked before the load
    // A forward patched at a boundary substitutes the engine's state there, as far as its file
    // gives it: its output of the previous layer (the patched layer's input), its rows at every
    // boundary of that layer up to this one, and this one's siblings (q_rotary with k_rotary);
    // one tensor alone would mix the engine's value with the reference's on a parallel branch.
    // kEvery: one forward per boundary. kBisect: none where every substituted row equals the
    // reference's bit for bit (that forward is the reference's), then a binary search over the
    // rest for the first whose substitution gives the candidate, assuming that the engine's
    // state flips the token at every boundary after the first that does: about log2(n) + 1
    // forwards.
    enum class Search { kEvery, kBisect } search = Search::kEvery;
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
