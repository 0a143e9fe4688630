#include "worker/model_files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <exception>
#include <mutex>
#include <thread>

#include "common/error.h"
#include "common/identity.h"

namespace assay::oracle {
namespace {

using common::Error;
using common::Json;

// Each chunk is hashed right after the kernel copied it, while it is still in cache.
constexpr std::size_t kChunk = 256 * 1024;

struct Mapping {
  std::byte* data = nullptr;
  std::size_t size = 0;
  ~Mapping() {
    if (data) ::munmap(data, size);
  }
};

}  // namespace

FileImage::FileImage(std::byte* data, std::size_t size, std::string sha256)
    : data_(data), size_(size), sha256_(std::move(sha256)) {}

FileImage::~FileImage() {
  if (data_) ::munmap(data_, size_);
}

ModelFiles ModelFiles::from_directory(const std::filesystem::path& dir) {
  ModelFiles f;
  f.dir_ = dir;
  f.dirfd_ = common::UniqueFd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!f.dirfd_) common::throw_errno("fs.open", "open directory " + dir.string(), errno);
  return f;
}

ModelFiles ModelFiles::from_fds(const std::filesystem::path& dir,
                                std::vector<fingerprint::ModelFd> fds) {
  ModelFiles f;
  f.dir_ = dir;
  f.fds_ = std::move(fds);
  return f;
}

bool ModelFiles::has(const std::string& name) const {
  if (fds_) return fingerprint::find_model_fd(*fds_, name) >= 0;
  struct stat st {};
  if (::fstatat(dirfd_.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) return true;
  if (errno != ENOENT) common::throw_errno("fs.stat", "stat " + (dir_ / name).string(), errno);
  return false;
}

// Opens (or takes the given descriptor of) `name`, then reads it whole into fresh anonymous
// memory with pread, hashing each chunk as it arrives.
std::shared_ptr<const FileImage> ModelFiles::fetch(const std::string& name,
                                                   std::size_t max_bytes) const {
  const std::string shown = (dir_ / name).string();
  common::UniqueFd owned;
  int fd = -1;
  if (fds_) {
    fd = fingerprint::find_model_fd(*fds_, name);
    if (fd < 0)
      throw Error("model.missing_fd",
                  shown + " is needed but is not among the model_fds the supervisor passed");
    int flags = ::fcntl(fd, F_GETFL);
    if (flags < 0)
      common::throw_errno("model.bad_fd", "fcntl " + shown + " (fd " + std::to_string(fd) + ")",
                          errno);
    if ((flags & O_PATH) == O_PATH || (flags & O_ACCMODE) == O_WRONLY)
      throw Error("model.bad_fd",
                  shown + " (fd " + std::to_string(fd) + ") is not open for reading");
  } else {
    owned =
        common::UniqueFd(::openat(dirfd_.get(), name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
    if (!owned) common::throw_errno("fs.open", "open " + shown, errno);
    fd = owned.get();
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) common::throw_errno("fs.stat", "fstat " + shown, errno);
  if (!S_ISREG(st.st_mode)) throw Error("fs.not_regular", shown + " is not a regular file");
  auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > max_bytes)
    throw Error("fs.too_large", shown + " has " + std::to_string(size) + " bytes, more than " +
                                    std::to_string(max_bytes));

  Mapping m;
  m.size = static_cast<std::size_t>(size);
  if (m.size > 0) {
    void* p = ::mmap(nullptr, m.size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      common::throw_errno("fs.read", "allocate " + std::to_string(m.size) + " bytes for " + shown,
                          errno);
    m.data = static_cast<std::byte*>(p);
  }
  common::Sha256 h;
  std::size_t got = 0;
  while (got < m.size) {
    // pread: a given descriptor's file offset may be shared with the supervisor.
    ssize_t n = ::pread(fd, m.data + got, std::min(kChunk, m.size - got), static_cast<off_t>(got));
    if (n < 0) {
      if (errno == EINTR) continue;
      common::throw_errno("fs.read", "read " + shown, errno);
    }
    if (n == 0)
      throw Error("model.file_changed", shown + " ended after " + std::to_string(got) + " of " +
                                            std::to_string(m.size) + " bytes while it was read");
    h.update(m.data + got, static_cast<std::size_t>(n));
    got += static_cast<std::size_t>(n);
  }
  char extra = 0;
  ssize_t more;
  do {
    more = ::pread(fd, &extra, 1, static_cast<off_t>(got));
  } while (more < 0 && errno == EINTR);
  if (more > 0)
    throw Error("model.file_changed",
                shown + " grew past " + std::to_string(m.size) + " bytes while it was read");
  if (m.data) ::mprotect(m.data, m.size, PROT_READ);  // the image is never written again
  auto image = std::make_shared<const FileImage>(m.data, m.size, common::identity(h.finish()));
  m.data = nullptr;
  return image;
}

void ModelFiles::record(const std::string& name, const FileImage& image) {
  records_[name] = {image.bytes().size(), image.sha256()};
}

std::shared_ptr<const FileImage> ModelFiles::read(const std::string& name, std::size_t max_bytes) {
  if (auto it = cache_.find(name); it != cache_.end()) return it->second;
  auto image = fetch(name, max_bytes);
  record(name, *image);
  cache_.emplace(name, image);
  return image;
}

std::vector<std::shared_ptr<const FileImage>> ModelFiles::read_large(
    const std::vector<std::string>& names, unsigned threads) {
  for (const auto& n : names)
    if (records_.count(n))
      throw Error("oracle.internal", (dir_ / n).string() + " would be read a second time");
  std::vector<std::shared_ptr<const FileImage>> out(names.size());
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::exception_ptr first_error;
  auto worker = [&] {
    for (;;) {
      std::size_t i = next.fetch_add(1);
      if (i >= names.size() || failed.load()) return;
      try {
        out[i] = fetch(names[i], SIZE_MAX);
      } catch (...) {
        std::lock_guard lock(error_mutex);
        if (!first_error) first_error = std::current_exception();
        failed = true;
        return;
      }
    }
  };
  threads = std::clamp<unsigned>(threads, 1, std::max<std::size_t>(names.size(), 1));
  {
    std::vector<std::jthread> pool;
    for (unsigned t = 1; t < threads; ++t) pool.emplace_back(worker);
    worker();
  }
  if (first_error) std::rethrow_exception(first_error);
  for (std::size_t i = 0; i < names.size(); ++i) record(names[i], *out[i]);
  return out;
}

Json bytes_used(const ModelFiles& files, const std::vector<std::string>& weight_files) {
  const auto& records = files.records();
  auto recorded = [&](const std::string& name) -> const FileRecord& {
    auto it = records.find(name);
    if (it == records.end())
      throw Error("oracle.internal", (files.dir() / name).string() + " was never read");
    return it->second;
  };
  std::vector<std::string> sorted = weight_files;
  std::sort(sorted.begin(), sorted.end());  // std::string compares as unsigned bytes
  Json weights = Json::array();
  for (const auto& name : sorted) {
    const FileRecord& r = recorded(name);
    weights.push_back({{"path", name}, {"bytes", r.bytes}, {"sha256", r.sha256}});
  }
  auto tokenizer = records.find("tokenizer.json");
  return {{"weight_files", std::move(weights)},
          {"config_hash", recorded("config.json").sha256},
          {"tokenizer_hash",
           tokenizer == records.end() ? Json(nullptr) : Json(tokenizer->second.sha256)}};
}

}  // namespace assay::oracle
