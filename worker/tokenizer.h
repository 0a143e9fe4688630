// Decoding of Hugging Face `tokenizer.json` byte-level BPE vocabularies (GPT-2 byte map,
// added and special tokens), as tokenizers' `decode(ids, skip_special_tokens=False)` does.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>

#include "common/json.h"
#include "worker/model_files.h"

namespace assay::oracle {

class Tokenizer {
 public:
  // Reads tokenizer.json (and tokenizer_config.json when present, for
  // clean_up_tokenization_spaces). Throws common::Error("tokenizer.invalid" /
  // "tokenizer.unsupported") naming the field.
  static Tokenizer load(ModelFiles& files);
  static Tokenizer load(const std::filesystem::path& model_dir);
  static Tokenizer from_json(const common::Json& tokenizer_json, bool clean_up_spaces = false);

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

}  // namespace assay::oracle
