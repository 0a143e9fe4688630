#include "common/worker_schemas.h"

#include <cstddef>
#include <string>
#include <utility>

#include "common/error.h"
#include "common/text.h"

namespace assay::common {

// Generated from schemas/*-output.schema.json and schemas/model-identity.schema.json.
extern const std::pair<const char*, const char*> kWorkerSchemaFiles[];
extern const std::size_t kWorkerSchemaFilesCount;

const SchemaCatalog& worker_output_schemas() {
  static const SchemaCatalog loaded(kWorkerSchemaFiles, kWorkerSchemaFilesCount);
  return loaded;
}

void check_worker_output(const Json& output, const std::string& code, std::string_view who) {
  const Json& schema = member(output, "schema");
  if (!schema.is_string())
    throw Error(code, std::string(who) + " is not a JSON object with a string \"schema\" (" +
                          printable(output.dump(), 80) + ")");
  auto id = worker_output_schemas().id_for(schema.get_ref<const std::string&>());
  if (!id) return;
  auto errors = worker_output_schemas().schemas().validate(output, *id);
  if (errors.empty()) return;
  std::string m = std::string(who) + " is not a valid " + schema.get<std::string>() + ":";
  constexpr std::size_t kShown = 3;
  for (std::size_t i = 0; i < errors.size() && i < kShown; ++i)
    m += " " + (errors[i].pointer.empty() ? std::string("/") : errors[i].pointer) + ": " +
         errors[i].message + ";";
  if (errors.size() > kShown) m += " and " + std::to_string(errors.size() - kShown) + " more";
  throw Error(code, m);
}

}  // namespace assay::common
