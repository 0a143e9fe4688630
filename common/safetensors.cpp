#include "common/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include "common/error.h"
#include "common/fs.h"
#include "common/json.h"

namespace assay::common {
namespace {

struct DtypeInfo {
  Dtype dtype;
  std::string_view name;
  std::size_t size;
};

constexpr DtypeInfo kDtypes[] = {
    {Dtype::kBool, "BOOL", 1}, {Dtype::kU8, "U8", 1},     {Dtype::kI8, "I8", 1},
    {Dtype::kI16, "I16", 2},   {Dtype::kU16, "U16", 2},   {Dtype::kI32, "I32", 4},
    {Dtype::kU32, "U32", 4},   {Dtype::kI64, "I64", 8},   {Dtype::kU64, "U64", 8},
    {Dtype::kF16, "F16", 2},   {Dtype::kBF16, "BF16", 2}, {Dtype::kF32, "F32", 4},
    {Dtype::kF64, "F64", 8},
};

const DtypeInfo& info(Dtype d) {
  for (const auto& i : kDtypes)
    if (i.dtype == d) return i;
  throw Error("safetensors.dtype", "unknown dtype value");
}

[[noreturn]] void invalid(const std::string& message) {
  throw Error("safetensors.invalid", "invalid safetensors: " + message);
}

std::uint64_t read_le64(const std::byte* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<std::uint8_t>(p[i]);
  return v;
}

std::uint64_t checked_offset(const Json& v, const std::string& name) {
  if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<std::int64_t>() >= 0))
    invalid("tensor \"" + name + "\": data_offsets must be non-negative integers");
  return v.get<std::uint64_t>();
}

}  // namespace

std::size_t dtype_size(Dtype d) {
  return info(d).size;
}
std::string_view dtype_name(Dtype d) {
  return info(d).name;
}

Dtype dtype_from_name(std::string_view name) {
  for (const auto& i : kDtypes)
    if (i.name == name) return i.dtype;
  throw Error("safetensors.dtype", "unknown safetensors dtype \"" + std::string(name) + "\"");
}

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

