// Wall-clock time as assay's documents write it.
#pragma once

#include <string>

namespace assay::common {

// "2026-12-01T14:54:51.123Z": UTC with milliseconds (RFC 3339).
std::string now_rfc3339();
// Seconds since the Unix epoch, with sub-second precision.
double now_unix();

}  // namespace assay::common
