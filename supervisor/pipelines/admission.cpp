#include "supervisor/pipelines/admission.h"

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <vector>

#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/openat2.h>
#include <pwd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/error.h"
#include "common/model_shapes.h"
#include "common/protocol.h"
#include "common/safetensors.h"
#include "common/text.h"

namespace assay::supervisor {

using common::Error;
using common::Json;
using common::UniqueFd;
namespace fs = std::filesystem;

namespace {

constexpr std::size_t kMaxModelFiles = 1024;

std::vector<gid_t> groups_of(const Peer& peer) {
  std::vector<gid_t> groups(64);
  if (struct passwd* pw = ::getpwuid(peer.uid)) {
    int n = static_cast<int>(groups.size());
    if (::getgrouplist(pw->pw_name, pw->pw_gid, groups.data(), &n) < 0) {
      groups.resize(static_cast<std::size_t>(n));
      ::getgrouplist(pw->pw_name, pw->pw_gid, groups.data(), &n);
    }
    groups.resize(static_cast<std::size_t>(std::max(n, 0)));
  } else {
    groups.clear();
  }
  groups.push_back(peer.gid);
  return groups;
}

// The peer's rights on an opened file: `need` is a combination of 4 (read), 1 (search/execute),
// taken from the owner's, the group's or the others' bits as the kernel would.
bool allowed(const struct stat& st, const Peer& peer, const std::vector<gid_t>& groups,
             mode_t need) {
  if (peer.admin) return true;
  mode_t bits = st.st_mode & 07;
  if (st.st_uid == peer.uid)
    bits = (st.st_mode >> 6) & 07;
  else if (std::find(groups.begin(), groups.end(), st.st_gid) != groups.end())
    bits = (st.st_mode >> 3) & 07;
  return (bits & need) == need;
}

std::string quote_path(const std::string& path) {
  return "\"" + common::printable(path, 300) + "\"";
}

// One component below an opened directory, never through a link: openat2 refuses any (and
// magic links), openat's O_NOFOLLOW the last one, which is the only one a single name has.
int open_component(int dir, const std::string& name, int flags) {
  static bool have_openat2 = true;
  if (have_openat2) {
    struct open_how how {};
    how.flags = static_cast<std::uint64_t>(flags | O_NOFOLLOW | O_CLOEXEC);
    how.resolve = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH;
    long fd = ::syscall(SYS_openat2, dir, name.c_str(), &how, sizeof how);
    if (fd >= 0 || (errno != ENOSYS && errno != EPERM)) return static_cast<int>(fd);
    have_openat2 = false;  // an old kernel, or a seccomp filter that refuses it
  }
  return ::openat(dir, name.c_str(), flags | O_NOFOLLOW | O_CLOEXEC);
}

std::vector<std::string> components(const std::string& path) {
  std::vector<std::string> parts;
  for (const auto& part : fs::path(path).relative_path()) parts.push_back(part.string());
  return parts;
}

std::string normalised(const std::string& dir, const std::string& code, const std::string& what) {
  if (dir.empty() || dir.front() != '/')
    throw Error(code, what + " " + quote_path(dir) + " is not absolute");
  for (const auto& part : fs::path(dir))
    if (part == "..") throw Error(code, what + " " + quote_path(dir) + " has .. in its path");
  std::string n = fs::path(dir).lexically_normal().string();
  while (n.size() > 1 && n.back() == '/') n.pop_back();
  return n;
}

Error forbidden(const std::string& what, const std::string& path, const Peer& peer) {
  return Error("request.forbidden", what + " " + quote_path(path) + " is not readable by uid " +
                                        std::to_string(peer.uid) + ", who submitted it");
}

// Why `name` below `dir` could not be opened, said only of a directory the peer may search.
[[noreturn]] void refuse_component(int dir, const std::string& name, int err,
                                   const std::string& here, const std::string& path,
                                   const std::string& code, const std::string& what) {
  struct stat lst {};
  if (::fstatat(dir, name.c_str(), &lst, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(lst.st_mode))
    throw Error(code, what + " " + quote_path(path) + " has a symlink at " + quote_path(here) +
                          "; links are not followed");
  if (err == ENOENT) throw Error(code, what + " " + quote_path(path) + " does not exist");
  if (err == ENOTDIR)
    throw Error(code,
                what + " " + quote_path(path) + ": " + quote_path(here) + " is not a directory");
  common::throw_errno(code, "cannot open " + quote_path(here) + " of " + what, err);
}

// Opens `raw` as described in the header: a directory (read + search) or a regular file (read).
Opened open_as(const std::string& raw, const Peer& peer, const std::string& code,
               const std::string& what, bool want_dir) {
  std::string path = normalised(raw, code, what);
  auto groups = groups_of(peer);
  UniqueFd dir(::open("/", O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!dir) common::throw_errno(code, "cannot open /", errno);
  struct stat st {};
  if (::fstat(dir.get(), &st) != 0) common::throw_errno(code, "cannot stat /", errno);
  std::vector<std::string> parts = components(path);
  if (parts.empty()) {
    if (!want_dir) throw Error(code, what + " \"/\" is not a regular file");
    if (!allowed(st, peer, groups, 05)) throw forbidden(what, path, peer);
    return Opened{path, UniqueFd(::open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC)), st};
  }
  std::string here;
  UniqueFd parent;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    // Nothing below a directory the peer may not search is looked at.
    if (!allowed(st, peer, groups, 01)) throw forbidden(what, path, peer);
    const bool last = i + 1 == parts.size();
    here += "/" + parts[i];
    int flags = !last ? O_PATH | O_DIRECTORY : want_dir ? O_RDONLY | O_DIRECTORY : O_PATH;
    int fd = open_component(dir.get(), parts[i], flags);
    if (fd < 0) refuse_component(dir.get(), parts[i], errno, here, path, code, what);
    UniqueFd next(fd);
    if (::fstat(next.get(), &st) != 0) common::throw_errno(code, "cannot stat " + here, errno);
    if (S_ISLNK(st.st_mode))
      throw Error(code, what + " " + quote_path(path) + " is a symlink; links are not followed");
    parent = std::move(dir);
    dir = std::move(next);
  }
  if (want_dir) {
    if (!allowed(st, peer, groups, 05)) throw forbidden(what, path, peer);
    return Opened{path, std::move(dir), st};
  }
  if (!S_ISREG(st.st_mode))
    throw Error(code, what + " " + quote_path(path) + " is not a regular file");
  if (!allowed(st, peer, groups, 04)) throw forbidden(what, path, peer);
  // Checked through an O_PATH descriptor (no open of a device or FIFO), read through this one:
  // the same file, or an error.
  int fd = open_component(parent.get(), parts.back(), O_RDONLY | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) refuse_component(parent.get(), parts.back(), errno, here, path, code, what);
  UniqueFd file(fd);
  struct stat opened {};
  if (::fstat(file.get(), &opened) != 0 || opened.st_dev != st.st_dev || opened.st_ino != st.st_ino)
    throw Error(code, what + " " + quote_path(path) + " was replaced while it was opened");
  return Opened{path, std::move(file), opened};
}

Json record_of(const Opened& o) {
  return Json{{"path", o.path},
              {"type", S_ISDIR(o.st.st_mode) ? "directory" : "file"},
              {"dev", std::to_string(o.st.st_dev)},
              {"ino", std::to_string(o.st.st_ino)},
              {"uid", o.st.st_uid},
              {"gid", o.st.st_gid},
              {"mode", o.st.st_mode & 07777}};
}

std::string octal(unsigned mode) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "%04o", mode);
  return buf;
}

