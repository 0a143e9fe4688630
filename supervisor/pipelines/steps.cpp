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

// v2: entries only for the files the worker names "cacheable" (a sound key); a v1 file, whose
// entries were kept without that, is ignored.
constexpr std::string_view kFingerprintCacheSchema = "assay.fingerprint-cache.v2";

fs::path fingerprint_cache_file(const fs::path& state_dir, const std::string& model_dir) {
  std::string id = common::sha256_id(model_dir);  // "sha256:<hex>"
  return state_dir / "fingerprint-cache" / (id.substr(7) + ".json");
}

// A digest the worker says came from the cache must be one the supervisor passed, for the same
// file state: the worker cannot invent cache hits.
void check_cache_hits(const Json& output, const Json& passed) {
  for (const Json& f : output.value("files", Json::array())) {
    if (f.value("source", "") != "cache") continue;
    bool found = false;
    for (const Json& e : passed) {
      Json entry = f;
      entry.erase("source");
      found |= entry == e;
    }
    if (!found)
      throw Error("worker.fingerprint_output",
                  "the fingerprint reports a cached digest that was not passed: " + f.dump());
  }
}

}  // namespace

Json fingerprint_section(const FingerprintRun& run) {
  return Json{{"implementation_sha256", run.output.value("implementation_sha256", Json(nullptr))},
              {"files", run.output.value("files", Json(nullptr))},
              {"process", run.evidence->to_json()}};
}

bool fingerprint_cache_on(const Config& config) {
  return config.fingerprint_cache && !config.state_dir.empty();
}

Json load_fingerprint_cache(const fs::path& state_dir, const std::string& model_dir) {
  std::error_code ec;
  fs::path file = fingerprint_cache_file(state_dir, model_dir);
  if (!fs::exists(file, ec)) return Json::array();
  try {
    Json doc = common::parse_strict(common::read_file(file, 16 << 20));
    if (doc.value("schema", "") != kFingerprintCacheSchema ||
        doc.value("model_dir", "") != model_dir || !doc.value("entries", Json()).is_array())
      return Json::array();
    return doc["entries"];
  } catch (const Error&) {
    return Json::array();  // a damaged cache costs a re-hash, never a job
  }
}

void store_fingerprint_cache(const fs::path& state_dir, const std::string& model_dir,
                             const Json& output, const std::string& job_id, const std::string& at) {
  // A file changed within the same tick of the kernel's coarse clock as the write before it
  // keeps its mtime and ctime: like git's "racily clean" entries, a digest of a file changed
  // less than kRacySeconds before now is not kept, so that the next job hashes it again.
  constexpr double kRacySeconds = 2.0;
  const auto recent_ns = static_cast<long long>((common::now_unix() - kRacySeconds) * 1e9);
  auto racy = [&](const Json& f) {
    for (const char* k : {"mtime_ns", "ctime_ns"}) {
      const Json& v = f.value(k, Json());
      if (!v.is_string()) return true;
      try {
        if (std::stoll(v.get<std::string>()) >= recent_ns) return true;
      } catch (const std::exception&) {
        return true;
      }
    }
    return false;
  };
  std::set<std::string> cacheable;
  for (const Json& name : output.value("cacheable", Json::array()))
    if (name.is_string()) cacheable.insert(name.get<std::string>());
  Json entries = Json::array();
  for (Json f : output.value("files", Json::array())) {
    if (racy(f) || !cacheable.count(f.value("name", std::string()))) continue;
    if (f.value("source", "") != "cache") {
      f["job"] = job_id;
      f["at"] = at;
    }
    f.erase("source");
    entries.push_back(std::move(f));
  }
  fs::path file = fingerprint_cache_file(state_dir, model_dir);
  std::error_code ec;
  fs::create_directory(file.parent_path(), ec);
  ::chmod(file.parent_path().c_str(), 0700);
  common::replace_file_fast(
      file,
      Json{{"schema", kFingerprintCacheSchema}, {"model_dir", model_dir}, {"entries", entries}}
              .dump() +
          "\n",
      0600);
}

bool drop_fingerprint_cache(const fs::path& state_dir, const std::string& model_dir) {
  std::error_code ec;
  return fs::remove(fingerprint_cache_file(state_dir, model_dir), ec);
}

