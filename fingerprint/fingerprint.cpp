// fingerprint_model (fingerprint.h): which files make a model's identity (the shards from the
// index, model.safetensors or the listing; config, tokenizer and chat template, the template
// possibly inside tokenizer_config.json), their digests computed in parallel or reused from the
// cache, and the identity assembled from them; and the identity's JSON and content_sha256.
#include "fingerprint/fingerprint.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <exception>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "fingerprint/reader.h"

namespace assay::fingerprint {
namespace {

using common::Error;
using common::Json;
using common::UniqueFd;
using Clock = std::chrono::steady_clock;

constexpr std::string_view kIndexName = "model.safetensors.index.json";

Json parse_json(const std::string& text, const std::string& shown) {
  common::ParseLimits limits;
  limits.max_bytes = kMaxJsonBytes;
  try {
    return common::parse_strict(text, limits);
  } catch (const Error& e) {
    throw Error("fingerprint.bad_json", shown + ": " + e.what());
  }
}

// The index's weight_map values in first-occurrence order, deduplicated.
std::vector<std::string> shards_from_index(const std::string& text, const std::string& shown) {
  Json strict = parse_json(text, shown);  // rejects duplicate keys and every other ambiguity
  if (!strict.is_object() || !strict.contains("weight_map") || !strict["weight_map"].is_object())
    throw Error("fingerprint.bad_index", shown + " has no 'weight_map' object");
  // nlohmann::json sorts keys; the ordered variant keeps the file's order.
  auto ordered = nlohmann::ordered_json::parse(text);
  std::vector<std::string> shards;
  std::set<std::string> seen;
  for (const auto& [tensor, file] : ordered["weight_map"].items()) {
    if (!file.is_string())
      throw Error("fingerprint.bad_index",
                  shown + ": weight_map['" + tensor + "'] is not a string");
    auto name = file.get<std::string>();
    if (seen.insert(name).second) shards.push_back(name);
  }
  if (shards.empty()) throw Error("fingerprint.bad_index", shown + " has an empty weight_map");
  return shards;
}

bool is_safetensors_name(std::string_view name) {
  constexpr std::string_view kSuffix = ".safetensors";
  return name.size() > kSuffix.size() && name.ends_with(kSuffix);
}

// The directory listing's counterpart with model_fds: the listed top-level *.safetensors.
std::vector<std::string> list_safetensors(const std::vector<ModelFd>& fds) {
  std::vector<std::string> names;
  for (const auto& f : fds)
    if (f.name.find('/') == std::string::npos && is_safetensors_name(f.name))
      names.push_back(f.name);
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<std::string> list_safetensors(int dirfd, const std::string& shown) {
  int fd = ::dup(dirfd);
  if (fd < 0) common::throw_errno("fingerprint.open", "dup directory " + shown, errno);
  DIR* dir = ::fdopendir(fd);
  if (!dir) {
    int err = errno;
    ::close(fd);
    common::throw_errno("fingerprint.open", "list directory " + shown, err);
  }
  ::rewinddir(dir);
  std::vector<std::string> names;
  errno = 0;
  while (struct dirent* e = ::readdir(dir)) {
    std::string_view name = e->d_name;
    if (is_safetensors_name(name)) names.emplace_back(name);
  }
  int err = errno;
  ::closedir(dir);
  if (err) common::throw_errno("fingerprint.read", "list directory " + shown, err);
  std::sort(names.begin(), names.end());  // std::string compares as unsigned bytes
  return names;
}

// Resolves the model directory (absolute, normalised, no trailing '/') and, unless the
// supervisor's descriptors are the files, opens it without following a symlink on the way.
void open_model_dir(ModelReader& reader, const std::filesystem::path& model_dir) {
  std::filesystem::path abs = std::filesystem::absolute(model_dir).lexically_normal();
  reader.model_dir = abs.string();
  if (reader.model_dir.size() > 1 && reader.model_dir.back() == '/') reader.model_dir.pop_back();
  if (!reader.by_fds()) {
    std::vector<std::string> parts;
    for (const auto& p : abs.relative_path()) {
      if (!p.empty()) parts.push_back(p.string());
    }
    UniqueFd slash(::open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!slash) common::throw_errno("fingerprint.open", "open /", errno);
    reader.root = open_dir_no_symlinks(slash.get(), "/", parts);
  }
}

// The files that make the identity, each probed (lstat'ed) before a shard's byte is read.
struct ModelFiles {
  FileRef config, tokenizer;
  std::optional<FileRef> jinja, tokenizer_config;
  std::vector<FileRef> shards;  // in the fingerprint's shard_order
  // The small files read whole here (the index, tokenizer_config.json), not hashed by a job.
  std::uint64_t small_bytes = 0;
  std::size_t small_files = 0;
};

// Probes every file, so that refusals come first, reading only the index; sets out.shard_order.
ModelFiles locate_files(ModelReader& reader, std::vector<char>& buf, Fingerprint& out) {
  ModelFiles m;
  m.config = *reader.probe("config.json", true);
  m.tokenizer = *reader.probe("tokenizer.json", true);
  m.jinja = reader.probe("chat_template.jinja", false);
  if (!m.jinja) m.tokenizer_config = reader.probe("tokenizer_config.json", false);
  std::optional<FileRef> index = reader.probe(std::string(kIndexName), false);

  if (index) {
    out.shard_order =
        shards_from_index(reader.read_json_file(*index, buf, m.small_bytes), index->shown);
    ++m.small_files;
  } else if (reader.present("model.safetensors")) {
    out.shard_order = {"model.safetensors"};
  } else {
    out.shard_order = reader.by_fds() ? list_safetensors(*reader.options.model_fds)
                                      : list_safetensors(reader.root.get(), reader.model_dir);
    if (out.shard_order.empty())
      throw Error("fingerprint.no_shards", reader.model_dir + " has no " + std::string(kIndexName) +
                                               ", no model.safetensors and no *.safetensors file");
  }
  for (const auto& rel : out.shard_order) {
    FileRef f = *reader.probe(rel, true);
    if (f.before.st_size == 0) throw Error("fingerprint.empty_shard", f.shown + " is empty");
    m.shards.push_back(std::move(f));
  }
  return m;
}

// Without chat_template.jinja: the template is tokenizer_config.json's chat_template, if any.
void read_chat_template(ModelReader& reader, ModelFiles& m, std::vector<char>& buf,
                        Fingerprint& out) {
  if (!m.tokenizer_config) return;
  const FileRef& tokenizer_config = *m.tokenizer_config;
  std::string text = reader.read_json_file(tokenizer_config, buf, m.small_bytes);
  ++m.small_files;
  Json tc = parse_json(text, tokenizer_config.shown);
  if (!tc.is_object())
    throw Error("fingerprint.bad_tokenizer_config",
                tokenizer_config.shown + " is not a JSON object");
  auto it = tc.find("chat_template");
  if (it != tc.end() && !it->is_null()) {
    if (!it->is_string())
      throw Error("fingerprint.bad_tokenizer_config",
                  tokenizer_config.shown + ": chat_template is a " + std::string(it->type_name()) +
                      ", not a string; which template applies is ambiguous");
    out.identity.chat_template_hash = common::sha256_id(it->get_ref<const std::string&>());
  }
}

// One file to digest: the shards plus config, tokenizer and template, in that order.
struct Job {
  FileRef* file;
  std::string digest;
  // Only weight shards may come from the cache, and only while their state is a sound key
  // (ModelReader::write_back): a resident worker's bytes are compared with this digest and not
  // hashed again. The small files are hashed every time.
  bool cacheable = false;
  const CacheEntry* from_cache = nullptr;
  bool deferred = false;  // Options::defer_shards: left to the worker that reads it next
};

std::vector<Job> jobs_for(ModelFiles& m) {
  std::vector<Job> jobs;
  for (auto& s : m.shards) jobs.push_back({&s, {}, true});
  jobs.push_back({&m.config, {}});
  jobs.push_back({&m.tokenizer, {}});
  if (m.jinja) jobs.push_back({&*m.jinja, {}});
  return jobs;
}

// Fills every job's digest: from the cache where the file's state equals its entry exactly,
// else by reading it, largest first so that the threads finish together. Returns the threads
// that hashed; the first error of any thread is rethrown after all have stopped.
unsigned hash_all(ModelReader& reader, const Options& options, std::vector<Job>& jobs) {
  std::vector<Job*> order;
  for (auto& j : jobs) {
    // Before the cache lookup: a cached sha256 stands only beside the same fs-verity digest.
    reader.measure_fsverity(*j.file);
    if (j.cacheable) reader.write_back(*j.file);
    j.from_cache = j.cacheable ? cached(options.cache, *j.file) : nullptr;
    // Deferred only where a cache entry would be sound: whoever reads it next can then tell
    // from the same state whether these are still its bytes.
    j.deferred = !j.from_cache && options.defer_shards && j.cacheable && !j.file->fsverity &&
                 storable(*j.file);
    if (j.from_cache)
      j.digest = j.from_cache->sha256;
    else if (!j.deferred)
      order.push_back(&j);
  }
  std::stable_sort(order.begin(), order.end(), [](const Job* a, const Job* b) {
    return a->file->before.st_size > b->file->before.st_size;
  });

  // By default one thread per CPU, but no more than 8: beyond that storage, not SHA-256, limits.
  unsigned threads =
      options.threads ? options.threads : std::min(std::thread::hardware_concurrency(), 8u);
  threads = std::clamp<unsigned>(threads, 1, std::max<unsigned>(1, order.size()));
  std::atomic<std::size_t> next{0};
  std::mutex error_mutex;
  std::exception_ptr first_error;
  auto worker = [&](std::vector<char>& local) {
    for (;;) {
      std::size_t i = next.fetch_add(1);
      if (i >= order.size() || reader.cancelled.load()) return;
      try {
        order[i]->digest = reader.hash_file(*order[i]->file, local);
      } catch (...) {
        std::lock_guard lock(error_mutex);
        if (!first_error) first_error = std::current_exception();
        reader.cancelled = true;
        return;
      }
    }
  };
  {
    std::vector<std::vector<char>> buffers(threads, std::vector<char>(kReadChunk));
    std::vector<std::jthread> pool;
    for (unsigned t = 1; t < threads; ++t) pool.emplace_back(worker, std::ref(buffers[t]));
    worker(buffers[0]);
  }
  if (first_error) std::rethrow_exception(first_error);
  return threads;
}

// The identity and the per-file digests from the jobs' digests; bytes and files counted.
void assemble(const ModelFiles& m, const std::vector<Job>& jobs, Fingerprint& out) {
  const auto& shards = m.shards;
  std::uint64_t bytes = m.small_bytes;
  for (std::size_t i = 0; i < shards.size(); ++i) {
    auto size = static_cast<std::uint64_t>(shards[i].before.st_size);
    out.identity.weight_files.push_back({shards[i].rel, size, jobs[i].digest});
  }
  for (const auto& j : jobs) {
    auto size = static_cast<std::uint64_t>(j.file->before.st_size);
    FileDigest d{state_of(*j.file), j.from_cache != nullptr, j.cacheable && storable(*j.file),
                 j.deferred};
    d.state.sha256 = j.digest;
    if (j.from_cache) {
      d.state.job = j.from_cache->job;
      d.state.at = j.from_cache->at;
      out.stats.cached_bytes += size;
      ++out.stats.cached_files;
    } else if (j.deferred) {
      out.stats.deferred_bytes += size;
      ++out.stats.deferred_files;
    } else {
      bytes += size;
    }
    out.files.push_back(std::move(d));
  }
  out.identity.config_hash = jobs[shards.size()].digest;
  out.identity.tokenizer_hash = jobs[shards.size() + 1].digest;
  if (m.jinja) out.identity.chat_template_hash = jobs[shards.size() + 2].digest;
  std::sort(out.identity.weight_files.begin(), out.identity.weight_files.end(),
            [](const WeightFile& a, const WeightFile& b) { return a.path < b.path; });
  const bool complete =
      std::none_of(jobs.begin(), jobs.end(), [](const Job& j) { return j.deferred; });
  if (complete) out.identity.content_sha256 = content_sha256(out.identity);

  out.stats.bytes = bytes;
  out.stats.files = m.small_files;
  for (const auto& j : jobs) out.stats.files += !j.from_cache && !j.deferred;
}

}  // namespace

std::string content_sha256(const ModelIdentity& identity) {
  Json j = to_json(identity);
  j.erase("content_sha256");
  return common::sha256_canonical_id(j);
}

Json to_json(const ModelIdentity& identity) {
  Json files = Json::array();
  for (const auto& w : identity.weight_files)
    files.push_back({{"path", w.path}, {"bytes", w.bytes}, {"sha256", w.sha256}});
  Json j = {{"id", identity.id},
            {"config_hash", identity.config_hash},
            {"tokenizer_hash", identity.tokenizer_hash},
            {"chat_template_hash",
             identity.chat_template_hash ? Json(*identity.chat_template_hash) : Json(nullptr)},
            {"weight_files", std::move(files)},
            {"content_sha256", identity.content_sha256}};
  return j;
}

Fingerprint fingerprint_model(const std::filesystem::path& model_dir, std::string_view id,
                              const Options& options) {
  auto t0 = Clock::now();
  require_plain_ascii("model id", id);
  if (options.max_read_mib_per_second < 0)
    throw Error("fingerprint.bad_option", "max_read_mib_per_second " +
                                              std::to_string(options.max_read_mib_per_second) +
                                              " is negative");
  ModelReader reader(options);
  open_model_dir(reader, model_dir);

  std::vector<char> buf(kReadChunk);
  Fingerprint out;
  out.identity.id = std::string(id);
  ModelFiles files = locate_files(reader, buf, out);
  read_chat_template(reader, files, buf, out);

  std::vector<Job> jobs = jobs_for(files);
  out.stats.threads = hash_all(reader, options, jobs);
  assemble(files, jobs, out);
  out.stats.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return out;
}

}  // namespace assay::fingerprint
