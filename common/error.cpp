#include "common/error.h"

#include <cstring>

namespace assay::common {

void throw_errno(const std::string& code, const std::string& what, int err) {
  throw Error(code, what + ": " + std::strerror(err));
}

}  // namespace assay::common
