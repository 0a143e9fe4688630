// DSSE envelopes as `assay verify` opens them (common::dsse_open: strict shape, canonical base64,
// every signature verified with the one trusted key). The input is the key (32 raw bytes or a
// SubjectPublicKeyInfo PEM, as `assay verify --key` reads it), a part separator, and the
// envelope; the seeds are envelopes signed with their key, so that mutations reach past the
// signature check. An envelope it opens has every signature verified, in order.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "common/error.h"
#include "common/identity.h"
#include "common/sign.h"
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace assay;
  auto in = fuzz::parts(fuzz::as_text(data, size), 2);
  if (in.size() != 2) return 0;
  std::string_view key = in[0];
  common::Json envelope;
  common::VerifiedEnvelope opened;
  try {
    envelope = common::parse_strict(in[1], {.max_bytes = 64 << 20});
    opened = common::dsse_open(envelope, key);
  } catch (const common::Error& e) {
    return 0;
  }
  const std::string raw =
      key.size() == 32 ? std::string(key) : common::public_key_raw_from_pem(key);
  if (raw.size() != 32) std::abort();
  if (opened.signatures.size() != envelope["signatures"].size() || opened.signatures.empty())
    std::abort();
  const std::string pae = common::dsse_pae(opened.payload_type, opened.payload);
  for (std::size_t i = 0; i < opened.signatures.size(); ++i) {
    const auto& s = opened.signatures[i];
    if (s.index != i || s.key_id != common::sha256_id(raw)) std::abort();
    if (!s.keyid.empty() && s.keyid != s.key_id) std::abort();
    std::string sig = common::base64_decode(envelope["signatures"][i]["sig"].get<std::string>());
    if (!common::ed25519_verify(raw, pae, sig)) std::abort();
  }
  if (opened.payload != common::base64_decode(envelope["payload"].get<std::string>())) std::abort();
  if (common::dsse_verify(envelope, key) != opened.payload) std::abort();
  return 0;
}
