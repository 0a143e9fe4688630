// Documents against Kiln's published JSON Schemas, compiled in (common::kiln_schemas(), what
// `assay verify --kiln` and the kiln-v2 export check with SchemaSet::validate). The schemas are
// assay's own, never from outside; the document is. Validation never crashes and never throws for
// a known schema id: it returns the errors, each with a JSON pointer into the document.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "common/error.h"
#include "common/json_schema.h"
#include "common/kiln_schemas.h"
#include "tests/fuzz/fuzz.h"

namespace {

const std::vector<std::string>& schema_ids() {
  static const std::vector<std::string> ids = [] {
    std::vector<std::string> out;
    for (const char* name :
         {"kiln.hf-next-token-request.v1", "kiln.rocm-hf-next-token-oracle.v1",
          "kiln.rocm-hf-next-token-oracle.v2", "kiln.rocm-hf-layer-attribution-result.v1",
          "kiln.rocm-hf-layer-attribution-result.v2"}) {
      auto id = assay::common::kiln_schema_id_for(name);
      if (!id) std::abort();
      out.push_back(*id);
    }
    return out;
  }();
  return ids;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace assay;
  common::Json doc;
  try {
    doc = common::parse_strict(fuzz::as_text(data, size), {.max_bytes = 64 << 20});
  } catch (const common::Error&) {
    return 0;
  }
  for (const std::string& id : schema_ids()) {
    for (const common::SchemaError& e : common::kiln_schemas().validate(doc, id)) {
      if (e.message.empty()) std::abort();
      if (!e.pointer.empty() && !doc.contains(common::Json::json_pointer(e.pointer))) std::abort();
    }
  }
  if (doc.is_object() && doc.contains("schema") && doc["schema"].is_string())
    (void)common::kiln_schema_id_for(doc["schema"].get<std::string>());
  return 0;
}
