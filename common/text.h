// Text from outside (a client's bytes, a worker's stderr) made safe to put into a message and a
// JSON document: always valid UTF-8, bounded, cut only between characters.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace assay::common {

// Whether `s` is well-formed UTF-8 (no overlong forms, surrogates or code points past U+10FFFF).
bool is_valid_utf8(std::string_view s);
// `s` with every byte that is not part of a well-formed UTF-8 sequence written as "\xNN", cut to
// at most `max_bytes` of output at a character boundary ("..." marks a cut).
std::string printable(std::string_view s, std::size_t max_bytes = 200);
// The same for the end of `s` (a log's tail): "..." first when the start was cut.
std::string printable_tail(std::string_view s, std::size_t max_bytes);

}  // namespace assay::common
