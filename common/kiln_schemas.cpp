#include "common/kiln_schemas.h"

#include <cstddef>
#include <utility>

namespace assay::common {

// Generated from schemas/kiln/*.schema.json: {file name, contents}.
extern const std::pair<const char*, const char*> kKilnSchemaFiles[];
extern const std::size_t kKilnSchemaFilesCount;

namespace {

const SchemaCatalog& kiln() {
  static const SchemaCatalog loaded(kKilnSchemaFiles, kKilnSchemaFilesCount);
  return loaded;
}

}  // namespace

const SchemaSet& kiln_schemas() {
  return kiln().schemas();
}

std::optional<std::string> kiln_schema_id_for(std::string_view document_schema) {
  return kiln().id_for(document_schema);
}

}  // namespace assay::common
