#include "common/tokenizer.h"

#include <array>
#include <vector>

#include "common/error.h"
#include "common/fs.h"
#include "common/protocol.h"

namespace assay::common {
namespace {

// GPT-2's byte <-> printable code point map: printable bytes map to themselves, the other
// 68 bytes to U+0100 onwards in byte order.
const std::unordered_map<char32_t, std::uint8_t>& byte_decoder() {
  static const auto map = [] {
    std::unordered_map<char32_t, std::uint8_t> m;
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      m[printable ? char32_t(b) : char32_t(256 + extra++)] = std::uint8_t(b);
    }
    return m;
  }();
  return map;
}

// Code points of valid UTF-8 `s` (strings from a strictly parsed JSON document).
std::vector<char32_t> code_points(std::string_view s) {
  std::vector<char32_t> out;
  for (std::size_t i = 0; i < s.size();) {
    auto c = static_cast<unsigned char>(s[i]);
    int len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    char32_t cp = len == 1 ? c : len == 2 ? c & 0x1F : len == 3 ? c & 0x0F : c & 0x07;
    for (int k = 1; k < len && i + k < s.size(); ++k) {
      cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    }
    out.push_back(cp);
    i += len;
  }
  return out;
}

// tokenizers' ByteLevel decoder: a token whose characters are all in the byte map becomes
// those bytes; any other token contributes its own UTF-8 bytes.
void append_byte_level(std::string_view token, std::string& bytes) {
  const auto& decoder = byte_decoder();
  std::string mapped;
  for (char32_t cp : code_points(token)) {
    auto it = decoder.find(cp);
    if (it == decoder.end()) {
      bytes.append(token);
      return;
    }
    mapped.push_back(static_cast<char>(it->second));
  }
  bytes.append(mapped);
}

// transformers' clean_up_tokenization.
std::string clean_up(std::string s) {
  static const std::array<std::pair<std::string_view, std::string_view>, 10> kRules{{
      {" .", "."},
      {" ?", "?"},
      {" !", "!"},
      {" ,", ","},
      {" ' ", "'"},
      {" n't", "n't"},
      {" 'm", "'m"},
      {" 's", "'s"},
      {" 've", "'ve"},
      {" 're", "'re"},
  }};
  for (const auto& [from, to] : kRules) {
    std::string out;
    for (std::size_t i = 0; i < s.size();) {
      if (s.compare(i, from.size(), from) == 0) {
        out.append(to);
        i += from.size();
      } else {
        out.push_back(s[i++]);
      }
    }
    s = std::move(out);
  }
  return s;
}

std::int64_t token_id(const Json& value, const std::string& where) {
  if (!value.is_number_integer() || value.get<std::int64_t>() < 0) {
    throw Error("tokenizer.invalid",
                where + ": token id must be a non-negative integer, got " + value.dump());
  }
  return value.get<std::int64_t>();
}

}  // namespace

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  const std::string_view kReplacement = "\xEF\xBF\xBD";
  std::size_t i = 0;
  while (i < bytes.size()) {
    auto c = static_cast<unsigned char>(bytes[i]);
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
      ++i;
      continue;
    }
    int len = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    }
    if (len == 0) {
      out.append(kReplacement);
      ++i;
      continue;
    }
    std::size_t k = 1;
    for (; k < static_cast<std::size_t>(len) && i + k < bytes.size(); ++k) {
      auto b = static_cast<unsigned char>(bytes[i + k]);
      bool ok = k == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
      if (!ok) break;
    }
    if (k == static_cast<std::size_t>(len)) {
      out.append(bytes.substr(i, len));
    } else {
      out.append(kReplacement);
    }
    i += k;
  }
  return out;
}

Tokenizer Tokenizer::from_json(const Json& doc, bool clean_up_spaces) {
  if (!doc.is_object()) throw Error("tokenizer.invalid", "tokenizer.json: not an object");
  const Json& model = require(doc, "model", "tokenizer.json");
  std::string type = model.is_object() && model.contains("type") && model["type"].is_string()
                         ? model["type"].get<std::string>()
                         : "";
  if (type != "BPE") {
    throw Error("tokenizer.unsupported",
                "tokenizer.json: model.type \"" + type + "\" is not supported (only BPE)");
  }
  const Json* decoder = doc.contains("decoder") ? &doc["decoder"] : nullptr;
  std::string decoder_type =
      decoder && decoder->is_object() && decoder->contains("type") && (*decoder)["type"].is_string()
          ? (*decoder)["type"].get<std::string>()
          : "null";
  if (decoder_type != "ByteLevel") {
    throw Error("tokenizer.unsupported", "tokenizer.json: decoder.type \"" + decoder_type +
                                             "\" is not supported (only ByteLevel)");
  }
  Tokenizer t;
  t.clean_up_spaces_ = clean_up_spaces;
  const Json& vocab = require(model, "vocab", "tokenizer.json model");
  if (!vocab.is_object()) throw Error("tokenizer.invalid", "tokenizer.json: model.vocab");
  for (const auto& [token, id_json] : vocab.items()) {
    std::int64_t id = token_id(id_json, "tokenizer.json model.vocab[\"" + token + "\"]");
    if (!t.vocab_.emplace(id, token).second) {
      throw Error("tokenizer.invalid",
                  "tokenizer.json: model.vocab has id " + std::to_string(id) + " twice");
    }
    t.max_id_ = std::max(t.max_id_, id);
  }
  if (doc.contains("added_tokens") && !doc["added_tokens"].is_null()) {
    const Json& added = doc["added_tokens"];
    if (!added.is_array()) throw Error("tokenizer.invalid", "tokenizer.json: added_tokens");
    for (std::size_t k = 0; k < added.size(); ++k) {
      std::string where = "tokenizer.json added_tokens[" + std::to_string(k) + "]";
      std::int64_t id = token_id(require(added[k], "id", where), where + ".id");
      t.added_[id] = require_string(added[k], "content", where);
      t.max_id_ = std::max(t.max_id_, id);
    }
  }
  return t;
}

Tokenizer Tokenizer::parse(std::string_view tokenizer_json,
                           std::optional<std::string_view> tokenizer_config) {
  ParseLimits limits;
  limits.max_bytes = kMaxTokenizerBytes;
  Json doc = parse_strict(tokenizer_json, limits);
  bool clean_up = false;
  if (tokenizer_config) {
    Json config = parse_strict(*tokenizer_config, limits);
    if (config.is_object() && config.contains("clean_up_tokenization_spaces")) {
      const Json& v = config["clean_up_tokenization_spaces"];
      if (!v.is_boolean()) {
        throw Error("tokenizer.invalid",
                    "tokenizer_config.json: clean_up_tokenization_spaces must be a boolean");
      }
      clean_up = v.get<bool>();
    }
  }
  return from_json(doc, clean_up);
}

bool Tokenizer::knows(std::int64_t id) const {
  return added_.count(id) || vocab_.count(id);
}

std::string Tokenizer::decode(std::span<const std::int64_t> ids) const {
  std::string text;
  std::string pending;  // bytes of byte-level tokens since the last added token
  for (std::int64_t id : ids) {
    if (auto it = added_.find(id); it != added_.end()) {
      text += utf8_lossy(pending);
      pending.clear();
      text += it->second;
    } else if (auto v = vocab_.find(id); v != vocab_.end()) {
      append_byte_level(v->second, pending);
    }
  }
  text += utf8_lossy(pending);
  return clean_up_spaces_ ? clean_up(std::move(text)) : text;
}

}  // namespace assay::common
