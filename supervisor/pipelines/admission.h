// Checks a submission makes before anything is queued: the paths a request names, against the
// rights of the user who submitted it.
#pragma once

#include <string>

#include "supervisor/pipelines/pipeline.h"

namespace assay::supervisor {

// `dir` as an absolute, normalised path ("/./", "//" and trailing slashes removed) to a
// directory the peer may search, with no symlink or ".." in it. Throws Error("request.bad_model")
// naming the path, or Error("request.forbidden") when the peer cannot reach it (without saying
// whether it exists).
std::string check_model_dir(const std::string& dir, const Peer& peer);
// Throws Error(code) when `path` is not a regular file the peer can read (same wording rules).
void check_readable_file(const std::string& path, const Peer& peer, const std::string& code,
                         const std::string& what);

// A request may lower the configured limits, never raise them: throws
// Error("request.limit_above_max") naming the asked and the configured value.
void check_request_limits(const common::RequestLimits& asked, const Config& config);

}  // namespace assay::supervisor
