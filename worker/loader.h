// Opening a Hugging Face checkpoint directory: config.json, safetensors read into memory (single
// file or shards with model.safetensors.index.json), and the architecture registry.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/json.h"
#include "worker/model.h"
#include "worker/model_files.h"

namespace assay::oracle {

// Every architecture this build knows, in a fixed order.
std::vector<ArchitectureEntry> architectures();

// Reads (once: later calls get the same bytes) and strictly parses config.json.
common::Json read_config(ModelFiles& files);
common::Json read_config(const std::filesystem::path& model_dir);

// The checkpoint's declared dtype ("torch_dtype" or "dtype", top level or text_config), or ""
// when it declares none.
std::string declared_dtype(const common::Json& config);

// Reads the weight files (every shard named in the index must exist and hold the tensors the
// index puts there) whole into this process's memory (`read_threads` files at a time), each
// hashed as it is read (ModelFiles::read_large). Tensors are views of that
// memory when the stored dtype is the execution dtype on CPU (each view keeps its file's memory
// alive), converted copies otherwise. Throws common::Error naming the file or tensor
// ("model.no_weights", "model.bad_index", "model.missing_tensor", "model.bad_shape",
// "model.bad_dtype", "safetensors.invalid").
std::unique_ptr<Weights> open_weights(ModelFiles& files, const ExecOptions& options,
                                      unsigned read_threads = 1);
std::unique_ptr<Weights> open_weights(const std::filesystem::path& model_dir,
                                      const ExecOptions& options);

struct LoadedModel {
  common::Json config;
  std::string model_type;
  std::unique_ptr<Weights> weights;  // names only once loaded: the tensors hold their memory
  std::unique_ptr<Model> model;
  std::vector<std::string> weight_files;  // the shards read, as named in the model directory
};

// config.json -> architecture by model_type -> weights -> model, then checks that every stored
// tensor was used or is ignored by rule (the architecture's ignored prefixes, and
// "*.rotary_emb.inv_freq" buffers): Error("model.unexpected_tensor") names the first others.
// Error("model.unsupported") names an unknown model_type.
LoadedModel load_model(ModelFiles& files, const ExecOptions& options, unsigned read_threads = 1);
LoadedModel load_model(const std::filesystem::path& model_dir, const ExecOptions& options);

}  // namespace assay::oracle