const TensorView* SafetensorsIndex::find(std::string_view name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

namespace {

// `head` holds the file's first bytes (all of it, or at least length and header); the data
// section is file_size - 8 - header length bytes from the end of the header, and views point
// into `head` only when it holds the whole file (else their data is null).
SafetensorsIndex parse_index(std::span<const std::byte> head, std::uint64_t file_size,
                             std::size_t max_header_bytes) {
  if (file_size < 8 || head.size() < 8)
    invalid("file of " + std::to_string(file_size) + " bytes has no header length");
  std::uint64_t header_len = read_le64(head.data());
  if (header_len > max_header_bytes)
    invalid("header length " + std::to_string(header_len) + " exceeds the limit of " +
            std::to_string(max_header_bytes));
  if (header_len > file_size - 8)
    invalid("header length " + std::to_string(header_len) + " runs past the end of the file (" +
            std::to_string(file_size) + " bytes)");
  if (header_len > head.size() - 8)
    invalid("header length " + std::to_string(header_len) + " runs past the " +
            std::to_string(head.size()) + " bytes read");
  const bool whole = head.size() == file_size;
  std::string_view header(reinterpret_cast<const char*>(head.data() + 8), header_len);
  Json doc;
  try {
    doc = parse_strict(header, ParseLimits{max_header_bytes, 64, true});
  } catch (const Error& e) {
    invalid(std::string("header: ") + e.what());
  }
  if (!doc.is_object()) invalid("header is not a JSON object");

  const std::byte* data = whole ? head.data() + 8 + header_len : nullptr;
  const std::uint64_t data_size = file_size - 8 - header_len;
  SafetensorsIndex index;
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    const std::string& name = it.key();
    const Json& entry = it.value();
    if (name == "__metadata__") {
      if (!entry.is_object()) invalid("__metadata__ is not an object");
      for (auto m = entry.begin(); m != entry.end(); ++m) {
        if (!m.value().is_string())
          invalid("__metadata__ value for \"" + m.key() + "\" is not a string");
        index.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!entry.is_object()) invalid("tensor \"" + name + "\" is not an object");
    for (auto f = entry.begin(); f != entry.end(); ++f)
      if (f.key() != "dtype" && f.key() != "shape" && f.key() != "data_offsets")
        invalid("tensor \"" + name + "\" has unknown field \"" + f.key() + "\"");
    if (!entry.contains("dtype") || !entry["dtype"].is_string())
      invalid("tensor \"" + name + "\" has no dtype string");
    if (!entry.contains("shape") || !entry["shape"].is_array())
      invalid("tensor \"" + name + "\" has no shape array");
    if (!entry.contains("data_offsets") || !entry["data_offsets"].is_array() ||
        entry["data_offsets"].size() != 2)
      invalid("tensor \"" + name + "\" has no [begin, end] data_offsets");
    TensorView view;
    view.name = name;
    try {
      view.dtype = dtype_from_name(entry["dtype"].get<std::string>());
    } catch (const Error& e) {
      invalid("tensor \"" + name + "\": " + e.what());
    }
    std::uint64_t numel = 1;
    for (const Json& d : entry["shape"]) {
      if (!d.is_number_integer() || d.get<std::int64_t>() < 0)
        invalid("tensor \"" + name + "\" has a shape entry that is not a non-negative integer");
      auto dim = d.get<std::uint64_t>();
      if (dim != 0 && numel > std::numeric_limits<std::uint64_t>::max() / dim)
        invalid("tensor \"" + name + "\" shape overflows");
      numel *= dim;
      view.shape.push_back(static_cast<std::int64_t>(dim));
    }
    std::uint64_t esize = dtype_size(view.dtype);
    if (numel > std::numeric_limits<std::uint64_t>::max() / esize)
      invalid("tensor \"" + name + "\" byte size overflows");
    std::uint64_t begin = checked_offset(entry["data_offsets"][0], name);
    std::uint64_t end = checked_offset(entry["data_offsets"][1], name);
    if (begin > end) invalid("tensor \"" + name + "\" has begin > end in data_offsets");
    if (end > data_size)
      invalid("tensor \"" + name + "\" ends at " + std::to_string(end) +
              ", past the data section of " + std::to_string(data_size) + " bytes");
    if (numel * esize != end - begin)
      invalid("tensor \"" + name + "\" has shape x dtype size " + std::to_string(numel * esize) +
              " but data_offsets span " + std::to_string(end - begin) + " bytes");
    view.data = data ? data + begin : nullptr;
    view.nbytes = static_cast<std::size_t>(end - begin);
    view.offset = begin;
    index.tensors.push_back(std::move(view));
  }
  std::sort(index.tensors.begin(), index.tensors.end(),
            [](const TensorView& a, const TensorView& b) { return a.offset < b.offset; });
  for (std::size_t i = 1; i < index.tensors.size(); ++i) {
    const auto& prev = index.tensors[i - 1];
    const auto& cur = index.tensors[i];
    if (cur.offset < prev.offset + prev.nbytes)
      invalid("tensors \"" + prev.name + "\" and \"" + cur.name + "\" overlap");
  }
  return index;
}

}  // namespace

SafetensorsIndex parse_safetensors(std::span<const std::byte> image, std::size_t max_header_bytes) {
  return parse_index(image, image.size(), max_header_bytes);
}

SafetensorsIndex read_safetensors_header(int fd, std::uint64_t file_size,
                                         std::size_t max_header_bytes) {
  std::vector<std::byte> head(8);
  auto read_at = [&](std::size_t from) {
    for (std::size_t got = from; got < head.size();) {
      ssize_t r = ::pread(fd, head.data() + got, head.size() - got, static_cast<off_t>(got));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0)
        invalid("the file ended after " + std::to_string(got) + " of its " +
                std::to_string(file_size) + " bytes (it shrank while it was read?)");
      got += static_cast<std::size_t>(r);
    }
  };
  if (file_size < 8)
    invalid("file of " + std::to_string(file_size) + " bytes has no header length");
  read_at(0);
  std::uint64_t header_len = read_le64(head.data());
  // parse_index reports a length past the limit or the file; read no more than either allows.
  head.resize(8 + static_cast<std::size_t>(
                      std::min<std::uint64_t>({header_len, max_header_bytes, file_size - 8})));
  read_at(8);
  return parse_index(head, file_size, max_header_bytes);
}

SafetensorsFile SafetensorsFile::open(const std::filesystem::path& path) {
  UniqueFd fd = open_nofollow(path, O_RDONLY | O_NONBLOCK);
  return open_fd(fd.get(), path.string());
}

SafetensorsFile SafetensorsFile::open_fd(int fd, const std::string& label) {
  struct stat st {};
  if (fstat(fd, &st) != 0) throw_errno("fs.stat", "stat " + label, errno);
  if (!S_ISREG(st.st_mode)) throw Error("fs.not_regular", label + " is not a regular file");
  SafetensorsFile f;
  f.path_ = label;
  f.size_ = static_cast<std::size_t>(st.st_size);
  if (f.size_ > 0) {
    // Populated at once: the reader touches every page (logits), and faulting them in one by one
    // cost a third of a comparison.
    void* m = ::mmap(nullptr, f.size_, PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd, 0);
    if (m == MAP_FAILED) throw_errno("fs.mmap", "mmap " + label, errno);
    f.map_ = m;
  }
  try {
    f.index_ = parse_safetensors({static_cast<const std::byte*>(f.map_), f.size_});
  } catch (const Error& e) {
    throw Error(e.code(), label + ": " + e.what());
  }
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, size_);
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept
    : path_(std::move(o.path_)), map_(o.map_), size_(o.size_), index_(std::move(o.index_)) {
  o.map_ = nullptr;
  o.size_ = 0;
}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    if (map_) ::munmap(map_, size_);
    path_ = std::move(o.path_);
    map_ = o.map_;
    size_ = o.size_;
    index_ = std::move(o.index_);
    o.map_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

