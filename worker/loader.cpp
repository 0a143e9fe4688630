#include "worker/loader.h"

#include <algorithm>
#include <map>
#include <set>

#include <ATen/ATen.h>

#include "common/error.h"
#include "common/fs.h"
#include "common/safetensors.h"

namespace assay::oracle {
namespace {

using common::Error;
using common::Json;

constexpr std::size_t kMaxConfigBytes = 16u << 20;

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

c10::ScalarType stored_scalar_type(const common::TensorView& t) {
  switch (t.dtype) {
    case common::Dtype::kBF16:
      return at::kBFloat16;
    case common::Dtype::kF16:
      return at::kHalf;
    case common::Dtype::kF32:
      return at::kFloat;
    case common::Dtype::kF64:
      return at::kDouble;
    default:
      throw Error("model.bad_dtype", "tensor \"" + t.name + "\" is stored as " +
                                         std::string(common::dtype_name(t.dtype)) +
                                         ", expected a floating-point dtype");
  }
}

class MappedWeights final : public Weights {
 public:
  MappedWeights(std::vector<common::SafetensorsFile> files, const ExecOptions& options)
      : files_(std::move(files)), options_(options) {
    for (const auto& f : files_) {
      for (const auto& t : f.tensors()) {
        if (!by_name_.emplace(t.name, &t).second) {
          throw Error("model.bad_index", "tensor \"" + t.name + "\" is stored twice (again in " +
                                             f.path().filename().string() + ")");
        }
      }
    }
  }

  at::Tensor get(const std::string& name, const std::vector<int64_t>& shape) override {
    return get_as(name, shape, options_.dtype);
  }

  at::Tensor get_as(const std::string& name, const std::vector<int64_t>& shape,
                    c10::ScalarType dtype) override {
    auto it = by_name_.find(name);
    if (it == by_name_.end()) {
      throw Error("model.missing_tensor", "tensor \"" + name + "\" (shape " + shape_string(shape) +
                                              ") is missing from the checkpoint");
    }
    const common::TensorView& view = *it->second;
    if (view.shape != shape) {
      throw Error("model.bad_shape", "tensor \"" + name + "\" has shape " +
                                         shape_string(view.shape) + ", expected " +
                                         shape_string(shape));
    }
    auto stored = stored_scalar_type(view);
    used_.insert(name);
    auto* data = const_cast<std::byte*>(view.data);  // PROT_READ mapping: never written
    bool aligned = reinterpret_cast<std::uintptr_t>(data) % c10::elementSize(stored) == 0;
    at::Tensor t;
    if (aligned) {
      t = at::from_blob(data, shape, at::TensorOptions().dtype(stored));
    } else {
      t = at::empty(shape, at::TensorOptions().dtype(stored));
      std::memcpy(t.data_ptr(), data, view.nbytes);
    }
    if (stored != dtype) t = t.to(dtype);
    if (options_.device != t.device()) t = t.to(options_.device);
    return t;
  }

  bool has(const std::string& name) const override { return by_name_.count(name) > 0; }

  std::vector<std::string> unused() const override {
    std::vector<std::string> out;
    for (const auto& [name, view] : by_name_) {
      if (!used_.count(name)) out.push_back(name);
    }
    return out;
  }

