#include "common/error.h"

#include <cerrno>
#include <cstring>

namespace assay::common {

void throw_errno(const std::string& code, const std::string& what, int err) {
  // A full or read-only disk is one condition wherever it shows; callers answer it as one.
  if (err == ENOSPC || err == EDQUOT) throw Error("fs.no_space", what + ": " + std::strerror(err));
  if (err == EROFS) throw Error("fs.read_only", what + ": " + std::strerror(err));
  throw Error(code, what + ": " + std::strerror(err));
}

}  // namespace assay::common
