#include "common/text.h"

#include <cstdint>
#include <cstdio>
#include <vector>

namespace assay::common {

namespace {

// Length of the well-formed UTF-8 sequence at s[i], or 0 when the byte there starts none.
std::size_t sequence_length(std::string_view s, std::size_t i) {
  auto b = [&](std::size_t k) { return static_cast<std::uint8_t>(s[k]); };
  std::uint8_t c = b(i);
  if (c < 0x80) return 1;
  std::size_t n;
  std::uint8_t lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;  // overlong
    if (c == 0xED) hi = 0x9F;  // surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;  // overlong
    if (c == 0xF4) hi = 0x8F;  // past U+10FFFF
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  if (b(i + 1) < lo || b(i + 1) > hi) return 0;
  for (std::size_t k = 2; k < n; ++k)
    if ((b(i + k) & 0xC0) != 0x80) return 0;
  return n;
}

// `s` as pieces, each a whole character or an escaped byte.
std::vector<std::string> pieces(std::string_view s) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < s.size();) {
    std::size_t n = sequence_length(s, i);
    if (n == 0) {
      char esc[8];
      std::snprintf(esc, sizeof esc, "\\x%02X",
                    static_cast<unsigned>(static_cast<std::uint8_t>(s[i])));
      out.emplace_back(esc);
      ++i;
    } else {
      out.emplace_back(s.substr(i, n));
      i += n;
    }
  }
  return out;
}

}  // namespace

bool is_valid_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    std::size_t n = sequence_length(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string printable(std::string_view s, std::size_t max_bytes) {
  std::string out;
  // Looking at no more input than could fit keeps this linear in max_bytes, not in s.
  auto parts = pieces(s.substr(0, max_bytes + 4));
  for (const auto& p : parts) {
    if (out.size() + p.size() > max_bytes) return out + "...";
    out += p;
  }
  return s.size() > max_bytes + 4 ? out + "..." : out;
}

std::string printable_tail(std::string_view s, std::size_t max_bytes) {
  bool cut = s.size() > max_bytes;
  // Start a few bytes early so that a character cut at the window's start is skipped whole.
  std::size_t start = cut ? s.size() - max_bytes : 0;
  auto parts = pieces(s.substr(start));
  std::size_t first = 0;
  if (cut)
    while (first < 3 && first < parts.size() && parts[first].size() == 4 &&
           (static_cast<std::uint8_t>(s[start + first]) & 0xC0) == 0x80)
      ++first;  // continuation bytes of a character that began before the window
  std::string out = cut ? "..." : "";
  std::size_t total = 0;
  for (std::size_t i = first; i < parts.size(); ++i) total += parts[i].size();
  for (std::size_t i = first; i < parts.size(); ++i) {
    if (total > max_bytes) {
      total -= parts[i].size();
      continue;
    }
    out += parts[i];
  }
  return out;
}

}  // namespace assay::common
