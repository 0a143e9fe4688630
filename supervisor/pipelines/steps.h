// Pieces the job kinds share: the request file, the fingerprint step (fingerprint_step.h), the
// implementation's digests, moving an artifact into the job directory, and sealing a result.
#pragma once

#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/json.h"
#include "common/sign.h"
#include "supervisor/pipelines/fingerprint_step.h"
#include "supervisor/pipelines/pipeline.h"

namespace assay::supervisor {

// A job's request.json, parsed strictly.
common::Json read_request(const std::filesystem::path& job_dir);
// The job's checks.json (Admission::checks), or {} for a job without one.
common::Json read_checks(const std::filesystem::path& job_dir);
// Intra-op threads of a reference worker: config.worker_threads, or where that is 0 every CPU of
// assayd's affinity mask (a cpuset or CPUAffinity= narrows it).
int worker_threads(const Config& config);

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
