// Kiln's published JSON Schemas (schemas/kiln/, copied byte for byte from Kiln), compiled into
// the binary at build time (cmake/embed_files.cmake): the request, the next-token oracle result
// v1 and v2, the layer-attribution result v1 and v2.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "common/json_schema.h"

namespace assay::common {

// All five, by their $id (the v2 results $ref the oracle schemas). Loaded on first use;
// thread-safe.
const SchemaSet& kiln_schemas();
// The $id of the schema for documents whose "schema" field is `document_schema` (e.g.
// "kiln.rocm-hf-next-token-oracle.v1"), or nullopt when it is none of Kiln's.
std::optional<std::string> kiln_schema_id_for(std::string_view document_schema);

// Kiln's name for a reference logits file of its layout (qwen35_hf_logits.py writes it in the
// file's __metadata__ "schema"; its readers require it): exactly the tensors input_ids (I64
// [1, N]) and logits (F32 [vocab], the last position). Kiln has no other full-logits layout; the
// name says the layout, whatever the model.
inline constexpr std::string_view kKilnFullLogitsSchema = "kiln.qwen35-hf-full-logits.v1";

}  // namespace assay::common
