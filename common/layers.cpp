#include "common/layers.h"

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <map>

#include "common/error.h"
#include "common/identity.h"
#include "common/request_fields.h"

namespace assay::common {

using namespace request_fields;

std::string_view layer_rows_name(LayerRows r) {
  return r == LayerRows::kLast ? "last" : "all";
}

void LayerRequest::check_vocab(std::int64_t vocab_size) const {
  for (std::size_t j = 0; j < input_token_ids.size(); ++j)
    if (input_token_ids[j] >= vocab_size)
      throw Error("request.invalid_token_id", "request.input_token_ids[" + std::to_string(j) +
                                                  "] = " + std::to_string(input_token_ids[j]) +
                                                  " is not below the model's vocab_size " +
                                                  std::to_string(vocab_size));
  if (next_token_id && *next_token_id >= vocab_size)
    throw Error("request.invalid_token_id",
                "request.engine.next_token_id = " + std::to_string(*next_token_id) +
                    " is not below the model's vocab_size " + std::to_string(vocab_size));
}

LayerRequest validate_layer_request(const Json& doc) {
  if (!doc.is_object()) invalid("the request must be a JSON object");
  const Json& schema = field(doc, "schema", "request");
  if (!schema.is_string() || schema.get<std::string>() != kLayerRequest)
    throw Error("request.unknown_schema", "request.schema " + schema.dump().substr(0, 80) +
                                              " is not \"" + std::string(kLayerRequest) + "\"");
  only_fields(doc,
              {"schema", "id", "model_dir", "model_identity", "input_token_ids", "engine", "rows",
               "tolerance", "patching", "patch_search", "limits"},
              "request");
  LayerRequest r;
  r.schema = kLayerRequest;
  r.id = string_field(doc, "id", "request", 256);
  r.model_dir = string_field(doc, "model_dir", "request", 4096);
  if (r.model_dir.front() != '/' || r.model_dir.find('\0') != std::string::npos)
    invalid("request.model_dir \"" + r.model_dir + "\" is not an absolute path");
  while (r.model_dir.size() > 1 && r.model_dir.back() == '/') r.model_dir.pop_back();
  if (auto mi = doc.find("model_identity"); mi != doc.end()) {
    validate_model_identity(*mi, "request.model_identity");
    r.model_identity = *mi;
  }
  r.input_token_ids = parse_token_id_array(doc, "input_token_ids", "request", false);
  if (r.input_token_ids.size() > kMaxLayerTokens)
    invalid("request.input_token_ids has " + std::to_string(r.input_token_ids.size()) +
            " ids, more than " + std::to_string(kMaxLayerTokens));

  const Json& engine = field(doc, "engine", "request");
  if (!engine.is_object()) invalid("request.engine must be an object, got " + engine.dump());
  only_fields(engine, {"name", "rows_file", "next_token_id"}, "request.engine");
  r.engine = string_field(engine, "name", "request.engine", 64);
  for (unsigned char ch : r.engine)
    if (ch < 0x20 || ch > 0x7e)
      invalid("request.engine.name \"" + r.engine + "\" is not printable ASCII");
  const Json& file = field(engine, "rows_file", "request.engine");
  if (!file.is_object())
    invalid("request.engine.rows_file must be an object, got " + file.dump().substr(0, 80));
  only_fields(file, {"path", "sha256"}, "request.engine.rows_file");
  r.rows_path = string_field(file, "path", "request.engine.rows_file", 4096);
  if (r.rows_path.front() != '/' || r.rows_path.find('\0') != std::string::npos)
    invalid("request.engine.rows_file.path \"" + r.rows_path + "\" is not an absolute path");
  r.rows_sha256 = string_field(file, "sha256", "request.engine.rows_file", 71);
  if (!is_identity(r.rows_sha256))
    invalid("request.engine.rows_file.sha256 \"" + r.rows_sha256 +
            "\" is not \"sha256:\" and 64 lowercase hex digits");
  if (auto it = engine.find("next_token_id"); it != engine.end()) {
    if (!it->is_number_integer() || it->get<std::int64_t>() < 0 ||
        it->get<std::int64_t>() > 2147483647)
      invalid("request.engine.next_token_id must be a token id (an integer in [0, 2^31)), got " +
              it->dump().substr(0, 80));
    r.next_token_id = it->get<std::int64_t>();
  }

  if (auto it = doc.find("rows"); it != doc.end()) {
    if (*it == "last")
      r.rows = LayerRows::kLast;
    else if (*it == "all")
      r.rows = LayerRows::kAll;
    else
      invalid("request.rows must be \"last\" or \"all\", got " + it->dump().substr(0, 80));
  }
  if (auto it = doc.find("tolerance"); it != doc.end()) {
    if (!it->is_object()) invalid("request.tolerance must be an object, got " + it->dump());
    only_fields(*it, {"relative_rmse"}, "request.tolerance");
    if (auto t = it->find("relative_rmse"); t != it->end()) {
      if (!t->is_number() || !(t->get<double>() >= 0))
        invalid("request.tolerance.relative_rmse must be a number >= 0, got " + t->dump());
      r.tolerance = t->get<double>();
    }
  }
  if (auto it = doc.find("patching"); it != doc.end()) {
    if (!it->is_boolean()) invalid("request.patching must be true or false, got " + it->dump());
    r.patching = it->get<bool>();
  }
  if (auto it = doc.find("patch_search"); it != doc.end()) {
    if (*it != "bisect" && *it != "every")
      invalid("request.patch_search must be \"bisect\" or \"every\", got " +
              it->dump().substr(0, 80));
    r.patch_search = it->get<std::string>();
  }
  if (r.patching && r.rows != LayerRows::kAll)
    invalid(
        "request.patching needs request.rows \"all\": a hidden state substituted at the last "
        "position only leaves every earlier position at the reference's, which is not the "
        "engine's state; send the engine's rows for all positions");
  if (r.patching && !r.next_token_id)
    invalid(
        "request.patching needs request.engine.next_token_id: the token the engine chose, which "
        "each patched forward is checked against");
  r.limits = parse_request_limits(doc);
  r.request_sha256 = sha256_canonical_id(doc);
  r.document = doc;
  return r;
}

std::vector<std::string> layer_boundaries(const Json& root) {
  const Json& c =
      root.contains("text_config") && root["text_config"].is_object() ? root["text_config"] : root;
  if (!c.contains("num_hidden_layers") || !c["num_hidden_layers"].is_number_integer() ||
      c["num_hidden_layers"].get<std::int64_t>() < 1 ||
      c["num_hidden_layers"].get<std::int64_t>() > 100000)
    throw Error("request.bad_model", "config.json has no positive integer num_hidden_layers");
  auto n = c["num_hidden_layers"].get<std::int64_t>();
  const Json* types =
      c.contains("layer_types") && c["layer_types"].is_array() ? &c["layer_types"] : nullptr;
  std::vector<std::string> names{"embedding"};
  for (std::int64_t i = 0; i < n; ++i) {
    std::string p = "layers." + std::to_string(i);
    bool linear = types && static_cast<std::size_t>(i) < types->size() &&
                  (*types)[static_cast<std::size_t>(i)] == "linear_attention";
    for (const char* part : {".input_layernorm", linear ? ".linear_attn" : ".self_attn",
                             ".post_attention_layernorm", ".mlp"})
      names.push_back(p + part);
    names.push_back(p);
  }
  names.push_back("norm");
  return names;
}

namespace {

const Json& text_config(const Json& root) {
  return root.contains("text_config") && root["text_config"].is_object() ? root["text_config"]
                                                                         : root;
}

// A positive size from config.json, or `fallback` when absent (0: required).
std::int64_t config_size(const Json& c, const char* key, std::int64_t fallback) {
  auto it = c.find(key);
  if (it == c.end() || it->is_null()) {
    if (fallback > 0) return fallback;
    throw Error("request.bad_model", std::string("config.json has no ") + key);
  }
  if (!it->is_number_integer() || it->get<std::int64_t>() < 1 ||
      it->get<std::int64_t>() > (std::int64_t{1} << 31))
    throw Error("request.bad_model", std::string("config.json ") + key + " = " +
                                         it->dump().substr(0, 80) + " is not a positive size");
  return it->get<std::int64_t>();
}

}  // namespace

std::vector<Boundary> model_boundaries(const Json& root, std::int64_t hidden) {
  const Json& c = text_config(root);
  std::string type = c.contains("model_type") && c["model_type"].is_string()
                         ? c["model_type"].get<std::string>()
                         : "";
  const bool llama = type == "llama" || type == "qwen2" || type == "qwen3";
  const bool qwen3_5 = type == "qwen3_5" || type == "qwen3_5_text";
  const bool named = llama || qwen3_5;
  std::int64_t q = 0, kv = 0, inter = 0, key = 0, value = 0, v_heads = 0;
  if (named) {
    std::int64_t heads = config_size(c, "num_attention_heads", 0);
    std::int64_t kv_heads = config_size(c, "num_key_value_heads", heads);
    std::int64_t head_dim = config_size(c, "head_dim", std::max<std::int64_t>(1, hidden / heads));
    q = heads * head_dim;
    kv = kv_heads * head_dim;
    inter = config_size(c, "intermediate_size", 0);
  }
  if (qwen3_5) {
    key = config_size(c, "linear_num_key_heads", 0) * config_size(c, "linear_key_head_dim", 0);
    v_heads = config_size(c, "linear_num_value_heads", 0);
    value = v_heads * config_size(c, "linear_value_head_dim", 0);
  }
  using Ops = std::vector<std::pair<const char*, std::int64_t>>;
  std::vector<Boundary> out;
  for (const std::string& name : layer_boundaries(root)) {
    Ops ops;
    if (llama && name.ends_with(".self_attn")) {
      ops = {{"q_proj", q}};
      if (type == "qwen3") ops.emplace_back("q_norm", q);
      ops.emplace_back("k_proj", kv);
      if (type == "qwen3") ops.emplace_back("k_norm", kv);
      for (auto op : Ops{{"v_proj", kv},
                         {"q_rotary", q},
                         {"k_rotary", kv},
                         {"attention", q},
                         {"o_proj", hidden}})
        ops.push_back(op);
    } else if (qwen3_5 && name.ends_with(".self_attn")) {
      // Gated attention: q_proj holds the query and its gate, which multiplies the attention's
      // output (output_gate, o_proj's input).
      ops = {{"q_proj", 2 * q},  {"q_norm", q},     {"k_proj", kv},   {"k_norm", kv},
             {"v_proj", kv},     {"q_rotary", q},   {"k_rotary", kv}, {"attention", q},
             {"output_gate", q}, {"o_proj", hidden}};
    } else if (qwen3_5 && name.ends_with(".linear_attn")) {
      // Gated DeltaNet: the projections, the causal convolution (after its SiLU), the gates beta
      // and g (the decay, float32), the recurrent output, the gated norm, out_proj.
      ops = {{"in_proj_qkv", 2 * key + value},
             {"in_proj_z", value},
             {"in_proj_b", v_heads},
             {"in_proj_a", v_heads},
             {"conv", 2 * key + value},
             {"beta", v_heads},
             {"g", v_heads},
             {"recurrent", value},
             {"norm", value},
             {"out_proj", hidden}};
    } else if (named && name.ends_with(".mlp")) {
      ops = {{"gate_proj", inter},
             {"act_fn", inter},
             {"up_proj", inter},
             {"product", inter},
             {"down_proj", hidden}};
    }
    for (auto [op, width] : ops) out.push_back({name + "." + op, width, true});
    out.push_back({name, hidden, false});
  }
  return out;
}

std::vector<Boundary> job_boundaries(const std::vector<Boundary>& model,
                                     const std::vector<std::string>& wanted) {
  std::vector<Boundary> out;
  for (const Boundary& b : model)
    if (!b.operator_level || std::find(wanted.begin(), wanted.end(), b.name) != wanted.end())
      out.push_back(b);
  return out;
}

std::vector<std::string> block_operators(const std::vector<Boundary>& model,
                                         const std::string& boundary) {
  // The block: "layers.N.self_attn" / "layers.N.mlp", from the boundary or its operator.
  std::string block;
  for (const char* part : {".self_attn", ".linear_attn", ".mlp"}) {
    auto at = boundary.find(part);
    if (boundary.starts_with("layers.") && at != std::string::npos)
      block = boundary.substr(0, at + std::strlen(part));
  }
  std::vector<std::string> out;
  if (block.empty()) return out;
  for (const Boundary& b : model)
    if (b.operator_level && b.name.starts_with(block + ".")) out.push_back(b.name);
  return out;
}

EngineRows check_engine_rows(const SafetensorsIndex& index, const std::vector<Boundary>& model,
                             const LayerRequest& r, const std::string& expected_content) {
  auto bad = [](const std::string& m) { throw Error("request.bad_layer_rows", m); };
  std::map<std::string, const TensorView*> by_name;
  for (const TensorView& t : index.tensors) by_name[t.name] = &t;
  std::map<std::string, const Boundary*> boundary;
  std::size_t layers = 0;
  for (const Boundary& b : model) {
    boundary[b.name] = &b;
    layers += b.name.starts_with("layers.") && b.name.find('.', 7) == std::string::npos;
  }
  for (const auto& [name, t] : by_name) {
    auto known = boundary.find(name);
    if (known == boundary.end())
      bad("the engine's rows file has tensor \"" + name.substr(0, 200) +
          "\", which is not a boundary of this model (" + std::to_string(model.size()) +
          " boundaries: embedding, layers.0.input_layernorm .. layers." +
          std::to_string(layers == 0 ? 0 : layers - 1) +
          ", norm, with the operators docs/operators.md names)");
    if (t->dtype != Dtype::kF32 && t->dtype != Dtype::kBF16)
      bad("tensor \"" + name + "\" has dtype " + std::string(dtype_name(t->dtype)) +
          "; rows are F32 or BF16");
    const auto& s = t->shape;
    const std::int64_t rows = r.row_count(), width = known->second->width;
    bool ok = r.rows == LayerRows::kLast ? (s.size() == 1 && s[0] == width) ||
                                               (s.size() == 2 && s[0] == 1 && s[1] == width)
                                         : s.size() == 2 && s[0] == rows && s[1] == width;
    if (!ok) {
      std::string shape = "[";
      for (std::size_t i = 0; i < s.size(); ++i) shape += (i ? ", " : "") + std::to_string(s[i]);
      shape += "]";
      bad("tensor \"" + name + "\" has shape " + shape + "; rows \"" +
          std::string(layer_rows_name(r.rows)) + "\" of this boundary are " +
          (r.rows == LayerRows::kLast
               ? "[" + std::to_string(width) + "] or [1, " + std::to_string(width) + "]"
               : "[" + std::to_string(rows) + ", " + std::to_string(width) + "]") +
          " (" +
          (known->second->operator_level ? std::to_string(width) + " values per position"
                                         : "hidden_size " + std::to_string(width)) +
          ", " + std::to_string(r.input_token_ids.size()) + " input ids)");
    }
  }
  if (by_name.empty()) bad("the engine's rows file holds no tensor");
  EngineRows out;
  for (const Boundary& b : model) {
    if (by_name.count(b.name)) {
      out.given.push_back(b.name);
      if (b.operator_level) out.operators_given.push_back(b.name);
    } else if (!b.operator_level) {
      out.omitted.push_back(b.name);
    }
  }
  auto meta = [&](const char* key) -> std::optional<std::string> {
    auto it = index.metadata.find(key);
    return it == index.metadata.end() ? std::nullopt : std::optional(it->second);
  };
  if (auto ids = meta("input_token_ids_sha256")) {
    std::string want = token_ids_sha256(r.input_token_ids);
    if (*ids != want)
      bad("the engine's rows file says __metadata__.input_token_ids_sha256 " + ids->substr(0, 80) +
          ", but the request's input_token_ids hash to " + want);
  }
  out.model_content_sha256 = meta("model_content_sha256");
  if (out.model_content_sha256 && !expected_content.empty() &&
      *out.model_content_sha256 != expected_content)
    bad("the engine's rows file says __metadata__.model_content_sha256 " +
        out.model_content_sha256->substr(0, 80) + ", but the model's content identity is " +
        expected_content + ": rows from another model");
  return out;
}

}  // namespace assay::common
