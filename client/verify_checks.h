// Private to `assay verify` (verify.cpp: assay's results; verify_kiln.cpp and
// verify_kiln_layer.cpp: Kiln's records): the
// list of checks a verification builds, readers of a document that never throw whatever it
// holds, and the numerics envelope's checks, which a result and a Kiln record's addendum share.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>

#include "client/verify.h"
#include "common/json.h"

namespace assay::client::verify_detail {

inline constexpr std::size_t kMaxDocumentBytes = 64 * 1024 * 1024;

class Checks {
 public:
  void add(std::string name, bool ok, std::string detail) {
    report_.checks.push_back({std::move(name), ok, std::move(detail)});
  }
  VerifyReport take() { return std::move(report_); }

 private:
  VerifyReport report_;
};

// The string at a path of object keys, or nullopt when any step is missing or not a string.
std::optional<std::string> string_at(const common::Json& doc,
                                     std::initializer_list<const char*> keys);
// The number (the integer) at `key` of an object, or nullopt.
std::optional<double> number_at(const common::Json& o, const char* key);
std::optional<std::int64_t> int_at(const common::Json& o, const char* key);
// One of Kiln's cross-field rules, as the check `name`: two parts of a record name the same value
// (and it is there); the detail shows both.
void check_same(Checks& checks, const char* name, const common::Json& a, const char* a_name,
                const common::Json& b, const char* b_name);
// Kiln's rules of a layer-attribution record (verify_kiln_layer.cpp).
void check_kiln_layer(const common::Json& doc, Checks& checks);
// A number as Python's repr writes it, for a check's detail. Unlike python_float_repr it never
// throws: an artifact's logit, or the difference of two huge JSON numbers, may not be finite.
std::string repr(double value);

// A numerics envelope's class recomputed from its members' figures (common/numerics.h), as the
// check `name`; false when the envelope could not be read at all.
bool check_envelope_verdict(const common::Json& n, Checks& checks, const std::string& name);
// The envelope's first member is the oracle's reference (its logits and argmax) and its
// candidates are the engines' tokens the oracle names: an assay next-token result's oracle or a
// Kiln record's, which share these fields. Checks PREFIX + "reference" and "candidates".
void check_envelope_oracle(const common::Json& n, const common::Json& oracle, Checks& checks,
                           const std::string& prefix);

}  // namespace assay::client::verify_detail
