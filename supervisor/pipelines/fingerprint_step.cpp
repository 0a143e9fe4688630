#include "supervisor/pipelines/fingerprint_step.h"

#include <fcntl.h>
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
#include "fingerprint/model_fds.h"

namespace assay::supervisor {

using common::Error;
using common::Json;
namespace fs = std::filesystem;
namespace fp = assay::fingerprint;

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
// The shards a worker says it left unread ("deferred" in files) must be exactly the weight
// files whose sha256 its identity leaves null, each one it calls cacheable (the premise of leaving
// it to the next reader), and none at all unless the identity is pending: otherwise a digest
// nobody computed could reach the identity, or a deferred file escape the reader's state check.
void check_deferred(const Json& output, bool pending, const std::string& role) {
  std::set<std::string> deferred, unhashed, cacheable;
  for (const Json& f : output.value("files", Json::array()))
    if (f.value("source", Json()) == "deferred") deferred.insert(f.value("name", std::string()));
  for (const Json& n : output.value("cacheable", Json::array()))
    if (n.is_string()) cacheable.insert(n.get<std::string>());
  if (pending)
    for (const Json& w : output["pending_identity"].value("weight_files", Json::array()))
      if (w.value("sha256", Json()).is_null()) unhashed.insert(w.value("path", std::string()));
  bool settled =
      std::includes(cacheable.begin(), cacheable.end(), deferred.begin(), deferred.end());
  if (deferred != unhashed || !settled || (pending && deferred.empty()))
    throw Error("worker.fingerprint_output",
                role + " output.json defers " + Json(deferred).dump() +
                    " but leaves the sha256 of " + Json(unhashed).dump() +
                    " unknown (cacheable: " + Json(cacheable).dump() +
                    "): the deferred shards must be exactly the unhashed weight files, each "
                    "cacheable");
  // Their states go to the reader as given: each must parse (a 19-digit time may overflow).
  if (pending) {
    FingerprintRun run;
    run.output = output;
    fp::parse_file_states(deferred_files(run), role + " output.json's deferred files",
                          "worker.fingerprint_output");
  }
}

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

Json state_json(const fp::FileState& s) {
  return Json{{"name", s.name},
              {"dev", std::to_string(s.dev)},
              {"ino", std::to_string(s.ino)},
              {"size", s.size},
              {"mtime_ns", std::to_string(s.mtime_ns)},
              {"ctime_ns", std::to_string(s.ctime_ns)}};
}

Json settled_json(const fp::SettledState& s) {
  Json j = state_json(s.state);
  if (s.fsverity_digest) j["fsverity_digest"] = *s.fsverity_digest;
  return j;
}

// settled_state of one opened file; a file whose fs-verity digest cannot be measured has none.
std::optional<fp::SettledState> settle(int fd, const std::string& name) {
  try {
    return fp::settled_state(fd, name);
  } catch (const Error&) {
    return std::nullopt;
  }
}

// The fingerprint executable's state by its path (the one the engine runs): a fingerprint is
// reused only from the same program.
std::optional<Json> worker_state(const fs::path& worker) {
  struct stat st {};
  if (::stat(worker.c_str(), &st) != 0) return std::nullopt;
  return state_json(fp::file_state(worker.string(), st));
}

// What the supervisor saw of the model directory as the fingerprint worker read it: every file
// at its top settled (fp::settled_state) before the worker started, and a duplicate of each
// descriptor to settle it again when the fingerprint completes.
struct SeenDirectory {
  bool sound = false;
  std::vector<common::UniqueFd> fds;
  std::vector<fp::SettledState> states;
};

void see(SeenDirectory& seen, const OpenedModel& m) {
  seen = SeenDirectory{};
  seen.sound = true;
  for (std::size_t i = 0; i < m.files.size() && seen.sound; ++i) {
    auto state = settle(m.files[i].fd.get(), m.names[i]);
    int dup = ::fcntl(m.files[i].fd.get(), F_DUPFD_CLOEXEC, 3);
    seen.sound = state && state->settled() && dup >= 0;
    if (dup >= 0) seen.fds.emplace_back(dup);
    if (state) seen.states.push_back(std::move(*state));
  }
  if (!seen.sound) seen = SeenDirectory{};
}

// The whole-directory record of a complete fingerprint `output`, or null when the directory
// cannot be proven to be what the worker read: a file not settled when the worker started, one
// whose state or fs-verity digest moved since, or a file the output lists in another state.
Json directory_record(const SeenDirectory& seen, const Json& output, const std::string& name,
                      const Json& worker, const std::string& job, const std::string& at) {
  if (!seen.sound || !output.contains("model_identity")) return nullptr;
  Json files = Json::array();
  for (std::size_t i = 0; i < seen.states.size(); ++i) {
    const fp::SettledState& then = seen.states[i];
    auto now = settle(seen.fds[i].get(), then.state.name);
    if (!now || !(now->state == then.state) || now->fsverity_digest != then.fsverity_digest)
      return nullptr;
    files.push_back(settled_json(then));
  }
  for (const Json& f : output.value("files", Json::array())) {
    try {
      fp::FileState listed = fp::parse_file_state(f, "output", "worker.fingerprint_output");
      auto it =
          std::find_if(seen.states.begin(), seen.states.end(),
                       [&](const fp::SettledState& s) { return s.state.name == listed.name; });
      if (it == seen.states.end() || !(it->state == listed)) return nullptr;
    } catch (const Error&) {
      return nullptr;
    }
  }
  return Json{{"id", name},     {"fingerprint_worker", worker},
              {"files", files}, {"output", output},
              {"job", job},     {"at", at}};
}

// The fingerprint output of `record` when it stands for `opened` now: the same model name and
// fingerprint executable, the same file names, and each file settled now in the state recorded.
std::optional<Json> reusable(const Json& record, const OpenedModel& opened, const std::string& name,
                             const std::optional<Json>& worker) {
  if (!record.is_object() || record.value("id", Json()) != name || !worker ||
      record.value("fingerprint_worker", Json()) != *worker)
    return std::nullopt;
  const Json files = record.value("files", Json());
  const Json output = record.value("output", Json());
  if (!files.is_array() || files.size() != opened.names.size() || !output.is_object() ||
      output.value("schema", Json()) != protocol::kFingerprintOutput ||
      !output.value("model_identity", Json()).is_object() ||
      output["model_identity"].value("id", Json()) != name ||
      !output["model_identity"].value("content_sha256", Json()).is_string() ||
      !output.value("files", Json()).is_array())
    return std::nullopt;
  for (std::size_t i = 0; i < files.size(); ++i) {
    if (files[i].value("name", Json()) != opened.names[i]) return std::nullopt;
    auto now = settle(opened.files[i].fd.get(), opened.names[i]);
    if (!now || settled_json(*now) != files[i]) return std::nullopt;
  }
  return output;
}

}  // namespace

