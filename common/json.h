// Strict JSON parsing and RFC 8785 (JCS) canonical serialisation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace assay::common {

using Json = nlohmann::json;

struct ParseLimits {
  std::size_t max_bytes = 16 * 1024 * 1024;
  int max_depth = 64;
  // Reject integers outside +-2^53 (they do not survive a round trip through a double).
  bool exact_integers = true;
};

// Parses `text` or throws Error("json.invalid", ...) naming the JSON pointer and the reason.
// Rejects: duplicate keys, NaN/Infinity (and numbers that overflow a double), nesting deeper
// than max_depth, documents larger than max_bytes, invalid UTF-8, trailing data.
Json parse_strict(std::string_view text, const ParseLimits& limits = {});

// RFC 8785 canonical form: keys sorted by UTF-16 code units, no whitespace, ECMAScript number
// form, minimal escaping, raw UTF-8. Throws Error("json.not_canonicalizable") on a non-finite
// number or invalid UTF-8.
std::string canonical(const Json& value);

// Kiln's canonical form: Python's json.dumps(obj, sort_keys=True, separators=(",", ":"),
// ensure_ascii=True, allow_nan=False). Keys sorted by code point, every non-ASCII character
// escaped as \uXXXX (surrogate pairs above U+FFFF), integers as integers, and a number parsed
// as a float written as Python's repr writes it: 300.0 stays 300.0 (RFC 8785 writes 300), 1e-05
// and 1e+16 keep their exponents. Throws Error("json.not_canonicalizable") on a non-finite
// number or invalid UTF-8.
std::string python_canonical(const Json& value);
// Python's repr of a finite double: the shortest digits that round-trip, fixed notation with at
// least one fractional digit when the decimal exponent is in [-4, 16), else d.ddde+XX.
std::string python_float_repr(double value);

// The member `key` of `object`, or a null when `object` is not an object or has no such member.
// Unlike Json::value and operator[], it neither throws nor asserts, whatever a document from
// outside (a worker's output, a record under verification) holds.
const Json& member(const Json& object, std::string_view key);

// The value at `key` of an object, or throws Error(code, "<where>: missing/wrong type ...").
const Json& require(const Json& object, std::string_view key, std::string_view where);
std::string require_string(const Json& object, std::string_view key, std::string_view where);
std::int64_t require_int(const Json& object, std::string_view key, std::string_view where);

// Throws Error("json.unknown_field") if `object` has a key not in `allowed`.
void reject_unknown_fields(const Json& object, std::initializer_list<std::string_view> allowed,
                           std::string_view where);

}  // namespace assay::common
