// Checks a submission makes before anything is queued, and the one way assayd opens what a
// request names: at admission, when a job starts, after a restart and for every step.
//
// A path is opened component by component from "/" without following a link anywhere in it
// (openat2 RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS, else O_NOFOLLOW), and the submitter's
// rights are checked on each opened directory and on the file itself (fstat of the descriptor),
// so that what was checked is what is read; workers get only those descriptors.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include <sys/stat.h>

#include "common/fs.h"
#include "common/json.h"
#include "supervisor/pipelines/pipeline.h"

namespace assay::supervisor {

// A directory or file a request names, opened as above.
struct Opened {
  std::string path;  // absolute; for a model directory's file, the directory's path / its name
  common::UniqueFd fd;
  struct stat st {};
};

// A model directory and every regular file at its top (sorted by name): what workers read.
struct OpenedModel {
  Opened dir;
  std::vector<Opened> files;
  std::vector<std::string> names;  // each file's name in the directory, in the same order
};

// Each throws Error(code) naming the path (not absolute, "..", a link at PREFIX, missing, not a
// directory / regular file), or Error("request.forbidden") when the peer may not search a
// directory on the way or read the file; nothing below a directory the peer may not search is
// looked at, so a refusal never tells whether a path exists.
Opened open_dir_as(const std::string& path, const Peer& peer, const std::string& code,
                   const std::string& what);
Opened open_file_as(const std::string& path, const Peer& peer, const std::string& code,
                    const std::string& what);
// A link at the top of the directory is refused by name; directories and other non-regular
// entries are skipped (workers are handed regular files only). A tokenizer or config file over
// protocol::kMaxSmallModelFileBytes, and a config.json whose sizes contradict the shards' tensor
// shapes (common/model_shapes.h), are refused with Error("request.bad_model") naming them: at
// admission and again each time a worker is handed the files, before it builds anything.
OpenedModel open_model_as(const std::string& dir, const Peer& peer);

// What admission opened, kept in the job record: [{path, dev, ino, uid, gid, mode}], so that a
// job whose files changed owner, mode or identity before it starts fails instead of reading them.
common::Json opened_record(const std::vector<const Opened*>& opened);
common::Json opened_record(const OpenedModel& model);
// Throws Error("job.files_changed") naming the path and what differs when `now` is listed in
// `admitted` with other values; a path admission did not list passes (its rights were checked
// when it was opened).
void check_unchanged(const common::Json& admitted, const Opened& now);
// Opens every path of `admitted` again as the peer (rights, no links) and check_unchanged()s
// it: called when a job starts, before anything of its files is read.
void verify_admitted(const common::Json& admitted, const Peer& peer);

// `dir` as an absolute, normalised path ("/./", "//" and trailing slashes removed) to a
// directory the peer may search, with no symlink or ".." in it. Throws Error("request.bad_model")
// naming the path, or Error("request.forbidden") when the peer cannot reach it (without saying
// whether it exists). `record`, when given, gets the opened_record of it and its files appended.
std::string check_model_dir(const std::string& dir, const Peer& peer,
                            common::Json* record = nullptr);
// Throws Error(code) when `path` is not a normalised path to a regular file the peer can read
// (same wording rules); returns it opened, for a caller that reads it there and then.
Opened check_readable_file(const std::string& path, const Peer& peer, const std::string& code,
                           const std::string& what, common::Json* record = nullptr);

// A file of assayd's own reading below a checked directory (config.json facts): opened with no
// link followed anywhere in its path; throws Error("fs.open") / Error("fs.not_regular").
common::UniqueFd open_no_links(const std::filesystem::path& path);
std::string read_no_links(const std::filesystem::path& path, std::size_t max_bytes);
// The whole of a file open_file_as() opened, at most max_bytes (else Error(code) naming it).
std::string read_opened(const Opened& file, std::size_t max_bytes, const std::string& code);

// The submitter of a stored job, as admission saw them.
Peer submitter_peer(uid_t uid, gid_t gid, bool admin);

// A request may lower the configured limits, never raise them: throws
// Error("request.limit_above_max") naming the asked and the configured value.
// The same for memory_events: a request may ask "reject" under "record", not the reverse.
void check_request_limits(const common::RequestLimits& asked, const Config& config);
// The memory policy a job runs under: the request's (checked above) or the configured one.
common::MemoryPolicy memory_policy(const common::RequestLimits& asked, const Config& config);

}  // namespace assay::supervisor
