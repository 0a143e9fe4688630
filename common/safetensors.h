// safetensors: a validating zero-copy reader (mmap) and an atomic writer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace assay::common {

enum class Dtype { kBool, kU8, kI8, kI16, kU16, kI32, kU32, kI64, kU64, kF16, kBF16, kF32, kF64 };

std::size_t dtype_size(Dtype d);
std::string_view dtype_name(Dtype d);  // "F32", "BF16", ...
// Throws Error("safetensors.dtype") for an unknown name.
Dtype dtype_from_name(std::string_view name);

struct TensorView {
  std::string name;
  Dtype dtype;
  std::vector<std::int64_t> shape;
  const std::byte* data;  // points into the mapping (or the caller's buffer); null from a header
  std::size_t nbytes;
  std::uint64_t offset = 0;  // of the first byte in the data section
  std::int64_t numel() const;
};

// Parses and validates a safetensors image held in memory. Every check happens before any
// tensor is exposed: header length bound, strict JSON header, known dtypes, shape x dtype size
// == end - begin, offsets inside the buffer, no overlaps, __metadata__ strings only.
// Throws Error("safetensors.invalid", ...) naming the tensor and the reason.
struct SafetensorsIndex {
  std::vector<TensorView> tensors;  // sorted by data offset
  std::map<std::string, std::string> metadata;
  const TensorView* find(std::string_view name) const;
};
SafetensorsIndex parse_safetensors(std::span<const std::byte> image,
                                   std::size_t max_header_bytes = 100 * 1024 * 1024);
// The same checks from the header alone, read with pread from `fd` (a file of `file_size` bytes,
// as fstat gave it): names, dtypes, shapes and offsets without reading the data. Views' data is
// null. Throws Error("safetensors.invalid") as above, and when the file ends early.
SafetensorsIndex read_safetensors_header(int fd, std::uint64_t file_size,
                                         std::size_t max_header_bytes = 100 * 1024 * 1024);

// A read-only mmap of a safetensors file; views stay valid while the object lives.
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::filesystem::path& path);
  // The same over a descriptor someone else opened (it stays open; `label` names it in errors).
  static SafetensorsFile open_fd(int fd, const std::string& label);
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::vector<TensorView>& tensors() const { return index_.tensors; }
  const std::map<std::string, std::string>& metadata() const { return index_.metadata; }
  const TensorView* find(std::string_view name) const { return index_.find(name); }
  const std::filesystem::path& path() const { return path_; }
  std::size_t file_size() const { return size_; }
  // The whole file's bytes (header and data), e.g. to hash it without reading it again.
  std::span<const std::byte> image() const { return {static_cast<const std::byte*>(map_), size_}; }

 private:
  SafetensorsFile() = default;
  std::filesystem::path path_;
  void* map_ = nullptr;
  std::size_t size_ = 0;
  SafetensorsIndex index_;
};

struct TensorToWrite {
  std::string name;
  Dtype dtype;
  std::vector<std::int64_t> shape;
  std::span<const std::byte> data;
};

// Serialises tensors (in the given order) with the header padded with spaces to 8 bytes.
std::string serialize_safetensors(const std::vector<TensorToWrite>& tensors,
                                  const std::map<std::string, std::string>& metadata = {});
// A safetensors file whose tensor bytes arrive in pieces, in the order of `layout`, so that a
// large tensor never has to be held whole (the oracle's captures). The file appears at `path`
// only on finish(): written to a temp file in the same directory, fsynced, renamed; a writer
// destroyed before finish() removes its temp file.
struct TensorLayout {
  std::string name;
  Dtype dtype;
  std::vector<std::int64_t> shape;
};
class SafetensorsStreamWriter {
 public:
  SafetensorsStreamWriter(std::filesystem::path path, const std::vector<TensorLayout>& layout,
                          const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsStreamWriter();
  SafetensorsStreamWriter(const SafetensorsStreamWriter&) = delete;
  SafetensorsStreamWriter& operator=(const SafetensorsStreamWriter&) = delete;
  // Appends data bytes; throws Error("safetensors.write") past the declared total.
  void write(std::span<const std::byte> bytes);
  // Throws Error("safetensors.write") unless exactly the declared bytes arrived.
  void finish();

 private:
  std::filesystem::path path_, tmp_;
  int fd_ = -1;
  std::uint64_t expected_ = 0, written_ = 0;
};

// serialize_safetensors + atomic_write_file.
void write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace assay::common
