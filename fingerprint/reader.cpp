// Reading a model directory safely (reader.h): opening directories and files without following
// a symlink anywhere, refusing what is not a regular file or is one file under two names,
// reading through the supervisor's descriptors instead when given, and hashing a file in one
// sequential pass at a capped rate, then checking that it did not change meanwhile.
#include "fingerprint/reader.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <thread>
#include <utility>

#include "common/error.h"
#include "common/identity.h"

namespace assay::fingerprint {

using common::Error;
using common::UniqueFd;

namespace {

// A relative path below the model directory: no absolute path, no '.', '..' or empty part.
std::vector<std::string> split_relative(const std::string& rel) {
  require_plain_ascii("shard path", rel);
  if (rel.front() == '/')
    throw Error("fingerprint.bad_name", "shard path '" + rel + "' is absolute");
  std::vector<std::string> parts;
  std::size_t start = 0;
  for (;;) {
    std::size_t slash = rel.find('/', start);
    std::string part = rel.substr(start, slash == std::string::npos ? slash : slash - start);
    if (part.empty() || part == "." || part == "..")
      throw Error("fingerprint.bad_name",
                  "shard path '" + rel + "' has an empty, '.' or '..' component");
    parts.push_back(std::move(part));
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  return parts;
}

bool same_file_state(const struct stat& a, const struct stat& b) {
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino && a.st_size == b.st_size &&
         a.st_mtim.tv_sec == b.st_mtim.tv_sec && a.st_mtim.tv_nsec == b.st_mtim.tv_nsec &&
         a.st_ctim.tv_sec == b.st_ctim.tv_sec && a.st_ctim.tv_nsec == b.st_ctim.tv_nsec;
}

// Filesystems whose shared-mapping writes fault on a clean page and move ctime there
// (page_mkwrite calls file_update_time): once written back, no page can change unseen. tmpfs,
// ramfs and network filesystems are not among them (tmpfs pages are never write-protected; an
// NFS client does not see another host's writes).
}  // namespace

bool ctime_follows_mapped_writes(long type) {
  return type == EXT4_SUPER_MAGIC || type == XFS_SUPER_MAGIC || type == BTRFS_SUPER_MAGIC;
}

std::int64_t realtime_ns() {
  struct timespec t {};
  ::clock_gettime(CLOCK_REALTIME, &t);
  return static_cast<std::int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

void require_plain_ascii(std::string_view what, std::string_view value) {
  if (value.empty()) throw Error("fingerprint.bad_name", std::string(what) + " is empty");
  for (unsigned char c : value)
    if (c < 0x20 || c > 0x7e)
      throw Error("fingerprint.bad_name",
                  std::string(what) + " '" + std::string(value) +
                      "' has a non-ASCII or control byte; its canonical JSON would differ "
                      "from Kiln's ensure_ascii form");
}

UniqueFd open_dir_no_symlinks(int parent, const std::string& shown_parent,
                              const std::vector<std::string>& parts) {
  UniqueFd current(::dup(parent));
  if (!current) common::throw_errno("fingerprint.open", "dup directory " + shown_parent, errno);
  std::string shown = shown_parent;
  for (const auto& part : parts) {
    shown = (shown == "/") ? "/" + part : shown + "/" + part;
    struct stat st {};
    if (::fstatat(current.get(), part.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) throw Error("fingerprint.missing", shown + " does not exist");
      common::throw_errno("fingerprint.stat", "stat " + shown, errno);
    }
    if (S_ISLNK(st.st_mode))
      throw Error("fingerprint.symlink", shown + " is a symbolic link; refusing to follow it");
    if (!S_ISDIR(st.st_mode))
      throw Error("fingerprint.not_directory", shown + " is not a directory");
    int fd = ::openat(current.get(), part.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) common::throw_errno("fingerprint.open", "open directory " + shown, errno);
    current = UniqueFd(fd);
  }
  return current;
}

void RateLimiter::acquire(std::size_t n) {
  if (bytes_per_second_ <= 0) return;
  Clock::time_point start;
  {
    std::lock_guard lock(mutex_);
    start = std::max(Clock::now(), next_);
    next_ = start + std::chrono::duration_cast<Clock::duration>(
                        std::chrono::duration<double>(n / bytes_per_second_));
  }
  std::this_thread::sleep_until(start);
}

int ModelReader::dir_for(const std::vector<std::string>& parts) {
  std::string key;
  for (std::size_t i = 0; i + 1 < parts.size(); ++i) key += (i ? "/" : "") + parts[i];
  auto it = dirs.find(key);
  if (it != dirs.end()) return it->second.get();
  std::vector<std::string> dir_parts(parts.begin(), parts.end() - 1);
  UniqueFd fd = open_dir_no_symlinks(root.get(), model_dir, dir_parts);
  int raw = fd.get();
  dirs.emplace(key, std::move(fd));
  return raw;
}

bool ModelReader::present(const std::string& name) {
  if (by_fds()) return find_model_fd(*options.model_fds, name) >= 0;
  struct stat st {};
  if (::fstatat(root.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) return true;
  if (errno != ENOENT)
    common::throw_errno("fingerprint.stat", "stat " + model_dir + "/" + name, errno);
  return false;
}

std::optional<FileRef> ModelReader::probe(const std::string& rel, bool required) {
  auto parts = split_relative(rel);
  FileRef f;
  f.rel = rel;
  f.shown = model_dir + "/" + rel;
  if (by_fds()) {
    f.given_fd = find_model_fd(*options.model_fds, rel);
    if (f.given_fd < 0) {
      if (!required) return std::nullopt;
      throw Error("fingerprint.missing_fd",
                  f.shown + " is needed but is not among the model_fds the supervisor passed");
    }
    check_given_fd(f);
  } else {
    f.dirfd = dir_for(parts);
    f.leaf = parts.back();
    if (::fstatat(f.dirfd, f.leaf.c_str(), &f.before, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) {
        if (!required) return std::nullopt;
        throw Error("fingerprint.missing", f.shown + " does not exist");
      }
      common::throw_errno("fingerprint.stat", "stat " + f.shown, errno);
    }
  }
  if (S_ISLNK(f.before.st_mode))
    throw Error("fingerprint.symlink", f.shown + " is a symbolic link; refusing to follow it");
  if (!S_ISREG(f.before.st_mode))
    throw Error("fingerprint.not_regular", f.shown + " is not a regular file");
  auto key = std::make_pair(f.before.st_dev, f.before.st_ino);
  auto [it, inserted] = seen_names.emplace(key, rel);
  if (!inserted)
    throw Error("fingerprint.duplicate_inode", f.shown + " and " + model_dir + "/" + it->second +
                                                   " are two names for one file (same device "
                                                   "and inode)");
  return f;
}

void ModelReader::check_given_fd(FileRef& f) {
  std::string which = f.shown + " (fd " + std::to_string(f.given_fd) + ")";
  int flags = ::fcntl(f.given_fd, F_GETFL);
  if (flags < 0) common::throw_errno("fingerprint.bad_fd", "fcntl " + which, errno);
  if ((flags & O_PATH) == O_PATH || (flags & O_ACCMODE) == O_WRONLY)
    throw Error("fingerprint.bad_fd", which + " is not open for reading");
  if (::fstat(f.given_fd, &f.before) != 0)
    common::throw_errno("fingerprint.bad_fd", "fstat " + which, errno);
}

UniqueFd ModelReader::open_checked(const FileRef& f) {
  if (by_fds()) {
    // A second descriptor of the same open file: closing it leaves the supervisor's intact.
    UniqueFd out(::fcntl(f.given_fd, F_DUPFD_CLOEXEC, 3));
    if (!out) common::throw_errno("fingerprint.bad_fd", "dup fd of " + f.shown, errno);
    return out;
  }
  int fd = ::openat(f.dirfd, f.leaf.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    if (errno == ELOOP)
      throw Error("fingerprint.symlink", f.shown + " is a symbolic link; refusing to follow it");
    common::throw_errno("fingerprint.open", "open " + f.shown, errno);
  }
  UniqueFd out(fd);
  struct stat now {};
  if (::fstat(fd, &now) != 0) common::throw_errno("fingerprint.stat", "fstat " + f.shown, errno);
  if (!same_file_state(f.before, now))
    throw Error("fingerprint.changed", f.shown + " changed between stat and open");
  return out;
}

void ModelReader::check_unchanged(const FileRef& f, int fd, std::uint64_t got) {
  if (options.after_read) options.after_read(f.rel);
  struct stat after {};
  if (::fstat(fd, &after) != 0) common::throw_errno("fingerprint.stat", "fstat " + f.shown, errno);
  if (!same_file_state(f.before, after) || got != static_cast<std::uint64_t>(f.before.st_size))
    throw Error("fingerprint.changed",
                f.shown + " changed while it was read (size, mtime, ctime or inode differ; " +
                    std::to_string(f.before.st_size) + " bytes at stat, " + std::to_string(got) +
                    " read)");
  // A new file renamed over the name leaves our descriptor intact: look at the name too.
  // With model_fds the descriptor is the file; there is no name to look at.
  if (by_fds()) return;
  struct stat by_name {};
  if (::fstatat(f.dirfd, f.leaf.c_str(), &by_name, AT_SYMLINK_NOFOLLOW) != 0 ||
      !same_file_state(f.before, by_name))
    throw Error("fingerprint.changed", f.shown + " was replaced or removed while it was read");
}

void ModelReader::write_back(FileRef& f) {
  f.sound_key = false;
  UniqueFd fd = open_checked(f);
  struct statfs fsinfo {};
  if (::fstatfs(fd.get(), &fsinfo) != 0 ||
      !ctime_follows_mapped_writes(static_cast<long>(fsinfo.f_type)))
    return;
  f.written_back_ns = realtime_ns();
  if (::sync_file_range(
          fd.get(), 0, 0,
          SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER) != 0)
    return;
  struct stat now {};
  if (::fstat(fd.get(), &now) != 0)
    common::throw_errno("fingerprint.stat", "fstat " + f.shown, errno);
  if (!same_file_state(f.before, now))
    throw Error("fingerprint.changed", f.shown +
                                           " changed before it was read (size, mtime, ctime "
                                           "or inode differ from its first stat)");
  f.sound_key = true;
}

void ModelReader::measure_fsverity(FileRef& f) {
  if (by_fds()) {
    f.fsverity = options.measure_fsverity(f.given_fd, f.shown);
    return;
  }
  UniqueFd fd = open_checked(f);
  f.fsverity = options.measure_fsverity(fd.get(), f.shown);
}

std::string ModelReader::hash_file(const FileRef& f, std::vector<char>& buf, std::string* keep) {
  UniqueFd fd = open_checked(f);
  ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  common::Sha256 h;
  std::uint64_t got = 0;
  for (;;) {
    if (cancelled.load(std::memory_order_relaxed))
      throw Error("fingerprint.cancelled", "cancelled after another file failed");
    limiter.acquire(buf.size());
    // pread: a given descriptor's file offset may be shared with the supervisor.
    ssize_t n = ::pread(fd.get(), buf.data(), buf.size(), static_cast<off_t>(got));
    if (n < 0) {
      if (errno == EINTR) continue;
      common::throw_errno("fingerprint.read", "read " + f.shown, errno);
    }
    if (n == 0) break;
    h.update(buf.data(), static_cast<std::size_t>(n));
    if (keep) {
      if (keep->size() + static_cast<std::size_t>(n) > kMaxJsonBytes)
        throw Error("fingerprint.too_large",
                    f.shown + " is larger than " + std::to_string(kMaxJsonBytes) + " bytes");
      keep->append(buf.data(), static_cast<std::size_t>(n));
    }
    got += static_cast<std::uint64_t>(n);
  }
  check_unchanged(f, fd.get(), got);
  return common::identity(h.finish());
}

std::string ModelReader::read_json_file(const FileRef& f, std::vector<char>& buf,
                                        std::uint64_t& bytes) {
  if (static_cast<std::uint64_t>(f.before.st_size) > kMaxJsonBytes)
    throw Error("fingerprint.too_large", f.shown + " has " + std::to_string(f.before.st_size) +
                                             " bytes, more than " + std::to_string(kMaxJsonBytes));
  std::string text;
  hash_file(f, buf, &text);
  bytes += text.size();
  return text;
}

}  // namespace assay::fingerprint
