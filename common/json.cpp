#include "common/json.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/text.h"

namespace assay::common {
namespace {

constexpr double kMaxExactInteger = 9007199254740992.0;  // 2^53
constexpr std::int64_t kMaxExactIntegerI = 9007199254740992;

std::string escape_pointer_token(const std::string& token) {
  std::string out;
  for (char c : token) {
    if (c == '~')
      out += "~0";
    else if (c == '/')
      out += "~1";
    else
      out += c;
  }
  return out;
}

// Builds the DOM itself so it can see every key (nlohmann's default map drops duplicates).
class StrictSax {
 public:
  explicit StrictSax(const ParseLimits& limits) : limits_(limits) {}

  Json result;
  std::string error;

  bool null() { return add(Json(nullptr)); }
  bool boolean(bool v) { return add(Json(v)); }
  bool number_integer(Json::number_integer_t v) {
    if (limits_.exact_integers && (v > kMaxExactIntegerI || v < -kMaxExactIntegerI))
      return fail("integer " + std::to_string(v) + " is outside +-2^53");
    return add(Json(v));
  }
  bool number_unsigned(Json::number_unsigned_t v) {
    if (limits_.exact_integers && v > static_cast<std::uint64_t>(kMaxExactIntegerI))
      return fail("integer " + std::to_string(v) + " is outside +-2^53");
    return add(Json(v));
  }
  bool number_float(Json::number_float_t v, const std::string& text) {
    if (!std::isfinite(v)) return fail("number " + text + " is not a finite double");
    if (limits_.exact_integers && text.find_first_of(".eE") == std::string::npos)
      return fail("integer " + text + " is outside +-2^53");
    return add(Json(v));
  }
  bool string(std::string& v) { return add(Json(std::move(v))); }
  bool binary(Json::binary_t&) { return fail("binary values are not JSON"); }

  bool start_object(std::size_t) { return open(Json::object()); }
  bool key(std::string& k) {
    Frame& f = stack_.back();
    f.pending_key = k;
    f.has_key = true;
    if (!f.keys.insert(k).second) return fail("duplicate key \"" + k + "\"");
    return true;
  }
  bool end_object() { return close(); }
  bool start_array(std::size_t) { return open(Json::array()); }
  bool end_array() { return close(); }

  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::detail::exception& ex) {
    if (error.empty()) {
      std::string what = ex.what();
      // nlohmann prefixes "[json.exception.parse_error.101] parse error at line 1, column 2: ".
      auto colon = what.find(": ");
      // Its "last read" quotes the input's bytes, which need not be UTF-8.
      std::string reason = printable(colon == std::string::npos ? what : what.substr(colon + 2));
      std::string where = pointer();
      error = "at " + (where.empty() ? std::string("/") : where) + " (byte " +
              std::to_string(position) + "): " + reason;
    }
    return false;
  }

  std::string pointer() const {
    std::string p;
    for (std::size_t i = 0; i < stack_.size(); ++i) {
      const Frame& f = stack_[i];
      if (f.value->is_object()) {
        if (f.has_key) p += "/" + escape_pointer_token(f.pending_key);
      } else {
        // An enclosing array already holds the open child; the innermost one not yet.
        std::size_t n = f.value->size();
        p += "/" + std::to_string(i + 1 < stack_.size() ? n - 1 : n);
      }
    }
    return p;
  }

 private:
  struct Frame {
    Json* value;
    std::set<std::string> keys;
    std::string pending_key;
    bool has_key = false;
  };

  bool fail(const std::string& reason) {
    if (error.empty()) {
      std::string where = pointer();
      error = "at " + (where.empty() ? std::string("/") : where) + ": " + reason;
    }
    return false;
  }

  Json* place(Json&& v) {
    if (stack_.empty()) {
      result = std::move(v);
      return &result;
    }
    Frame& f = stack_.back();
    if (f.value->is_array()) {
      f.value->push_back(std::move(v));
      return &f.value->back();
    }
    Json& slot = (*f.value)[f.pending_key];
    slot = std::move(v);
    return &slot;
  }

  bool add(Json&& v) {
    place(std::move(v));
    return true;
  }

  bool open(Json&& container) {
    if (static_cast<int>(stack_.size()) >= limits_.max_depth)
      return fail("nesting deeper than " + std::to_string(limits_.max_depth));
    Json* p = place(std::move(container));
    stack_.push_back(Frame{p, {}, {}, false});
    return true;
  }

  bool close() {
    stack_.pop_back();
    return true;
  }

