// The tokenizer (common/tokenizer.h) as the oracle loads it: tokenizer.json and
// tokenizer_config.json read through the job's ModelFiles, under its checks.
#pragma once

#include <filesystem>

#include "common/tokenizer.h"
#include "worker/model_files.h"

namespace assay::oracle {

using common::Tokenizer;
using common::utf8_lossy;

// Reads tokenizer.json (and tokenizer_config.json when present, for
// clean_up_tokenization_spaces). Throws common::Error("tokenizer.invalid" /
// "tokenizer.unsupported") naming the field.
Tokenizer load_tokenizer(ModelFiles& files);
Tokenizer load_tokenizer(const std::filesystem::path& model_dir);

}  // namespace assay::oracle
