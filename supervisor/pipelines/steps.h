// Pieces the job kinds share: the fingerprint step with its identity check, the request file,
// moving an artifact into the job directory, and sealing a result.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/json.h"
#include "common/sign.h"
#include "supervisor/jobs/store.h"
#include "supervisor/pipelines/pipeline.h"

namespace assay::supervisor {

// A job's request.json, parsed strictly.
common::Json read_request(const std::filesystem::path& job_dir);
// The job's checks.json (Admission::checks), or {} for a job without one.
common::Json read_checks(const std::filesystem::path& job_dir);
// Intra-op threads of a reference worker: config.worker_threads, or where that is 0 every CPU of
// assayd's affinity mask (a cpuset or CPUAffinity= narrows it).
int worker_threads(const Config& config);

struct FingerprintRun {
  common::Json output;  // assay.fingerprint-output.v1
  std::optional<contain::Evidence> evidence;
  const common::Json& identity() const { return output["model_identity"]; }
};
// A result's "model_fingerprint": {implementation_sha256, files (each computed in this job or
// taken from the fingerprint cache, with the job and time that computed it), process}.
common::Json fingerprint_section(const FingerprintRun& run);
// Fingerprints `model_dir` into `out`; fails the job with Error("job.identity_mismatch") when
// `expected` is given and its content_sha256 differs. `out` must outlive the step.
Step fingerprint_step(const Config& config, const std::string& role, const std::string& model_dir,
                      const std::string& name, const std::optional<common::Json>& expected,
                      FingerprintRun& out);

// The fingerprint cache: per model directory, STATE/fingerprint-cache/<sha256 of the path>.json
// holds the per-file digests of the last successful fingerprint with each file's (dev, ino,
// size, mtime, ctime). fingerprint_step passes them to the worker (which cannot see the state
// directory), the worker reuses a digest only on an exact match, and after a successful step the
// file is rewritten (common::replace_file_fast: losing it only costs a re-hash).
bool fingerprint_cache_on(const Config& config);
// The entries known for `model_dir` ([] when none, or when the file is unreadable or malformed).
common::Json load_fingerprint_cache(const std::filesystem::path& state_dir,
                                    const std::string& model_dir);
// Stores the files of a successful fingerprint output: digests computed now under `job_id` and
// `at`, reused ones with their original job and time; a file whose mtime or ctime is less than
// 2 s old is left out (it could change again within the same timestamp tick).
void store_fingerprint_cache(const std::filesystem::path& state_dir, const std::string& model_dir,
                             const common::Json& fingerprint_output, const std::string& job_id,
                             const std::string& at);
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

// take_artifact, then the sha256 of what was moved, which must be what the worker reported
// (`reported`, an "sha256:<hex>" or anything else): Error("worker.compare_output") naming both
// and `what` otherwise. Returns the digest.
std::string take_reported_artifact(const std::filesystem::path& from,
                                   const std::filesystem::path& to, const common::Json& reported,
                                   const std::string& what);

// The comparison step of a kind ("compare": `assay-compare MODE`): `input(&move_in)` builds its
// input and names the files moved into its workspace (`input(nullptr)`: the input only);
// `open_files` are handed over as descriptors; its output is checked by `check` (which throws
// common::Error to fail the job), then kept in `output` with its `evidence`, which must outlive
// the step.
Step compare_step(
    const Config& config, const std::string& mode, std::vector<std::string> open_files,
    std::function<common::Json(std::vector<std::pair<std::filesystem::path, std::string>>*)> input,
    std::function<void(const common::Json&)> check, common::Json& output,
    std::optional<contain::Evidence>& evidence);

// Renames a worker's artifact to `to` (0600); its data and the rename become durable with the
// job's terminal commit. Throws Error("job.artifact").
std::filesystem::path take_artifact(const std::filesystem::path& from,
                                    const std::filesystem::path& to);

// The result's "implementation": {executables: {role: {path, bytes, sha256}}, libraries: [{path,
// bytes, sha256}], hashing: {files, bytes_hashed, bytes_cached, seconds}}. `executables` are
// (role, path) pairs ("assayd-serve" is /proc/self/exe); `libraries` is the oracle's
// "loaded_libraries" (absolute paths of the LibTorch shared objects mapped in its process, or
// null), each checked to name a regular file with a runtime library's name before the supervisor
// opens it (Error("worker.oracle_output") otherwise). Files are hashed by the supervisor, once
// per (device, inode, size, mtime, ctime) for the life of the process; the engine hashes the
// executables at start and a step's reported libraries before it goes on, both on its digest
// thread (warm_digests), so that here they cost a stat per file and the loop never reads
// LibTorch (~0.5 GB) itself.
common::Json implementation_section(
    const std::vector<std::pair<std::string, std::filesystem::path>>& executables,
    const common::Json& libraries);

// Digests off the event loop. implementation_section hashes on the caller's thread; a file it
// has not seen (LibTorch, ~0.5 GB, after a start or an upgrade) would hold the loop for a second.
// warm_digests hashes the files the cache does not hold into it, on any thread (the cache is
// shared and locked); a file that cannot be hashed is skipped, for implementation_section to
// report. `follow`: as implementation_section opens it (executables through links, reported
// libraries without).
struct DigestFile {
  std::filesystem::path path;
  bool follow = false;
};
// The files among `files` whose digest for their current (dev, ino, size, mtime, ctime) is not
// in the cache.
std::vector<DigestFile> uncached_digests(const std::vector<DigestFile>& files);
void warm_digests(const std::vector<DigestFile>& files);
// The runtime libraries a worker's output file names ("loaded_libraries"), for warm_digests; none
// when the file is missing, unreadable or names none (implementation_section checks them later).
std::vector<DigestFile> reported_libraries(const std::filesystem::path& output_file);

// Seals `sealed.result` (result_sha256), signs its statement (DSSE) and returns the files that
// become durable with the job's terminal state.
CommitFiles seal(Sealed& sealed, const common::SigningKey& key);

}  // namespace assay::supervisor
