#include <doctest/doctest.h>

#include <vector>

#include "common/error.h"
#include "worker/tokenizer.h"

using assay::common::Json;
using assay::oracle::Tokenizer;
using assay::oracle::utf8_lossy;

namespace {

// Byte-level tokens as GPT-2's byte map spells them: "Ġ" is the space byte, "Ã" and "©" are
// 0xC3 and 0xA9 (together "é").
Tokenizer small_tokenizer(bool clean_up = false) {
  Json doc = {{"model",
               {{"type", "BPE"},
                {"vocab",
                 {{"h", 0},
                  {"i", 1},
                  {"\xC4\xA0the", 2},       // "Ġthe"
                  {"\xC3\x83", 3},          // "Ã"  -> byte 0xC3
                  {"\xC2\xA9", 4},          // "©"  -> byte 0xA9
                  {"\xC3\x83\xC2\xA9", 5},  // "Ã©" -> "é"
                  {"\xC4\xA0.", 6},         // "Ġ."
                  {"x\xE6\x97\xA5", 7}}},   // "x日": 日 is not in the byte map, so raw UTF-8
                {"merges", Json::array()}}},
              {"decoder", {{"type", "ByteLevel"}}},
              {"added_tokens",
               {{{"id", 8}, {"content", "<|im_end|>"}, {"special", true}},
                {{"id", 9}, {"content", "\xC4\xA0raw"}, {"special", false}}}}};
  return Tokenizer::from_json(doc, clean_up);
}

}  // namespace

TEST_CASE("byte-level tokens decode through the GPT-2 byte map") {
  Tokenizer t = small_tokenizer();
  CHECK(t.decode_one(2) == " the");
  CHECK(t.decode_one(5) == "\xC3\xA9");
  std::vector<std::int64_t> ids{0, 1, 2};
  CHECK(t.decode(ids) == "hi the");
  CHECK(t.size() == 10);
}

TEST_CASE("a multi-byte character split over two tokens decodes whole, alone each is U+FFFD") {
  Tokenizer t = small_tokenizer();
  std::vector<std::int64_t> ids{3, 4};
  CHECK(t.decode(ids) == "\xC3\xA9");
  CHECK(t.decode_one(3) == "\xEF\xBF\xBD");
  CHECK(t.decode_one(4) == "\xEF\xBF\xBD");
}

TEST_CASE("added tokens are copied as they are, not through the byte map") {
  Tokenizer t = small_tokenizer();
  CHECK(t.decode_one(8) == "<|im_end|>");
  CHECK(t.decode_one(9) == "\xC4\xA0raw");
  std::vector<std::int64_t> ids{3, 8, 4};  // the added token flushes the pending bytes
  CHECK(t.decode(ids) == "\xEF\xBF\xBD<|im_end|>\xEF\xBF\xBD");
}

TEST_CASE("a token with a character outside the byte map contributes its own UTF-8") {
  CHECK(small_tokenizer().decode_one(7) == "x\xE6\x97\xA5");
}

TEST_CASE("unknown ids decode to nothing and are not known") {
  Tokenizer t = small_tokenizer();
  CHECK_FALSE(t.knows(10));
  CHECK(t.knows(8));
  std::vector<std::int64_t> ids{0, 42, 1};
  CHECK(t.decode(ids) == "hi");
}

TEST_CASE("clean_up_tokenization_spaces removes the space before punctuation when asked") {
  CHECK(small_tokenizer(false).decode_one(6) == " .");
  CHECK(small_tokenizer(true).decode_one(6) == ".");
}

TEST_CASE("utf8_lossy replaces each maximal invalid subsequence with one U+FFFD") {
  const std::string r = "\xEF\xBF\xBD";
  CHECK(utf8_lossy("abc") == "abc");
  CHECK(utf8_lossy("\xF0\x9F\x98\x80") == "\xF0\x9F\x98\x80");
  CHECK(utf8_lossy("\xF0\x9F\x98") == r);  // truncated 4-byte sequence
  CHECK(utf8_lossy("\xF0\x9F\x98"
                   "a") == r + "a");
  CHECK(utf8_lossy("\xED\xA0\x80") == r + r + r);  // surrogate: ED alone, then 2 strays
  CHECK(utf8_lossy("\xC0\xAF") == r + r);          // overlong lead byte
  CHECK(utf8_lossy("\xE0\x80\x80") == r + r + r);
  CHECK(utf8_lossy("\xFF"
                   "x") == r + "x");
}

TEST_CASE("a tokenizer that is not byte-level BPE is refused by name") {
  Json doc = {{"model", {{"type", "Unigram"}, {"vocab", Json::array()}}},
              {"decoder", {{"type", "ByteLevel"}}}};
  try {
    Tokenizer::from_json(doc);
    FAIL("accepted a Unigram tokenizer");
  } catch (const assay::common::Error& e) {
    CHECK(e.code() == "tokenizer.unsupported");
    CHECK(std::string(e.what()).find("Unigram") != std::string::npos);
  }
  doc = {{"model", {{"type", "BPE"}, {"vocab", Json::object()}}},
         {"decoder", {{"type", "Metaspace"}}}};
  CHECK_THROWS_WITH_AS(Tokenizer::from_json(doc), doctest::Contains("Metaspace"),
                       assay::common::Error);
}
