// `assay verify --kiln RECORD [--artifact LOGITS]`: a record Kiln wrote (its next-token and
// layer-attribution results, v1 and v2), checked offline by client::verify_kiln: Kiln's
// canonical self-hash (common::python_canonical), Kiln's published schema, the facts that follow
// from the document and, with an artifact, the logits recomputed. The input is the record,
// optionally a part separator and the artifact's bytes. verify_kiln throws only when a file
// cannot be read; whatever the bytes, it reports its checks, or names the Kiln kind it does not
// check (a path-attribution record) and checks nothing.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "client/verify.h"
#include "common/error.h"
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace assay;
  auto in = fuzz::parts(fuzz::as_text(data, size), 2);
  const auto record = fuzz::scratch_dir() / "record.json";
  const auto artifact = fuzz::scratch_dir() / "logits.safetensors";
  common::write_unsynced(record, in[0], 0600);
  std::optional<std::filesystem::path> with;
  if (in.size() == 2) {
    common::write_unsynced(artifact, in[1], 0600);
    with = artifact;
  }
  client::VerifyReport report = client::verify_kiln(record, with);
  if (report.checks.empty() != report.not_checked_kind.has_value()) std::abort();
  (void)report.to_json().dump();
  return 0;
}
