// `assay verify`: a result record, its DSSE envelope and the public key, checked offline by
// client::verify_result. The input is result.json, a part separator, result.dsse.json, a part
// separator and the key (32 raw bytes or PEM); with fewer parts there is no envelope and the key is
// 32 zero bytes. verify_result throws only when a file cannot be read; whatever the bytes, it
// reports its checks. A report that passes every check is of a result whose file is named by the
// statement the key signed.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "client/verify.h"
#include "common/error.h"
#include "common/identity.h"
#include "common/sign.h"
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace assay;
  auto in = fuzz::parts(fuzz::as_text(data, size), 3);
  const auto result = fuzz::scratch_dir() / "result.json";
  const auto envelope = fuzz::scratch_dir() / "result.dsse.json";
  common::write_unsynced(result, in[0], 0600);
  client::VerifyInputs inputs{
      .result = result, .envelope = {}, .public_key = std::string(32, '\0'), .artifact = {}};
  if (in.size() >= 2) {
    common::write_unsynced(envelope, in[1], 0600);
    inputs.envelope = envelope;
  }
  if (in.size() == 3) inputs.public_key = std::string(in[2]);
  client::VerifyReport report = client::verify_result(inputs);
  (void)report.to_json().dump();
  if (!report.ok()) return 0;
  // Every check passed: the key opens the envelope and its statement names the result's bytes.
  common::Json statement = common::parse_strict(
      common::dsse_verify(common::parse_strict(in[1], {.max_bytes = 64 << 20}), in[2]),
      {.max_bytes = 64 << 20});
  std::string digest = common::sha256_id(in[0]).substr(7);
  bool named = false;
  for (const auto& s : statement["subject"]) named = named || s["digest"]["sha256"] == digest;
  if (!named) std::abort();
  return 0;
}