 private:
  std::vector<common::SafetensorsFile> files_;
  ExecOptions options_;
  std::map<std::string, const common::TensorView*> by_name_;
  std::set<std::string> used_;
};

Json read_json(const std::filesystem::path& path) {
  try {
    return common::parse_strict(common::read_file(path, kMaxConfigBytes));
  } catch (const Error& e) {
    throw Error(e.code(), path.string() + ": " + e.what());
  }
}

}  // namespace

std::vector<ArchitectureEntry> architectures() {
  std::vector<ArchitectureEntry> all{llama_family_architecture(), spark2_5_architecture()};
#ifdef ASSAY_HAVE_QWEN3_5
  all.push_back(qwen3_5_architecture());
#endif
  return all;
}

Json read_config(const std::filesystem::path& model_dir) {
  Json config = read_json(model_dir / "config.json");
  if (!config.is_object()) {
    throw Error("model.bad_config", (model_dir / "config.json").string() + ": not an object");
  }
  return config;
}

std::string declared_dtype(const Json& config) {
  for (const Json* c :
       {&config, config.contains("text_config") ? &config["text_config"] : nullptr}) {
    if (!c || !c->is_object()) continue;
    for (const char* key : {"torch_dtype", "dtype"}) {
      if (c->contains(key) && (*c)[key].is_string()) return (*c)[key].get<std::string>();
    }
  }
  return "";
}

std::unique_ptr<Weights> open_weights(const std::filesystem::path& model_dir,
                                      const ExecOptions& options) {
  std::vector<common::SafetensorsFile> files;
  auto index_path = model_dir / "model.safetensors.index.json";
  if (std::filesystem::exists(index_path)) {
    Json index = read_json(index_path);
    const Json* map =
        index.is_object() && index.contains("weight_map") ? &index["weight_map"] : nullptr;
    if (!map || !map->is_object() || map->empty()) {
      throw Error("model.bad_index", index_path.string() + ": no weight_map object");
    }
    std::map<std::string, std::vector<std::string>> by_file;
    for (const auto& [name, file] : map->items()) {
      if (!file.is_string()) {
        throw Error("model.bad_index",
                    index_path.string() + ": weight_map[\"" + name + "\"] is not a file name");
      }
      std::string f = file.get<std::string>();
      if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..") {
        throw Error("model.bad_index", index_path.string() + ": weight_map[\"" + name + "\"] = \"" +
                                           f + "\" is not a plain file name");
      }
      by_file[f].push_back(name);
    }
    for (const auto& [file, names] : by_file) {
      files.push_back(common::SafetensorsFile::open(model_dir / file));
      for (const auto& name : names) {
        if (!files.back().find(name)) {
          throw Error("model.missing_tensor",
                      "tensor \"" + name + "\" is not in " + file + " where the index puts it");
        }
      }
    }
  } else if (std::filesystem::exists(model_dir / "model.safetensors")) {
    files.push_back(common::SafetensorsFile::open(model_dir / "model.safetensors"));
  } else {
    throw Error("model.no_weights", model_dir.string() +
                                        " has neither model.safetensors nor "
                                        "model.safetensors.index.json");
  }
  return std::make_unique<MappedWeights>(std::move(files), options);
}

LoadedModel load_model(const std::filesystem::path& model_dir, const ExecOptions& options) {
  LoadedModel loaded;
  loaded.config = read_config(model_dir);
  if (!loaded.config.contains("model_type") || !loaded.config["model_type"].is_string()) {
    throw Error("model.bad_config",
                (model_dir / "config.json").string() + ": missing string \"model_type\"");
  }
  loaded.model_type = loaded.config["model_type"].get<std::string>();
  const ArchitectureEntry* entry = nullptr;
  auto all = architectures();
  std::string known;
  for (const auto& a : all) {
    for (const auto& t : a.model_types) {
      known += (known.empty() ? "" : ", ") + t;
      if (t == loaded.model_type) entry = &a;
    }
  }
  if (!entry) {
    throw Error("model.unsupported", "config.json: model_type \"" + loaded.model_type +
                                         "\" is not supported (supported: " + known + ")");
  }
  loaded.weights = open_weights(model_dir, options);
  loaded.model = entry->make(loaded.config, *loaded.weights, options);
  std::vector<std::string> unexpected;
  for (const auto& name : loaded.weights->unused()) {
    bool ignored = name.ends_with(".rotary_emb.inv_freq");
    for (const auto& prefix : entry->ignored_prefixes) ignored |= name.starts_with(prefix);
    if (!ignored) unexpected.push_back(name);
  }
  if (!unexpected.empty()) {
    std::string names;
    for (std::size_t i = 0; i < unexpected.size() && i < 5; ++i) {
      names += (i ? ", \"" : "\"") + unexpected[i] + "\"";
    }
    throw Error("model.unexpected_tensor", std::to_string(unexpected.size()) +
                                               " tensor(s) of the checkpoint are not part of " +
                                               loaded.model_type + ": " + names);
  }
  return loaded;
}

}  // namespace assay::oracle
