#include "worker/model_files.h"

#include <fcntl.h>
#include <sched.h>
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
#include "common/fsverity.h"
#include "common/identity.h"
#include "worker/prefault.h"

namespace assay::oracle {
namespace {

using common::Error;
using common::Json;

// Small files hash each chunk right after the kernel copied it, while it is still in cache.
constexpr std::size_t kChunk = 256 * 1024;

struct Mapping {
  std::byte* data = nullptr;
  std::size_t size = 0;
  ~Mapping() {
    if (data) ::munmap(data, size);
  }
};

}  // namespace

FileImage::FileImage(std::byte* data, std::size_t size) : data_(data), size_(size) {}

FileImage::~FileImage() {
  if (data_) ::munmap(data_, size_);
}

ModelFiles ModelFiles::from_directory(const std::filesystem::path& dir) {
  ModelFiles f;
  f.dir_ = dir;
  f.measure_verity_ = common::measure_fsverity;
  f.dirfd_ = common::UniqueFd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!f.dirfd_) common::throw_errno("fs.open", "open directory " + dir.string(), errno);
  return f;
}

ModelFiles ModelFiles::from_fds(const std::filesystem::path& dir,
                                std::vector<fingerprint::ModelFd> fds) {
  ModelFiles f;
  f.dir_ = dir;
  f.measure_verity_ = common::measure_fsverity;
  f.fds_ = std::move(fds);
  return f;
}

void ModelFiles::expect_unchanged(std::vector<fingerprint::FileState> states) {
  for (auto& s : states) unchanged_[s.name] = std::move(s);
}

