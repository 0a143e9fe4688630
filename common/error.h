// One error type for all of assay: a stable machine-readable code plus a message that
// names the offending value.
#pragma once

#include <stdexcept>
#include <string>

namespace assay::common {

class Error : public std::runtime_error {
 public:
  Error(std::string code, const std::string& message)
      : std::runtime_error(message), code_(std::move(code)) {}
  const std::string& code() const noexcept { return code_; }

 private:
  std::string code_;
};

// Error for a failed system call: "<what> <path>: <strerror(errno)>". ENOSPC and EDQUOT become
// "fs.no_space" and EROFS "fs.read_only", whatever `code` says.
[[noreturn]] void throw_errno(const std::string& code, const std::string& what, int err);

}  // namespace assay::common