  const ParseLimits& limits_;
  std::vector<Frame> stack_;
};

// Checks that `s` is UTF-8 and, when `out` is given, appends its UTF-16 code units there.
void append_utf16_units(std::string_view s, std::u16string* out) {
  std::size_t i = 0;
  while (i < s.size()) {
    auto c = static_cast<unsigned char>(s[i]);
    char32_t cp;
    int n;
    if (c < 0x80) {
      cp = c;
      n = 1;
    } else if ((c >> 5) == 6) {
      cp = c & 0x1f;
      n = 2;
    } else if ((c >> 4) == 14) {
      cp = c & 0x0f;
      n = 3;
    } else if ((c >> 3) == 30) {
      cp = c & 0x07;
      n = 4;
    } else
      throw Error("json.not_canonicalizable", "invalid UTF-8 in string");
    if (i + n > s.size()) throw Error("json.not_canonicalizable", "truncated UTF-8 in string");
    for (int k = 1; k < n; ++k) {
      auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc >> 6) != 2) throw Error("json.not_canonicalizable", "invalid UTF-8 in string");
      cp = (cp << 6) | (cc & 0x3f);
    }
    if (out && cp >= 0x10000) {
      cp -= 0x10000;
      out->push_back(static_cast<char16_t>(0xd800 + (cp >> 10)));
      out->push_back(static_cast<char16_t>(0xdc00 + (cp & 0x3ff)));
    } else if (out) {
      out->push_back(static_cast<char16_t>(cp));
    }
    i += n;
  }
}

// The two canonical forms this project writes. They agree on everything but three things:
// numbers (RFC 8785 writes ECMAScript's Number::toString and integers past 2^53 as doubles;
// Python keeps integers exact and writes a float as its repr), non-ASCII text (raw in RFC 8785,
// \uXXXX in Python's ensure_ascii) and key order (UTF-16 code units against code points, which
// is the byte order nlohmann's std::map keeps already).
enum class Form { kRfc8785, kPython };

void write_string(std::string_view s, std::string& out, Form form) {
  static const char* kHex = "0123456789abcdef";
  auto escape = [&](char16_t unit) {
    out += "\\u";
    for (int shift = 12; shift >= 0; shift -= 4) out += kHex[(unit >> shift) & 0xf];
  };
  auto write_ascii = [&](unsigned char c) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20)
          escape(c);
        else
          out += static_cast<char>(c);
    }
  };
  out += '"';
  if (form == Form::kPython) {
    std::u16string units;
    append_utf16_units(s, &units);  // validates; surrogate pairs above U+FFFF
    for (char16_t u : units) u < 0x80 ? write_ascii(static_cast<unsigned char>(u)) : escape(u);
  } else {
    append_utf16_units(s, nullptr);  // validates without building the UTF-16 copy
    for (char ch : s) {
      auto c = static_cast<unsigned char>(ch);
      if (c < 0x80)
        write_ascii(c);
      else
        out += ch;
    }
  }
  out += '"';
}

// The shortest digits that round-trip `v` (finite, not zero, positive) and the position of the
// decimal point after their first `point` digits: v = 0.DIGITS x 10^point.
struct Shortest {
  std::string digits;
  int point;
};
Shortest shortest(double v) {
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
  std::string sci(buf, res.ptr);  // d[.ddd]e[+-]XX
  auto e = sci.find('e');
  Shortest out{"", std::stoi(sci.substr(e + 1)) + 1};
  for (std::size_t i = 0; i < e; ++i)
    if (sci[i] != '.') out.digits += sci[i];
  while (out.digits.size() > 1 && out.digits.back() == '0') out.digits.pop_back();
  return out;
}

// ECMAScript Number::toString for a finite double (RFC 8785 section 3.2.2.3).
void write_number(double v, std::string& out) {
  if (!std::isfinite(v)) throw Error("json.not_canonicalizable", "non-finite number");
  if (v == 0) {
    out += '0';
    return;
  }
  if (v < 0) {
    out += '-';
    v = -v;
  }
  auto [digits, n] = shortest(v);
  int k = static_cast<int>(digits.size());
  if (k <= n && n <= 21) {
    out += digits;
    out.append(n - k, '0');
  } else if (0 < n && n <= 21) {
    out += digits.substr(0, n);
    out += '.';
    out += digits.substr(n);
  } else if (-6 < n && n <= 0) {
    out += "0.";
    out.append(-n, '0');
    out += digits;
  } else {
    out += digits[0];
    if (k > 1) {
      out += '.';
      out += digits.substr(1);
    }
    out += 'e';
    out += (n - 1 >= 0) ? '+' : '-';
    out += std::to_string(std::abs(n - 1));
  }
}

