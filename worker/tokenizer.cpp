#include "worker/tokenizer.h"

#include <optional>
#include <string>

namespace assay::oracle {

Tokenizer load_tokenizer(ModelFiles& files) {
  auto tokenizer = files.read("tokenizer.json", common::kMaxTokenizerBytes);
  std::optional<std::string> config;
  if (files.has("tokenizer_config.json"))
    config = std::string(files.read("tokenizer_config.json", common::kMaxTokenizerBytes)->text());
  return Tokenizer::parse(tokenizer->text(), config);
}

Tokenizer load_tokenizer(const std::filesystem::path& model_dir) {
  ModelFiles files = ModelFiles::from_directory(model_dir);
  return load_tokenizer(files);
}

}  // namespace assay::oracle
