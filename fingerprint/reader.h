// Private to the fingerprint library: one fingerprint's safe view of a model directory. Every
// file is located and lstat'ed (FileRef) before a byte is read; ModelReader opens directories and
// files without following symlinks (or reads the supervisor's descriptors), hashes a file once,
// sequentially, under a shared rate limit, and refuses a file that changed while it was read.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/fs.h"
#include "fingerprint/fingerprint.h"

namespace assay::fingerprint {

// Measured here: 64 KiB reads cost a quarter of the kernel time of 256 KiB-1 MiB reads (the
// copy stays cache-hot for the hash) and match openssl dgst.
constexpr std::size_t kReadChunk = 64 * 1024;
constexpr std::size_t kMaxJsonBytes = 64 * 1024 * 1024;

// Printable ASCII only: there RFC 8785 and json.dumps(ensure_ascii=True) write the same bytes.
// Throws Error("fingerprint.bad_name") naming `what`.
void require_plain_ascii(std::string_view what, std::string_view value);

// Opens a directory one component at a time, refusing a symlink anywhere on the way.
common::UniqueFd open_dir_no_symlinks(int parent, const std::string& shown_parent,
                                      const std::vector<std::string>& parts);

// One file of the model, checked (lstat) before anything is read.
struct FileRef {
  std::string rel;    // as it appears in the identity or error messages
  std::string shown;  // model_dir/rel, for error messages
  int dirfd = -1;     // borrowed from Run::dirs
  std::string leaf;
  int given_fd = -1;  // the supervisor's descriptor (Options::model_fds); then dirfd is unused
  struct stat before {};
  std::optional<std::string> fsverity;  // set by ModelReader::measure_fsverity
  // Set by ModelReader::write_back: whether (dev, ino, size, mtime, ctime) is a sound cache key
  // for this file now, and the CLOCK_REALTIME (ns) just before its dirty pages were written back.
  bool sound_key = false;
  std::int64_t written_back_ns = 0;
};

class RateLimiter {
 public:
  explicit RateLimiter(double mib_per_second) : bytes_per_second_(mib_per_second * 1048576.0) {}
  // Reserves a slot for n bytes and sleeps until it starts; the first chunk goes at once.
  void acquire(std::size_t n);

 private:
  using Clock = std::chrono::steady_clock;
  double bytes_per_second_;
  std::mutex mutex_;
  Clock::time_point next_{};
};

struct ModelReader {
  std::string model_dir;
  common::UniqueFd root;
  std::map<std::string, common::UniqueFd> dirs;  // by relative directory path ("" = root)
  std::map<std::pair<dev_t, ino_t>, std::string> seen_names;
  const Options& options;
  RateLimiter limiter;
  std::atomic<bool> cancelled{false};

  explicit ModelReader(const Options& o) : options(o), limiter(o.max_read_mib_per_second) {}

  bool by_fds() const { return options.model_fds.has_value(); }
  // The directory holding `parts` (a relative path split), opened once and kept in `dirs`.
  int dir_for(const std::vector<std::string>& parts);
  // True if the top-level name exists in any form (a symlink too: probe() then refuses it).
  bool present(const std::string& name);
  // Stats `rel` without following links; nullopt if it does not exist and is optional.
  std::optional<FileRef> probe(const std::string& rel, bool required);
  // The descriptor is what the supervisor opened: readable, and fstat describes it.
  void check_given_fd(FileRef& f);
  // Opens `f` (or duplicates its given descriptor), refusing it if it changed since probe().
  common::UniqueFd open_checked(const FileRef& f);
  // After reading `got` bytes: the file, and the name, are still what probe() saw.
  void check_unchanged(const FileRef& f, int fd, std::uint64_t got);
  // Sets f.fsverity: the file's fs-verity digest, measured on the descriptor it is read through
  // (the given one, or one opened and checked as for reading), or none.
  void measure_fsverity(FileRef& f);
  // Writes back `f`'s dirty pages (sync_file_range), then sets f.sound_key: true only on a
  // filesystem whose shared-mapping writes move ctime once a page is clean again (ext2/3/4, XFS,
  // Btrfs), where the writeback succeeded and the file's state is still what probe() saw.
  // Without it, a write into a page a shared mapping already dirtied keeps both times (tmpfs
  // never moves them), and the state would name old bytes. Throws Error("fingerprint.changed")
  // when the state moved since probe().
  void write_back(FileRef& f);
  // Reads the file once, in large sequential chunks, feeding the hash (and `keep` if given).
  std::string hash_file(const FileRef& f, std::vector<char>& buf, std::string* keep = nullptr);
  // A JSON file's text (at most kMaxJsonBytes), hashed as it is read; adds its size to `bytes`.
  std::string read_json_file(const FileRef& f, std::vector<char>& buf, std::uint64_t& bytes);
};

// The cache key of a probed file: its name and (dev, ino, size, mtime, ctime); no digest.
CacheEntry state_of(const FileRef& f);
// The cached digest of `f` when its key is sound (write_back) and its entry's state equals the
// file's state exactly.
const CacheEntry* cached(const std::vector<CacheEntry>& cache, const FileRef& f);
// Whether a digest of `f` computed in this run may be kept for later runs: a sound key whose
// mtime and ctime are older than the writeback by more than the coarse clock's tick could hide
// (kRacyNs), so that no write since the writeback kept them.
bool storable(const FileRef& f);
constexpr std::int64_t kRacyNs = 2'000'000'000;
// Whether the filesystem of this f_type moves a file's ctime on the first write through a mapping
// after its pages were written back (ext2/3/4, XFS, Btrfs): there a file's state is a sound key.
bool ctime_follows_mapped_writes(long type);
// CLOCK_REALTIME in nanoseconds, the clock of st_mtim and st_ctim.
std::int64_t realtime_ns();

}  // namespace assay::fingerprint
