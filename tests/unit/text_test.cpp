#include <doctest/doctest.h>

#include "common/text.h"

using namespace assay::common;

TEST_CASE("is_valid_utf8 rejects the malformed sequences clients send") {
  CHECK(is_valid_utf8("plain ascii"));
  CHECK(is_valid_utf8("\xe2\x82\xac"));  // €
  CHECK_FALSE(is_valid_utf8("\xc3\x28"));
  CHECK_FALSE(is_valid_utf8("\xc0\xaf"));          // overlong '/'
  CHECK_FALSE(is_valid_utf8("\xed\xa0\x80"));      // a surrogate
  CHECK_FALSE(is_valid_utf8("\xf4\x90\x80\x80"));  // past U+10FFFF
  CHECK_FALSE(is_valid_utf8("\xe2\x82"));          // truncated
  CHECK_FALSE(is_valid_utf8("\xff"));
}

TEST_CASE("printable escapes bad bytes and cuts between characters") {
  CHECK(printable("a\xffz") == "a\\xFFz");
  std::string euros;
  for (int i = 0; i < 10; ++i) euros += "\xe2\x82\xac";
  std::string cut = printable(euros, 7);  // room for two 3-byte characters
  CHECK(cut == "\xe2\x82\xac\xe2\x82\xac...");
  CHECK(is_valid_utf8(cut));
}

TEST_CASE("printable_tail of a log cut mid-character is valid UTF-8") {
  std::string euros;
  for (int i = 0; i < 700; ++i) euros += "\xe2\x82\xac";
  for (std::size_t max : {1999u, 2000u, 2001u}) {
    std::string tail = printable_tail(euros, max);
    CHECK(is_valid_utf8(tail));
    CHECK(tail.rfind("...", 0) == 0);
    CHECK(tail.size() <= max + 3);
    CHECK(tail.size() >= max - 3);
  }
  CHECK(printable_tail("short", 100) == "short");
}
