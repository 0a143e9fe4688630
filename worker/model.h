// What every architecture file provides, and what it gets: config, weights, options.
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "common/json.h"

namespace assay::oracle {

struct ExecOptions {
  c10::ScalarType dtype = c10::kBFloat16;  // execution dtype of the model
  c10::Device device{c10::kCPU};
};

// Tensors of a checkpoint, read into memory; each is handed out at most once and checked.
class Weights {
 public:
  virtual ~Weights() = default;
  // The tensor `name` with exactly `shape`, as a tensor of the execution dtype on the execution
  // device (no copy when stored dtype and device already match). Throws
  // common::Error("model.missing_tensor" / "model.bad_shape" / "model.bad_dtype") naming it.
  virtual at::Tensor get(const std::string& name, const std::vector<int64_t>& shape) = 0;
  // Same, but keeps the stored dtype converted to `dtype` (e.g. fp32 parameters such as A_log).
  virtual at::Tensor get_as(const std::string& name, const std::vector<int64_t>& shape,
                            c10::ScalarType dtype) = 0;
  virtual bool has(const std::string& name) const = 0;
  // Names never fetched with get/get_as.
  virtual std::vector<std::string> unused() const = 0;
  // Ends loading: drops this object's hold on the checkpoint's memory (tensors handed out keep
  // what they view); get/get_as then throw, has/unused still answer.
  virtual void release() = 0;
};

// Sees the forward's hidden state at each named boundary as it passes, and may replace it
// (activation patching). Boundaries, in forward order, named as transformers' modules under
// `model.` are (common/layers.h layer_boundaries): "embedding"; per layer N
// "layers.N.input_layernorm", "layers.N.self_attn" (or "layers.N.linear_attn"; the block's output
// before the residual add), "layers.N.post_attention_layernorm", "layers.N.mlp" (its output
// before the residual add), "layers.N" (the layer's output); "norm". The value is [1, T, hidden]
// in the dtype the forward computed it in. Architectures that name their operators
// (common/layers.h model_boundaries, docs/operators.md) also pass each block's operators, e.g.
// "layers.N.self_attn.q_rotary", as [1, T, ...] (any trailing dims; a view, so that a probe
// that returns what it is given changes no stride of the forward's tensors).
class Probe {
 public:
  virtual ~Probe() = default;
  // Returns the tensor the forward goes on with: `value` itself to observe only.
  virtual at::Tensor at(const std::string& boundary, const at::Tensor& value) = 0;
};

// probe ? probe->at(name, value) : value. The name is built only when there is a probe.
template <typename Name>
at::Tensor probed(Probe* probe, Name&& name, const at::Tensor& value) {
  return probe ? probe->at(name(), value) : value;
}

class Model {
 public:
  virtual ~Model() = default;
  // input_ids: int64 [1, T] on the execution device. Returns logits [1, T, vocab] in the
  // execution dtype, computed as transformers' eager forward computes them.
  at::Tensor forward(const at::Tensor& input_ids) { return lm_head(hidden_states(input_ids)); }
  // The forward up to the LM head: the final normalised hidden states [1, T, hidden]. A probe
  // sees every boundary; one that returns what it is given changes no bit of the result.
  at::Tensor hidden_states(const at::Tensor& input_ids, Probe* probe = nullptr) {
    return hidden_states_from(0,
                              probed(
                                  probe, [] { return "embedding"; }, embed(input_ids)),
                              probe);
  }
  // The embedding's output [1, T, hidden] (the "embedding" boundary).
  virtual at::Tensor embed(const at::Tensor& input_ids) = 0;
  // The forward from decoder layer `first` (0 .. layer_count(); layer_count() runs the final
  // norm only) given that layer's input `h` [1, T, hidden]: the "embedding" boundary's value for
  // layer 0, "layers.<first - 1>"'s otherwise. The same ops as the whole forward from there, so
  // that the reference's own input gives the whole forward's bits (activation patching starts
  // at the patched layer instead of the embedding).
  virtual at::Tensor hidden_states_from(int64_t first, const at::Tensor& h, Probe* probe) = 0;
  virtual int64_t layer_count() const = 0;
  virtual int64_t hidden_size() const = 0;
  // The LM head over hidden states [1, n, hidden] (any n rows of hidden_states' output) ->
  // logits [1, n, vocab]. Captures apply it to blocks of positions so that [T, vocab] is never
  // held whole.
  virtual at::Tensor lm_head(const at::Tensor& hidden) const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual std::string architecture() const = 0;              // e.g. "Qwen3ForCausalLM"
  virtual std::string attention_implementation() const = 0;  // e.g. "eager"
  virtual std::string linear_attention_implementation() const { return "none"; }
};

// One per architecture file. `config` is the parsed config.json. Throws
// common::Error("model.unsupported", ...) naming the field and value it does not support.
using ModelFactory = std::function<std::unique_ptr<Model>(
    const common::Json& config, Weights& weights, const ExecOptions& options)>;

struct ArchitectureEntry {
  std::vector<std::string> model_types;  // config.json "model_type" values it accepts
  ModelFactory make;
  // Weight-name prefixes that belong to the checkpoint but not to the text model (ignored).
  std::vector<std::string> ignored_prefixes;
};

// Defined in each architecture file; the registry lists them explicitly (no static init).
ArchitectureEntry llama_family_architecture();  // llama, qwen2, qwen3
ArchitectureEntry spark2_5_architecture();
ArchitectureEntry qwen3_5_architecture();

}  // namespace assay::oracle
