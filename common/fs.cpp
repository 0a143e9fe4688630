#include "common/fs.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <random>
#include <thread>
#include <vector>

#include "common/error.h"

namespace assay::common {

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) ::close(fd_);
}

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

UniqueFd open_nofollow(const std::filesystem::path& path, int flags, mode_t mode) {
  int fd = ::open(path.c_str(), flags | O_NOFOLLOW | O_CLOEXEC, mode);
  if (fd < 0) {
    int err = errno;
    // O_NOFOLLOW's ELOOP says "too many levels of symbolic links"; what happened is plainer.
    struct stat st {};
    if (err == ELOOP && ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode))
      throw Error("fs.open", path.string() + " is a symlink; links are not followed");
    throw_errno("fs.open", "open " + path.string(), err);
  }
  return UniqueFd(fd);
}

UniqueFd open_regular(const std::filesystem::path& path) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer. It changes nothing
  // for a regular file.
  UniqueFd fd = open_nofollow(path, O_RDONLY | O_NONBLOCK);
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) throw_errno("fs.stat", "stat " + path.string(), errno);
  if (!S_ISREG(st.st_mode)) throw Error("fs.not_regular", path.string() + " is not a regular file");
  return fd;
}

std::string read_file(const std::filesystem::path& path, std::size_t max_bytes) {
  UniqueFd fd = open_regular(path);
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) throw_errno("fs.stat", "stat " + path.string(), errno);
  if (static_cast<std::uint64_t>(st.st_size) > max_bytes)
    throw Error("fs.too_large", path.string() + " has " + std::to_string(st.st_size) +
                                    " bytes, more than the limit of " + std::to_string(max_bytes));
  std::string out;
  out.resize(static_cast<std::size_t>(st.st_size));
  std::size_t got = 0;
  for (;;) {
    if (got == out.size()) out.resize(out.size() + 4096);  // file grew: read on, up to the limit
    ssize_t n = ::read(fd.get(), out.data() + got, out.size() - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("fs.read", "read " + path.string(), errno);
    }
    if (n == 0) break;
    got += static_cast<std::size_t>(n);
    if (got > max_bytes)
      throw Error("fs.too_large", path.string() + " grew past the limit of " +
                                      std::to_string(max_bytes) + " bytes");
  }
  out.resize(got);
  return out;
}

void fsync_directory(const std::filesystem::path& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw_errno("fs.open", "open directory " + dir.string(), errno);
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) throw_errno("fs.fsync", "fsync directory " + dir.string(), err);
}

void atomic_write_file(const std::filesystem::path& path, std::string_view content, mode_t mode) {
  std::filesystem::path dir = path.parent_path();
  std::random_device rd;
  std::string tmp_name = "." + path.filename().string() + ".tmp." + std::to_string(::getpid()) +
                         "." + std::to_string(rd());
  std::filesystem::path tmp = dir / tmp_name;
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
  if (fd < 0) throw_errno("fs.open", "create " + tmp.string(), errno);
  auto fail = [&](const std::string& what) {
    int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    throw_errno("fs.write", what + " " + tmp.string(), err);
  };
  if (::fchmod(fd, mode) != 0) fail("chmod");
  std::size_t done = 0;
  while (done < content.size()) {
    ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("write");
    }
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0) fail("fsync");
  if (::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw_errno("fs.write", "close " + tmp.string(), err);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw_errno("fs.rename", "rename " + tmp.string() + " to " + path.string(), err);
  }
  fsync_directory(dir);
}

void write_unsynced(const std::filesystem::path& path, std::string_view content, mode_t mode) {
  UniqueFd fd = open_nofollow(path, O_WRONLY | O_CREAT | O_TRUNC, mode);
  if (::fchmod(fd.get(), mode) != 0) throw_errno("fs.write", "chmod " + path.string(), errno);
  std::size_t off = 0;
  while (off < content.size()) {
    ssize_t n = ::write(fd.get(), content.data() + off, content.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw_errno("fs.write", "write " + path.string(), errno);
    off += static_cast<std::size_t>(n);
  }
  // tmpfs and some network filesystems report a full disk only at close.
  if (::close(fd.release()) != 0) throw_errno("fs.write", "close " + path.string(), errno);
}

void replace_file_fast(const std::filesystem::path& path, std::string_view content, mode_t mode) {
  auto tmp = path;
  tmp += ".tmp";
  try {
    write_unsynced(tmp, content, mode);
  } catch (const Error&) {
    ::unlink(tmp.c_str());
    throw;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw_errno("fs.rename", "rename " + tmp.string(), err);
  }
}

void fsync_together(const std::vector<std::filesystem::path>& paths) {
  std::vector<UniqueFd> fds;
  for (const auto& p : paths) fds.push_back(open_nofollow(p, O_RDONLY));
  std::vector<int> errors(paths.size(), 0);
  {
    std::vector<std::jthread> threads;
    for (std::size_t i = 1; i < fds.size(); ++i)
      threads.emplace_back([&, i] { errors[i] = ::fsync(fds[i].get()) == 0 ? 0 : errno; });
    if (!fds.empty()) errors[0] = ::fsync(fds[0].get()) == 0 ? 0 : errno;
  }  // the jthreads join here
  for (std::size_t i = 0; i < paths.size(); ++i)
    if (errors[i] != 0) throw_errno("fs.fsync", "fsync " + paths[i].string(), errors[i]);
}

}  // namespace assay::common
