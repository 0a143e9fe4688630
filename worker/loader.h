// Opening a Hugging Face checkpoint directory: config.json, mmapped safetensors (single file
// or shards with model.safetensors.index.json), and the architecture registry.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/json.h"
#include "worker/model.h"

namespace assay::oracle {

// Every architecture this build knows, in a fixed order.
std::vector<ArchitectureEntry> architectures();

// Reads and strictly parses DIR/config.json.
common::Json read_config(const std::filesystem::path& model_dir);

// The checkpoint's declared dtype ("torch_dtype" or "dtype", top level or text_config), or ""
// when it declares none.
std::string declared_dtype(const common::Json& config);

// Maps the weight files of `model_dir` (every shard named in the index must exist and hold the
// tensors the index puts there). Tensors are views of the mapping when the stored dtype is the
// execution dtype on CPU, converted copies otherwise. Throws common::Error naming the file or
// tensor ("model.no_weights", "model.bad_index", "model.missing_tensor", "model.bad_shape",
// "model.bad_dtype", "safetensors.invalid").
std::unique_ptr<Weights> open_weights(const std::filesystem::path& model_dir,
                                      const ExecOptions& options);

struct LoadedModel {
  common::Json config;
  std::string model_type;
  std::unique_ptr<Weights> weights;  // owns the mappings the model's tensors point into
  std::unique_ptr<Model> model;
};

// config.json -> architecture by model_type -> weights -> model, then checks that every stored
// tensor was used or is ignored by rule (the architecture's ignored prefixes, and
// "*.rotary_emb.inv_freq" buffers): Error("model.unexpected_tensor") names the first others.
// Error("model.unsupported") names an unknown model_type.
LoadedModel load_model(const std::filesystem::path& model_dir, const ExecOptions& options);

}  // namespace assay::oracle