void write_json(const Json& v, std::string& out, Form form) {
  switch (v.type()) {
    case Json::value_t::null:
      out += "null";
      break;
    case Json::value_t::boolean:
      out += v.get<bool>() ? "true" : "false";
      break;
    case Json::value_t::number_integer: {
      auto i = v.get<std::int64_t>();
      if (form == Form::kPython || std::fabs(static_cast<double>(i)) <= kMaxExactInteger)
        out += std::to_string(i);
      else
        write_number(static_cast<double>(i), out);
      break;
    }
    case Json::value_t::number_unsigned: {
      auto u = v.get<std::uint64_t>();
      if (form == Form::kPython || static_cast<double>(u) <= kMaxExactInteger)
        out += std::to_string(u);
      else
        write_number(static_cast<double>(u), out);
      break;
    }
    case Json::value_t::number_float:
      if (form == Form::kPython)
        out += python_float_repr(v.get<double>());
      else
        write_number(v.get<double>(), out);
      break;
    case Json::value_t::string:
      write_string(v.get_ref<const std::string&>(), out, form);
      break;
    case Json::value_t::array: {
      out += '[';
      bool first = true;
      for (const auto& item : v) {
        if (!first) out += ',';
        first = false;
        write_json(item, out, form);
      }
      out += ']';
      break;
    }
    case Json::value_t::object: {
      // Python's order (code points) is the std::map's byte order; RFC 8785's is UTF-16's.
      std::vector<std::pair<std::u16string, const std::string*>> keys;
      for (auto it = v.begin(); it != v.end(); ++it) {
        std::u16string units;
        if (form == Form::kRfc8785) append_utf16_units(it.key(), &units);
        keys.emplace_back(std::move(units), &it.key());
      }
      if (form == Form::kRfc8785)
        std::stable_sort(keys.begin(), keys.end(),
                         [](const auto& a, const auto& b) { return a.first < b.first; });
      out += '{';
      bool first = true;
      for (const auto& [units, key] : keys) {
        if (!first) out += ',';
        first = false;
        write_string(*key, out, form);
        out += ':';
        write_json(v.at(*key), out, form);
      }
      out += '}';
      break;
    }
    default:
      throw Error("json.not_canonicalizable", "value of a type JSON does not have");
  }
}

std::string where_key(std::string_view where, std::string_view key) {
  std::string s(where);
  s += '/';
  s += key;
  return s;
}

}  // namespace

Json parse_strict(std::string_view text, const ParseLimits& limits) {
  if (text.size() > limits.max_bytes)
    throw Error("json.too_large", "document of " + std::to_string(text.size()) +
                                      " bytes exceeds the limit of " +
                                      std::to_string(limits.max_bytes));
  StrictSax sax(limits);
  bool ok = Json::sax_parse(text.begin(), text.end(), &sax, nlohmann::detail::input_format_t::json,
                            /*strict=*/true, /*ignore_comments=*/false);
  if (!ok || !sax.error.empty())
    throw Error("json.invalid", "invalid JSON " + (sax.error.empty() ? "document" : sax.error));
  return std::move(sax.result);
}

std::string canonical(const Json& value) {
  std::string out;
  write_json(value, out, Form::kRfc8785);
  return out;
}

std::string python_canonical(const Json& value) {
  std::string out;
  write_json(value, out, Form::kPython);
  return out;
}

std::string python_float_repr(double value) {
  if (!std::isfinite(value))
    throw Error("json.not_canonicalizable", "a non-finite number has no JSON form");
  if (value == 0) return std::signbit(value) ? "-0.0" : "0.0";
  std::string out = value < 0 ? "-" : "";
  auto [digits, point] = shortest(std::fabs(value));
  auto n = static_cast<std::size_t>(std::max(point, 0));
  if (point > -4 && point <= 16) {
    if (point <= 0)
      out += "0." + std::string(static_cast<std::size_t>(-point), '0') + digits;
    else if (n >= digits.size())
      out += digits + std::string(n - digits.size(), '0') + ".0";
    else
      out += digits.substr(0, n) + "." + digits.substr(n);
    return out;
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  int shown = point - 1;
  std::string mag = std::to_string(std::abs(shown));
  if (mag.size() < 2) mag.insert(0, "0");
  return out + (shown < 0 ? "e-" : "e+") + mag;
}

const Json& require(const Json& object, std::string_view key, std::string_view where) {
  if (!object.is_object())
    throw Error("json.wrong_type", std::string(where) + " must be an object");
  auto it = object.find(std::string(key));
  if (it == object.end())
    throw Error("json.missing_field", "missing field " + where_key(where, key));
  return *it;
}

std::string require_string(const Json& object, std::string_view key, std::string_view where) {
  const Json& v = require(object, key, where);
  if (!v.is_string())
    throw Error("json.wrong_type", where_key(where, key) + " must be a string, got " + v.dump());
  return v.get<std::string>();
}

std::int64_t require_int(const Json& object, std::string_view key, std::string_view where) {
  const Json& v = require(object, key, where);
  if (!v.is_number_integer())
    throw Error("json.wrong_type", where_key(where, key) + " must be an integer, got " + v.dump());
  return v.get<std::int64_t>();
}

void reject_unknown_fields(const Json& object, std::initializer_list<std::string_view> allowed,
                           std::string_view where) {
  if (!object.is_object())
    throw Error("json.wrong_type", std::string(where) + " must be an object");
  for (auto it = object.begin(); it != object.end(); ++it) {
    bool known = false;
    for (auto a : allowed) known = known || a == it.key();
    if (!known) throw Error("json.unknown_field", "unknown field " + where_key(where, it.key()));
  }
}

const Json& member(const Json& object, std::string_view key) {
  static const Json kNull;
  if (!object.is_object()) return kNull;
  auto it = object.find(key);
  return it == object.end() ? kNull : *it;
}

}  // namespace assay::common
