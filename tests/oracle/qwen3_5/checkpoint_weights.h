// A Weights over one mmapped model.safetensors, for the Qwen3.5 architecture tests: it lets the
// tests run the architecture file alone, with the checks the Weights contract promises (name,
// shape, dtype named on error; each tensor handed out once; unused names listed).
#pragma once

#include <ATen/ATen.h>

#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/safetensors.h"
#include "worker/model.h"

namespace assay::oracle::test {

inline c10::ScalarType to_scalar_type(common::Dtype d, const std::string& name) {
  switch (d) {
    case common::Dtype::kBF16:
      return at::kBFloat16;
    case common::Dtype::kF16:
      return at::kHalf;
    case common::Dtype::kF32:
      return at::kFloat;
    default:
      throw common::Error("model.bad_dtype", "tensor " + name + " has dtype " +
                                                 std::string(common::dtype_name(d)) +
                                                 ", not a floating-point type");
  }
}

class CheckpointWeights final : public Weights {
 public:
  CheckpointWeights(const std::filesystem::path& file, c10::ScalarType dtype)
      : file_(common::SafetensorsFile::open(file)), dtype_(dtype) {}

  at::Tensor get(const std::string& name, const std::vector<int64_t>& shape) override {
    return get_as(name, shape, dtype_);
  }

  at::Tensor get_as(const std::string& name, const std::vector<int64_t>& shape,
                    c10::ScalarType dtype) override {
    const common::TensorView* view = file_.find(name);
    if (view == nullptr) {
      throw common::Error("model.missing_tensor",
                          "tensor " + name + " is missing from " + file_.path().string());
    }
    if (view->shape != shape) {
      throw common::Error("model.bad_shape", "tensor " + name + " has shape " +
                                                 c10::str(c10::IntArrayRef(view->shape)) +
                                                 ", expected " + c10::str(c10::IntArrayRef(shape)));
    }
    const auto stored = to_scalar_type(view->dtype, name);
    if (!used_.insert(name).second) {
      throw common::Error("model.duplicate_use", "tensor " + name + " requested twice");
    }
    // The mapping is read-only and outlives the model; tensors over it are never written.
    at::Tensor t =
        at::from_blob(const_cast<std::byte*>(view->data), shape, at::TensorOptions().dtype(stored));
    return stored == dtype ? t : t.to(dtype);
  }

  bool has(const std::string& name) const override { return file_.find(name) != nullptr; }

  std::vector<std::string> unused() const override {
    std::vector<std::string> names;
    for (const auto& t : file_.tensors()) {
      if (!used_.count(t.name)) names.push_back(t.name);
    }
    return names;
  }

 private:
  common::SafetensorsFile file_;
  c10::ScalarType dtype_;
  std::set<std::string> used_;
};

}  // namespace assay::oracle::test
