#include "common/request.h"

#include "common/numerics.h"

#include <optional>
#include <set>

#include "common/error.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "common/request_fields.h"
#include "common/text.h"

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
  only_fields(*it, {"timeout_seconds", "memory_bytes", "memory_events"}, "request.limits");
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
  if (auto m = it->find("memory_events"); m != it->end())
    limits.memory_events =
        memory_policy_from(*m, "request.limits.memory_events", "request.invalid");
  return limits;
}

Json parse_numerics(const Json& doc) {
  auto it = doc.find("numerics");
  if (it == doc.end()) return nullptr;
  const std::string where = "request.numerics";
  if (!it->is_object()) invalid(where + " must be an object");
  only_fields(*it,
              {"reduction_seeds", "batch_sizes", "sdpa", "kv_cache", "fp32", "spread_factor",
               "margin_steps"},
              where);
  // Every member spelled out, defaults included: the worker runs exactly what the record says.
  Json spec{{"reduction_seeds", 16},
            {"batch_sizes", Json::array({4})},
            {"sdpa", true},
            {"kv_cache", true},
            {"fp32", true}};
  if (auto s = it->find("reduction_seeds"); s != it->end()) {
    if (!s->is_number_integer() || s->get<std::int64_t>() < 0 || s->get<std::int64_t>() > 64)
      invalid(where + ".reduction_seeds must be an integer in [0, 64], got " + s->dump());
    spec["reduction_seeds"] = *s;
  }
  if (auto b = it->find("batch_sizes"); b != it->end()) {
    if (!b->is_array() || b->size() > 4)
      invalid(where + ".batch_sizes must be an array of at most 4 sizes, got " +
              printable(b->dump(), 64));
    for (const Json& n : *b)
      if (!n.is_number_integer() || n.get<std::int64_t>() < 2 || n.get<std::int64_t>() > 16)
        invalid(where + ".batch_sizes: each size must be an integer in [2, 16], got " + n.dump());
    spec["batch_sizes"] = *b;
  }
  for (const char* flag : {"sdpa", "kv_cache", "fp32"})
    if (auto f = it->find(flag); f != it->end()) {
      if (!f->is_boolean())
        invalid(where + "." + flag + " must be true or false, got " + f->dump());
      spec[flag] = *f;
    }
  NumericsPolicy policy = numerics_policy(*it, where);
  spec["spread_factor"] = policy.spread_factor;
  spec["margin_steps"] = policy.margin_steps;
  return spec;
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
    throw Error("request.sha_mismatch",
                "request.input_token_ids_sha256: expected " + recomputed +
                    " (sha256 of the canonical request.input_token_ids), found " +
                    it->get<std::string>());
}

// Kiln's source: which commit and which two receipts produced the disputed tokens. Closed as
// Kiln's is; assay does not read the receipts, it carries the object into the result verbatim.
void check_hex(const Json& obj, std::string_view key, std::string_view where, std::size_t len) {
  const Json& v = field(obj, key, where);
  bool ok = v.is_string() && v.get_ref<const std::string&>().size() == len;
  if (ok)
    for (char c : v.get_ref<const std::string&>())
      ok = ok && ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'));
  if (!ok)
    invalid(std::string(where) + "." + std::string(key) + " must be " + std::to_string(len) +
            " lowercase hex digits, got " + v.dump());
}

const Json& kiln_source(const Json& source) {
  if (!source.is_object()) invalid("request.source must be an object");
  only_fields(source, {"source_commit", "kiln_receipt", "vllm_receipt"}, "request.source");
  check_hex(source, "source_commit", "request.source", 40);
  for (const char* receipt : {"kiln_receipt", "vllm_receipt"}) {
    std::string where = std::string("request.source.") + receipt;
    const Json& r = field(source, receipt, "request.source");
    if (!r.is_object()) invalid(where + " must be an object");
    only_fields(r, {"path", "file_sha256", "content_sha256"}, where);
    auto path = string_field(r, "path", where, 4096);
    if (path.front() == '/' || path.find("..") != std::string::npos)
      invalid(where + ".path \"" + path + "\" must be relative, without \"..\"");
    check_identity_string(r, "file_sha256", where, false);
    check_identity_string(r, "content_sha256", where, false);
  }
  return source;
}

void check_bool(const Json& obj, std::string_view key, std::string_view where) {
  const Json& v = field(obj, key, where);
  if (!v.is_boolean())
    invalid(std::string(where) + "." + std::string(key) + " must be true or false, got " +
            v.dump());
}

