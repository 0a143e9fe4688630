// How a worker writes its output.json (and a batch its state files).
#pragma once

#include <filesystem>
#include <string_view>

#include "common/fs.h"

namespace assay::common {

// Written as replace_file_fast does (a temp file renamed over `path`, never a partial file),
// mode 0644, without fsync: the supervisor reads it once the worker has exited (or, for a batch
// state, once it appears) and copies what it keeps into the job's own documents, which it
// fsyncs; after a power cut the step runs again. Two fsyncs per worker per job bought nothing.
inline void write_worker_document(const std::filesystem::path& path, std::string_view content) {
  replace_file_fast(path, content, 0644);
}

}  // namespace assay::common
