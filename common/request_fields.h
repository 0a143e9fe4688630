// Field helpers shared by the request parsers (request.cpp, fidelity.cpp): the generic json.*
// errors of require/reject_unknown_fields become request.invalid, with the same messages.
// Internal to common/.
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>

#include "common/error.h"
#include "common/json.h"

namespace assay::common::request_fields {

[[noreturn]] inline void invalid(const std::string& message) {
  throw Error("request.invalid", message);
}

// Runs f, mapping the generic json.* errors (but json.invalid) onto request.invalid.
template <typename F>
auto as_request_error(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error& e) {
    if (e.code().rfind("json.", 0) == 0 && e.code() != "json.invalid")
      throw Error("request.invalid", e.what());
    throw;
  }
}

inline const Json& field(const Json& obj, std::string_view key, std::string_view where) {
  return as_request_error([&]() -> const Json& { return require(obj, key, where); });
}

// obj[key]: a string of 1..max_len bytes.
inline std::string string_field(const Json& obj, std::string_view key, std::string_view where,
                                std::size_t max_len) {
  const Json& v = field(obj, key, where);
  if (!v.is_string())
    invalid(std::string(where) + "." + std::string(key) + " must be a string, got " + v.dump());
  auto s = v.get<std::string>();
  if (s.empty() || s.size() > max_len)
    invalid(std::string(where) + "." + std::string(key) + " must have 1.." +
            std::to_string(max_len) + " bytes, got " + std::to_string(s.size()));
  return s;
}

inline void only_fields(const Json& obj, std::initializer_list<std::string_view> allowed,
                        std::string_view where) {
  as_request_error([&] {
    reject_unknown_fields(obj, allowed, where);
    return 0;
  });
}

}  // namespace assay::common::request_fields
