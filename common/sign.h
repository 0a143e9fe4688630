// Ed25519 keys, DSSE v1 envelopes and in-toto Statement v1.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/json.h"

namespace assay::common {

inline constexpr std::string_view kInTotoPayloadType = "application/vnd.in-toto+json";
inline constexpr std::string_view kInTotoStatementType = "https://in-toto.io/Statement/v1";

class SigningKey {
 public:
  static SigningKey generate();
  // Loads a PKCS#8 PEM private key; refuses a file readable by group or others.
  static SigningKey load_pem(const std::filesystem::path& path);
  // Loads the key at `path`, or generates one and saves it (0600) when there is none.
  static SigningKey load_or_create(const std::filesystem::path& path);
  ~SigningKey();
  SigningKey(SigningKey&&) noexcept;
  SigningKey& operator=(SigningKey&&) noexcept;

  void save_pem(const std::filesystem::path& path) const;  // mode 0600, atomic
  std::string public_key_pem() const;                      // SubjectPublicKeyInfo PEM
  std::string public_key_raw() const;                      // 32 bytes
  std::string key_id() const;                              // sha256: of the raw public key
  std::string sign(std::string_view message) const;        // 64-byte signature

 private:
  SigningKey() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Verifies an Ed25519 signature with a raw 32-byte or PEM public key.
bool ed25519_verify(std::string_view public_key, std::string_view message,
                    std::string_view signature);
// Public key from a SubjectPublicKeyInfo PEM, as 32 raw bytes; throws Error("sign.key").
std::string public_key_raw_from_pem(std::string_view pem);

std::string base64_encode(std::string_view bytes);
// RFC 4648 base64 with padding, canonical only: the text must be exactly what base64_encode
// gives for the bytes (so the unused bits before '=' must be zero; RFC 4648 section 3.5).
// Throws Error("sign.base64") naming the offset otherwise.
std::string base64_decode(std::string_view text);

// DSSE pre-authentication encoding: "DSSEv1 <len(type)> <type> <len(body)> <body>".
std::string dsse_pae(std::string_view payload_type, std::string_view payload);
// {"payload": b64, "payloadType": type, "signatures": [{"keyid", "sig": b64}]}
Json dsse_sign(std::string_view payload_type, std::string_view payload, const SigningKey& key);

// One signature entry of a verified envelope.
struct VerifiedSignature {
  std::size_t index = 0;  // position in "signatures"
  std::string key_id;     // sha256: of the raw public key the signature verified with
  std::string keyid;      // the entry's keyid as written ("" when absent or empty)
};
struct VerifiedEnvelope {
  std::string payload;  // decoded
  std::string payload_type;
  std::vector<VerifiedSignature> signatures;  // every entry, in order
};
// Strict DSSE verification with one trusted key (raw 32 bytes or PEM). The envelope is exactly
// {payload, payloadType, signatures}; signatures is a non-empty array of exactly {keyid?, sig};
// payload and sig are canonical base64 (base64_decode), sig decodes to 64 bytes. EVERY entry
// must verify with `public_key` over PAE(payloadType, payload): assay signs with one key, and
// an entry nobody here can check is refused rather than ignored. keyid is an unsigned hint
// that proves nothing; when present and non-empty it must be "sha256:<hex>" and name the key
// that verified the entry, so that no byte of an envelope can change after signing.
// Throws Error with code:
//   sign.envelope        not of that shape (names the member)
//   sign.base64          payload or a sig is malformed or non-canonical base64
//   sign.verify_failed   signatures[i] does not verify with the key (names i, keyid, key id)
//   sign.keyid_mismatch  signatures[i] verifies but its keyid names another key
VerifiedEnvelope dsse_open(const Json& envelope, std::string_view public_key);
// dsse_open(envelope, public_key).payload.
std::string dsse_verify(const Json& envelope, std::string_view public_key);

struct Subject {
  std::string name;
  std::string sha256_hex;  // 64 lowercase hex, no prefix
};
Json intoto_statement(const std::vector<Subject>& subjects, std::string_view predicate_type,
                      const Json& predicate);

}  // namespace assay::common
