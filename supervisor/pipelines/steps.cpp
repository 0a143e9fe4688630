#include "supervisor/pipelines/steps.h"

#include <algorithm>
#include <cstddef>
#include <memory>
#include <thread>

#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <tuple>

#include <fcntl.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "common/result.h"
#include "common/text.h"
#include "common/time.h"

namespace assay::supervisor {

using common::Error;
using common::Json;
namespace fs = std::filesystem;

Json read_request(const fs::path& job_dir) {
  return common::parse_strict(common::read_file(job_dir / "request.json", 64 << 20),
                              {.max_bytes = 64 << 20});
}

Json read_checks(const fs::path& job_dir) {
  std::error_code ec;
  if (!fs::exists(job_dir / kChecksFile, ec)) return Json::object();
  return common::parse_strict(common::read_file(job_dir / kChecksFile, 64 << 20),
                              {.max_bytes = 64 << 20});
}

int worker_threads(const Config& config) {
  if (config.worker_threads > 0) return config.worker_threads;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

namespace {

struct FileKey {
  dev_t dev;
  ino_t ino;
  off_t size;
  std::int64_t mtime_ns, ctime_ns;
  auto operator<=>(const FileKey&) const = default;
};

struct HashCost {
  std::size_t files = 0;
  std::uint64_t bytes_hashed = 0, bytes_cached = 0;
};

// sha256 of a regular file, read through one descriptor (so the hashed bytes are the stat'ed
// file's), cached by its identity: the daemon is single-threaded and LibTorch is ~0.5 GB.
// `follow`: an executable is hashed as exec runs it, through symlinks (and /proc/self/exe, a
// magic link to the running image); a library a worker reported is opened without following.
// The digests, shared by the loop and warm_digests' thread.
struct DigestCache {
  std::mutex mutex;
  std::map<FileKey, std::string> digests;
  std::optional<std::string> find(const FileKey& key) {
    std::lock_guard lock(mutex);
    auto it = digests.find(key);
    return it == digests.end() ? std::nullopt : std::optional(it->second);
  }
  void add(const FileKey& key, const std::string& id) {
    std::lock_guard lock(mutex);
    digests.emplace(key, id);
  }
};
DigestCache& digest_cache() {
  static DigestCache cache;
  return cache;
}

common::UniqueFd open_for_digest(const fs::path& path, bool follow, struct stat& st) {
  common::UniqueFd fd(
      ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | (follow ? 0 : O_NOFOLLOW)));
  if (fd.get() < 0)
    common::throw_errno("job.implementation", "cannot open " + path.string(), errno);
  if (::fstat(fd.get(), &st) != 0)
    common::throw_errno("job.implementation", "cannot stat " + path.string(), errno);
  if (!S_ISREG(st.st_mode))
    throw Error("job.implementation", path.string() + " is not a regular file");
  return fd;
}

FileKey file_key(const struct stat& st) {
  return FileKey{st.st_dev, st.st_ino, st.st_size,
                 std::int64_t{st.st_mtim.tv_sec} * 1'000'000'000 + st.st_mtim.tv_nsec,
                 std::int64_t{st.st_ctim.tv_sec} * 1'000'000'000 + st.st_ctim.tv_nsec};
}

Json hash_file(const fs::path& path, HashCost& cost, bool follow) {
  struct stat st {};
  common::UniqueFd fd = open_for_digest(path, follow, st);
  FileKey key = file_key(st);
  ++cost.files;
  auto bytes = static_cast<std::uint64_t>(st.st_size);
  if (auto id = digest_cache().find(key)) {
    cost.bytes_cached += bytes;
    return Json{{"path", path.string()}, {"bytes", bytes}, {"sha256", *id}};
  }
  common::Sha256 digest;
  std::vector<char> buf(1 << 20);
  std::uint64_t total = 0;
  for (;;) {
    ssize_t n = ::read(fd.get(), buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) common::throw_errno("job.implementation", "cannot read " + path.string(), errno);
    if (n == 0) break;
    digest.update(buf.data(), static_cast<std::size_t>(n));
    total += static_cast<std::uint64_t>(n);
  }
  if (total != bytes)
    throw Error("job.implementation", path.string() + " changed size while it was hashed");
  std::string id = common::identity(digest.finish());
  digest_cache().add(key, id);
  cost.bytes_hashed += bytes;
  return Json{{"path", path.string()}, {"bytes", bytes}, {"sha256", id}};
}

// A shared object of the runtime the oracle may report: an absolute path whose file name is a
// LibTorch, BLAS, oneDNN, OpenMP or GPU runtime library.
bool is_runtime_library(const std::string& path) {
  static constexpr std::string_view kPrefixes[] = {
      "libtorch",  "libc10",     "libcaffe2",   "libshm",       "libgomp",   "libiomp",
      "libomp",    "libmkl",     "libdnnl",     "libmkldnn",    "libblas",   "libopenblas",
      "liblapack", "libsleef",   "libcudnn",    "libcublas",    "libcudart", "libnvrtc",
      "libcufft",  "libcurand",  "libcusparse", "libcusolver",  "libnccl",   "libamdhip64",
      "libMIOpen", "librocblas", "libhipblas",  "libhipblaslt", "librccl",   "libroctx64"};
  if (path.empty() || path[0] != '/' || path.find("/../") != std::string::npos ||
      path.find('\n') != std::string::npos)
    return false;
  std::string name = fs::path(path).filename().string();
  if (name.find(".so") == std::string::npos) return false;
  for (std::string_view p : kPrefixes)
    if (name.starts_with(p)) return true;
  return false;
}

}  // namespace

std::vector<DigestFile> uncached_digests(const std::vector<DigestFile>& files) {
  std::vector<DigestFile> out;
  for (const DigestFile& f : files) {
    struct stat st {};
    if (::stat(f.path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;  // reported later
    if (!digest_cache().find(file_key(st))) out.push_back(f);
  }
  return out;
}

void warm_digests(const std::vector<DigestFile>& files) {
  for (const DigestFile& f : files) {
    HashCost cost;
    try {
      hash_file(f.path, cost, f.follow);
    } catch (const Error&) {
      // implementation_section opens it again and fails the job, naming it.
    }
  }
}

std::vector<DigestFile> reported_libraries(const fs::path& output_file) {
  std::vector<DigestFile> out;
  try {
    Json o = common::parse_strict(common::read_file(output_file, 64 << 20),
                                  {.max_bytes = 64 << 20, .exact_integers = false});
    auto it = o.find("loaded_libraries");
    if (it == o.end() || !it->is_array()) return out;
    for (const Json& l : *it)
      if (l.is_string() && is_runtime_library(l.get<std::string>()) && out.size() < 128)
        out.push_back({l.get<std::string>(), false});
  } catch (const Error&) {
    // The step reads the output itself and says what is wrong with it.
  }
  return out;
}

Json implementation_section(const std::vector<std::pair<std::string, fs::path>>& executables,
                            const Json& libraries) {
  auto t0 = std::chrono::steady_clock::now();
  HashCost cost;
  Json exes = Json::object();
  for (const auto& [role, path] : executables) {
    // /proc/self/exe names the running image even when its path was replaced since.
    exes[role] = hash_file(path, cost, true);
    if (path == "/proc/self/exe") exes[role]["path"] = fs::read_symlink(path).string();
  }
  Json libs = Json::array();
  if (!libraries.is_null()) {
    constexpr std::size_t kMaxLibraries = 128;
    if (!libraries.is_array() || libraries.size() > kMaxLibraries)
      throw Error("worker.oracle_output", "oracle loaded_libraries is not an array of at most " +
                                              std::to_string(kMaxLibraries) + " paths");
    for (const Json& l : libraries) {
      if (!l.is_string() || !is_runtime_library(l.get<std::string>()))
        throw Error("worker.oracle_output",
                    "oracle loaded_libraries entry " + l.dump() +
                        " is not the absolute path of a LibTorch or runtime shared object");
      libs.push_back(hash_file(l.get<std::string>(), cost, false));
    }
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return Json{{"executables", exes},
              {"libraries", libs},
              {"hashing",
               {{"files", cost.files},
                {"bytes_hashed", cost.bytes_hashed},
                {"bytes_cached", cost.bytes_cached},
                {"seconds", seconds}}}};
}

fs::path take_artifact(const fs::path& from, const fs::path& to) {
  // The worker made this file and could have made it a symlink (to a file of root's that a
  // chmod by path would change) or a FIFO (which a read would wait on): only a regular file is
  // taken, opened without following or blocking, and changed through that descriptor.
  common::UniqueFd fd;
  try {
    fd = common::open_regular(from);
  } catch (const Error& e) {
    throw Error("job.artifact", "the worker's artifact is unusable: " + std::string(e.what()));
  }
  struct stat opened {};
  if (::fstat(fd.get(), &opened) != 0)
    common::throw_errno("job.artifact", "stat " + from.string(), errno);
  if (::rename(from.c_str(), to.c_str()) != 0)
    common::throw_errno("job.artifact", "cannot move the worker's artifact " + from.string(),
                        errno);
  struct stat moved {};
  if (::lstat(to.c_str(), &moved) != 0 || !S_ISREG(moved.st_mode) ||
      moved.st_ino != opened.st_ino || moved.st_dev != opened.st_dev) {
    ::unlink(to.c_str());
    throw Error("job.artifact",
                "the worker's artifact " + from.string() + " was replaced while it was moved");
  }
  ::fchmod(fd.get(), 0600);
  return to;
}

std::string take_reported_artifact(const fs::path& from, const fs::path& to, const Json& reported,
                                   const std::string& what) {
  take_artifact(from, to);
  std::string sha = common::sha256_file_id(to);
  if (reported != Json(sha))
    throw Error("worker.compare_output",
                what + " hashes to " + sha + ", the comparison reported " + reported.dump());
  return sha;
}

Step compare_step(const Config& config, const std::string& mode,
                  std::vector<std::string> open_files,
                  std::function<Json(std::vector<std::pair<fs::path, std::string>>*)> input,
                  std::function<void(const Json&)> check, Json& output,
                  std::optional<contain::Evidence>& evidence) {
  return Step{"compare",
              config.compare_worker,
              mode,
              "",
              std::move(open_files),
              [input] { return input(nullptr); },
              [input] {
                std::vector<std::pair<fs::path, std::string>> move_in;
                input(&move_in);
                return move_in;
              },
              [check, &output, &evidence](Json out, const contain::Evidence& ev) {
                check(out);
                output = std::move(out);
                evidence = ev;
              }};
}

CommitFiles seal(Sealed& sealed, const common::SigningKey& key) {
  std::string result_bytes = common::seal_result(sealed.result);
  Json statement = common::make_statement(sealed.predicate_type, result_bytes, sealed.artifact_name,
                                          sealed.artifact_sha256);
  Json envelope = common::dsse_sign(common::kInTotoPayloadType, common::canonical(statement), key);
  return CommitFiles{{{std::string(common::kResultFileName), result_bytes},
                      {std::string(common::kEnvelopeFileName), common::canonical(envelope) + "\n"}},
                     {sealed.artifact}};
}

}  // namespace assay::supervisor
