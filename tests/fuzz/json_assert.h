// Included first in every translation unit of the fuzz build (tests/fuzz/CMakeLists.txt): an
// nlohmann::json assertion (a const operator[] on a missing key, for one) is undefined behaviour
// in a release build. Here it is reported with its stack and aborts the run; with
// ASSAY_FUZZ_JSON_ASSERT=throw it throws std::logic_error instead, each distinct stack reported
// once, so that one run of a target whose callers catch std::exception lists every such site.
#pragma once

namespace assay::fuzz {
[[noreturn]] void json_assertion_failed(const char* condition);
}  // namespace assay::fuzz

#define JSON_ASSERT(x) ((x) ? static_cast<void>(0) : ::assay::fuzz::json_assertion_failed(#x))
