// The fingerprint step every job kind starts with: the model's identity (fingerprint worker),
// the request's expected identity checked against it, the fingerprint cache, the shards a cold
// job leaves to its oracle (one pass over the weights) and the check that the bytes a worker
// computed with are the identity the result names.
#pragma once

#include <filesystem>
#include <functional>
#include <optional>
#include <string>

#include "common/json.h"
#include "supervisor/config.h"
#include "supervisor/contain/evidence.h"
#include "supervisor/pipelines/admission.h"
#include "supervisor/pipelines/pipeline.h"

namespace assay::supervisor {

struct FingerprintRun {
  common::Json output;  // assay.fingerprint-output.v1
  std::optional<contain::Evidence> evidence;
  // The model identity; while shards are deferred (pending()), the identity without
  // content_sha256 and with those shards' sha256 null.
  const common::Json& identity() const {
    return output[pending() ? "pending_identity" : "model_identity"];
  }
  // Whether the fingerprint left shards to the next reader (fingerprint_step's defer_shards)
  // and complete_fingerprint has not yet filled them in.
  bool pending() const { return output.is_object() && output.contains("pending_identity"); }
  // Set by fingerprint_step for complete_fingerprint: the request's expected identity, and where
  // the completed digests are cached.
  std::optional<common::Json> expected;
  std::function<void(const common::Json& output)> store_cache;
  // Set when no fingerprint worker ran because the fingerprint of an earlier job was reused
  // (fingerprint_step): {"job", "at"} of the job that computed it; evidence is then empty.
  std::optional<common::Json> reused;
};
// A result's "model_fingerprint": {implementation_sha256, files (each computed in this job or
// taken from the fingerprint cache, with the job and time that computed it), process (null when
// no worker ran), and "reused": {job, at} when the whole fingerprint was an earlier job's}.
common::Json fingerprint_section(const FingerprintRun& run);
// Fingerprints `model_dir` into `out`; fails the job with Error("job.identity_mismatch") when
// `expected` is given and its content_sha256 differs. `out` must outlive the step.
// With defer_shards (one pass over the weights in a cold job), a shard the worker would hash is
// left to the step that reads it next when its state is a sound cache key (fingerprint
// README): `out` is then pending() until complete_fingerprint, the parts of `expected` that are
// known are checked now and the rest at completion, and nothing is cached before then.
//
// With the cache on, no worker runs for a model directory whose fingerprint the supervisor can
// prove unchanged (Step::reuse): the cache file also keeps the last complete fingerprint of the
// directory with the state of every file at its top, each taken as the worker takes a shard's
// (dirty pages written back, then fstat, on a filesystem whose ctime follows mapped writes; its
// fs-verity digest), before the worker read it and again, equal and settled, when the
// fingerprint completed. A later job whose opened files have exactly those names and states
// (taken the same way), for the same model name and the same fingerprint executable (its
// path's state), takes that fingerprint: a write since would have moved a ctime.
Step fingerprint_step(const Config& config, const std::string& role, const std::string& model_dir,
                      const std::string& name, const std::optional<common::Json>& expected,
                      FingerprintRun& out, bool defer_shards = false);
// The input "unchanged_files" for the worker that reads the deferred shards: each with the
// state the fingerprint saw ([] when none is deferred).
common::Json deferred_files(const FingerprintRun& fingerprint);
// Throws Error("job.bytes_mismatch") naming the first deferred shard whose file, as the engine
// opened it for the next step, is missing or not in the state the fingerprint saw: the model
// directory changed between the fingerprint and its reader.
void check_deferred_unchanged(const FingerprintRun& fingerprint, const OpenedModel& opened,
                              const std::string& role);
// Fills the deferred shards' digests from `output`'s bytes_used (the worker was given
// deferred_files() and checked that every such shard kept its state while it read and hashed
// it), computes content_sha256, checks the expected identity and caches the digests. Throws
// Error("job.bytes_mismatch") when a deferred shard is missing from bytes_used, has other bytes
// or no sha256, and Error("job.identity_mismatch") as fingerprint_step does. No-op when not
// pending().
void complete_fingerprint(FingerprintRun& fingerprint, const common::Json& output,
                          const std::string& role);

// The fingerprint cache: per model directory, STATE/fingerprint-cache/<sha256 of the path>.json
// holds the per-file digests of the last successful fingerprint with each file's (dev, ino,
// size, mtime, ctime). fingerprint_step passes them to the worker (which cannot see the state
// directory), the worker reuses a digest only on an exact match, and after a successful step the
// file is rewritten (common::replace_file_fast: losing it only costs a re-hash).
bool fingerprint_cache_on(const Config& config);
// The cache file of `model_dir`: {entries (the per-file digests), directory (the whole-directory
// record fingerprint_step keeps beside them, or absent)}, or null when there is none or it is
// unreadable or malformed.
common::Json load_fingerprint_cache(const std::filesystem::path& state_dir,
                                    const std::string& model_dir);
// Stores the files of a successful fingerprint output: digests computed now under `job_id` and
// `at`, reused ones with their original job and time; a file whose mtime or ctime is less than
// 2 s old is left out (it could change again within the same timestamp tick). `directory`, when
// not null, is kept as the whole-directory record.
void store_fingerprint_cache(const std::filesystem::path& state_dir, const std::string& model_dir,
                             const common::Json& fingerprint_output, const std::string& job_id,
                             const std::string& at, const common::Json& directory = nullptr);
// Forgets `model_dir`'s entries (`assay fingerprint --refresh`): its next fingerprint reads every
// file. Returns whether there were any.
bool drop_fingerprint_cache(const std::filesystem::path& state_dir, const std::string& model_dir);

// The oracle's report of the bytes it computed with (output "bytes_used") must equal what the
// fingerprint worker hashed: every weight file (path, bytes, sha256), config_hash and
// tokenizer_hash. A weight file the oracle mapped under fs-verity ({path, bytes, fsverity_digest,
// "bound_by": "fs-verity"}) matches when the fingerprint read the same path and bytes with that
// same fs-verity digest (its output "files"); the fingerprint's sha256 then stands for it. Throws
// Error("job.bytes_mismatch") naming the first difference, so that no result names one model and
// carries another's logits.
void check_bytes_used(const common::Json& oracle_output, const FingerprintRun& fingerprint,
                      const std::string& role);

}  // namespace assay::supervisor
