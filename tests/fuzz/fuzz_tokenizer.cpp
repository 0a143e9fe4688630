// tokenizer.json (and tokenizer_config.json) as the oracle reads them: written into a model
// directory and loaded by oracle::load_tokenizer through oracle::ModelFiles, as assay-oracle
// does (worker/tokenizer.cpp and worker/model_files.cpp, which need no LibTorch). The input is
// tokenizer.json, optionally a part separator and tokenizer_config.json. Whatever loads decodes
// every id to valid UTF-8, and utf8_lossy makes any bytes valid UTF-8.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "common/error.h"
#include "common/text.h"
#include "tests/fuzz/fuzz.h"
#include "worker/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace assay;
  std::string_view text = fuzz::as_text(data, size);
  if (!common::is_valid_utf8(oracle::utf8_lossy(text))) std::abort();

  auto in = fuzz::parts(text, 2);
  const auto dir = fuzz::scratch_dir() / "model";
  std::filesystem::create_directories(dir);
  common::write_unsynced(dir / "tokenizer.json", in[0], 0600);
  if (in.size() == 2)
    common::write_unsynced(dir / "tokenizer_config.json", in[1], 0600);
  else
    std::filesystem::remove(dir / "tokenizer_config.json");
  std::optional<oracle::Tokenizer> t;
  try {
    oracle::ModelFiles files = oracle::ModelFiles::from_directory(dir);
    t.emplace(oracle::load_tokenizer(files));
  } catch (const common::Error&) {
    return 0;
  }
  // Every id up to a bound, ids past the vocabulary, and a negative one: all decode.
  std::vector<std::int64_t> ids;
  for (std::int64_t id = 0; id < std::min<std::int64_t>(t->size(), 4096); ++id) ids.push_back(id);
  for (std::int64_t id : {t->size(), t->size() + 1, std::int64_t{-1}}) ids.push_back(id);
  if (!common::is_valid_utf8(t->decode(ids))) std::abort();
  for (std::int64_t id : ids)
    if (!common::is_valid_utf8(t->decode_one(id)) || (t->knows(id) && id >= t->size()))
      std::abort();
  return 0;
}
