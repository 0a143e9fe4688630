#include "common/json_schema.h"

#include <algorithm>
#include <cmath>
#include <regex>
#include <set>

#include "common/error.h"
#include "common/text.h"

namespace assay::common {

namespace {

constexpr std::string_view kDraft202012 = "https://json-schema.org/draft/2020-12/schema";

const std::set<std::string_view> kAnnotations = {"$schema",    "title",    "description",
                                                 "$comment",   "examples", "default",
                                                 "deprecated", "readOnly", "writeOnly"};
const std::set<std::string_view> kTypes = {"null",   "boolean", "object", "array",
                                           "number", "integer", "string"};

using Schemas = std::map<std::string, Json, std::less<>>;

std::string show(const Json& value) {
  return printable(value.dump(), 120);
}

std::string pointer_token(std::string_view key) {
  std::string out;
  for (char c : key) out += c == '~' ? "~0" : c == '/' ? "~1" : std::string(1, c);
  return out;
}

[[noreturn]] void invalid(const std::string& where, const std::string& what) {
  throw Error("schema.invalid", where + ": " + what);
}

// ---- A $ref: which schema of the set, and where in it.

struct Ref {
  std::string id;              // the target schema's $id
  Json::json_pointer pointer;  // into that schema
};

// Supports "#/json/pointer", "name.json#/pointer" (a sibling of `base`, as Kiln's schemas refer
// to each other) and absolute URIs; not anchors, percent-encoding, "../" or "/rooted" paths.
Ref resolve(const std::string& ref, const std::string& base) {
  static const std::regex absolute("^[A-Za-z][A-Za-z0-9+.-]*:");
  std::size_t hash = ref.find('#');
  std::string target = ref.substr(0, hash);
  std::string fragment = hash == std::string::npos ? "" : ref.substr(hash + 1);
  if (!fragment.empty() && fragment[0] != '/')
    throw Error("schema.invalid", "$ref \"" + ref + "\": anchors are not supported");
  if (ref.find('%') != std::string::npos)
    throw Error("schema.invalid", "$ref \"" + ref + "\": percent-encoding is not supported");
  Ref out;
  if (target.empty())
    out.id = base;
  else if (std::regex_search(target, absolute))
    out.id = target;
  else if (target.find('/') == std::string::npos && target != "." && target != "..")
    out.id = base.substr(0, base.rfind('/') + 1) + target;
  else
    throw Error("schema.invalid", "$ref \"" + ref + "\": only a sibling's file name is supported");
  try {
    out.pointer = Json::json_pointer(fragment);
  } catch (const Json::exception& e) {
    throw Error("schema.invalid", "$ref \"" + ref + "\": " + e.what());
  }
  return out;
}

// ---- Loading: every keyword is checked once, so that validation can trust the schema.

bool is_schema(const Json& v) {
  return v.is_object() || v.is_boolean();
}
bool is_count(const Json& v) {
  return v.is_number_unsigned() || (v.is_number_integer() && v.get<std::int64_t>() >= 0);
}
bool is_type_name(const Json& v) {
  return v.is_string() && kTypes.contains(v.get_ref<const std::string&>());
}
template <typename Pred>
bool is_array_of(const Json& v, Pred pred) {
  return v.is_array() && std::all_of(v.begin(), v.end(), pred);
}

void check_schema(const Json& schema, const std::string& id, const std::string& where,
                  bool root = false);

void check_keyword(const std::string& key, const Json& value, const std::string& id,
                   const std::string& at) {
  auto need = [&](bool ok, const char* what) {
    if (!ok) invalid(at, key + " must be " + what + ", not " + show(value));
  };
  if (key == "$ref") {
    need(value.is_string(), "a string");
    resolve(value, id);
  } else if (key == "properties" || key == "$defs") {
    need(value.is_object(), "an object");
    for (const auto& [name, sub] : value.items())
      check_schema(sub, id, at + "/" + pointer_token(name));
  } else if (key == "additionalProperties" || key == "items") {
    need(is_schema(value), "a schema");
    check_schema(value, id, at);
  } else if (key == "prefixItems" || key == "allOf" || key == "oneOf") {
    need(is_array_of(value, is_schema) && !value.empty(), "a non-empty array of schemas");
    for (std::size_t i = 0; i < value.size(); ++i)
      check_schema(value[i], id, at + "/" + std::to_string(i));
  } else if (key == "uniqueItems") {
    need(value.is_boolean(), "a boolean");
  } else if (key == "type") {
    need(is_type_name(value) || (is_array_of(value, is_type_name) && !value.empty()),
         "a type name or an array of them");
  } else if (key == "enum") {
    need(value.is_array(), "an array");
  } else if (key == "required") {
    need(is_array_of(value, [](const Json& v) { return v.is_string(); }), "an array of strings");
  } else if (key == "minimum" || key == "maximum" || key == "exclusiveMinimum" ||
             key == "exclusiveMaximum") {
    need(value.is_number(), "a number");
  } else if (key == "minLength" || key == "maxLength" || key == "minItems" || key == "maxItems") {
    need(is_count(value), "a non-negative integer");
  } else if (key == "pattern") {
    need(value.is_string(), "a string");
    try {
      std::regex(value.get<std::string>(), std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      invalid(at, "pattern " + show(value) + " does not compile: " + e.what());
    }
  } else if (key == "format") {
    if (value != "date-time") invalid(at, "format " + show(value) + " is not supported");
  } else if (key != "const" && !kAnnotations.contains(key)) {
    invalid(at, "keyword \"" + key + "\" is not supported by assay's validator");
  }
}

void check_schema(const Json& schema, const std::string& id, const std::string& where, bool root) {
  if (schema.is_boolean()) return;
  if (!schema.is_object()) invalid(where, "a schema must be an object or a boolean");
  for (const auto& [key, value] : schema.items()) {
    if (key == "$id" && root) continue;
    // An inner $id would start a new base URI for the $refs below it; Kiln's schemas have none.
    if (key == "$id") invalid(where + "/$id", "$id inside a schema is not supported");
    check_keyword(key, value, id, where + "/" + pointer_token(key));
  }
}

// ---- The checks on values.

std::string kind_of(const Json& v) {
  switch (v.type()) {
    case Json::value_t::null:
      return "null";
    case Json::value_t::boolean:
      return "boolean";
    case Json::value_t::object:
      return "object";
    case Json::value_t::array:
      return "array";
    case Json::value_t::string:
      return "string";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
      return "integer";
    default:
      return "number";
  }
}

// 2020-12: an integer is a number with no fractional part, however it is written.
bool is_integer(const Json& v) {
  if (v.is_number_integer()) return true;
  if (!v.is_number_float()) return false;
  double d = v.get<double>();
  return std::isfinite(d) && std::trunc(d) == d;
}

bool has_type(const Json& v, const std::string& type) {
  if (type == "integer") return is_integer(v);
  if (type == "number") return v.is_number();
  return kind_of(v) == type;
}

// Unicode code points of UTF-8 text (parse_strict has checked it): its non-continuation bytes.
std::size_t code_points(const std::string& s) {
  std::size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

// RFC 3339 section 5.6, each field in range: the day in its month (leap years too), a leap
// second only at 23:59:60 UTC. Read by hand, not with std::regex, which recursed once per digit of
// the fraction (a long one overflowed the stack).
bool is_date_time(const std::string& s) {
  auto digits = [&](std::size_t at, std::size_t n, int& out) {
    if (at + n > s.size()) return false;
    out = 0;
    for (std::size_t i = at; i < at + n; ++i) {
      if (s[i] < '0' || s[i] > '9') return false;
      out = out * 10 + (s[i] - '0');
    }
    return true;
  };
  auto one_of = [&](std::size_t at, std::string_view chars) {
    return at < s.size() && chars.find(s[at]) != std::string_view::npos;
  };
  int year, month, day, hour, minute, second, offset_hour = 0, offset_minute = 0, sign = 1;
  if (!digits(0, 4, year) || !one_of(4, "-") || !digits(5, 2, month) || !one_of(7, "-") ||
      !digits(8, 2, day) || !one_of(10, "Tt") || !digits(11, 2, hour) || !one_of(13, ":") ||
      !digits(14, 2, minute) || !one_of(16, ":") || !digits(17, 2, second))
    return false;
  std::size_t at = 19;
  if (one_of(at, ".")) {
    std::size_t first = ++at;
    while (at < s.size() && s[at] >= '0' && s[at] <= '9') ++at;
    if (at == first) return false;
  }
  if (one_of(at, "Zz")) {
    ++at;
  } else if (one_of(at, "+-")) {
    sign = s[at] == '-' ? -1 : 1;
    if (!digits(at + 1, 2, offset_hour) || !one_of(at + 3, ":") ||
        !digits(at + 4, 2, offset_minute))
      return false;
    at += 6;
  } else {
    return false;
  }
  if (at != s.size()) return false;
  static const int kDays[] = {31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  bool leap_year = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
  if (month < 1 || month > 12 || day < 1 || day > kDays[month - 1]) return false;
  if (month == 2 && day == 29 && !leap_year) return false;
  if (hour > 23 || minute > 59 || second > 60 || offset_hour > 23 || offset_minute > 59)
    return false;
  if (second == 60) {
    int offset = sign * (offset_hour * 60 + offset_minute);
    int utc = ((hour * 60 + minute - offset) % 1440 + 1440) % 1440;
    return utc == 23 * 60 + 59;
  }
  return true;
}

class Validator {
 public:
  Validator(const Schemas& schemas, std::vector<SchemaError>& errors)
      : schemas_(schemas), errors_(errors) {}

  // `doc` (at `at` in the document) against `schema`, whose $refs resolve against `base`.
  void check(const Json& doc, const Json& schema, const std::string& base, const std::string& at) {
    if (schema.is_boolean()) {
      if (!schema.get<bool>()) fail(at, "false: expected no value, found " + show(doc));
      return;
    }
    if (auto ref = schema.find("$ref"); ref != schema.end()) check_ref(doc, *ref, base, at);
    if (auto all = schema.find("allOf"); all != schema.end())
      for (const auto& sub : *all) check(doc, sub, base, at);
    if (auto one = schema.find("oneOf"); one != schema.end()) check_one_of(doc, *one, base, at);
    check_type(doc, schema, at);
    check_equality(doc, schema, at);
    if (doc.is_number()) check_number(doc, schema, at);
    if (doc.is_string()) check_string(doc.get_ref<const std::string&>(), schema, at);
    if (doc.is_object()) check_object(doc, schema, base, at);
    if (doc.is_array()) check_array(doc, schema, base, at);
  }

 private:
  void fail(const std::string& at, std::string message) {
    errors_.push_back({at, std::move(message)});
  }

  void check_ref(const Json& doc, const std::string& ref, const std::string& base,
                 const std::string& at) {
    Ref target = resolve(ref, base);
    auto schema = schemas_.find(target.id);
    if (schema == schemas_.end())
      throw Error("schema.invalid", base + ": $ref \"" + ref + "\" names no schema of the set");
    if (!schema->second.contains(target.pointer))
      throw Error("schema.invalid", base + ": $ref \"" + ref + "\" points at nothing");
    const Json& sub = schema->second.at(target.pointer);
    // Coming back to the same subschema for the same value, without a step into the value, never
    // ends.
    if (!in_progress_.emplace(&sub, &doc).second)
      throw Error("schema.invalid",
                  base + ": $ref \"" + ref + "\" loops at " + (at.empty() ? "/" : at));
    check(doc, sub, target.id, at);
    in_progress_.erase({&sub, &doc});
  }

  // Exactly one of the alternatives: each is checked into errors of its own; when none holds,
  // the errors of the one that came nearest are reported under it: fewest errors, and an
  // alternative of another type than the value's only when all are.
  void check_one_of(const Json& doc, const Json& one_of, const std::string& base,
                    const std::string& at) {
    std::vector<std::size_t> valid;
    std::vector<SchemaError> nearest;
    std::size_t nearest_index = 0, nearest_distance = 0;
    auto distance = [&](const std::vector<SchemaError>& errors) {
      bool other_type = std::any_of(errors.begin(), errors.end(), [&](const SchemaError& e) {
        return e.pointer == at && e.message.rfind("type:", 0) == 0;
      });
      return errors.size() + (other_type ? std::size_t{1} << 20 : 0);
    };
    for (std::size_t i = 0; i < one_of.size(); ++i) {
      std::vector<SchemaError> mine;
      Validator sub(schemas_, mine);
      sub.in_progress_ = in_progress_;
      sub.check(doc, one_of[i], base, at);
      if (mine.empty())
        valid.push_back(i);
      else if (nearest.empty() || distance(mine) < nearest_distance)
        nearest_distance = distance(mine), nearest = std::move(mine), nearest_index = i;
    }
    if (valid.size() == 1) return;
    if (valid.empty()) {
      fail(at, "oneOf: matches none of the " + std::to_string(one_of.size()) +
                   " alternatives; nearest, alternative " + std::to_string(nearest_index) + ":");
      for (auto& e : nearest) errors_.push_back(std::move(e));
      return;
    }
    fail(at, "oneOf: matches alternatives " + std::to_string(valid[0]) + " and " +
                 std::to_string(valid[1]) + ", expected exactly one");
  }

  void check_type(const Json& doc, const Json& schema, const std::string& at) {
    auto type = schema.find("type");
    if (type == schema.end()) return;
    auto matches = [&](const Json& t) { return has_type(doc, t.get<std::string>()); };
    bool ok = type->is_string() ? matches(*type) : std::any_of(type->begin(), type->end(), matches);
    if (!ok)
      fail(at, "type: expected " + (type->is_string() ? type->get<std::string>() : show(*type)) +
                   ", found " +
                   (doc.is_null() ? std::string("null")  // not "null null"
                                  : kind_of(doc) + " " + show(doc)));
  }

  // nlohmann's == is JSON equality: numbers by value (1 == 1.0), objects regardless of key order.
  void check_equality(const Json& doc, const Json& schema, const std::string& at) {
    if (auto c = schema.find("const"); c != schema.end() && doc != *c)
      fail(at, "const: expected " + show(*c) + ", found " + show(doc));
    if (auto e = schema.find("enum");
        e != schema.end() && std::find(e->begin(), e->end(), doc) == e->end())
      fail(at, "enum: expected one of " + show(*e) + ", found " + show(doc));
  }

  void check_number(const Json& doc, const Json& schema, const std::string& at) {
    double v = doc.get<double>();
    auto bound = [&](const char* keyword, const char* relation, bool ok_if_below, bool inclusive) {
      auto it = schema.find(keyword);
      if (it == schema.end()) return;
      double b = it->get<double>();
      bool ok = (ok_if_below ? v < b : v > b) || (inclusive && v == b);
      if (!ok)
        fail(at, std::string(keyword) + ": expected " + relation + " " + show(*it) + ", found " +
                     show(doc));
    };
    bound("minimum", ">=", false, true);
    bound("exclusiveMinimum", ">", false, false);
    bound("maximum", "<=", true, true);
    bound("exclusiveMaximum", "<", true, false);
  }

  void check_string(const std::string& s, const Json& schema, const std::string& at) {
    std::size_t n = code_points(s);
    if (auto it = schema.find("minLength"); it != schema.end() && n < it->get<std::size_t>())
      fail(at, "minLength: expected at least " + show(*it) + " characters, found " +
                   std::to_string(n) + " in " + show(s));
    if (auto it = schema.find("maxLength"); it != schema.end() && n > it->get<std::size_t>())
      fail(at, "maxLength: expected at most " + show(*it) + " characters, found " +
                   std::to_string(n) + " in " + show(s));
    if (auto it = schema.find("pattern"); it != schema.end() && !std::regex_search(s, regex(*it)))
      fail(at, "pattern: expected a match of " + show(*it) + ", found " + show(s));
    if (schema.contains("format") && !is_date_time(s))
      fail(at, "format: expected an RFC 3339 date-time, found " + show(s));
  }

  void check_object(const Json& doc, const Json& schema, const std::string& base,
                    const std::string& at) {
    if (auto it = schema.find("required"); it != schema.end())
      for (const auto& key : *it)
        if (!doc.contains(key.get<std::string>()))
          fail(at, "required: " + show(key) + " is missing");
    auto properties = schema.find("properties");
    auto additional = schema.find("additionalProperties");
    for (const auto& [key, value] : doc.items()) {
      std::string at_key = at + "/" + pointer_token(key);
      if (properties != schema.end() && properties->contains(key))
        check(value, (*properties)[key], base, at_key);
      else if (additional != schema.end() && *additional == false)
        fail(at_key, "additionalProperties: " + show(key) + " is not allowed");
      else if (additional != schema.end())
        check(value, *additional, base, at_key);
    }
  }

  void check_array(const Json& doc, const Json& schema, const std::string& base,
                   const std::string& at) {
    if (auto it = schema.find("minItems");
        it != schema.end() && doc.size() < it->get<std::size_t>())
      fail(at, "minItems: expected at least " + show(*it) + " items, found " +
                   std::to_string(doc.size()));
    if (auto it = schema.find("maxItems");
        it != schema.end() && doc.size() > it->get<std::size_t>())
      fail(at, "maxItems: expected at most " + show(*it) + " items, found " +
                   std::to_string(doc.size()));
    if (auto it = schema.find("uniqueItems"); it != schema.end() && *it == true) {
      // Sorted, so that a long array costs n log n; nlohmann's < orders numbers by value, as
      // its == compares them (1 == 1.0).
      std::vector<const Json*> sorted;
      for (const auto& v : doc) sorted.push_back(&v);
      std::stable_sort(sorted.begin(), sorted.end(),
                       [](const Json* a, const Json* b) { return *a < *b; });
      for (std::size_t i = 1; i < sorted.size(); ++i)
        if (*sorted[i - 1] == *sorted[i]) {
          fail(at, "uniqueItems: " + show(*sorted[i - 1]) + " occurs more than once");
          break;
        }
    }
    std::size_t prefix = 0;
    if (auto it = schema.find("prefixItems"); it != schema.end()) {
      prefix = it->size();
      for (std::size_t i = 0; i < prefix && i < doc.size(); ++i)
        check(doc[i], (*it)[i], base, at + "/" + std::to_string(i));
    }
    auto items = schema.find("items");
    if (items == schema.end() || doc.size() <= prefix) return;
    if (*items == false) {
      fail(at, "items: expected at most " + std::to_string(prefix) + " items, found " +
                   std::to_string(doc.size()));
      return;
    }
    for (std::size_t i = prefix; i < doc.size(); ++i)
      check(doc[i], *items, base, at + "/" + std::to_string(i));
  }

  const std::regex& regex(const std::string& pattern) {
    auto it = regexes_.find(pattern);
    if (it == regexes_.end())
      it = regexes_.emplace(pattern, std::regex(pattern, std::regex::ECMAScript)).first;
    return it->second;
  }

  const Schemas& schemas_;
  std::vector<SchemaError>& errors_;
  std::map<std::string, std::regex> regexes_;                  // compiled once per validation
  std::set<std::pair<const Json*, const Json*>> in_progress_;  // $ref targets and their values
};

}  // namespace

void SchemaSet::add(Json schema) {
  if (!schema.is_object() || !schema.contains("$id") || !schema["$id"].is_string())
    throw Error("schema.invalid", "a schema of the set needs a string $id");
  std::string id = schema["$id"];
  if (schema.contains("$schema") && schema["$schema"] != kDraft202012)
    invalid(id + "#/$schema", show(schema["$schema"]) + " is not draft 2020-12");
  if (schemas_.contains(id)) throw Error("schema.invalid", id + " is already in the set");
  check_schema(schema, id, id + "#", true);
  schemas_.emplace(id, std::move(schema));
}

SchemaCatalog::SchemaCatalog(const std::pair<const char*, const char*>* files, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    auto [file, text] = files[i];
    Json schema = parse_strict(text);
    Json name = schema.value(Json::json_pointer("/properties/schema/const"), Json());
    if (!name.is_null() && !name.is_string())
      throw Error("schema.invalid",
                  std::string(file) + ": /properties/schema/const is not a string");
    std::string id = member(schema, "$id").is_string() ? schema["$id"].get<std::string>() : "";
    schemas_.add(std::move(schema));  // throws for a missing $id, before it is indexed
    if (name.is_string()) ids_.emplace(name.get<std::string>(), id);
  }
}

std::optional<std::string> SchemaCatalog::id_for(std::string_view document_schema) const {
  auto it = ids_.find(document_schema);
  if (it == ids_.end()) return std::nullopt;
  return it->second;
}

std::vector<SchemaError> SchemaSet::validate(const Json& document,
                                             std::string_view schema_id) const {
  auto it = schemas_.find(schema_id);
  if (it == schemas_.end())
    throw Error("schema.invalid", "no schema with $id " + std::string(schema_id));
  std::vector<SchemaError> errors;
  Validator(schemas_, errors).check(document, it->second, it->first, "");
  return errors;
}

}  // namespace assay::common
