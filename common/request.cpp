#include "common/request.h"

#include <set>

#include "common/error.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "common/request_fields.h"

namespace assay::common {
namespace {

using namespace request_fields;

std::int64_t token_id(const Json& v, const std::string& where) {
  if (!v.is_number_integer())
    throw Error("request.invalid_token_id",
                where + " must be an integer token id, got " + v.dump());
  if (v.is_number_unsigned() && v.get<std::uint64_t>() > std::uint64_t(kMaxTokenId))
    throw Error("request.invalid_token_id", where + " = " + v.dump() + " is too large");
  auto id = v.get<std::int64_t>();
  if (id < 0 || id > kMaxTokenId)
    throw Error("request.invalid_token_id", where + " = " + v.dump() + " is out of range");
  return id;
}

std::vector<std::int64_t> token_ids(const Json& obj, std::string_view key, std::string_view where,
                                    bool allow_empty) {
  const Json& v = field(obj, key, where);
  std::string name = std::string(where) + "." + std::string(key);
  if (!v.is_array()) invalid(name + " must be an array of token ids, got " + v.type_name());
  if (v.empty() && !allow_empty) invalid(name + " must not be empty");
  if (v.size() > kMaxInputTokens)
    invalid(name + " has " + std::to_string(v.size()) + " ids, more than the limit " +
            std::to_string(kMaxInputTokens));
  std::vector<std::int64_t> ids;
  ids.reserve(v.size());
  for (std::size_t i = 0; i < v.size(); ++i)
    ids.push_back(token_id(v[i], name + "[" + std::to_string(i) + "]"));
  return ids;
}

std::vector<Candidate> parse_candidates(const Json& doc) {
  const Json& v = field(doc, "candidates", "request");
  if (!v.is_array())
    invalid("request.candidates must be an array, got " + std::string(v.type_name()));
  if (v.size() < 2 || v.size() > kMaxCandidates)
    invalid("request.candidates must have 2.." + std::to_string(kMaxCandidates) + " entries, got " +
            std::to_string(v.size()));
  std::vector<Candidate> out;
  std::set<std::string> engines;
  for (std::size_t i = 0; i < v.size(); ++i) {
    std::string where = "request.candidates[" + std::to_string(i) + "]";
    if (!v[i].is_object()) invalid(where + " must be an object");
    only_fields(v[i], {"engine", "token_id", "text"}, where);
    Candidate c;
    c.engine = string_field(v[i], "engine", where, 128);
    if (c.engine == "neither") invalid(where + ".engine \"neither\" is reserved for the verdict");
    if (!engines.insert(c.engine).second)
      invalid(where + ".engine \"" + c.engine + "\" appears twice");
    c.token_id = token_id(field(v[i], "token_id", where), where + ".token_id");
    const Json& text = field(v[i], "text", where);
    if (!text.is_string()) invalid(where + ".text must be a string, got " + text.dump());
    c.text = text.get<std::string>();
    out.push_back(std::move(c));
  }
  return out;
}

RequestLimits parse_limits(const Json& doc) {
  RequestLimits limits;
  auto it = doc.find("limits");
  if (it == doc.end()) return limits;
  if (!it->is_object()) invalid("request.limits must be an object");
  only_fields(*it, {"timeout_seconds", "memory_bytes"}, "request.limits");
  if (auto t = it->find("timeout_seconds"); t != it->end()) {
    if (!t->is_number() || t->get<double>() <= 0 || t->get<double>() > 7 * 86400)
      invalid("request.limits.timeout_seconds must be a number in (0, 604800], got " + t->dump());
    limits.timeout_seconds = t->get<double>();
  }
  if (auto m = it->find("memory_bytes"); m != it->end()) {
    if (!m->is_number_integer() || m->get<std::int64_t>() < (1 << 20))
      invalid("request.limits.memory_bytes must be an integer >= 1048576, got " + m->dump());
    limits.memory_bytes = m->get<std::uint64_t>();
  }
  return limits;
}

void check_identity_string(const Json& obj, std::string_view key, std::string_view where,
                           bool nullable) {
  const Json& v = field(obj, key, where);
  if (nullable && v.is_null()) return;
  if (!v.is_string() || !is_identity(v.get_ref<const std::string&>()))
    throw Error("request.invalid", std::string(where) + "." + std::string(key) +
                                       " must be \"sha256:<64 lowercase hex>\"" +
                                       (nullable ? " or null" : "") + ", got " + v.dump());
}

void check_token_ids_sha(const Json& doc, const std::string& recomputed) {
  auto it = doc.find("input_token_ids_sha256");
  if (it == doc.end()) return;
  if (!it->is_string() || !is_identity(it->get_ref<const std::string&>()))
    invalid("request.input_token_ids_sha256 must be \"sha256:<64 lowercase hex>\", got " +
            it->dump());
  if (*it != recomputed)
    throw Error("request.sha_mismatch", "request.input_token_ids_sha256 is " +
                                            it->get<std::string>() + " but the ids hash to " +
                                            recomputed);
}

}  // namespace

RequestLimits parse_request_limits(const Json& doc) { return parse_limits(doc); }

std::vector<std::int64_t> parse_token_id_array(const Json& obj, std::string_view key,
                                               std::string_view where, bool allow_empty) {
  return token_ids(obj, key, where, allow_empty);
}

std::string token_ids_sha256(std::span<const std::int64_t> ids) {
  // Canonical form of an integer array is digits and commas; built directly so a million ids
  // do not go through a Json tree.
  std::string s = "[";
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(ids[i]);
  }
  s += ']';
  return sha256_id(s);
}

