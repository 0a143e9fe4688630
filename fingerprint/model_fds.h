// Model files the supervisor opened for a worker: `model_fds` in the worker inputs. A worker
// given them reads the model only through these descriptors and never opens a path below
// model_dir, so it reads exactly what the submitter was allowed to read.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <optional>
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

// A file's state as the fingerprint saw it (its cache key without the digest): a worker given it
// for a file whose digest the fingerprint left to it (input "unchanged_files") checks that its
// descriptor has exactly this state before and after reading the file.
struct FileState {
  std::string name;  // relative to model_dir
  std::uint64_t dev = 0, ino = 0, size = 0;
  std::int64_t mtime_ns = 0, ctime_ns = 0;
  bool operator==(const FileState&) const = default;
};

// One state's fields of `entry` (a cache entry or an unchanged_files entry; other keys are the
// caller's): name a non-empty string; dev, ino, mtime_ns and ctime_ns decimal strings within
// their types; size a non-negative integer. Throws common::Error(code) naming `where`.field.
FileState parse_file_state(const common::Json& entry, const std::string& where,
                           const std::string& code);
// [{"name", "dev", "ino", "size", "mtime_ns", "ctime_ns"}, ...]: dev, ino and the times as
// decimal strings (they exceed 2^53), each name once. Throws common::Error(code) naming the entry.
std::vector<FileState> parse_file_states(const common::Json& value, const std::string& where,
                                         const std::string& code);
// `name`'s state from fstat.
FileState file_state(std::string name, const struct stat& st);
// What differs between `want` and `got` ("inode 12 is now 13; mtime ... is now ..."), or "".
std::string state_difference(const FileState& want, const FileState& got);

// An open file's state as a sound key (README: "What a hit trusts"), taken as the fingerprint
// worker takes it before it looks a shard up: the file's dirty pages written back
// (sync_file_range, which write-protects them in every mapping), then fstat and its fs-verity
// digest. nullopt when the state is no sound key: a filesystem whose ctime does not follow
// mapped writes, or a failed writeback. The supervisor reuses a whole fingerprint on such states.
struct SettledState {
  FileState state;
  std::optional<std::string> fsverity_digest;
  std::int64_t written_back_ns = 0;  // CLOCK_REALTIME just before the writeback
  // Whether mtime and ctime are both older than the writeback by more than the coarse clock's
  // tick: a write since the writeback would have moved them.
  bool settled() const;
};
std::optional<SettledState> settled_state(int fd, std::string name);

// Writes back the dirty pages of every regular file at the top of `dir` (sync_file_range, as
// settled_state does), so that a settled_state taken afterwards finds them clean and returns at
// once: the supervisor runs this off its event loop first (a model copied in just before a job
// has about 0.6 s of writeback per GiB). Best effort, and nothing else: no link is followed (in
// any component of `dir`, nor at the top of it), a
// file is opened for reading only after an O_PATH descriptor showed it is regular (a device node
// or FIFO swapped in is never opened), at most kMaxWriteBackFiles files; errors are ignored
// (the settle that follows is what counts). Returns how many files it wrote back.
inline constexpr std::size_t kMaxWriteBackFiles = 4096;
std::size_t write_back_directory(const std::string& dir);

}  // namespace assay::fingerprint