// Kiln's prompt: the chat it rendered and the token ids the rendering gave. assay does not
// render the chat template; it checks the document's own claims about itself.
std::vector<std::int64_t> kiln_prompt_token_ids(const Json& prompt) {
  constexpr std::string_view w = "request.prompt";
  if (!prompt.is_object()) invalid("request.prompt must be an object");
  only_fields(prompt,
              {"generator", "messages", "add_generation_prompt", "template_kwargs", "utf8_sha256",
               "token_count", "token_ids"},
              w);

  const Json& gen = field(prompt, "generator", w);
  if (!gen.is_object()) invalid("request.prompt.generator must be an object");
  only_fields(gen, {"run_id", "phase", "request_index", "profile", "template_version"},
              "request.prompt.generator");
  for (const char* k : {"run_id", "phase", "profile", "template_version"})
    string_field(gen, k, "request.prompt.generator", 256);
  const Json& index = field(gen, "request_index", "request.prompt.generator");
  if (!index.is_number_integer() || index.get<std::int64_t>() < 0)
    invalid("request.prompt.generator.request_index must be a non-negative integer, got " +
            index.dump());

  // The one user message is the text Kiln hashes into utf8_sha256; with several user messages
  // the hash would not say which, so such a prompt is refused.
  const Json& messages = field(prompt, "messages", w);
  if (!messages.is_array() || messages.empty() || messages.size() > kMaxMessages)
    invalid("request.prompt.messages must be an array of 1.." + std::to_string(kMaxMessages) +
            " messages, got " +
            (messages.is_array() ? std::to_string(messages.size()) + " entries"
                                 : std::string(messages.type_name())));
  std::optional<std::size_t> user;
  for (std::size_t i = 0; i < messages.size(); ++i) {
    std::string mw = "request.prompt.messages[" + std::to_string(i) + "]";
    if (!messages[i].is_object()) invalid(mw + " must be an object");
    only_fields(messages[i], {"role", "content"}, mw);
    auto role = string_field(messages[i], "role", mw, 64);
    if (role != "system" && role != "user" && role != "assistant")
      invalid(mw + ".role must be \"system\", \"user\" or \"assistant\", got \"" + role + "\"");
    string_field(messages[i], "content", mw, kMaxRequestBytes);
    if (role != "user") continue;
    if (user)
      invalid(mw + " is a second user message (the first is messages[" + std::to_string(*user) +
              "]); utf8_sha256 names one user message");
    user = i;
  }
  if (!user) invalid("request.prompt.messages has no message with role \"user\"");

  check_bool(prompt, "add_generation_prompt", w);
  const Json& kwargs = field(prompt, "template_kwargs", w);
  if (!kwargs.is_object()) invalid("request.prompt.template_kwargs must be an object");
  only_fields(kwargs, {"enable_thinking"}, "request.prompt.template_kwargs");
  check_bool(kwargs, "enable_thinking", "request.prompt.template_kwargs");

  check_identity_string(prompt, "utf8_sha256", w, false);
  const auto& content = messages[*user]["content"].get_ref<const std::string&>();
  std::string content_sha = sha256_id(content);
  if (prompt["utf8_sha256"] != content_sha)
    throw Error("request.sha_mismatch", "request.prompt.utf8_sha256: expected " + content_sha +
                                            " (sha256 of the " + std::to_string(content.size()) +
                                            " UTF-8 bytes of request.prompt.messages[" +
                                            std::to_string(*user) + "].content), found " +
                                            prompt["utf8_sha256"].get<std::string>());

  auto ids = token_ids(prompt, "token_ids", w, false);
  const Json& count = field(prompt, "token_count", w);
  if (!count.is_number_integer())
    invalid("request.prompt.token_count must be an integer, got " + count.dump());
  if (count.is_number_unsigned() ? count.get<std::uint64_t>() != ids.size()
                                 : count.get<std::int64_t>() != std::int64_t(ids.size()))
    throw Error("request.token_count_mismatch",
                "request.prompt.token_count: expected " + std::to_string(ids.size()) +
                    " (the number of request.prompt.token_ids), found " + count.dump());
  return ids;
}

std::vector<PrefixToken> continuation_prefix(const Json& v) {
  constexpr std::string_view w = "request.continuation_prefix";
  if (!v.is_array())
    invalid("request.continuation_prefix must be an array of {token_id, text}, got " +
            std::string(v.type_name()));
  if (v.size() > kMaxInputTokens)
    invalid("request.continuation_prefix has " + std::to_string(v.size()) +
            " tokens, more than the limit " + std::to_string(kMaxInputTokens));
  std::vector<PrefixToken> out;
  out.reserve(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    std::string tw = std::string(w) + "[" + std::to_string(i) + "]";
    if (!v[i].is_object()) invalid(tw + " must be an object");
    only_fields(v[i], {"token_id", "text"}, tw);
    PrefixToken t;
    t.token_id = token_id(field(v[i], "token_id", tw), tw + ".token_id");
    const Json& text = field(v[i], "text", tw);
    if (!text.is_string()) invalid(tw + ".text must be a string, got " + text.dump());
    t.text = text.get<std::string>();
    out.push_back(std::move(t));
  }
  return out;
}