std::string model_content_sha256(const Json& mi) {
  if (!mi.is_object()) invalid("model_identity must be an object");
  Json core = Json::object();
  for (const char* k :
       {"id", "config_hash", "tokenizer_hash", "chat_template_hash", "weight_files"})
    core[k] = field(mi, k, "model_identity");
  return sha256_canonical_id(core);
}

void validate_model_identity(const Json& mi, std::string_view where) {
  if (!mi.is_object()) invalid(std::string(where) + " must be an object");
  only_fields(mi,
              {"id", "config_hash", "tokenizer_hash", "chat_template_hash", "weight_files",
               "content_sha256"},
              where);
  string_field(mi, "id", where, 512);
  check_identity_string(mi, "config_hash", where, false);
  check_identity_string(mi, "tokenizer_hash", where, false);
  check_identity_string(mi, "chat_template_hash", where, true);
  check_identity_string(mi, "content_sha256", where, false);
  const Json& files = field(mi, "weight_files", where);
  std::string fw = std::string(where) + ".weight_files";
  if (!files.is_array() || files.empty()) invalid(fw + " must be a non-empty array");
  std::string previous;
  for (std::size_t i = 0; i < files.size(); ++i) {
    std::string w = fw + "[" + std::to_string(i) + "]";
    if (!files[i].is_object()) invalid(w + " must be an object");
    only_fields(files[i], {"path", "bytes", "sha256"}, w);
    auto path = string_field(files[i], "path", w, 4096);
    if (path.front() == '/' || path.find("..") != std::string::npos)
      invalid(w + ".path \"" + path + "\" must be relative, without \"..\"");
    if (i > 0 && !(previous < path))
      invalid(w + ".path \"" + path + "\" is not after \"" + previous + "\" (sorted, unique)");
    previous = path;
    const Json& bytes = field(files[i], "bytes", w);
    if (!bytes.is_number_integer() || bytes.get<std::int64_t>() < 0)
      invalid(w + ".bytes must be a non-negative integer, got " + bytes.dump());
    check_identity_string(files[i], "sha256", w, false);
  }
  auto recomputed = model_content_sha256(mi);
  if (mi["content_sha256"] != recomputed)
    throw Error("request.sha_mismatch", std::string(where) + ".content_sha256 is " +
                                            mi["content_sha256"].get<std::string>() +
                                            " but the identity hashes to " + recomputed);
}

NextTokenRequest parse_request(std::string_view text) {
  ParseLimits limits;
  limits.max_bytes = kMaxRequestBytes;
  return validate_request(parse_strict(text, limits));
}

