// Decoding of Hugging Face `tokenizer.json` byte-level BPE vocabularies (GPT-2 byte map,
// added and special tokens), as tokenizers' `decode(ids, skip_special_tokens=False)` does.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>

#include "common/json.h"
#include "common/protocol.h"

namespace assay::common {

// The largest tokenizer.json or tokenizer_config.json read.
inline constexpr std::size_t kMaxTokenizerBytes = protocol::kMaxSmallModelFileBytes;

class Tokenizer {
 public:
  // From the texts of tokenizer.json and (when the model has one) tokenizer_config.json, for
  // clean_up_tokenization_spaces; each parsed strictly, at most kMaxTokenizerBytes. Throws
  // Error("tokenizer.invalid" / "tokenizer.unsupported" / "json.invalid") naming the field.
  static Tokenizer parse(std::string_view tokenizer_json,
                         std::optional<std::string_view> tokenizer_config);
  static Tokenizer from_json(const Json& tokenizer_json, bool clean_up_spaces = false);

  // Decoded text of `ids`: byte-level tokens are mapped back to bytes, added tokens are copied
  // as they are, ids the tokenizer does not know are skipped, and invalid UTF-8 becomes
  // U+FFFD per maximal invalid subsequence.
  std::string decode(std::span<const std::int64_t> ids) const;
  std::string decode_one(std::int64_t id) const { return decode(std::span(&id, 1)); }
  bool knows(std::int64_t id) const;
  std::int64_t size() const { return max_id_ + 1; }

 private:
  std::unordered_map<std::int64_t, std::string> vocab_;  // id -> byte-mapped token
  std::unordered_map<std::int64_t, std::string> added_;  // id -> content
  std::int64_t max_id_ = -1;
  bool clean_up_spaces_ = false;
};

// Bytes to UTF-8, replacing each maximal invalid subsequence with U+FFFD (as Rust's
// String::from_utf8_lossy, which tokenizers uses).
std::string utf8_lossy(std::string_view bytes);

}  // namespace assay::common
