#include "common/kiln_schemas.h"

#include <cstddef>
#include <map>
#include <utility>

#include "common/error.h"

namespace assay::common {

// Generated from schemas/kiln/*.schema.json: {file name, contents}.
extern const std::pair<const char*, const char*> kKilnSchemaFiles[];
extern const std::size_t kKilnSchemaFilesCount;

namespace {

struct Kiln {
  SchemaSet schemas;
  std::map<std::string, std::string, std::less<>> id_by_document_schema;
};

// Each schema says which documents it describes: the const of its "schema" property.
std::string document_schema_of(const Json& schema, const std::string& file) {
  Json name = schema.value(Json::json_pointer("/properties/schema/const"), Json());
  if (!name.is_string())
    throw Error("schema.invalid", file + ": no string at /properties/schema/const");
  return name;
}

const Kiln& kiln() {
  static const Kiln loaded = [] {
    Kiln out;
    for (std::size_t i = 0; i < kKilnSchemaFilesCount; ++i) {
      auto [file, text] = kKilnSchemaFiles[i];
      Json schema = parse_strict(text);
      out.schemas.add(schema);
      out.id_by_document_schema.emplace(document_schema_of(schema, file), schema["$id"]);
    }
    return out;
  }();
  return loaded;
}

}  // namespace

const SchemaSet& kiln_schemas() {
  return kiln().schemas;
}

std::optional<std::string> kiln_schema_id_for(std::string_view document_schema) {
  const auto& ids = kiln().id_by_document_schema;
  auto it = ids.find(document_schema);
  if (it == ids.end()) return std::nullopt;
  return it->second;
}

}  // namespace assay::common
