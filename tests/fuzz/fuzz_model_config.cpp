// A model directory's config.json as assayd reads it (supervisor/pipelines/documents.cpp): the
// vocabulary, hidden and context sizes, end-of-sequence ids, the execution dtype and the memory
// estimate, and the layer boundaries (common::layer_boundaries) of a layer-attribution job. The
// directory is the submitter's, so the file is bytes from outside. Each reader answers or refuses
// with common::Error; another exception is counted as the engine counts it.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "common/error.h"
#include "common/layers.h"
#include "supervisor/pipelines/documents.h"
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace assay;
  const auto dir = fuzz::scratch_dir() / "model";
  std::filesystem::create_directories(dir);
  common::write_unsynced(dir / "config.json", fuzz::as_text(data, size), 0600);
  // The engine calls them in steps and the preflight: any other exception is a job failed with
  // "supervisor.internal", counted.
  auto refused = [](auto&& read) { fuzz::as_the_engine_does(read); };
  refused([&] { (void)supervisor::read_vocab_size(dir); });
  refused([&] {
    if (supervisor::read_hidden_size(dir) < 1) std::abort();
  });
  refused([&] { (void)supervisor::read_max_positions(dir); });
  refused([&] { (void)supervisor::read_eos_token_ids(dir); });
  refused([&] {
    std::string dtype = supervisor::execution_dtype(dir.string());
    if (dtype != "bfloat16" && dtype != "float32") std::abort();
  });
  refused([&] {
    for (std::uint64_t tokens : {0, 1, 4096, 1'000'000})
      (void)supervisor::estimate_required_bytes(dir, tokens, 64);
  });
  refused([&] {
    auto names = common::layer_boundaries(supervisor::read_model_config(dir));
    if (names.size() < 7 || names.front() != "embedding" || names.back() != "norm") std::abort();
  });
  return 0;
}
