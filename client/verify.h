// Offline verification of a result record: its self-hash, its DSSE signature and the in-toto
// statement's subjects. Nothing here talks to assayd.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/json.h"

namespace assay::client {

struct VerifyInputs {
  std::filesystem::path result;                   // result.json as written by assayd
  std::optional<std::filesystem::path> envelope;  // result.dsse.json
  std::string public_key;                         // PEM (SubjectPublicKeyInfo) or 32 raw bytes
  std::optional<std::filesystem::path> artifact;  // the logits artifact, when at hand
};

struct Check {
  std::string name;  // stable: "result.schema", "result_sha256", "signature", ...
  bool ok = false;
  std::string detail;  // what was compared, or why it failed
};

struct VerifyReport {
  std::vector<Check> checks;
  // verify --kiln on a Kiln record of a kind assay has no rules for (its schema): nothing was
  // checked, so it is neither verified nor refused.
  std::optional<std::string> not_checked_kind;
  bool ok() const;
  // {"ok": bool, "checks": [{"name","ok","detail"}]}, and "not_checked": kind when so.
  common::Json to_json() const;
};

// Runs every check it can and records each outcome; a failed check does not stop the
// independent ones. Throws common::Error only when a file cannot be read at all.
VerifyReport verify_result(const VerifyInputs& in);

// A record Kiln wrote (its next-token oracle result v1/v2, its layer-attribution result
// v1/v2): its schema is one of Kiln's; result_sha256 recomputed in Kiln's canonical form
// (common::python_canonical, without the field); and for a next-token result the facts that
// follow from the document: the verdict against the candidates and the argmax by Kiln's rule,
// the top tokens in order with the argmax first, the margin, each candidate's logit and rank
// against the top tokens; the document against Kiln's published JSON Schema for its "schema".
// With `artifact` (a next-token record's logits file): its sha256 and size against the record,
// its logits tensor against oracle.logits_sha256, and the argmax, the top tokens and each
// candidate's logit and rank recomputed from the F32 values. With `numerics` (by default the
// file kiln_numerics_path names, when it exists beside a next-token record): assay's numerics
// addendum bound to the record by its result_sha256, its class recomputed from its members'
// figures, its reference and candidates the record's. Throws common::Error only when a file
// cannot be read.
VerifyReport verify_kiln(const std::filesystem::path& record,
                         const std::optional<std::filesystem::path>& artifact = std::nullopt,
                         const std::optional<std::filesystem::path>& numerics = std::nullopt);

// The envelope beside a result: "<dir>/<stem>.dsse.json" (result.json -> result.dsse.json).
std::filesystem::path default_envelope_path(const std::filesystem::path& result);

}  // namespace assay::client
