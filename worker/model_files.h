// The model files the oracle computes with, each read once into memory this process owns and
// hashed on the way, so that what it reports (bytes_used) is exactly what its tensors, config
// and tokenizer were built from. A weight file with fs-verity is the exception: the kernel refuses
// every write to it and checks each page against its Merkle tree as it is read, so it is mapped
// read-only instead of copied, and its fs-verity digest (not a sha256) names its bytes. Read by
// name below the model directory, or only through the descriptors the supervisor opened
// (model_fds).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/fs.h"
#include "common/json.h"
#include "fingerprint/model_fds.h"

namespace assay::oracle {

// A whole file in anonymous, page-aligned memory of this process, so that no other process can
// change it underneath; or, for a file with fs-verity, a read-only shared mapping of it, which no
// one can change either. Read-only once read.
class FileImage {
 public:
  FileImage(std::byte* data, std::size_t size);
  ~FileImage();
  FileImage(const FileImage&) = delete;
  FileImage& operator=(const FileImage&) = delete;

  std::span<const std::byte> bytes() const { return {data_, size_}; }
  std::string_view text() const { return {reinterpret_cast<const char*>(data_), size_}; }
  // "sha256:<hex>" of exactly bytes(), computed as they were read. A mapped fs-verity file is
  // never hashed here: Error("oracle.internal").
  const std::string& sha256() const { return digest_.get(); }
  // Set when the file is mapped because it has fs-verity: its digest, as measure_fsverity says.
  const std::optional<std::string>& fsverity_digest() const { return fsverity_; }

 private:
  friend class ModelFiles;
  std::byte* data_;
  std::size_t size_;
  std::shared_future<std::string> digest_;
  std::optional<std::string> fsverity_;
};

struct FileRecord {
  std::uint64_t bytes = 0;
  std::shared_future<std::string> digest;      // unset when fsverity_digest is set
  std::optional<std::string> fsverity_digest;  // the file was mapped, bound by fs-verity
  const std::string& sha256() const { return digest.get(); }
};

// The fs-verity digest of an open file, or nullopt where it has none (common::measure_fsverity).
using VerityProbe = std::function<std::optional<std::string>(int fd, const std::string& shown)>;

class ModelFiles {
 public:
  // Files opened by name below `dir` (the leaf never through a symlink).
  static ModelFiles from_directory(const std::filesystem::path& dir);
  // Files read only through the given descriptors (pread; never reopened, no path below `dir`
  // opened). `dir` names the model in messages.
  static ModelFiles from_fds(const std::filesystem::path& dir,
                             std::vector<fingerprint::ModelFd> fds);

  const std::filesystem::path& dir() const { return dir_; }
  // Whether `name` exists (in any form) or, with model_fds, was passed.
  bool has(const std::string& name) const;
  // The file read whole and hashed the first time; the same image every later time. Throws
  // Error("fs.too_large") past max_bytes, Error("model.missing_fd") for a name not passed.
  std::shared_ptr<const FileImage> read(const std::string& name, std::size_t max_bytes);
  // Large files (shards), read `threads` at a time and each hashed as it is read, so that every
  // digest is known when this returns (none competes with the forward for a core); not kept
  // here, so their memory goes with the last holder. A file whose descriptor has fs-verity is
  // mapped instead of read, and not hashed. Each name may be read once.
  std::vector<std::shared_ptr<const FileImage>> read_large(const std::vector<std::string>& names,
                                                           unsigned threads);
  // Size and digest of every file read so far, by name.
  const std::map<std::string, FileRecord>& records() const { return records_; }
  // Replaces how read_large asks whether a file has fs-verity (by default the kernel, through
  // FS_IOC_MEASURE_VERITY): lets tests on a host without fs-verity take the mapped path.
  void measure_verity_with(VerityProbe probe) { measure_verity_ = std::move(probe); }
  // Files whose digest the fingerprint left to this reader (input "unchanged_files"): each is
  // read and hashed (never mapped), and its descriptor must have exactly the given state before
  // and after the read, else Error("model.file_changed"). So its digest here is the content of
  // the state the fingerprint saw, and the supervisor may complete the identity with it.
  void expect_unchanged(std::vector<fingerprint::FileState> states);

 private:
  ModelFiles() = default;
  std::shared_ptr<FileImage> fetch(const std::string& name, std::size_t max_bytes, bool hash_now,
                                   bool may_map) const;

  std::filesystem::path dir_;
  common::UniqueFd dirfd_;
  std::optional<std::vector<fingerprint::ModelFd>> fds_;
  std::map<std::string, std::shared_ptr<const FileImage>> cache_;
  std::map<std::string, FileRecord> records_;
  VerityProbe measure_verity_;
  std::map<std::string, fingerprint::FileState> unchanged_;
};

// CPUs this process may run on (its affinity mask), at most 8: read and hash threads.
unsigned io_threads();

// output.json's "bytes_used": {"weight_files": [{path, bytes, sha256}] sorted by path bytes,
// "config_hash", "tokenizer_hash" (null unless tokenizer.json was read)}, defined as the
// fingerprint's model identity defines the same fields, from the bytes this process read. A
// mapped fs-verity weight file is {path, bytes, fsverity_digest, "bound_by": "fs-verity"}.
common::Json bytes_used(const ModelFiles& files, const std::vector<std::string>& weight_files);

}  // namespace assay::oracle
