// Model files the supervisor opened for a worker: `model_fds` in the worker inputs. A worker
// given them reads the model only through these descriptors and never opens a path below
// model_dir, so it reads exactly what the submitter was allowed to read.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/json.h"

namespace assay::fingerprint {

struct ModelFd {
  std::string name;  // path relative to model_dir, as the identity names it
  int fd = -1;
  bool operator==(const ModelFd&) const = default;
};

// Parses the `model_fds` array: [{"name": "config.json", "fd": 3}, ...]. Names are relative
// paths without empty, "." or ".." components or control bytes; fds are >= 3 (0-2 are stdio);
// no name and no fd appears twice. Throws common::Error(code, ...) naming the entry.
std::vector<ModelFd> parse_model_fds(const common::Json& value, const std::string& where,
                                     const std::string& code);

// The descriptor given for `name`, or -1.
int find_model_fd(const std::vector<ModelFd>& fds, std::string_view name);

}  // namespace assay::fingerprint
