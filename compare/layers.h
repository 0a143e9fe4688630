// Layer attribution's comparison: an engine's hidden-state rows against the reference's, per
// boundary, with Kiln's metrics (kiln.rocm-hf-layer-attribution.v2 $defs/boundary) in float64
// over every element of the rows, and the first departures.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "common/json.h"

namespace assay::compare {

struct LayersInput {
  std::string reference;  // the oracle's layers.safetensors, a file of the workspace
  int engine_fd = -1;     // the engine's rows file, opened by assayd (or -1 with engine_path)
  std::string engine_path;
  std::optional<std::string> engine_sha256;  // of the whole file; checked when given
  // The oracle's boundaries in forward order: name and the sha256 of its F32 rows.
  struct Boundary {
    std::string name, sha256;
  };
  std::vector<Boundary> boundaries;
  double tolerance = 0.01;  // relative RMSE for first_over_tolerance
};

// Throws Error("input.invalid") naming the field.
LayersInput parse_layers_input(const common::Json& doc, const std::string& where);

// The output document (assay.compare-layers-output.v1). Throws Error("request.bad_layer_rows")
// naming the tensor, row and column of a non-finite engine value, or a tensor whose shape is not
// the reference's ([hidden] is taken as [1, hidden]); Error("compare.file_changed") when the
// engine's file is not the one the request names; Error("compare.reference_changed") when a
// reference tensor is not the one the oracle reported.
common::Json compare_layers(const LayersInput& in);

}  // namespace assay::compare
