// assay's schemas of the workers' output.json documents (schemas/*-output.schema.json and the
// model identity they $ref), compiled into the binary at build time (cmake/embed_files.cmake), so
// that assayd checks a worker's output against its schema before any step reads it: a worker
// runs contained but computes over files from outside, so its output is not trusted either.
#pragma once

#include <string_view>

#include "common/json.h"
#include "common/json_schema.h"

namespace assay::common {

// Loaded on first use; thread-safe.
const SchemaCatalog& worker_output_schemas();

// Throws Error(`code`) unless `output` is an object whose "schema" is a string and, where that
// names a schema of worker_output_schemas(), valid against it; the message starts with `who`
// ("assay-oracle's output.json") and names the schema and the first errors by JSON pointer.
// Outputs whose schema assay publishes no file for (the layers comparison's, a batch's) are
// checked by their steps alone.
void check_worker_output(const Json& output, const std::string& code, std::string_view who);

}  // namespace assay::common
