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

std::vector<FileState> parse_file_states(const Json& value, const std::string& where,
                                         const std::string& code) {
  if (!value.is_array()) throw Error(code, where + " is not an array");
  std::vector<FileState> out;
  std::set<std::string> names;
  for (std::size_t i = 0; i < value.size(); ++i) {
    std::string w = where + "[" + std::to_string(i) + "]";
    const Json& e = value[i];
    if (!e.is_object()) throw Error(code, w + " is not an object");
    common::reject_unknown_fields(e, {"name", "dev", "ino", "size", "mtime_ns", "ctime_ns"}, w);
    // Decimal strings of at most 19 digits (a time may be negative): they exceed 2^53.
    auto decimal = [&](const char* k, bool negative_ok) {
      std::string t = common::require_string(e, k, w);
      std::size_t start = negative_ok && !t.empty() && t[0] == '-' ? 1 : 0;
      if (t.size() == start || t.size() - start > 19 ||
          t.find_first_not_of("0123456789", start) != std::string::npos)
        throw Error(code, w + "." + k + " \"" + t + "\" is not a decimal integer string");
      return t;
    };
    FileState f;
    f.name = common::require_string(e, "name", w);
    if (!plain_relative(f.name))
      throw Error(code, w + ": name '" + f.name +
                            "' is not a relative path without empty, '.' or '..' components");
    f.dev = std::stoull(decimal("dev", false));
    f.ino = std::stoull(decimal("ino", false));
    std::int64_t size = common::require_int(e, "size", w);
    if (size < 0) throw Error(code, w + ".size " + std::to_string(size) + " is negative");
    f.size = static_cast<std::uint64_t>(size);
    f.mtime_ns = std::stoll(decimal("mtime_ns", true));
    f.ctime_ns = std::stoll(decimal("ctime_ns", true));
    if (!names.insert(f.name).second)
      throw Error(code, w + ": name '" + f.name + "' appears twice");
    out.push_back(std::move(f));
  }
  return out;
}

FileState file_state(std::string name, const struct stat& st) {
  auto ns = [](const struct timespec& t) {
    return static_cast<std::int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
  };
  return FileState{std::move(name),
                   static_cast<std::uint64_t>(st.st_dev),
                   static_cast<std::uint64_t>(st.st_ino),
                   static_cast<std::uint64_t>(st.st_size),
                   ns(st.st_mtim),
                   ns(st.st_ctim)};
}

std::string state_difference(const FileState& want, const FileState& got) {
  std::string out;
  auto add = [&](const char* what, auto a, auto b) {
    if (a == b) return;
    if (!out.empty()) out += "; ";
    out += std::string(what) + " " + std::to_string(a) + " is now " + std::to_string(b);
  };
  add("device", want.dev, got.dev);
  add("inode", want.ino, got.ino);
  add("size", want.size, got.size);
  add("mtime_ns", want.mtime_ns, got.mtime_ns);
  add("ctime_ns", want.ctime_ns, got.ctime_ns);
  return out;
}

}  // namespace assay::fingerprint