Json fingerprint_section(const FingerprintRun& run) {
  Json section{{"implementation_sha256", run.output.value("implementation_sha256", Json(nullptr))},
               {"files", run.output.value("files", Json(nullptr))},
               {"process", run.evidence ? run.evidence->to_json() : Json(nullptr)}};
  if (run.reused) section["reused"] = *run.reused;
  return section;
}

bool fingerprint_cache_on(const Config& config) {
  return config.fingerprint_cache && !config.state_dir.empty();
}

Json load_fingerprint_cache(const fs::path& state_dir, const std::string& model_dir) {
  std::error_code ec;
  fs::path file = fingerprint_cache_file(state_dir, model_dir);
  if (!fs::exists(file, ec)) return nullptr;
  try {
    Json doc = common::parse_strict(common::read_file(file, 64 << 20));
    if (doc.value("schema", "") != kFingerprintCacheSchema ||
        doc.value("model_dir", "") != model_dir || !doc.value("entries", Json()).is_array())
      return nullptr;
    return doc;
  } catch (const Error&) {
    return nullptr;  // a damaged cache costs a re-hash, never a job
  }
}

void store_fingerprint_cache(const fs::path& state_dir, const std::string& model_dir,
                             const Json& output, const std::string& job_id, const std::string& at,
                             const Json& directory) {
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
  Json doc{{"schema", kFingerprintCacheSchema}, {"model_dir", model_dir}, {"entries", entries}};
  if (!directory.is_null()) doc["directory"] = directory;
  common::replace_file_fast(file, doc.dump() + "\n", 0600);
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
  // The cache file, read once per step: by the reuse check when it runs, else when the input is
  // made (its entries), never twice.
  auto file = std::make_shared<std::optional<Json>>();
  auto cache_file = [file, state_dir, model_dir]() -> const Json& {
    if (!*file) *file = load_fingerprint_cache(state_dir, model_dir);
    return **file;
  };
  fs::path worker = config.fingerprint_worker;
  auto seen = std::make_shared<SeenDirectory>();
  Step step{role,
            config.fingerprint_worker,
            "run",
            model_dir,
            {},
            [input, passed, cache, cache_file] {
              Json in = input;
              if (cache && cache_file().is_object()) *passed = cache_file()["entries"];
              if (!passed->empty()) in["cache"] = *passed;
              return in;
            },
            {},
            [&out, expected, role, passed, cache, state_dir, model_dir, name, worker, seen,
             defer_shards](Json output, const contain::Evidence& evidence) {
              // Read without trusting its shape (fuzz_worker_output: a model_identity that is a
              // string).
              const Json schema = output.is_object() ? output.value("schema", Json()) : Json();
              if (schema != protocol::kFingerprintOutput)
                throw Error("worker.fingerprint_output", role + " output.json has schema " +
                                                             common::printable(schema.dump(), 80));
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
              check_deferred(output, pending, role);
              check_cache_hits(output, *passed);
              // The job is the workspace's parent: STATE/jobs/<id>/<role>.
              std::string job =
                  evidence.spawn
                      ? fs::path(evidence.spawn->workdir).parent_path().filename().string()
                      : std::string();
              auto store = [cache, state_dir, model_dir, job, role, name, worker,
                            seen](const Json& complete) {
                if (!cache) return;
                try {
                  const std::string by = job.empty() ? role : job, at = common::now_rfc3339();
                  auto exe = worker_state(worker);
                  Json directory =
                      exe ? directory_record(*seen, complete, name, *exe, by, at) : Json(nullptr);
                  *seen = SeenDirectory{};  // its descriptors are not needed any more
                  store_fingerprint_cache(state_dir, model_dir, complete, by, at, directory);
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
  if (!cache) return step;
  // Before the worker reads them: every file settled, so that a write after this point moves a
  // ctime that the completed fingerprint's record then no longer matches.
  step.opened_model = [seen](const OpenedModel& m) { see(*seen, m); };
  step.reuse = [&out, expected, cache_file, name, worker](const OpenedModel& m) {
    const Json& doc = cache_file();
    const Json record = doc.is_object() ? doc.value("directory", Json()) : Json();
    std::optional<Json> output = reusable(record, m, name, worker_state(worker));
    if (!output) return false;
    check_expected((*output)["model_identity"], expected, false);
    const Json by{{"job", record.value("job", Json())}, {"at", record.value("at", Json())}};
    // Every digest now comes from the cache: each file with the job and time that computed it.
    for (Json& f : (*output)["files"]) {
      if (!f.is_object()) continue;
      if (f.value("source", Json()) != "cache") {
        f["source"] = "cache";
        f["job"] = by["job"];
        f["at"] = by["at"];
      }
      f.erase("reader");
    }
    out.output = std::move(*output);
    out.evidence.reset();
    out.expected = expected;
    out.store_cache = nullptr;
    out.reused = by;
    return true;
  };
  return step;
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

void check_deferred_unchanged(const FingerprintRun& fingerprint, const OpenedModel& opened,
                              const std::string& role) {
  for (const fp::FileState& want :
       fp::parse_file_states(deferred_files(fingerprint), "the fingerprint's deferred files",
                             "supervisor.internal")) {
    auto it = std::find(opened.names.begin(), opened.names.end(), want.name);
    const std::string what =
        it == opened.names.end()
            ? "it is gone"
            : fp::state_difference(
                  want, fp::file_state(
                            want.name,
                            opened.files[static_cast<std::size_t>(it - opened.names.begin())].st));
    if (!what.empty())
      throw Error("job.bytes_mismatch",
                  "weight file " + want.name + " changed after the fingerprint left it to the " +
                      role + " worker (" + what +
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
