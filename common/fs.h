// Files: atomic replacement and no-follow opening.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <sys/types.h>

namespace assay::common {

// Writes `content` to a temp file beside `path`, fsyncs it, renames it over `path` and fsyncs
// the directory. On any failure the temp file is removed and `path` is untouched.
void atomic_write_file(const std::filesystem::path& path, std::string_view content,
                       mode_t mode = 0644);

// A file descriptor that closes itself.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd();
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  int get() const { return fd_; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// open(2) with O_NOFOLLOW | O_CLOEXEC added; throws Error("fs.open") naming the path.
UniqueFd open_nofollow(const std::filesystem::path& path, int flags, mode_t mode = 0);
// Opens a regular file for reading without following a final symlink and without blocking on a
// FIFO or device; throws Error("fs.not_regular") for anything but a regular file.
UniqueFd open_regular(const std::filesystem::path& path);
// Reads a whole regular file (no-follow, see open_regular), refusing files larger than max_bytes.
std::string read_file(const std::filesystem::path& path, std::size_t max_bytes);
void fsync_directory(const std::filesystem::path& dir);
// Creates or truncates `path` and writes `content` without fsync (the caller fsyncs a group).
void write_unsynced(const std::filesystem::path& path, std::string_view content, mode_t mode);
// temp file + rename without fsync: atomic for readers and across a crash of the process, not
// across a power cut. For files whose loss only means re-running a job.
void replace_file_fast(const std::filesystem::path& path, std::string_view content, mode_t mode);
// fsyncs all of `paths` concurrently and throws Error("fs.fsync") naming the first that failed.
// On ext4 concurrent fsyncs share one journal commit; one after another each pays its own.
void fsync_together(const std::vector<std::filesystem::path>& paths);

}  // namespace assay::common