namespace {

// The 8-byte length and the JSON header (padded with spaces to 8 bytes) for tensors laid out
// one after another in `layout` order; `total` receives the data bytes they take.
std::string safetensors_header(const std::vector<TensorLayout>& layout,
                               const std::map<std::string, std::string>& metadata,
                               std::uint64_t& total) {
  Json header = Json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const auto& t : layout) {
    std::uint64_t numel = 1;
    for (auto d : t.shape) {
      if (d < 0) throw Error("safetensors.write", "tensor \"" + t.name + "\" has a negative dim");
      numel *= static_cast<std::uint64_t>(d);
    }
    if (t.name == "__metadata__" || header.contains(t.name))
      throw Error("safetensors.write", "duplicate or reserved tensor name \"" + t.name + "\"");
    std::uint64_t bytes = numel * dtype_size(t.dtype);
    header[t.name] = {{"dtype", dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out;
  std::uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out += static_cast<char>((n >> (8 * i)) & 0xff);
  out += text;
  total = offset;
  return out;
}

void write_all(int fd, const void* data, std::size_t size, const std::filesystem::path& what) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error("safetensors.write", "write " + what.string() + ": " + std::strerror(errno));
    }
    p += n;
    size -= static_cast<std::size_t>(n);
  }
}

}  // namespace

std::string serialize_safetensors(const std::vector<TensorToWrite>& tensors,
                                  const std::map<std::string, std::string>& metadata) {
  std::vector<TensorLayout> layout;
  for (const auto& t : tensors) {
    layout.push_back({t.name, t.dtype, t.shape});
    std::uint64_t numel = 1;
    for (auto d : t.shape) numel *= static_cast<std::uint64_t>(std::max<std::int64_t>(d, 0));
    if (numel * dtype_size(t.dtype) != t.data.size())
      throw Error("safetensors.write",
                  "tensor \"" + t.name + "\" has " + std::to_string(t.data.size()) +
                      " bytes for shape x dtype " + std::to_string(numel * dtype_size(t.dtype)));
  }
  std::uint64_t total = 0;
  std::string out = safetensors_header(layout, metadata, total);
  out.reserve(out.size() + total);
  for (const auto& t : tensors)
    out.append(reinterpret_cast<const char*>(t.data.data()), t.data.size());
  return out;
}

SafetensorsStreamWriter::SafetensorsStreamWriter(std::filesystem::path path,
                                                 const std::vector<TensorLayout>& layout,
                                                 const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)) {
  std::string header = safetensors_header(layout, metadata, expected_);
  tmp_ = path_.parent_path() /
         ("." + path_.filename().string() + ".tmp." + std::to_string(::getpid()));
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd_ < 0)
    throw Error("safetensors.write", "create " + tmp_.string() + ": " + std::strerror(errno));
  try {
    write_all(fd_, header.data(), header.size(), tmp_);
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    ::unlink(tmp_.c_str());
    throw;
  }
}

SafetensorsStreamWriter::~SafetensorsStreamWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void SafetensorsStreamWriter::write(std::span<const std::byte> bytes) {
  if (fd_ < 0) throw Error("safetensors.write", path_.string() + " is already finished");
  if (bytes.size() > expected_ - written_)
    throw Error("safetensors.write",
                path_.string() + ": " + std::to_string(written_ + bytes.size()) +
                    " data bytes written, the header declares " + std::to_string(expected_));
  write_all(fd_, bytes.data(), bytes.size(), tmp_);
  written_ += bytes.size();
}

void SafetensorsStreamWriter::finish() {
  if (fd_ < 0) throw Error("safetensors.write", path_.string() + " is already finished");
  if (written_ != expected_)
    throw Error("safetensors.write", path_.string() + ": " + std::to_string(written_) +
                                         " data bytes written, the header declares " +
                                         std::to_string(expected_));
  int fd = fd_;
  fd_ = -1;
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp_.c_str());
    throw Error("safetensors.write", "fsync " + tmp_.string() + ": " + std::strerror(err));
  }
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp_.c_str());
    throw Error("safetensors.write",
                "rename " + tmp_.string() + " to " + path_.string() + ": " + std::strerror(err));
  }
  fsync_directory(path_.parent_path());
}

void write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  atomic_write_file(path, serialize_safetensors(tensors, metadata));
}

}  // namespace assay::common