bool ModelFiles::has(const std::string& name) const {
  if (fds_) return fingerprint::find_model_fd(*fds_, name) >= 0;
  struct stat st {};
  if (::fstatat(dirfd_.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) return true;
  if (errno != ENOENT) common::throw_errno("fs.stat", "stat " + (dir_ / name).string(), errno);
  return false;
}

// Opens (or takes the given descriptor of) `name`, then reads it whole into fresh anonymous
// memory with pread; with hash_now each chunk is hashed as it arrives. With may_map, a file whose
// descriptor has fs-verity is mapped instead: the kernel refuses any write to it and verifies each
// page as it faults in, so the mapping holds the measured bytes without a private copy.
std::shared_ptr<FileImage> ModelFiles::fetch(const std::string& name, std::size_t max_bytes,
                                             bool hash_now, bool may_map) const {
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
    // O_NONBLOCK: a FIFO under the name must not hang the open (fstat then refuses it).
    owned = common::UniqueFd(
        ::openat(dirfd_.get(), name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK));
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
  // A file the fingerprint left to this reader: exactly the state it saw, before and after.
  const auto expected = unchanged_.find(name);
  auto check_unchanged = [&](const struct stat& now, const char* when) {
    if (expected == unchanged_.end()) return;
    std::string diff =
        fingerprint::state_difference(expected->second, fingerprint::file_state(name, now));
    if (!diff.empty())
      throw Error("model.file_changed", shown + " is not as the fingerprint saw it " + when +
                                            " it was read (" + diff +
                                            "): its digest would not be the model's");
  };
  check_unchanged(st, "before");
  may_map = may_map && expected == unchanged_.end();

  Mapping m;
  m.size = static_cast<std::size_t>(size);
  // The digest is measured on this very descriptor, the one the bytes are mapped from.
  std::optional<std::string> verity;
  if (may_map && m.size > 0) verity = measure_verity_(fd, shown);
  if (verity) {
    void* p = ::mmap(nullptr, m.size, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) common::throw_errno("fs.map", "map " + shown + " (fs-verity)", errno);
    auto image = std::make_shared<FileImage>(static_cast<std::byte*>(p), m.size);
    image->fsverity_ = std::move(verity);
    // Never hashed here: a reader of its sha256 gets this error, not a wait that never ends.
    std::promise<std::string> none;
    none.set_exception(std::make_exception_ptr(common::Error(
        "oracle.internal", shown + " is bound by its fs-verity digest; no sha256 was computed")));
    image->digest_ = none.get_future().share();
    return image;
  }
  if (m.size > 0) {
    void* p = ::mmap(nullptr, m.size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      common::throw_errno("fs.read", "allocate " + std::to_string(m.size) + " bytes for " + shown,
                          errno);
    m.data = static_cast<std::byte*>(p);
    // Huge pages where the kernel offers them on request: far fewer faults while reading.
    if (m.size >= (2u << 20)) ::madvise(p, m.size, MADV_HUGEPAGE);
  }
  Prefaulter prefault(m.data, m.size);  // declared after m: joined before m is unmapped
  common::Sha256 h;
  std::size_t got = 0;
  while (got < m.size) {
    const std::size_t want = std::min(kChunk, m.size - got);
    prefault.wait_for(got + want);
    // pread: a given descriptor's file offset may be shared with the supervisor.
    ssize_t n = ::pread(fd, m.data + got, want, static_cast<off_t>(got));
    if (n < 0) {
      if (errno == EINTR) continue;
      common::throw_errno("fs.read", "read " + shown, errno);
    }
    if (n == 0)
      throw Error("model.file_changed", shown + " ended after " + std::to_string(got) + " of " +
                                            std::to_string(m.size) + " bytes while it was read");
    if (hash_now) h.update(m.data + got, static_cast<std::size_t>(n));
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
  if (expected != unchanged_.end()) {
    struct stat after {};
    if (::fstat(fd, &after) != 0) common::throw_errno("fs.stat", "fstat " + shown, errno);
    check_unchanged(after, "after");
  }
  if (m.data) ::mprotect(m.data, m.size, PROT_READ);  // the image is never written again
  auto image = std::make_shared<FileImage>(m.data, m.size);
  m.data = nullptr;
  if (hash_now) {
    std::promise<std::string> digest;
    digest.set_value(common::identity(h.finish()));
    image->digest_ = digest.get_future().share();
  }
  return image;
}

std::shared_ptr<const FileImage> ModelFiles::read(const std::string& name, std::size_t max_bytes) {
  if (auto it = cache_.find(name); it != cache_.end()) return it->second;
  auto image = fetch(name, max_bytes, /*hash_now=*/true, /*may_map=*/false);
  records_[name] = {image->bytes().size(), image->digest_, std::nullopt};
  cache_.emplace(name, image);
  return image;
}

std::vector<std::shared_ptr<const FileImage>> ModelFiles::read_large(
    const std::vector<std::string>& names, unsigned threads) {
  for (const auto& n : names)
    if (records_.count(n))
      throw Error("oracle.internal", (dir_ / n).string() + " would be read a second time");
  std::vector<std::shared_ptr<FileImage>> out(names.size());
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::exception_ptr first_error;
  auto worker = [&] {
    for (;;) {
      std::size_t i = next.fetch_add(1);
      if (i >= names.size() || failed.load()) return;
      try {
        // Hashed as it is read, each chunk while it is in cache, so that every digest exists
        // before the forward starts: a background hash during the forward took one of its
        // cores (bench/oracle_hashing.md).
        out[i] = fetch(names[i], SIZE_MAX, /*hash_now=*/true, /*may_map=*/true);
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
  for (std::size_t i = 0; i < names.size(); ++i)
    records_[names[i]] = {out[i]->bytes().size(), out[i]->digest_, out[i]->fsverity_};
  return {out.begin(), out.end()};
}

unsigned io_threads() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return static_cast<unsigned>(std::clamp(CPU_COUNT(&set), 1, 8));
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
    if (r.fsverity_digest)
      weights.push_back({{"path", name},
                         {"bytes", r.bytes},
                         {"fsverity_digest", *r.fsverity_digest},
                         {"bound_by", "fs-verity"}});
    else
      weights.push_back({{"path", name}, {"bytes", r.bytes}, {"sha256", r.sha256()}});
  }
  auto tokenizer = records.find("tokenizer.json");
  return {{"weight_files", std::move(weights)},
          {"config_hash", recorded("config.json").sha256()},
          {"tokenizer_hash",
           tokenizer == records.end() ? Json(nullptr) : Json(tokenizer->second.sha256())}};
}

}  // namespace assay::oracle