// The safetensors header admission reads of each shard: real checkpoints' are under 1 MiB.
constexpr std::uint64_t kMaxAdmittedHeaderBytes = 16ull << 20;

bool pread_all(int fd, char* out, std::size_t n) {
  for (std::size_t got = 0; got < n;) {
    ssize_t r = ::pread(fd, out + got, n - got, static_cast<off_t>(got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    got += static_cast<std::size_t>(r);
  }
  return true;
}

// config.json's sizes against the shards' headers (common/model_shapes.h), before a worker
// builds anything from them. Read with pread: the descriptors a worker is handed stay at offset
// 0. A config or header that cannot be read or parsed is the worker's to report, as it always
// was; a header larger than admission reads is refused, so that no size escapes the check.
void check_model_shapes(const OpenedModel& m) {
  const std::string code = "request.bad_model";
  const Opened* config = nullptr;
  for (std::size_t i = 0; i < m.files.size(); ++i)
    if (m.names[i] == "config.json") config = &m.files[i];
  if (!config || config->st.st_size > static_cast<off_t>(protocol::kMaxSmallModelFileBytes)) return;
  std::string text(static_cast<std::size_t>(config->st.st_size), '\0');
  if (!pread_all(config->fd.get(), text.data(), text.size())) return;
  Json parsed;
  try {
    parsed = common::parse_strict(text);
  } catch (const Error&) {
    return;
  }
  common::TensorShapes shapes;
  for (std::size_t i = 0; i < m.files.size(); ++i) {
    const std::string& name = m.names[i];
    if (name.size() < 12 || name.compare(name.size() - 12, 12, ".safetensors") != 0) continue;
    const Opened& f = m.files[i];
    const auto size = static_cast<std::uint64_t>(f.st.st_size);
    unsigned char len[8];
    if (size < 8 || !pread_all(f.fd.get(), reinterpret_cast<char*>(len), 8)) return;
    std::uint64_t header = 0;
    for (int b = 7; b >= 0; --b) header = header << 8 | len[b];
    if (header > kMaxAdmittedHeaderBytes && header <= size - 8)
      throw Error(code, "model file " + quote_path(f.path) + " has a safetensors header of " +
                            std::to_string(header) + " bytes, more than the limit of " +
                            std::to_string(kMaxAdmittedHeaderBytes));
    try {
      for (auto& t :
           common::read_safetensors_header(f.fd.get(), size, kMaxAdmittedHeaderBytes).tensors)
        shapes[t.name] = std::move(t.shape);
    } catch (const Error&) {
      return;
    }
  }
  common::check_config_shapes(parsed, shapes, quote_path(config->path), code);
}

}  // namespace

Opened open_dir_as(const std::string& path, const Peer& peer, const std::string& code,
                   const std::string& what) {
  return open_as(path, peer, code, what, true);
}

Opened open_file_as(const std::string& path, const Peer& peer, const std::string& code,
                    const std::string& what) {
  return open_as(path, peer, code, what, false);
}

OpenedModel open_model_as(const std::string& raw, const Peer& peer) {
  const std::string code = "request.bad_model";
  OpenedModel m;
  m.dir = open_dir_as(raw, peer, code, "model directory");
  if (!S_ISDIR(m.dir.st.st_mode))
    throw Error(code, "model directory " + quote_path(m.dir.path) + " is not a directory");
  auto groups = groups_of(peer);
  // Listed through its own descriptor: fdopendir takes the one it is given.
  int listing = ::openat(m.dir.fd.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR* d = listing < 0 ? nullptr : ::fdopendir(listing);
  if (!d) {
    int err = errno;
    if (listing >= 0) ::close(listing);
    common::throw_errno(code, "cannot list model directory " + quote_path(m.dir.path), err);
  }
  std::vector<std::string> names;
  while (struct dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  for (const auto& name : names) {
    std::string path = (fs::path(m.dir.path) / name).string();
    struct stat lst {};
    if (::fstatat(m.dir.fd.get(), name.c_str(), &lst, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (S_ISLNK(lst.st_mode))
      throw Error(code, "model file " + quote_path(path) + " is a symlink; links are not followed");
    // Workers read every regular file at the top of the directory: each must be readable by
    // the submitter. Non-blocking: a FIFO is never waited on.
    if (!S_ISREG(lst.st_mode)) continue;
    if (!allowed(lst, peer, groups, 04)) throw forbidden("model file", path, peer);
    int fd = open_component(m.dir.fd.get(), name, O_RDONLY | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) continue;  // gone since the listing
    UniqueFd file(fd);
    struct stat st {};
    if (::fstat(file.get(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_ino != lst.st_ino ||
        st.st_dev != lst.st_dev || !allowed(st, peer, groups, 04))
      throw Error(code, "model file " + quote_path(path) + " changed while it was opened");
    if (std::find(protocol::kSmallModelFiles.begin(), protocol::kSmallModelFiles.end(), name) !=
            protocol::kSmallModelFiles.end() &&
        static_cast<std::uint64_t>(st.st_size) > protocol::kMaxSmallModelFileBytes)
      throw Error(code, "model file " + quote_path(path) + " has " + std::to_string(st.st_size) +
                            " bytes, more than the limit of " +
                            std::to_string(protocol::kMaxSmallModelFileBytes) +
                            " for a tokenizer or config file");
    if (m.files.size() == kMaxModelFiles)
      throw Error(code, "model directory " + quote_path(m.dir.path) + " holds more than " +
                            std::to_string(kMaxModelFiles) + " files");
    m.files.push_back(Opened{path, std::move(file), st});
    m.names.push_back(name);
  }
  check_model_shapes(m);
  return m;
}

Json opened_record(const std::vector<const Opened*>& opened) {
  Json out = Json::array();
  for (const Opened* o : opened) out.push_back(record_of(*o));
  return out;
}

Json opened_record(const OpenedModel& model) {
  std::vector<const Opened*> all{&model.dir};
  for (const auto& f : model.files) all.push_back(&f);
  return opened_record(all);
}

void check_unchanged(const Json& admitted, const Opened& now) {
  if (!admitted.is_array()) return;
  for (const Json& e : admitted) {
    if (!e.is_object() || e.value("path", "") != now.path) continue;
    Json n = record_of(now);
    std::string what;
    if (e.value("uid", Json()) != n["uid"] || e.value("gid", Json()) != n["gid"])
      what += "owner " + e.value("uid", Json()).dump() + ":" + e.value("gid", Json()).dump() +
              " is now " + n["uid"].dump() + ":" + n["gid"].dump() + "; ";
    if (e.value("mode", Json()) != n["mode"])
      what += "mode " + octal(e.value("mode", 0u)) + " is now " + octal(n["mode"].get<unsigned>()) +
              "; ";
    if (e.value("dev", Json()) != n["dev"] || e.value("ino", Json()) != n["ino"])
      what += "it is another file (device:inode " + e.value("dev", std::string("?")) + ":" +
              e.value("ino", std::string("?")) + " is now " + n["dev"].get<std::string>() + ":" +
              n["ino"].get<std::string>() + "); ";
    if (what.empty()) return;
    what.resize(what.size() - 2);
    throw Error("job.files_changed", quote_path(now.path) +
                                         " changed between admission and start: " + what +
                                         "; nothing was read (resubmit with retry=1 to run it "
                                         "on the files as they are now)");
  }
}

void verify_admitted(const Json& admitted, const Peer& peer) {
  if (!admitted.is_array()) return;
  for (const Json& e : admitted) {
    if (!e.is_object() || !e.value("path", Json()).is_string()) continue;
    bool dir = e.value("type", "") == "directory";
    Opened now = open_as(e["path"].get<std::string>(), peer, "job.files_changed",
                         dir ? "directory" : "file", dir);
    check_unchanged(admitted, now);
  }
}

std::string check_model_dir(const std::string& raw, const Peer& peer, Json* record) {
  OpenedModel m = open_model_as(raw, peer);
  if (record)
    for (Json& e : opened_record(m)) record->push_back(std::move(e));
  return m.dir.path;
}

Opened check_readable_file(const std::string& raw, const Peer& peer, const std::string& code,
                           const std::string& what, Json* record) {
  std::string path = normalised(raw, code, what);
  if (path != raw) throw Error(code, what + " " + quote_path(raw) + " is not a normalised path");
  Opened f = open_file_as(path, peer, code, what);
  if (record) record->push_back(record_of(f));
  return f;
}

UniqueFd open_no_links(const fs::path& path) {
  struct open_how how {};
  how.flags = O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC | O_NOFOLLOW;
  how.resolve = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
  long fd = ::syscall(SYS_openat2, AT_FDCWD, path.c_str(), &how, sizeof how);
  if (fd < 0 && (errno == ENOSYS || errno == EPERM)) {
    // Without openat2: every component by itself, none of them a link.
    std::string p = path.string();
    UniqueFd dir(::open("/", O_PATH | O_DIRECTORY | O_CLOEXEC));
    auto parts = components(p);
    for (std::size_t i = 0; dir && i < parts.size(); ++i) {
      bool last = i + 1 == parts.size();
      int next = ::openat(dir.get(), parts[i].c_str(),
                          (last ? how.flags : O_PATH | O_DIRECTORY) | O_NOFOLLOW | O_CLOEXEC);
      dir = UniqueFd(next);
    }
    fd = dir ? dir.release() : -1;
  }
  if (fd < 0) common::throw_errno("fs.open", "open " + path.string() + " (no links)", errno);
  UniqueFd out(static_cast<int>(fd));
  struct stat st {};
  if (::fstat(out.get(), &st) != 0) common::throw_errno("fs.stat", "stat " + path.string(), errno);
  if (!S_ISREG(st.st_mode)) throw Error("fs.not_regular", path.string() + " is not a regular file");
  return out;
}

namespace {

std::string read_all(int fd, const std::string& path, std::size_t max_bytes,
                     const std::string& code) {
  std::string out;
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) common::throw_errno(code, "read " + path, errno);
    if (n == 0) return out;
    out.append(buf, static_cast<std::size_t>(n));
    if (out.size() > max_bytes)
      throw Error(code == "fs.read" ? "fs.too_large" : code,
                  path + " has more than the limit of " + std::to_string(max_bytes) + " bytes");
  }
}

}  // namespace

std::string read_no_links(const fs::path& path, std::size_t max_bytes) {
  UniqueFd fd = open_no_links(path);
  return read_all(fd.get(), path.string(), max_bytes, "fs.read");
}

std::string read_opened(const Opened& file, std::size_t max_bytes, const std::string& code) {
  if (file.st.st_size > static_cast<off_t>(max_bytes))
    throw Error(code, quote_path(file.path) + " has " + std::to_string(file.st.st_size) +
                          " bytes, more than the limit of " + std::to_string(max_bytes));
  return read_all(file.fd.get(), quote_path(file.path), max_bytes, code);
}

Peer submitter_peer(uid_t uid, gid_t gid, bool admin) {
  Peer p;
  p.uid = uid;
  p.gid = gid;
  p.admin = admin;
  return p;
}

void check_request_limits(const common::RequestLimits& asked, const Config& config) {
  if (asked.timeout_seconds && *asked.timeout_seconds > config.worker_timeout_seconds)
    throw Error("request.limit_above_max", "request.limits.timeout_seconds " +
                                               std::to_string(*asked.timeout_seconds) +
                                               " is above the configured worker_timeout_seconds " +
                                               std::to_string(config.worker_timeout_seconds));
  if (asked.memory_bytes && config.worker_memory_max &&
      *asked.memory_bytes > *config.worker_memory_max)
    throw Error("request.limit_above_max", "request.limits.memory_bytes " +
                                               std::to_string(*asked.memory_bytes) +
                                               " is above the configured worker_memory_max " +
                                               std::to_string(*config.worker_memory_max));
  if (asked.memory_events == common::MemoryPolicy::kRecord &&
      config.memory_events == common::MemoryPolicy::kReject)
    throw Error("request.limit_above_max",
                "request.limits.memory_events \"record\" is weaker than the configured "
                "memory_events \"reject\"");
}

common::MemoryPolicy memory_policy(const common::RequestLimits& asked, const Config& config) {
  return asked.memory_events.value_or(config.memory_events);
}

}  // namespace assay::supervisor
