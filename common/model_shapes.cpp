#include "common/model_shapes.h"

#include <cmath>
#include <optional>
#include <set>

#include "common/error.h"

namespace assay::common {

namespace {

// A size as config.json writes it: JSON's 1e9 is a float, and a size written so is still one.
std::optional<double> number(const Json& object, const char* key) {
  auto it = object.find(key);
  if (it == object.end() || !it->is_number()) return std::nullopt;
  return it->get<double>();
}

std::string show_shape(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

class Checker {
 public:
  Checker(const Json& config, const TensorShapes& shapes, const std::string& label,
          const std::string& code)
      : shapes_(shapes), code_(code) {
    auto text = config.find("text_config");
    if (text != config.end() && text->is_object()) {
      text_ = &*text;
      where_ = label + " text_config";
    } else {
      text_ = &config;
      where_ = label;
    }
  }

  void run() {
    if (!find_embedding()) return;  // an architecture this does not know: the backend decides
    const auto& embed = *shape(embedding_);
    expect("vocab_size", static_cast<double>(embed[0]), embedding_, "its rows");
    expect("hidden_size", static_cast<double>(embed[1]), embedding_, "its columns");
    hidden_ = static_cast<double>(embed[1]);
    check_layers();
    check_mlp();
    check_attention();
    check_linear_attention();
  }

 private:
  const std::vector<std::int64_t>* shape(const std::string& name) const {
    auto it = shapes_.find(name);
    return it == shapes_.end() ? nullptr : &it->second;
  }

  // The first stored block that has `suffix` (as <P>layers.N.<suffix>) and its shape.
  const std::vector<std::int64_t>* in_a_layer(const std::string& suffix, std::string* name) const {
    for (std::int64_t n : layers_) {
      std::string candidate = prefix_ + "layers." + std::to_string(n) + "." + suffix;
      if (const auto* s = shape(candidate); s && !s->empty()) {
        *name = candidate;
        return s;
      }
    }
    return nullptr;
  }

  [[noreturn]] void refuse(const std::string& keys, const std::string& tensor,
                           const std::string& why) const {
    throw Error(code_, where_ + " " + keys + " contradicts the checkpoint: " + tensor +
                           " has shape " + show_shape(*shape(tensor)) + " (" + why +
                           "); nothing was built from it");
  }

  std::string value_of(const char* key) const {
    return key + std::string(" = ") + (*text_)[key].dump();
  }

  void expect(const char* key, double want, const std::string& tensor, const std::string& what) {
    auto v = number(*text_, key);
    if (v && *v != want)
      refuse(value_of(key), tensor,
             what + " say " + std::to_string(static_cast<std::int64_t>(want)));
  }

  bool find_embedding() {
    std::string fallback;
    for (const auto& [name, s] : shapes_) {
      for (const char* suffix : {"embed_tokens.weight", "embedding.weight"}) {
        std::string_view sv(suffix);
        if (s.size() != 2 || name.size() < sv.size() ||
            name.compare(name.size() - sv.size(), sv.size(), sv) != 0)
          continue;
        std::string p = name.substr(0, name.size() - sv.size());
        if (!p.empty() && p.back() != '.') continue;
        auto first = shapes_.lower_bound(p + "layers.");
        if (first != shapes_.end() && first->first.rfind(p + "layers.", 0) == 0) {
          embedding_ = name;
          prefix_ = p;
          collect_layers();
          return true;
        }
      }
    }
    return false;
  }

  void collect_layers() {
    const std::string head = prefix_ + "layers.";
    for (auto it = shapes_.lower_bound(head); it != shapes_.end() && it->first.rfind(head, 0) == 0;
         ++it) {
      std::size_t at = head.size(), end = at;
      while (end < it->first.size() && end - at < 18 && it->first[end] >= '0' &&
             it->first[end] <= '9')
        ++end;
      if (end == at || end >= it->first.size() || it->first[end] != '.') continue;
      layers_.insert(std::stoll(it->first.substr(at, end - at)));
    }
  }

  void check_layers() {
    auto v = number(*text_, "num_hidden_layers");
    if (!v || layers_.empty() || *v == static_cast<double>(layers_.size())) return;
    const std::string last = prefix_ + "layers." + std::to_string(*layers_.rbegin());
    throw Error(code_, where_ + " " + value_of("num_hidden_layers") +
                           " contradicts the checkpoint: it stores " +
                           std::to_string(layers_.size()) + " blocks (" + prefix_ +
                           "layers.N, the last " + last + "); nothing was built from it");
  }

  void check_mlp() {
    std::string name;
    const auto* s = in_a_layer("mlp.gate_proj.weight", &name);
    if (!s) s = in_a_layer("mlp.up_proj.weight", &name);
    if (s) expect("intermediate_size", static_cast<double>((*s)[0]), name, "its rows");
  }

  double head_dim() const {
    if (auto d = number(*text_, "head_dim")) return *d;
    auto heads = number(*text_, "num_attention_heads");
    if (!heads || *heads < 1) return 0;
    return std::floor(hidden_ / *heads);  // transformers' hidden_size // num_attention_heads
  }

  void check_attention() {
    auto heads = number(*text_, "num_attention_heads");
    if (!heads) return;
    auto kv = number(*text_, "num_key_value_heads");
    const double kv_heads = kv ? *kv : *heads;
    const double dim = head_dim();
    const std::string keys =
        value_of("num_attention_heads") + (text_->contains("head_dim") && number(*text_, "head_dim")
                                               ? ", " + value_of("head_dim")
                                               : "");
    std::string name;
    if (const auto* q = in_a_layer("self_attn.q_proj.weight", &name)) {
      const double rows = static_cast<double>((*q)[0]);
      // Architectures that gate attention's output store the gate's rows with the query's.
      if (*heads * dim != rows && 2 * *heads * dim != rows)
        refuse(keys, name, "heads x head_dim = " + fmt(*heads * dim) + ", its rows " + fmt(rows));
    }
    if (const auto* k = in_a_layer("self_attn.k_proj.weight", &name); k && kv) {
      const double rows = static_cast<double>((*k)[0]);
      if (kv_heads * dim != rows)
        refuse(value_of("num_key_value_heads"), name,
               "kv heads x head_dim = " + fmt(kv_heads * dim) + ", its rows " + fmt(rows));
    }
    if (const auto* qkv = in_a_layer("self_attn.q_k_v_proj.weight", &name)) {
      const double rows = static_cast<double>((*qkv)[0]);
      if ((*heads + 2 * kv_heads) * dim != rows)
        refuse(keys + (kv ? ", " + value_of("num_key_value_heads") : ""), name,
               "(heads + 2 x kv heads) x head_dim = " + fmt((*heads + 2 * kv_heads) * dim) +
                   ", its rows " + fmt(rows));
    }
  }

  void check_linear_attention() {
    std::string name;
    if (const auto* a = in_a_layer("linear_attn.A_log", &name))
      expect("linear_num_value_heads", static_cast<double>((*a)[0]), name, "its length");
    if (const auto* c = in_a_layer("linear_attn.conv1d.weight", &name); c && c->size() == 3)
      expect("linear_conv_kernel_dim", static_cast<double>((*c)[2]), name, "its last dimension");
    if (const auto* n = in_a_layer("linear_attn.norm.weight", &name))
      expect("linear_value_head_dim", static_cast<double>((*n)[0]), name, "its length");
    if (const auto* p = in_a_layer("linear_attn.in_proj_qkv.weight", &name)) {
      auto kh = number(*text_, "linear_num_key_heads"), kd = number(*text_, "linear_key_head_dim");
      auto vh = number(*text_, "linear_num_value_heads"),
           vd = number(*text_, "linear_value_head_dim");
      if (!kh || !kd || !vh || !vd) return;
      const double want = 2 * *kh * *kd + *vh * *vd, rows = static_cast<double>((*p)[0]);
      if (want != rows)
        refuse(value_of("linear_num_key_heads") + ", " + value_of("linear_key_head_dim"), name,
               "2 x key heads x key dim + value heads x value dim = " + fmt(want) + ", its rows " +
                   fmt(rows));
    }
  }

  static std::string fmt(double v) {
    if (v >= -9e15 && v <= 9e15 && v == std::floor(v))
      return std::to_string(static_cast<std::int64_t>(v));
    return Json(v).dump();
  }

  const TensorShapes& shapes_;
  std::string code_, where_;
  const Json* text_ = nullptr;
  std::string embedding_, prefix_;
  std::set<std::int64_t> layers_;
  double hidden_ = 0;
};

}  // namespace

void check_config_shapes(const Json& config, const TensorShapes& shapes, const std::string& label,
                         const std::string& code) {
  if (!config.is_object()) return;
  Checker(config, shapes, label, code).run();
}

}  // namespace assay::common