NextTokenRequest validate_request(const Json& doc) {
  if (!doc.is_object())
    invalid(std::string("a request must be a JSON object, got ") + doc.type_name());
  auto schema_it = doc.find("schema");
  if (schema_it == doc.end() || !schema_it->is_string())
    throw Error("request.unknown_schema", "request.schema is missing or not a string");
  NextTokenRequest r;
  r.schema = schema_it->get<std::string>();
  if (r.schema == protocol::kNextTokenRequest) {
    r.kind = RequestKind::kAssay;
    only_fields(doc,
                {"schema", "id", "model_dir", "model_identity", "input_token_ids",
                 "input_token_ids_sha256", "candidates", "limits"},
                "request");
  } else if (r.schema == protocol::kKilnNextTokenRequest) {
    r.kind = RequestKind::kKiln;
    only_fields(doc,
                {"schema", "id", "source", "model_identity", "prompt", "continuation_prefix",
                 "input_token_ids", "input_token_ids_sha256", "candidates", "limits"},
                "request");
  } else {
    throw Error("request.unknown_schema", "request.schema \"" + r.schema + "\" is not " +
                                              std::string(protocol::kNextTokenRequest) + " or " +
                                              std::string(protocol::kKilnNextTokenRequest));
  }
  r.id = string_field(doc, "id", "request", 256);
  r.input_token_ids = token_ids(doc, "input_token_ids", "request", false);
  r.input_token_ids_sha256 = token_ids_sha256(r.input_token_ids);
  r.candidates = parse_candidates(doc);
  r.limits = parse_limits(doc);

  if (auto mi = doc.find("model_identity"); mi != doc.end()) {
    validate_model_identity(*mi, "request.model_identity");
    r.model_identity = *mi;
  }

  if (r.kind == RequestKind::kAssay) {
    if (auto md = doc.find("model_dir"); md != doc.end()) {
      auto dir = string_field(doc, "model_dir", "request", 4096);
      if (dir.front() != '/') invalid("request.model_dir \"" + dir + "\" must be absolute");
      r.model_dir = dir;
    }
    check_token_ids_sha(doc, r.input_token_ids_sha256);
  } else {
    if (!r.model_identity)
      invalid("request.model_identity is required in a " + r.schema + " request");
    if (doc.find("input_token_ids_sha256") == doc.end())
      invalid("request.input_token_ids_sha256 is required in a " + r.schema + " request");
    const Json& source = field(doc, "source", "request");
    if (!source.is_object()) invalid("request.source must be an object");
    r.source = source;
    const Json& prompt = field(doc, "prompt", "request");
    if (!prompt.is_object()) invalid("request.prompt must be an object");
    only_fields(prompt, {"token_ids", "text"}, "request.prompt");
    auto prompt_ids = token_ids(prompt, "token_ids", "request.prompt", false);
    std::vector<std::int64_t> prefix_ids;
    if (auto cp = doc.find("continuation_prefix"); cp != doc.end()) {
      if (!cp->is_object()) invalid("request.continuation_prefix must be an object");
      only_fields(*cp, {"token_ids", "text"}, "request.continuation_prefix");
      prefix_ids = token_ids(*cp, "token_ids", "request.continuation_prefix", true);
    }
    std::vector<std::int64_t> joined = prompt_ids;
    joined.insert(joined.end(), prefix_ids.begin(), prefix_ids.end());
    if (joined != r.input_token_ids) {
      std::size_t i = 0;
      while (i < joined.size() && i < r.input_token_ids.size() && joined[i] == r.input_token_ids[i])
        ++i;
      throw Error("request.inconsistent_token_ids",
                  "request.input_token_ids (" + std::to_string(r.input_token_ids.size()) +
                      " ids) != prompt.token_ids + continuation_prefix.token_ids (" +
                      std::to_string(joined.size()) + " ids); first difference at index " +
                      std::to_string(i));
    }
    check_token_ids_sha(doc, r.input_token_ids_sha256);
  }
  r.request_sha256 = sha256_canonical_id(doc);
  r.document = doc;
  return r;
}

Json NextTokenRequest::check_report() const {
  return Json{{"schema", schema},
              {"request_sha256", request_sha256},
              {"input_token_ids_sha256", input_token_ids_sha256},
              {"model_content_sha256",
               model_identity ? Json((*model_identity)["content_sha256"]) : Json(nullptr)}};
}

void NextTokenRequest::check_vocab(std::int64_t vocab_size) const {
  for (std::size_t i = 0; i < input_token_ids.size(); ++i)
    if (input_token_ids[i] >= vocab_size)
      throw Error("request.invalid_token_id", "request.input_token_ids[" + std::to_string(i) +
                                                  "] = " + std::to_string(input_token_ids[i]) +
                                                  " is not below the model's vocab size " +
                                                  std::to_string(vocab_size));
  for (std::size_t i = 0; i < candidates.size(); ++i)
    if (candidates[i].token_id >= vocab_size)
      throw Error("request.invalid_token_id",
                  "request.candidates[" + std::to_string(i) +
                      "].token_id = " + std::to_string(candidates[i].token_id) +
                      " is not below the model's vocab size " + std::to_string(vocab_size));
}

}  // namespace assay::common
