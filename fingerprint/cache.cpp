// The fingerprint cache's side of a fingerprint: the worker input's `cache` parsed strictly into
// CacheEntry values, a probed file's state (its cache key, fs-verity digest included), the lookup
// that reuses a digest only for a file whose state is exactly its entry's, and a hashed file's
// document in the output.
#include <algorithm>
#include <set>

#include "common/error.h"
#include "common/fsverity.h"
#include "common/identity.h"
#include "fingerprint/fingerprint.h"
#include "fingerprint/reader.h"

namespace assay::fingerprint {
namespace {

using common::Error;
using common::Json;

std::int64_t ns(const struct timespec& t) {
  return static_cast<std::int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

}  // namespace

namespace {

// An entry keyed by `s`, its digest, fs-verity digest, job and time still empty.
CacheEntry keyed_by(FileState s) {
  CacheEntry e;
  e.name = std::move(s.name);
  e.dev = s.dev;
  e.ino = s.ino;
  e.size = s.size;
  e.mtime_ns = s.mtime_ns;
  e.ctime_ns = s.ctime_ns;
  return e;
}

}  // namespace

CacheEntry state_of(const FileRef& f) {
  CacheEntry e = keyed_by(file_state(f.rel, f.before));
  e.fsverity_digest = f.fsverity;
  return e;
}

const CacheEntry* cached(const std::vector<CacheEntry>& cache, const FileRef& f) {
  if (!f.sound_key) return nullptr;
  CacheEntry now = state_of(f);
  for (const CacheEntry& e : cache)
    if (e.name == now.name && e.dev == now.dev && e.ino == now.ino && e.size == now.size &&
        e.mtime_ns == now.mtime_ns && e.ctime_ns == now.ctime_ns &&
        e.fsverity_digest == now.fsverity_digest)
      return &e;
  return nullptr;
}

bool storable(const FileRef& f) {
  const std::int64_t before = f.written_back_ns - kRacyNs;
  return f.sound_key && ns(f.before.st_mtim) < before && ns(f.before.st_ctim) < before;
}

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
      if (std::string_view k = it.key();
          k != "name" && k != "dev" && k != "ino" && k != "size" && k != "mtime_ns" &&
          k != "ctime_ns" && k != "fsverity_digest" && k != "sha256" && k != "job" && k != "at")
        throw Error(code, w + " has an unknown field \"" + it.key() + "\"");
    auto str = [&](const char* k) {
      if (!v.contains(k) || !v[k].is_string() || v[k].get<std::string>().empty())
        throw Error(code, w + "." + k + " is not a non-empty string");
      return v[k].get<std::string>();
    };
    CacheEntry e = keyed_by(parse_file_state(v, w, code));
    e.sha256 = str("sha256");
    e.job = str("job");
    e.at = str("at");
    if (!common::is_identity(e.sha256))
      throw Error(code, w + ".sha256 \"" + e.sha256 + "\" is not sha256:<64 lowercase hex>");
    if (v.contains("fsverity_digest")) {
      e.fsverity_digest = str("fsverity_digest");
      if (!common::is_fsverity_digest(*e.fsverity_digest))
        throw Error(code, w + ".fsverity_digest \"" + *e.fsverity_digest +
                              "\" is not sha256:<64 hex> or sha512:<128 hex>, lowercase");
    }
    if (!names.insert(e.name).second) throw Error(code, w + ".name \"" + e.name + "\" twice");
    out.push_back(std::move(e));
  }
  return out;
}

Json to_json(const FileDigest& f) {
  const CacheEntry& s = f.state;
  Json j{{"name", s.name},
         {"dev", std::to_string(s.dev)},
         {"ino", std::to_string(s.ino)},
         {"size", s.size},
         {"mtime_ns", std::to_string(s.mtime_ns)},
         {"ctime_ns", std::to_string(s.ctime_ns)},
         {"sha256", f.deferred ? Json(nullptr) : Json(s.sha256)},
         {"source", f.from_cache ? "cache"
                    : f.deferred ? "deferred"
                                 : "computed"},
         {"job", f.from_cache ? Json(s.job) : Json(nullptr)},
         {"at", f.from_cache ? Json(s.at) : Json(nullptr)}};
  // Absent rather than null without fs-verity: the documents of such files stay as they were.
  if (s.fsverity_digest) j["fsverity_digest"] = *s.fsverity_digest;
  return j;
}

}  // namespace assay::fingerprint