Step fingerprint_step(const Config& config, const std::string& role, const std::string& model_dir,
                      const std::string& name, const std::optional<Json>& expected,
                      FingerprintRun& out) {
  Json input{{"schema", protocol::kFingerprintInput},
             {"model_dir", model_dir},
             {"id", name},
             {"threads", config.fingerprint_threads}};
  // The entries passed are looked up when the step starts and checked against the hits reported.
  auto passed = std::make_shared<Json>(Json::array());
  bool cache = fingerprint_cache_on(config);
  fs::path state_dir = config.state_dir;
  return Step{
      role,
      config.fingerprint_worker,
      "run",
      model_dir,
      {},
      [input, passed, cache, state_dir, model_dir] {
        Json in = input;
        if (cache) *passed = load_fingerprint_cache(state_dir, model_dir);
        if (!passed->empty()) in["cache"] = *passed;
        return in;
      },
      {},
      [&out, expected, role, passed, cache, state_dir, model_dir](
          Json output, const contain::Evidence& evidence) {
        // Read without trusting its shape (fuzz_worker_output: a model_identity that is a string).
        const Json schema = output.is_object() ? output.value("schema", Json()) : Json();
        if (schema != protocol::kFingerprintOutput)
          throw Error("worker.fingerprint_output",
                      role + " output.json has schema " + common::printable(schema.dump(), 80));
        const Json& identity = common::require(output, "model_identity", "fingerprint output");
        if (!identity.is_object())
          throw Error("worker.fingerprint_output",
                      role + " output.json's model_identity is not an object");
        const Json got = identity.value("content_sha256", Json());
        if (!got.is_string())
          throw Error("worker.fingerprint_output",
                      role + " output.json's model_identity has no content_sha256");
        if (expected && expected->value("content_sha256", Json()) != got)
          throw Error("job.identity_mismatch",
                      "the model directory's identity " + got.dump() +
                          " differs from the request's expected identity " +
                          expected->value("content_sha256", Json()).dump() + "; fingerprinted: " +
                          identity.dump() + "; expected: " + expected->dump());
        check_cache_hits(output, *passed);
        if (cache) {
          // The job is the workspace's parent: STATE/jobs/<id>/<role>.
          std::string job =
              evidence.spawn ? fs::path(evidence.spawn->workdir).parent_path().filename().string()
                             : std::string();
          try {
            store_fingerprint_cache(state_dir, model_dir, output, job.empty() ? role : job,
                                    common::now_rfc3339());
          } catch (const Error&) {
            // A cache that cannot be written costs the next job a re-hash, not this job.
          }
        }
        out.output = std::move(output);
        out.evidence = evidence;
      }};
}

void check_bytes_used(const Json& output, const FingerprintRun& fingerprint,
                      const std::string& role) {
  const Json& used = output.value("bytes_used", Json());
  if (!used.is_object())
    throw Error("worker." + role + "_output", role + " output.json has no bytes_used");
  const Json& id = fingerprint.identity();
  auto differ = [&](const std::string& what, const Json& got, const Json& want) {
    throw Error("job.bytes_mismatch",
                "the " + role + " worker computed with " + what + " " + got.dump() +
                    " but the fingerprint worker hashed " + want.dump() +
                    ": the model directory changed during the job; no result is signed");
  };
  // The fs-verity digest the fingerprint worker measured on a file it hashed, or null.
  auto fingerprint_fsverity = [&](const Json& path) {
    for (const Json& f : fingerprint.output.value("files", Json::array()))
      if (f.is_object() && f.value("name", Json()) == path)
        return f.value("fsverity_digest", Json());
    return Json();
  };
  const Json& got = used.value("weight_files", Json::array());
  const Json& want = id.value("weight_files", Json::array());
  for (std::size_t i = 0; i < std::max(got.size(), want.size()); ++i) {
    Json g = i < got.size() ? got[i] : Json(nullptr), w = i < want.size() ? want[i] : Json(nullptr);
    std::string what =
        "weight file " + (w.is_object() ? w.value("path", std::string("?")) : g.dump());
    if (g.is_object() && g.contains("bound_by")) {
      // Mapped, not hashed: the oracle measured this fs-verity digest on its descriptor, and the
      // fingerprint hashed a file with the same one, which the kernel keeps from changing; so
      // the fingerprint's sha256 is of the bytes the oracle mapped.
      Json verity = w.is_object() ? fingerprint_fsverity(w["path"]) : Json();
      bool same = g.size() == 4 && g["bound_by"] == "fs-verity" && w.is_object() &&
                  g.value("path", Json()) == w["path"] && g.value("bytes", Json()) == w["bytes"] &&
                  verity.is_string() && g.value("fsverity_digest", Json()) == verity;
      if (!same) {
        if (w.is_object()) w["fsverity_digest"] = verity;
        differ(what, g, w);
      }
      continue;
    }
    if (g != w) differ(what, g, w);
  }
  if (used.value("config_hash", Json()) != id.value("config_hash", Json()))
    differ("config_hash", used.value("config_hash", Json()), id.value("config_hash", Json()));
  // A capture reads no tokenizer and reports null; a next-token run decodes with it.
  if (!used.value("tokenizer_hash", Json()).is_null() &&
      used["tokenizer_hash"] != id.value("tokenizer_hash", Json()))
    differ("tokenizer_hash", used["tokenizer_hash"], id.value("tokenizer_hash", Json()));
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
