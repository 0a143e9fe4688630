#include "worker/loader.h"

#include <algorithm>
#include <map>
#include <set>

#include <ATen/ATen.h>

#include "common/error.h"
#include "common/fs.h"
#include "common/safetensors.h"
#include "worker/model_files.h"

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

// One weight file: its image in this process's memory and the tensors parsed from it.
struct Shard {
  std::string name;
  std::shared_ptr<const FileImage> image;
  common::SafetensorsIndex index;
};

class ReadWeights final : public Weights {
 public:
  ReadWeights(std::vector<Shard> shards, const ExecOptions& options)
      : shards_(std::move(shards)), options_(options) {
    for (const auto& s : shards_) {
      for (const auto& t : s.index.tensors) {
        if (!by_name_.emplace(t.name, Entry{&t, s.image}).second) {
          throw Error("model.bad_index",
                      "tensor \"" + t.name + "\" is stored twice (again in " + s.name + ")");
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
    if (!it->second.image) {
      throw Error("oracle.internal", "tensor \"" + name + "\" requested after loading finished");
    }
    const common::TensorView& view = *it->second.view;
    if (view.shape != shape) {
      throw Error("model.bad_shape", "tensor \"" + name + "\" has shape " +
                                         shape_string(view.shape) + ", expected " +
                                         shape_string(shape));
    }
    auto stored = stored_scalar_type(view);
    used_.insert(name);
    auto* data = const_cast<std::byte*>(view.data);  // read-only image: never written
    bool aligned = reinterpret_cast<std::uintptr_t>(data) % c10::elementSize(stored) == 0;
    at::Tensor t;
    if (aligned) {
      // The view holds its file's image: a model on CPU keeps exactly the images it uses.
      t = at::from_blob(
          data, shape, [image = it->second.image](void*) {}, at::TensorOptions().dtype(stored));
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
    for (const auto& [name, entry] : by_name_) {
      if (!used_.count(name)) out.push_back(name);
    }
    return out;
  }

  void release() override {
    for (auto& [name, entry] : by_name_) entry = Entry{};
    shards_.clear();
  }

 private:
  struct Entry {
    const common::TensorView* view = nullptr;
    std::shared_ptr<const FileImage> image;
  };
  std::vector<Shard> shards_;
  ExecOptions options_;
  std::map<std::string, Entry> by_name_;
  std::set<std::string> used_;
};

Json read_json(ModelFiles& files, const std::string& name) {
  auto image = files.read(name, kMaxConfigBytes);
  try {
    return common::parse_strict(std::string(image->text()));
  } catch (const Error& e) {
    throw Error(e.code(), (files.dir() / name).string() + ": " + e.what());
  }
}

Shard parse_shard(const std::string& name, std::shared_ptr<const FileImage> image,
                  const std::filesystem::path& dir) {
  Shard s{name, std::move(image), {}};
  try {
    s.index = common::parse_safetensors(s.image->bytes());
  } catch (const Error& e) {
    throw Error(e.code(), (dir / name).string() + ": " + e.what());
  }
  return s;
}

}  // namespace

std::vector<ArchitectureEntry> architectures() {
  std::vector<ArchitectureEntry> all{llama_family_architecture(), spark2_5_architecture()};
#ifdef ASSAY_HAVE_QWEN3_5
  all.push_back(qwen3_5_architecture());
#endif
  return all;
}

Json read_config(ModelFiles& files) {
  Json config = read_json(files, "config.json");
  if (!config.is_object()) {
    throw Error("model.bad_config", (files.dir() / "config.json").string() + ": not an object");
  }
  return config;
}

Json read_config(const std::filesystem::path& model_dir) {
  ModelFiles files = ModelFiles::from_directory(model_dir);
  return read_config(files);
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

namespace {

// The shard names: the index's files (each checked to hold the tensors the index puts there),
// or model.safetensors.
std::vector<Shard> read_shards(ModelFiles& files, unsigned threads) {
  const std::string index_name = "model.safetensors.index.json";
  const std::string index_path = (files.dir() / index_name).string();
  if (!files.has(index_name)) {
    if (!files.has("model.safetensors")) {
      throw Error("model.no_weights", files.dir().string() +
                                          " has neither model.safetensors nor "
                                          "model.safetensors.index.json");
    }
    auto images = files.read_large({"model.safetensors"}, 1);
    std::vector<Shard> out;
    out.push_back(parse_shard("model.safetensors", std::move(images[0]), files.dir()));
    return out;
  }
  Json index = read_json(files, index_name);
  const Json* map =
      index.is_object() && index.contains("weight_map") ? &index["weight_map"] : nullptr;
  if (!map || !map->is_object() || map->empty()) {
    throw Error("model.bad_index", index_path + ": no weight_map object");
  }
  std::map<std::string, std::vector<std::string>> by_file;
  for (const auto& [name, file] : map->items()) {
    if (!file.is_string()) {
      throw Error("model.bad_index",
                  index_path + ": weight_map[\"" + name + "\"] is not a file name");
    }
    std::string f = file.get<std::string>();
    if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..") {
      throw Error("model.bad_index", index_path + ": weight_map[\"" + name + "\"] = \"" + f +
                                         "\" is not a plain file name");
    }
    by_file[f].push_back(name);
  }
  std::vector<std::string> names;
  for (const auto& [file, tensors] : by_file) names.push_back(file);
  auto images = files.read_large(names, threads);
  std::vector<Shard> out;
  for (std::size_t i = 0; i < names.size(); ++i) {
    out.push_back(parse_shard(names[i], std::move(images[i]), files.dir()));
    for (const auto& name : by_file[names[i]]) {
      if (!out.back().index.find(name)) {
        throw Error("model.missing_tensor",
                    "tensor \"" + name + "\" is not in " + names[i] + " where the index puts it");
      }
    }
  }
  return out;
}

}  // namespace

std::unique_ptr<Weights> open_weights(ModelFiles& files, const ExecOptions& options,
                                      unsigned read_threads) {
  return std::make_unique<ReadWeights>(read_shards(files, read_threads), options);
}

std::unique_ptr<Weights> open_weights(const std::filesystem::path& model_dir,
                                      const ExecOptions& options) {
  ModelFiles files = ModelFiles::from_directory(model_dir);
  return open_weights(files, options);
}

LoadedModel load_model(ModelFiles& files, const ExecOptions& options, unsigned read_threads) {
  LoadedModel loaded;
  loaded.config = read_config(files);
  if (!loaded.config.contains("model_type") || !loaded.config["model_type"].is_string()) {
    throw Error("model.bad_config",
                (files.dir() / "config.json").string() + ": missing string \"model_type\"");
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
  std::vector<Shard> shards = read_shards(files, read_threads);
  for (const auto& s : shards) loaded.weight_files.push_back(s.name);
  loaded.weights = std::make_unique<ReadWeights>(std::move(shards), options);
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
  // From here the tensors alone hold the file images they view; copies (another dtype, a GPU)
  // leave theirs to be freed.
  loaded.weights->release();
  return loaded;
}

LoadedModel load_model(const std::filesystem::path& model_dir, const ExecOptions& options) {
  ModelFiles files = ModelFiles::from_directory(model_dir);
  return load_model(files, options);
}

}  // namespace assay::oracle