// input_token_ids must be the prompt's ids followed by the prefix's; the message names the
// first position that differs, what the two parts give there and what the document has.
void check_joined_ids(const std::vector<std::int64_t>& prompt,
                      const std::vector<PrefixToken>& prefix,
                      const std::vector<std::int64_t>& input) {
  std::size_t n = prompt.size() + prefix.size();
  auto expected_at = [&](std::size_t i) {
    return i < prompt.size() ? prompt[i] : prefix[i - prompt.size()].token_id;
  };
  auto source_of = [&](std::size_t i) {
    return i < prompt.size()
               ? "request.prompt.token_ids[" + std::to_string(i) + "]"
               : "request.continuation_prefix[" + std::to_string(i - prompt.size()) + "].token_id";
  };
  std::size_t i = 0;
  while (i < n && i < input.size() && expected_at(i) == input[i]) ++i;
  if (i == n && i == input.size()) return;
  std::string parts = "request.prompt.token_ids " + std::to_string(prompt.size()) +
                      " + request.continuation_prefix " + std::to_string(prefix.size());
  if (i < n && i < input.size())
    throw Error("request.inconsistent_token_ids",
                "request.input_token_ids[" + std::to_string(i) + "]: expected " +
                    std::to_string(expected_at(i)) + " (" + source_of(i) + "), found " +
                    std::to_string(input[i]));
  throw Error("request.inconsistent_token_ids", "request.input_token_ids: expected " +
                                                    std::to_string(n) + " ids (" + parts +
                                                    "), found " + std::to_string(input.size()));
}
}  // namespace

Json parse_numerics_spec(const Json& doc) {
  return parse_numerics(doc);
}

std::string_view memory_policy_name(MemoryPolicy policy) {
  return policy == MemoryPolicy::kReject ? "reject" : "record";
}

MemoryPolicy memory_policy_from(const Json& value, std::string_view where, std::string_view code) {
  if (value == "record") return MemoryPolicy::kRecord;
  if (value == "reject") return MemoryPolicy::kReject;
  throw Error(std::string(code), std::string(where) + " must be \"record\" or \"reject\", got " +
                                     printable(value.dump(), 64));
}

RequestLimits parse_request_limits(const Json& doc) {
  return parse_limits(doc);
}

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

std::string kiln_canonical(const Json& value) {
  return python_canonical(value);
}

std::string model_content_sha256(const Json& mi) {
  if (!mi.is_object()) invalid("model_identity must be an object");
  Json core = Json::object();
  for (const char* k :
       {"id", "config_hash", "tokenizer_hash", "chat_template_hash", "weight_files"})
    core[k] = field(mi, k, "model_identity");
  return sha256_id(kiln_canonical(core));
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
    throw Error("request.sha_mismatch",
                std::string(where) + ".content_sha256: expected " + recomputed +
                    " (canonical sha256 of {id, config_hash, tokenizer_hash, chat_template_hash, "
                    "weight_files}), found " +
                    mi["content_sha256"].get<std::string>());
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
                 "input_token_ids_sha256", "candidates", "limits", "oracle", "numerics"},
                "request");
  } else if (r.schema == protocol::kKilnNextTokenRequest) {
    r.kind = RequestKind::kKiln;
    only_fields(
        doc,
        {"schema", "id", "source", "model_identity", "prompt", "continuation_prefix",
         "input_token_ids", "input_token_ids_sha256", "candidates", "limits", "oracle", "numerics"},
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
  r.numerics = parse_numerics(doc);
  if (auto o = doc.find("oracle"); o != doc.end()) {
    if (!o->is_object()) invalid("request.oracle must be an object");
    only_fields(*o, {"backend"}, "request.oracle");
    const Json& backend = field(*o, "backend", "request.oracle");
    if (backend != "libtorch" && backend != "transformers" && backend != "both")
      invalid("request.oracle.backend must be \"libtorch\", \"transformers\" or \"both\", got " +
              printable(backend.dump(), 64));
    r.backend = backend.get<std::string>();
  }
  // Kiln's oracle refuses a run that saw memory pressure; its requests get that unless they say.
  if (r.kind == RequestKind::kKiln && !r.limits.memory_events)
    r.limits.memory_events = MemoryPolicy::kReject;

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
    r.source = kiln_source(field(doc, "source", "request"));
    auto prompt_ids = kiln_prompt_token_ids(field(doc, "prompt", "request"));
    r.continuation_prefix = continuation_prefix(field(doc, "continuation_prefix", "request"));
    check_joined_ids(prompt_ids, r.continuation_prefix, r.input_token_ids);
    check_token_ids_sha(doc, r.input_token_ids_sha256);
  }
  if (r.kind == RequestKind::kKiln) {
    // Kiln's canonical identity of its retained request: the fields Kiln's schema has, never
    // assay's additions (limits, oracle, numerics), so that an exported record names the file
    // Kiln keeps. The job's key adds the whole document's digest (pipelines/next_token.cpp).
    Json kiln = doc;
    for (const char* added : {"limits", "oracle", "numerics"}) kiln.erase(added);
    r.request_sha256 = sha256_id(kiln_canonical(kiln));
  } else {
    r.request_sha256 = sha256_canonical_id(doc);
  }
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
