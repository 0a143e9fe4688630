// Private to the client's terminal output (format.cpp, format_reports.cpp): reading a document's
// fields as text and laying rows out as an aligned table.
#pragma once

#include <initializer_list>
#include <string>
#include <vector>

#include "common/json.h"

namespace assay::client::format_detail {

// A value as text: a string unquoted, null as "-", anything else as JSON.
std::string scalar(const common::Json& v);
// The first of `keys` that `o` has with a non-null value, or nullptr.
const common::Json* find(const common::Json& o, std::initializer_list<const char*> keys);
// scalar of find, or "" when none is there.
std::string field(const common::Json& o, std::initializer_list<const char*> keys);
// Rows as columns aligned with two spaces, trailing spaces trimmed, one line each.
std::string render_table(const std::vector<std::vector<std::string>>& rows);

}  // namespace assay::client::format_detail
