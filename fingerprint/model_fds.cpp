#include "fingerprint/model_fds.h"

#include <climits>
#include <set>

#include "common/error.h"

namespace assay::fingerprint {

using common::Error;
using common::Json;

namespace {

bool plain_relative(std::string_view name) {
  if (name.empty() || name.front() == '/') return false;
  for (unsigned char c : name)
    if (c < 0x20 || c == 0x7f) return false;
  std::size_t start = 0;
  for (;;) {
    std::size_t slash = name.find('/', start);
    std::string_view part =
        name.substr(start, slash == std::string_view::npos ? slash : slash - start);
    if (part.empty() || part == "." || part == "..") return false;
    if (slash == std::string_view::npos) return true;
    start = slash + 1;
  }
}

}  // namespace

std::vector<ModelFd> parse_model_fds(const Json& value, const std::string& where,
                                     const std::string& code) {
  if (!value.is_array()) throw Error(code, where + ": model_fds is not an array");
  std::vector<ModelFd> out;
  std::set<std::string> names;
  std::set<int> fds;
  for (std::size_t i = 0; i < value.size(); ++i) {
    std::string w = where + ": model_fds[" + std::to_string(i) + "]";
    const Json& e = value[i];
    if (!e.is_object()) throw Error(code, w + " is not an object");
    common::reject_unknown_fields(e, {"name", "fd"}, w);
    ModelFd f;
    f.name = common::require_string(e, "name", w);
    if (!plain_relative(f.name))
      throw Error(code, w + ": name '" + f.name +
                            "' is not a relative path without empty, '.' or '..' components");
    std::int64_t fd = common::require_int(e, "fd", w);
    if (fd < 3 || fd > INT_MAX)
      throw Error(code, w + ": fd " + std::to_string(fd) + " is outside 3.." +
                            std::to_string(INT_MAX) + " (0-2 are stdio)");
    f.fd = static_cast<int>(fd);
    if (!names.insert(f.name).second)
      throw Error(code, w + ": name '" + f.name + "' appears twice");
    if (!fds.insert(f.fd).second)
      throw Error(code, w + ": fd " + std::to_string(f.fd) + " is given for two names");
    out.push_back(std::move(f));
  }
  return out;
}

int find_model_fd(const std::vector<ModelFd>& fds, std::string_view name) {
  for (const auto& f : fds)
    if (f.name == name) return f.fd;
  return -1;
}

}  // namespace assay::fingerprint
