#include "fingerprint/model_fds.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <climits>
#include <set>
#include <stdexcept>
#include <string_view>

#include "common/error.h"
#include "common/fsverity.h"
#include "fingerprint/reader.h"

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

FileState parse_file_state(const Json& e, const std::string& w, const std::string& code) {
  auto str = [&](const char* k) {
    if (!e.contains(k) || !e[k].is_string() || e[k].get<std::string>().empty())
      throw Error(code, w + "." + k + " is not a non-empty string");
    return e[k].get<std::string>();
  };
  // dev, ino and the nanosecond times exceed 2^53: decimal strings of at most 19 digits, within
  // the field's type (a 19-digit time may still overflow 64 bits).
  auto decimal = [&](const char* k, bool negative_ok) -> std::string {
    std::string t = str(k);
    std::size_t start = negative_ok && t[0] == '-' ? 1 : 0;
    if (t.size() == start || t.size() - start > 19 ||
        t.find_first_not_of("0123456789", start) != std::string::npos)
      throw Error(code, w + "." + k + " \"" + t + "\" is not a decimal integer string");
    return t;
  };
  auto in_range = [&](const char* k, auto parse) {
    std::string t = decimal(k, std::string_view(k).ends_with("_ns"));
    try {
      return parse(t);
    } catch (const std::out_of_range&) {
      throw Error(code, w + "." + k + " \"" + t + "\" is out of range");
    }
  };
  auto u64 = [](const std::string& t) { return std::stoull(t); };
  auto i64 = [](const std::string& t) { return std::stoll(t); };
  FileState f;
  f.name = str("name");
  f.dev = in_range("dev", u64);
  f.ino = in_range("ino", u64);
  if (!e.contains("size") || !e["size"].is_number_integer() || e["size"].get<std::int64_t>() < 0)
    throw Error(code, w + ".size is not a non-negative integer");
  f.size = e["size"].get<std::uint64_t>();
  f.mtime_ns = in_range("mtime_ns", i64);
  f.ctime_ns = in_range("ctime_ns", i64);
  return f;
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
    FileState f = parse_file_state(e, w, code);
    if (!plain_relative(f.name))
      throw Error(code, w + ": name '" + f.name +
                            "' is not a relative path without empty, '.' or '..' components");
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

bool SettledState::settled() const {
  return state.mtime_ns < written_back_ns - kRacyNs && state.ctime_ns < written_back_ns - kRacyNs;
}

std::optional<SettledState> settled_state(int fd, std::string name) {
  struct statfs fsinfo {};
  if (::fstatfs(fd, &fsinfo) != 0 || !ctime_follows_mapped_writes(static_cast<long>(fsinfo.f_type)))
    return std::nullopt;
  SettledState out;
  out.written_back_ns = realtime_ns();
  if (::sync_file_range(
          fd, 0, 0,
          SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER) != 0)
    return std::nullopt;
  struct stat st {};
  if (::fstat(fd, &st) != 0) return std::nullopt;
  out.fsverity_digest = common::measure_fsverity(fd, name);
  out.state = file_state(std::move(name), st);
  return out;
}

std::size_t write_back_directory(const std::string& dir) {
  // No link in any component (openat2, as admission's open_no_links resolves): a directory of
  // the path swapped for a link after admission checked it is not followed. Without openat2,
  // nothing is written back.
  struct open_how how {};
  how.flags = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;
  how.resolve = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
  const long opened = ::syscall(SYS_openat2, AT_FDCWD, dir.c_str(), &how, sizeof how);
  if (opened < 0) return 0;
  const int dfd = static_cast<int>(opened);
  DIR* d = ::fdopendir(dfd);  // owns dfd from here
  if (!d) {
    ::close(dfd);
    return 0;
  }
  std::size_t seen = 0, written = 0;
  while (const dirent* e = ::readdir(d)) {
    if (++seen > kMaxWriteBackFiles + 2) break;  // "." and ".." count too
    const std::string_view name(e->d_name);
    if (name == "." || name == "..") continue;
    const int path = ::openat(dfd, e->d_name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (path < 0) continue;
    struct stat st {};
    if (::fstat(path, &st) == 0 && S_ISREG(st.st_mode)) {
      // The inode the O_PATH descriptor holds, reopened: a regular file whatever the name names
      // by now.
      const std::string self = "/proc/self/fd/" + std::to_string(path);
      const int fd = ::open(self.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
      if (fd >= 0) {
        struct stat again {};
        if (::fstat(fd, &again) == 0 && S_ISREG(again.st_mode) &&
            ::sync_file_range(fd, 0, 0,
                              SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                                  SYNC_FILE_RANGE_WAIT_AFTER) == 0)
          ++written;
        ::close(fd);
      }
    }
    ::close(path);
  }
  ::closedir(d);
  return written;
}

}  // namespace assay::fingerprint
