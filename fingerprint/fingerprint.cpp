#include "fingerprint/fingerprint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <exception>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"

namespace assay::fingerprint {
namespace {

using common::Error;
using common::Json;
using common::UniqueFd;
using Clock = std::chrono::steady_clock;

// Measured here: 64 KiB reads cost a quarter of the kernel time of 256 KiB-1 MiB reads (the
// copy stays cache-hot for the hash) and match openssl dgst.
constexpr std::size_t kReadChunk = 64 * 1024;
constexpr std::size_t kMaxJsonBytes = 64 * 1024 * 1024;
constexpr std::string_view kIndexName = "model.safetensors.index.json";

// Printable ASCII only: there RFC 8785 and json.dumps(ensure_ascii=True) write the same bytes.
void require_plain_ascii(std::string_view what, std::string_view value) {
  if (value.empty()) throw Error("fingerprint.bad_name", std::string(what) + " is empty");
  for (unsigned char c : value)
    if (c < 0x20 || c > 0x7e)
      throw Error("fingerprint.bad_name",
                  std::string(what) + " '" + std::string(value) +
                      "' has a non-ASCII or control byte; its canonical JSON would differ "
                      "from Kiln's ensure_ascii form");
}

// A relative path below the model directory: no absolute path, no '.', '..' or empty part.
std::vector<std::string> split_relative(const std::string& rel) {
  require_plain_ascii("shard path", rel);
  if (rel.front() == '/')
    throw Error("fingerprint.bad_name", "shard path '" + rel + "' is absolute");
  std::vector<std::string> parts;
  std::size_t start = 0;
  for (;;) {
    std::size_t slash = rel.find('/', start);
    std::string part = rel.substr(start, slash == std::string::npos ? slash : slash - start);
    if (part.empty() || part == "." || part == "..")
      throw Error("fingerprint.bad_name",
                  "shard path '" + rel + "' has an empty, '.' or '..' component");
    parts.push_back(std::move(part));
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  return parts;
}

bool same_file_state(const struct stat& a, const struct stat& b) {
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino && a.st_size == b.st_size &&
         a.st_mtim.tv_sec == b.st_mtim.tv_sec && a.st_mtim.tv_nsec == b.st_mtim.tv_nsec &&
         a.st_ctim.tv_sec == b.st_ctim.tv_sec && a.st_ctim.tv_nsec == b.st_ctim.tv_nsec;
}

// Opens a directory one component at a time, refusing a symlink anywhere on the way.
UniqueFd open_dir_no_symlinks(int parent, const std::string& shown_parent,
                              const std::vector<std::string>& parts) {
  UniqueFd current(::dup(parent));
  if (!current) common::throw_errno("fingerprint.open", "dup directory " + shown_parent, errno);
  std::string shown = shown_parent;
  for (const auto& part : parts) {
    shown = (shown == "/") ? "/" + part : shown + "/" + part;
    struct stat st {};
    if (::fstatat(current.get(), part.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) throw Error("fingerprint.missing", shown + " does not exist");
      common::throw_errno("fingerprint.stat", "stat " + shown, errno);
    }
    if (S_ISLNK(st.st_mode))
      throw Error("fingerprint.symlink", shown + " is a symbolic link; refusing to follow it");
    if (!S_ISDIR(st.st_mode))
      throw Error("fingerprint.not_directory", shown + " is not a directory");
    int fd = ::openat(current.get(), part.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) common::throw_errno("fingerprint.open", "open directory " + shown, errno);
    current = UniqueFd(fd);
  }
  return current;
}

// One file of the model, checked (lstat) before anything is read.
struct FileRef {
  std::string rel;    // as it appears in the identity or error messages
  std::string shown;  // model_dir/rel, for error messages
  int dirfd = -1;     // borrowed from Run::dirs
  std::string leaf;
  int given_fd = -1;  // the supervisor's descriptor (Options::model_fds); then dirfd is unused
  struct stat before {};
};

class RateLimiter {
 public:
  explicit RateLimiter(double mib_per_second) : bytes_per_second_(mib_per_second * 1048576.0) {}
  // Reserves a slot for n bytes and sleeps until it starts; the first chunk goes at once.
  void acquire(std::size_t n) {
    if (bytes_per_second_ <= 0) return;
    Clock::time_point start;
    {
      std::lock_guard lock(mutex_);
      start = std::max(Clock::now(), next_);
      next_ = start + std::chrono::duration_cast<Clock::duration>(
                          std::chrono::duration<double>(n / bytes_per_second_));
    }
    std::this_thread::sleep_until(start);
  }

 private:
  double bytes_per_second_;
  std::mutex mutex_;
  Clock::time_point next_{};
};

struct Run {
  std::string model_dir;
  UniqueFd root;
  std::map<std::string, UniqueFd> dirs;  // by relative directory path ("" = root)
  std::map<std::pair<dev_t, ino_t>, std::string> seen_names;
  const Options& options;
  RateLimiter limiter;
  std::atomic<bool> cancelled{false};

  explicit Run(const Options& o) : options(o), limiter(o.max_read_mib_per_second) {}

  int dir_for(const std::vector<std::string>& parts) {
    std::string key;
    for (std::size_t i = 0; i + 1 < parts.size(); ++i) key += (i ? "/" : "") + parts[i];
    auto it = dirs.find(key);
    if (it != dirs.end()) return it->second.get();
    std::vector<std::string> dir_parts(parts.begin(), parts.end() - 1);
    UniqueFd fd = open_dir_no_symlinks(root.get(), model_dir, dir_parts);
    int raw = fd.get();
    dirs.emplace(key, std::move(fd));
    return raw;
  }

  bool by_fds() const { return options.model_fds.has_value(); }

  // True if the top-level name exists in any form (a symlink too: probe() then refuses it).
  bool present(const std::string& name) {
    if (by_fds()) return find_model_fd(*options.model_fds, name) >= 0;
    struct stat st {};
    if (::fstatat(root.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) return true;
    if (errno != ENOENT)
      common::throw_errno("fingerprint.stat", "stat " + model_dir + "/" + name, errno);
    return false;
  }

  // Stats `rel` without following links; nullopt if it does not exist and is optional.
  std::optional<FileRef> probe(const std::string& rel, bool required) {
    auto parts = split_relative(rel);
    FileRef f;
    f.rel = rel;
    f.shown = model_dir + "/" + rel;
    if (by_fds()) {
      f.given_fd = find_model_fd(*options.model_fds, rel);
      if (f.given_fd < 0) {
        if (!required) return std::nullopt;
        throw Error("fingerprint.missing_fd",
                    f.shown + " is needed but is not among the model_fds the supervisor passed");
      }
      check_given_fd(f);
    } else {
      f.dirfd = dir_for(parts);
      f.leaf = parts.back();
      if (::fstatat(f.dirfd, f.leaf.c_str(), &f.before, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno == ENOENT) {
          if (!required) return std::nullopt;
          throw Error("fingerprint.missing", f.shown + " does not exist");
        }
        common::throw_errno("fingerprint.stat", "stat " + f.shown, errno);
      }
    }
    if (S_ISLNK(f.before.st_mode))
      throw Error("fingerprint.symlink", f.shown + " is a symbolic link; refusing to follow it");
    if (!S_ISREG(f.before.st_mode))
      throw Error("fingerprint.not_regular", f.shown + " is not a regular file");
    auto key = std::make_pair(f.before.st_dev, f.before.st_ino);
    auto [it, inserted] = seen_names.emplace(key, rel);
    if (!inserted)
      throw Error("fingerprint.duplicate_inode", f.shown + " and " + model_dir + "/" + it->second +
                                                     " are two names for one file (same device "
                                                     "and inode)");
    return f;
  }

  // The descriptor is what the supervisor opened: readable, and fstat describes it.
  void check_given_fd(FileRef& f) {
    std::string which = f.shown + " (fd " + std::to_string(f.given_fd) + ")";
    int flags = ::fcntl(f.given_fd, F_GETFL);
    if (flags < 0) common::throw_errno("fingerprint.bad_fd", "fcntl " + which, errno);
    if ((flags & O_PATH) == O_PATH || (flags & O_ACCMODE) == O_WRONLY)
      throw Error("fingerprint.bad_fd", which + " is not open for reading");
    if (::fstat(f.given_fd, &f.before) != 0)
      common::throw_errno("fingerprint.bad_fd", "fstat " + which, errno);
  }

  UniqueFd open_checked(const FileRef& f) {
    if (by_fds()) {
      // A second descriptor of the same open file: closing it leaves the supervisor's intact.
      UniqueFd out(::fcntl(f.given_fd, F_DUPFD_CLOEXEC, 3));
      if (!out) common::throw_errno("fingerprint.bad_fd", "dup fd of " + f.shown, errno);
      return out;
    }
    int fd = ::openat(f.dirfd, f.leaf.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
      if (errno == ELOOP)
        throw Error("fingerprint.symlink", f.shown + " is a symbolic link; refusing to follow it");
      common::throw_errno("fingerprint.open", "open " + f.shown, errno);
    }
    UniqueFd out(fd);
    struct stat now {};
    if (::fstat(fd, &now) != 0) common::throw_errno("fingerprint.stat", "fstat " + f.shown, errno);
    if (!same_file_state(f.before, now))
      throw Error("fingerprint.changed", f.shown + " changed between stat and open");
    return out;
  }

  void check_unchanged(const FileRef& f, int fd, std::uint64_t got) {
    if (options.after_read) options.after_read(f.rel);
    struct stat after {};
    if (::fstat(fd, &after) != 0)
      common::throw_errno("fingerprint.stat", "fstat " + f.shown, errno);
    if (!same_file_state(f.before, after) || got != static_cast<std::uint64_t>(f.before.st_size))
      throw Error("fingerprint.changed",
                  f.shown + " changed while it was read (size, mtime, ctime or inode differ; " +
                      std::to_string(f.before.st_size) + " bytes at stat, " + std::to_string(got) +
                      " read)");
    // A new file renamed over the name leaves our descriptor intact: look at the name too.
    // With model_fds the descriptor is the file; there is no name to look at.
    if (by_fds()) return;
    struct stat by_name {};
    if (::fstatat(f.dirfd, f.leaf.c_str(), &by_name, AT_SYMLINK_NOFOLLOW) != 0 ||
        !same_file_state(f.before, by_name))
      throw Error("fingerprint.changed", f.shown + " was replaced or removed while it was read");
  }

  // Reads the file once, in large sequential chunks, feeding the hash (and `keep` if given).
  std::string hash_file(const FileRef& f, std::vector<char>& buf, std::string* keep = nullptr) {
    UniqueFd fd = open_checked(f);
    ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
    common::Sha256 h;
    std::uint64_t got = 0;
    for (;;) {
      if (cancelled.load(std::memory_order_relaxed))
        throw Error("fingerprint.cancelled", "cancelled after another file failed");
      limiter.acquire(buf.size());
      // pread: a given descriptor's file offset may be shared with the supervisor.
      ssize_t n = ::pread(fd.get(), buf.data(), buf.size(), static_cast<off_t>(got));
      if (n < 0) {
        if (errno == EINTR) continue;
        common::throw_errno("fingerprint.read", "read " + f.shown, errno);
      }
      if (n == 0) break;
      h.update(buf.data(), static_cast<std::size_t>(n));
      if (keep) {
        if (keep->size() + static_cast<std::size_t>(n) > kMaxJsonBytes)
          throw Error("fingerprint.too_large",
                      f.shown + " is larger than " + std::to_string(kMaxJsonBytes) + " bytes");
        keep->append(buf.data(), static_cast<std::size_t>(n));
      }
      got += static_cast<std::uint64_t>(n);
    }
    check_unchanged(f, fd.get(), got);
    return common::identity(h.finish());
  }

  std::string read_json_file(const FileRef& f, std::vector<char>& buf, std::uint64_t& bytes) {
    if (static_cast<std::uint64_t>(f.before.st_size) > kMaxJsonBytes)
      throw Error("fingerprint.too_large", f.shown + " has " + std::to_string(f.before.st_size) +
                                               " bytes, more than " +
                                               std::to_string(kMaxJsonBytes));
    std::string text;
    hash_file(f, buf, &text);
    bytes += text.size();
    return text;
  }
};

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

std::int64_t ns(const struct timespec& t) {
  return static_cast<std::int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

CacheEntry state_of(const FileRef& f) {
  CacheEntry e;
  e.name = f.rel;
  e.dev = static_cast<std::uint64_t>(f.before.st_dev);
  e.ino = static_cast<std::uint64_t>(f.before.st_ino);
  e.size = static_cast<std::uint64_t>(f.before.st_size);
  e.mtime_ns = ns(f.before.st_mtim);
  e.ctime_ns = ns(f.before.st_ctim);
  return e;
}

// The cached digest of `f` when its entry's state equals the file's state exactly.
const CacheEntry* cached(const std::vector<CacheEntry>& cache, const FileRef& f) {
  CacheEntry now = state_of(f);
  for (const CacheEntry& e : cache)
    if (e.name == now.name && e.dev == now.dev && e.ino == now.ino && e.size == now.size &&
        e.mtime_ns == now.mtime_ns && e.ctime_ns == now.ctime_ns)
      return &e;
  return nullptr;
}

}  // namespace

std::vector<CacheEntry> parse_cache(const Json& value, const std::string& where,
                                    const std::string& code) {
  if (!value.is_array()) throw Error(code, where + ": cache is not an array");
  std::vector<CacheEntry> out;
  std::set<std::string> names;
  for (std::size_t i = 0; i < value.size(); ++i) {
    std::string w = where + ": cache[" + std::to_string(i) + "]";
    const Json& v = value[i];
    if (!v.is_object()) throw Error(code, w + " is not an object");
    for (auto it = v.begin(); it != v.end(); ++it)
      if (std::string_view k = it.key(); k != "name" && k != "dev" && k != "ino" && k != "size" &&
                                         k != "mtime_ns" && k != "ctime_ns" && k != "sha256" &&
                                         k != "job" && k != "at")
        throw Error(code, w + " has an unknown field \"" + it.key() + "\"");
    auto str = [&](const char* k) {
      if (!v.contains(k) || !v[k].is_string() || v[k].get<std::string>().empty())
        throw Error(code, w + "." + k + " is not a non-empty string");
      return v[k].get<std::string>();
    };
    // dev, ino and the nanosecond times exceed 2^53: decimal strings, as in to_json().
    auto decimal = [&](const char* k, bool allow_negative) {
      std::string t = str(k);
      std::size_t digits = t.size() - (allow_negative && t[0] == '-' ? 1 : 0);
      if (digits < 1 || digits > 19 ||
          !std::all_of(t.end() - static_cast<std::ptrdiff_t>(digits), t.end(),
                       [](char c) { return c >= '0' && c <= '9'; }))
        throw Error(code, w + "." + k + " \"" + t + "\" is not a decimal integer string");
      return t;
    };
    auto u64 = [&](const char* k) { return std::stoull(decimal(k, false)); };
    auto i64 = [&](const char* k) { return std::stoll(decimal(k, true)); };
    auto size = [&] {
      if (!v.contains("size") || !v["size"].is_number_integer() ||
          v["size"].get<std::int64_t>() < 0)
        throw Error(code, w + ".size is not a non-negative integer");
      return v["size"].get<std::uint64_t>();
    };
    CacheEntry e{str("name"),     u64("dev"),    u64("ino"), size(),   i64("mtime_ns"),
                 i64("ctime_ns"), str("sha256"), str("job"), str("at")};
    if (!common::is_identity(e.sha256))
      throw Error(code, w + ".sha256 \"" + e.sha256 + "\" is not sha256:<64 lowercase hex>");
    if (!names.insert(e.name).second) throw Error(code, w + ".name \"" + e.name + "\" twice");
    out.push_back(std::move(e));
  }
  return out;
}

Json to_json(const FileDigest& f) {
  const CacheEntry& s = f.state;
  return Json{{"name", s.name},
              {"dev", std::to_string(s.dev)},
              {"ino", std::to_string(s.ino)},
              {"size", s.size},
              {"mtime_ns", std::to_string(s.mtime_ns)},
              {"ctime_ns", std::to_string(s.ctime_ns)},
              {"sha256", s.sha256},
              {"source", f.from_cache ? "cache" : "computed"},
              {"job", f.from_cache ? Json(s.job) : Json(nullptr)},
              {"at", f.from_cache ? Json(s.at) : Json(nullptr)}};
}

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
  Run run(options);
  std::filesystem::path abs = std::filesystem::absolute(model_dir).lexically_normal();
  run.model_dir = abs.string();
  if (run.model_dir.size() > 1 && run.model_dir.back() == '/') run.model_dir.pop_back();
  if (!run.by_fds()) {
    std::vector<std::string> parts;
    for (const auto& p : abs.relative_path()) {
      if (!p.empty()) parts.push_back(p.string());
    }
    UniqueFd slash(::open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!slash) common::throw_errno("fingerprint.open", "open /", errno);
    run.root = open_dir_no_symlinks(slash.get(), "/", parts);
  }

  std::vector<char> buf(kReadChunk);
  Fingerprint out;
  out.identity.id = std::string(id);

  // Every file is located and lstat'ed before a byte is read, so refusals come first.
  FileRef config = *run.probe("config.json", true);
  FileRef tokenizer = *run.probe("tokenizer.json", true);
  std::optional<FileRef> jinja = run.probe("chat_template.jinja", false);
  std::optional<FileRef> tokenizer_config;
  if (!jinja) tokenizer_config = run.probe("tokenizer_config.json", false);
  std::optional<FileRef> index = run.probe(std::string(kIndexName), false);

  std::uint64_t small_bytes = 0;
  std::size_t small_files = 0;
  if (index) {
    out.shard_order = shards_from_index(run.read_json_file(*index, buf, small_bytes), index->shown);
    ++small_files;
  } else if (run.present("model.safetensors")) {
    out.shard_order = {"model.safetensors"};
  } else {
    out.shard_order = run.by_fds() ? list_safetensors(*options.model_fds)
                                   : list_safetensors(run.root.get(), run.model_dir);
    if (out.shard_order.empty())
      throw Error("fingerprint.no_shards", run.model_dir + " has no " + std::string(kIndexName) +
                                               ", no model.safetensors and no *.safetensors file");
  }
  std::vector<FileRef> shards;
  for (const auto& rel : out.shard_order) {
    FileRef f = *run.probe(rel, true);
    if (f.before.st_size == 0) throw Error("fingerprint.empty_shard", f.shown + " is empty");
    shards.push_back(std::move(f));
  }

  if (tokenizer_config) {
    std::string text = run.read_json_file(*tokenizer_config, buf, small_bytes);
    ++small_files;
    Json tc = parse_json(text, tokenizer_config->shown);
    if (!tc.is_object())
      throw Error("fingerprint.bad_tokenizer_config",
                  tokenizer_config->shown + " is not a JSON object");
    auto it = tc.find("chat_template");
    if (it != tc.end() && !it->is_null()) {
      if (!it->is_string())
        throw Error("fingerprint.bad_tokenizer_config",
                    tokenizer_config->shown + ": chat_template is a " +
                        std::string(it->type_name()) +
                        ", not a string; which template applies is ambiguous");
      out.identity.chat_template_hash = common::sha256_id(it->get_ref<const std::string&>());
    }
  }

  // Jobs: the shards plus config, tokenizer and template, largest first so threads finish
  // together.
  struct Job {
    const FileRef* file;
    std::string digest;
    const CacheEntry* from_cache = nullptr;
  };
  std::vector<Job> jobs;
  for (const auto& s : shards) jobs.push_back({&s, {}});
  jobs.push_back({&config, {}});
  jobs.push_back({&tokenizer, {}});
  if (jinja) jobs.push_back({&*jinja, {}});
  // A file whose state equals its cache entry exactly keeps that digest and is not read.
  std::vector<Job*> order;
  for (auto& j : jobs) {
    j.from_cache = cached(options.cache, *j.file);
    if (j.from_cache)
      j.digest = j.from_cache->sha256;
    else
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
      if (i >= order.size() || run.cancelled.load()) return;
      try {
        order[i]->digest = run.hash_file(*order[i]->file, local);
      } catch (...) {
        std::lock_guard lock(error_mutex);
        if (!first_error) first_error = std::current_exception();
        run.cancelled = true;
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

  std::uint64_t bytes = small_bytes;
  for (std::size_t i = 0; i < shards.size(); ++i) {
    auto size = static_cast<std::uint64_t>(shards[i].before.st_size);
    out.identity.weight_files.push_back({shards[i].rel, size, jobs[i].digest});
  }
  for (const auto& j : jobs) {
    auto size = static_cast<std::uint64_t>(j.file->before.st_size);
    FileDigest d{state_of(*j.file), j.from_cache != nullptr};
    d.state.sha256 = j.digest;
    if (j.from_cache) {
      d.state.job = j.from_cache->job;
      d.state.at = j.from_cache->at;
      out.stats.cached_bytes += size;
      ++out.stats.cached_files;
    } else {
      bytes += size;
    }
    out.files.push_back(std::move(d));
  }
  out.identity.config_hash = jobs[shards.size()].digest;
  out.identity.tokenizer_hash = jobs[shards.size() + 1].digest;
  if (jinja) out.identity.chat_template_hash = jobs[shards.size() + 2].digest;
  std::sort(out.identity.weight_files.begin(), out.identity.weight_files.end(),
            [](const WeightFile& a, const WeightFile& b) { return a.path < b.path; });
  out.identity.content_sha256 = content_sha256(out.identity);

  out.stats.bytes = bytes;
  out.stats.files = jobs.size() - out.stats.cached_files + small_files;
  out.stats.threads = threads;
  out.stats.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return out;
}

}  // namespace assay::fingerprint
