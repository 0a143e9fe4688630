// A model directory's content identity (Kiln-compatible), computed by reading every byte once.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/fsverity.h"
#include "common/json.h"
#include "fingerprint/model_fds.h"

namespace assay::fingerprint {

struct WeightFile {
  std::string path;  // relative to the model directory, as the index (or directory) names it
  std::uint64_t bytes = 0;
  std::string sha256;  // "sha256:<hex>"
  bool operator==(const WeightFile&) const = default;
};

// Exactly the identity Kiln publishes; nothing else belongs in it.
struct ModelIdentity {
  std::string id;
  std::string config_hash;
  std::string tokenizer_hash;
  std::optional<std::string> chat_template_hash;
  std::vector<WeightFile> weight_files;  // sorted by path bytes
  std::string content_sha256;
  bool operator==(const ModelIdentity&) const = default;
};

// A digest a previous fingerprint computed, with the file's state then: reused only when the
// file's (device, inode, size, mtime, ctime) now are exactly these, and its fs-verity digest too
// (both absent, or equal). Whoever can set a file's ctime back (root, the kernel's clock) could
// defeat the times; an unchanged state is what it trusts. Enabling fs-verity moves neither time,
// and a file with fs-verity can no longer change, so its digest is the stronger half of the key.
struct CacheEntry {
  std::string name;  // relative to the model directory
  std::uint64_t dev = 0, ino = 0, size = 0;
  std::int64_t mtime_ns = 0, ctime_ns = 0;
  // The file's fs-verity digest (common::measure_fsverity) when it has fs-verity.
  std::optional<std::string> fsverity_digest;
  std::string sha256;
  std::string job;  // the job that computed it
  std::string at;   // when (UTC, RFC 3339)
  bool operator==(const CacheEntry&) const = default;
};

// Parses `cache` of the worker input: [{name, dev, ino, size, mtime_ns, ctime_ns,
// [fsverity_digest], sha256, job, at}, ...], each name once; dev, ino and the times as decimal
// strings (they exceed 2^53). Throws Error(code) naming the entry.
std::vector<CacheEntry> parse_cache(const common::Json& value, const std::string& where,
                                    const std::string& code);

struct Options {
  // Files hashed at once; 0 = one per CPU, at most 8. Never more threads than files.
  unsigned threads = 0;
  // Cap on the summed read rate of all threads, in MiB/s; 0 = unlimited.
  double max_read_mib_per_second = 0;
  // Called with a file's relative path after its bytes were read and before its identity is
  // checked again. Lets tests change a file at the worst moment.
  std::function<void(const std::string& path)> after_read;
  // Files the supervisor opened: when set, every file is read through its descriptor (pread,
  // never reopened) and no path below model_dir is opened; a required file that is not listed
  // is Error("fingerprint.missing_fd"), an optional one counts as absent, and the shard listing
  // (no index, no model.safetensors) is the listed top-level *.safetensors names.
  std::optional<std::vector<ModelFd>> model_fds;
  // Digests known from earlier jobs; a file whose fstat matches its entry exactly is not read.
  std::vector<CacheEntry> cache;
  // Asks whether a file has fs-verity, on the descriptor it is read through (by default the
  // kernel): lets tests on a host without fs-verity stand in for it.
  std::function<std::optional<std::string>(int fd, const std::string& shown)> measure_fsverity =
      common::measure_fsverity;
  // One pass over the weights in a cold job: a shard that is not in the cache, has no fs-verity
  // and whose state is a sound key older than its writeback (FileDigest::storable) is not read.
  // Its digest is left to the worker that reads it next, which checks that its descriptor keeps
  // exactly this state before and after reading it (the supervisor completes the identity from
  // that worker's bytes_used: supervisor/pipelines/steps.h complete_fingerprint).
  bool defer_shards = false;
};

// How one hashed file's digest was obtained, with the file's state (its cache key).
struct FileDigest {
  CacheEntry state;  // job/at: the cache entry's when reused, empty when computed here
  bool from_cache = false;
  // A later run may reuse this digest: a weight shard whose state was a sound key, older than
  // the writeback of its dirty pages that came before it was read (reader.h, storable()).
  bool storable = false;
  // Not read here (Options::defer_shards): state.sha256 is empty.
  bool deferred = false;
};

struct Stats {
  std::uint64_t bytes = 0;  // every byte read: shards, config, tokenizer, template, index
  std::size_t files = 0;
  std::uint64_t cached_bytes = 0;  // bytes of files whose digest came from the cache (not read)
  std::size_t cached_files = 0;
  std::uint64_t deferred_bytes = 0;  // bytes of shards left to the next reader (not read)
  std::size_t deferred_files = 0;
  double seconds = 0;
  unsigned threads = 0;  // threads that actually hashed
};

struct Fingerprint {
  // With deferred shards, their weight_files sha256 and content_sha256 are empty.
  ModelIdentity identity;
  // Shards in the order the index names them (first occurrence), else in identity order.
  std::vector<std::string> shard_order;
  Stats stats;
  // Shards (in shard_order), then config, tokenizer and template: every file hashed or reused.
  std::vector<FileDigest> files;
};

// Computes the identity of `model_dir` (absolute or relative to the working directory).
// Throws common::Error with a `fingerprint.*` code naming the file for: a symlink in any path
// component, a non-regular file, an empty shard, two names for one (dev, inode), a missing
// required file or index-named shard, an invalid index or tokenizer_config.json, a non-ASCII or
// control character in the id or a shard path (where RFC 8785 and Kiln's ensure_ascii JSON
// differ), and a file that changed while it was read.
Fingerprint fingerprint_model(const std::filesystem::path& model_dir, std::string_view id,
                              const Options& options = {});

// The identity object: {id, config_hash, tokenizer_hash, chat_template_hash, weight_files,
// content_sha256}.
common::Json to_json(const ModelIdentity& identity);
// {name, dev, ino, size, mtime_ns, ctime_ns, [fsverity_digest], sha256, source:
// "computed"|"cache"|"deferred", job, at} (a deferred file's sha256 is null); dev, ino and the
// times as decimal strings; fsverity_digest only for a file with fs-verity; job and at are null for
// a digest computed in this run.
common::Json to_json(const FileDigest& file);

// sha256 of the canonical form of {id, config_hash, tokenizer_hash, chat_template_hash,
// weight_files}.
std::string content_sha256(const ModelIdentity& identity);

}  // namespace assay::fingerprint
