// Kiln's v2 next-token record (kiln.rocm-hf-next-token-oracle.v2) from an assay next-token
// result: written only when every field of it is a fact of the run the result records.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/json.h"

namespace assay::client {

// assay's addition beside a Kiln record: the result's numerics envelope (bug or numerics), bound
// to the record by its result_sha256 (schemas/kiln-numerics-addendum.schema.json). Kiln's own
// schema admits no field of assay's, so the record stays Kiln's and the envelope sits beside it.
inline constexpr std::string_view kKilnNumericsAddendum = "assay.kiln-numerics-addendum.v1";

struct KilnExportOptions {
  // request.contract_path: where the request lives in Kiln's repository. assay is not told;
  // without it the field cannot be filled.
  std::optional<std::string> contract_path;
};

struct KilnExport {
  // The record as it would be written, result_sha256 (Kiln's canonical self-hash) included.
  common::Json record;
  // Each field that would not be a fact of the run, as "pointer: why" (e.g.
  // "/oracle/torch_version: Kiln pins 2.13.0+rocm7.2, the run had 2.13.0+cu130"): the field's
  // own reason where assay knows it, else what Kiln's published schema says of the value.
  std::vector<std::string> false_fields;
  // The addendum (kKilnNumericsAddendum) when the result has a numerics envelope, else null.
  common::Json numerics;
  bool writable() const { return false_fields.empty(); }
};

// Builds the record from `result` (an assay.next-token-oracle-result.v1) and validates it
// against Kiln's published v2 schema. Throws common::Error("export.not_next_token") for another
// kind of result.
KilnExport kiln_v2_record(const common::Json& result, const KilnExportOptions& options = {});

// Where the addendum of RECORD lives: beside it, "<stem>.assay-numerics.json".
std::filesystem::path kiln_numerics_path(const std::filesystem::path& record);

// The file as Kiln writes one: Python's json.dumps(obj, indent=2, sort_keys=True) and a newline.
std::string kiln_file_text(const common::Json& record);

}  // namespace assay::client
