#include "supervisor/pipelines/fingerprint_step.h"

#include <sys/stat.h>

#include <algorithm>
#include <memory>
#include <set>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/protocol.h"
#include "common/request.h"
#include "common/text.h"
#include "common/time.h"

namespace assay::supervisor {

using common::Error;
using common::Json;
namespace fs = std::filesystem;

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
    f.erase("reader");
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

namespace {

// The request's expected identity against a fingerprint's: whole (content_sha256), or while
// shards are deferred, every field already known (so a wrong model is still refused before a
// forward runs).
void check_expected(const Json& identity, const std::optional<Json>& expected, bool pending) {
  if (!expected) return;
  bool differs = false;
  if (!pending) {
    differs = expected->value("content_sha256", Json()) != identity.value("content_sha256", Json());
  } else {
    for (const char* k : {"id", "config_hash", "tokenizer_hash", "chat_template_hash"})
      differs |= expected->value(k, Json()) != identity.value(k, Json());
    const Json want = expected->value("weight_files", Json::array()),
               got = identity.value("weight_files", Json::array());
    differs |= !want.is_array() || !got.is_array() || want.size() != got.size();
    for (std::size_t i = 0; !differs && i < got.size(); ++i) {
      const Json& g = got[i];
      const Json& w = want[i];
      differs = !w.is_object() || w.value("path", Json()) != g.value("path", Json()) ||
                w.value("bytes", Json()) != g.value("bytes", Json()) ||
                (!g.value("sha256", Json()).is_null() &&
                 w.value("sha256", Json()) != g.value("sha256", Json()));
    }
  }
  if (differs)
    throw Error("job.identity_mismatch",
                "the model directory's identity " +
                    (pending ? std::string("(its shards not yet hashed)")
                             : identity.value("content_sha256", Json()).dump()) +
                    " differs from the request's expected identity " +
                    expected->value("content_sha256", Json()).dump() +
                    "; fingerprinted: " + identity.dump() + "; expected: " + expected->dump());
}

}  // namespace

Step fingerprint_step(const Config& config, const std::string& role, const std::string& model_dir,
                      const std::string& name, const std::optional<Json>& expected,
                      FingerprintRun& out, bool defer_shards) {
  Json input{{"schema", protocol::kFingerprintInput},
             {"model_dir", model_dir},
             {"id", name},
             {"threads", config.fingerprint_threads}};
  if (defer_shards) input["defer_shards"] = true;
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
      [&out, expected, role, passed, cache, state_dir, model_dir, defer_shards](
          Json output, const contain::Evidence& evidence) {
        // Read without trusting its shape (fuzz_worker_output: a model_identity that is a string).
        const Json schema = output.is_object() ? output.value("schema", Json()) : Json();
        if (schema != protocol::kFingerprintOutput)
          throw Error("worker.fingerprint_output",
                      role + " output.json has schema " + common::printable(schema.dump(), 80));
        const bool pending = output.contains("pending_identity");
        if (pending && !defer_shards)
          throw Error("worker.fingerprint_output",
                      role + " output.json defers shards that it was asked to hash");
        const char* key = pending ? "pending_identity" : "model_identity";
        const Json& identity = common::require(output, key, "fingerprint output");
        if (!identity.is_object())
          throw Error("worker.fingerprint_output",
                      role + " output.json's " + key + " is not an object");
        if (!pending && !identity.value("content_sha256", Json()).is_string())
          throw Error("worker.fingerprint_output",
                      role + " output.json's model_identity has no content_sha256");
        check_expected(identity, expected, pending);
        check_cache_hits(output, *passed);
        // The job is the workspace's parent: STATE/jobs/<id>/<role>.
        std::string job = evidence.spawn
                              ? fs::path(evidence.spawn->workdir).parent_path().filename().string()
                              : std::string();
        auto store = [cache, state_dir, model_dir, job, role](const Json& complete) {
          if (!cache) return;
          try {
            store_fingerprint_cache(state_dir, model_dir, complete, job.empty() ? role : job,
                                    common::now_rfc3339());
          } catch (const Error&) {
            // A cache that cannot be written costs the next job a re-hash, not this job.
          }
        };
        if (!pending) store(output);
        out.output = std::move(output);
        out.evidence = evidence;
        out.expected = expected;
        out.store_cache = pending ? std::function<void(const Json&)>(store) : nullptr;
      }};
}

