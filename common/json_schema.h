// JSON Schema (draft 2020-12) validation for the keywords Kiln's published schemas and assay's
// worker-output schemas use, so that `assay verify --kiln` and the kiln-v2 export check Kiln's
// documents without Python, and assayd checks each worker's output.json before it reads it.
//
// Checked: type, const, enum (JSON equality: 1 == 1.0), properties, additionalProperties,
// required, minimum, maximum, exclusiveMinimum, exclusiveMaximum, minLength, maxLength (both in
// code points), pattern, minItems, maxItems, uniqueItems, items, prefixItems, allOf, oneOf, and
// $ref to a JSON pointer in the same schema or in another of the set ("other.schema.json#/$defs/x"
// resolves against the referring schema's $id). "integer" is any number with no fractional part
// (3.0 is one). pattern is an ECMAScript std::regex searched, not anchored, over the UTF-8 bytes.
// format "date-time" is asserted, not just annotated: an RFC 3339 date-time or an error (assay
// wants a timestamp to be one; Python's jsonschema only checks formats when asked to).
// Annotations ($schema, title, description, $comment, examples, default, deprecated, readOnly,
// writeOnly) are ignored. Any other keyword, format or $ref form makes add() throw: a schema is
// never checked halfway.
#pragma once

#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/json.h"

namespace assay::common {

struct SchemaError {
  std::string pointer;  // JSON pointer of the offending value in the document ("": the root)
  std::string message;  // the keyword and the values, e.g. `const: expected "a", found "b"`
};

// Schemas that may $ref each other by their $id.
class SchemaSet {
 public:
  // Throws Error("schema.invalid") naming the schema's $id and the pointer of the fault: an
  // unsupported keyword, format or $ref, a keyword's value of the wrong kind, a pattern
  // std::regex cannot compile, a missing $id or a $schema other than 2020-12.
  void add(Json schema);
  // Every error of `document` against the schema whose $id is `schema_id`; empty when valid.
  // Throws Error("schema.invalid") for an unknown `schema_id`, or a $ref that names no schema of
  // the set or nothing in it, or that loops.
  std::vector<SchemaError> validate(const Json& document, std::string_view schema_id) const;

 private:
  std::map<std::string, Json, std::less<>> schemas_;  // by $id
};

// Schemas compiled into a binary (cmake/embed_files.cmake: {file name, text}), each describing
// the documents whose "schema" member is the const at its /properties/schema/const; one without
// such a const is only a $ref target of the others. Throws as SchemaSet::add.
class SchemaCatalog {
 public:
  SchemaCatalog(const std::pair<const char*, const char*>* files, std::size_t count);
  const SchemaSet& schemas() const { return schemas_; }
  // The $id of the schema for documents whose "schema" is `document_schema`, or nullopt.
  std::optional<std::string> id_for(std::string_view document_schema) const;

 private:
  SchemaSet schemas_;
  std::map<std::string, std::string, std::less<>> ids_;
};

}  // namespace assay::common