Json deferred_files(const FingerprintRun& fingerprint) {
  Json out = Json::array();
  if (!fingerprint.pending()) return out;
  for (const Json& f : fingerprint.output.value("files", Json::array()))
    if (f.is_object() && f.value("source", Json()) == "deferred")
      out.push_back(Json{{"name", f.value("name", Json())},
                         {"dev", f.value("dev", Json())},
                         {"ino", f.value("ino", Json())},
                         {"size", f.value("size", Json())},
                         {"mtime_ns", f.value("mtime_ns", Json())},
                         {"ctime_ns", f.value("ctime_ns", Json())}});
  return out;
}

void check_deferred_unchanged(const FingerprintRun& fingerprint,
                              const std::vector<std::string>& names,
                              const std::vector<struct stat>& states, const std::string& role) {
  auto ns = [](const struct timespec& t) {
    return std::to_string(static_cast<std::int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec);
  };
  for (const Json& want : deferred_files(fingerprint)) {
    const std::string name = want.value("name", std::string());
    auto it = std::find(names.begin(), names.end(), name);
    std::string what;
    if (it == names.end()) {
      what = "it is gone";
    } else {
      const struct stat& st = states[static_cast<std::size_t>(it - names.begin())];
      Json now{{"name", name},
               {"dev", std::to_string(st.st_dev)},
               {"ino", std::to_string(st.st_ino)},
               {"size", static_cast<std::uint64_t>(st.st_size)},
               {"mtime_ns", ns(st.st_mtim)},
               {"ctime_ns", ns(st.st_ctim)}};
      for (const char* k : {"dev", "ino", "size", "mtime_ns", "ctime_ns"})
        if (now[k] != want.value(k, Json()))
          what += (what.empty() ? "" : "; ") + std::string(k) + " " + want.value(k, Json()).dump() +
                  " is now " + now[k].dump();
    }
    if (!what.empty())
      throw Error("job.bytes_mismatch",
                  "weight file " + name + " changed after the fingerprint left it to the " + role +
                      " worker (" + what +
                      "): the model directory changed during the job; no result is signed");
  }
}

void complete_fingerprint(FingerprintRun& fingerprint, const Json& output,
                          const std::string& role) {
  if (!fingerprint.pending()) return;
  const Json used = output.is_object() ? output.value("bytes_used", Json()) : Json();
  const Json got = used.is_object() ? used.value("weight_files", Json()) : Json();
  auto digest_of = [&](const std::string& path, const Json& bytes) {
    const Json* entry = nullptr;
    if (got.is_array())
      for (const Json& g : got)
        if (g.is_object() && g.value("path", Json()) == path) entry = &g;
    const Json sha = entry ? entry->value("sha256", Json()) : Json();
    if (!entry || entry->value("bytes", Json()) != bytes || !sha.is_string() ||
        !common::is_identity(sha.get<std::string>()))
      throw Error("job.bytes_mismatch",
                  "the fingerprint left weight file " + path + " (" + bytes.dump() +
                      " bytes) to the " + role + " worker, whose bytes_used has " +
                      (entry ? entry->dump() : std::string("no entry for it")) +
                      ": the model's identity is unknown; no result is signed");
    return sha;
  };
  Json identity = fingerprint.output["pending_identity"];
  for (Json& w : identity["weight_files"])
    if (w.value("sha256", Json()).is_null())
      w["sha256"] = digest_of(w.value("path", std::string()), w.value("bytes", Json()));
  identity["content_sha256"] = common::model_content_sha256(identity);
  for (Json& f : fingerprint.output["files"]) {
    if (f.value("source", Json()) != "deferred") continue;
    for (const Json& w : identity["weight_files"])
      if (w["path"] == f["name"]) f["sha256"] = w["sha256"];
    // Hashed by the reader as it read the bytes it computed with, in the state listed here.
    f["source"] = "reader";
    f["reader"] = role;
  }
  fingerprint.output.erase("pending_identity");
  fingerprint.output["model_identity"] = std::move(identity);
  check_expected(fingerprint.output["model_identity"], fingerprint.expected, false);
  if (fingerprint.store_cache) fingerprint.store_cache(fingerprint.output);
  fingerprint.store_cache = nullptr;
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

}  // namespace assay::supervisor
