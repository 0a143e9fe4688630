#include "common/sign.h"

#include <fcntl.h>
#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <sys/stat.h>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"

namespace assay::common {
namespace {

struct PkeyDeleter {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyDeleter>;

struct BioDeleter {
  void operator()(BIO* b) const { BIO_free(b); }
};
using BioPtr = std::unique_ptr<BIO, BioDeleter>;

std::string bio_to_string(BIO* bio) {
  char* data = nullptr;
  long n = BIO_get_mem_data(bio, &data);
  return std::string(data, static_cast<std::size_t>(n));
}

std::string raw_public(EVP_PKEY* key) {
  std::string out(32, '\0');
  std::size_t len = out.size();
  if (EVP_PKEY_get_raw_public_key(key, reinterpret_cast<unsigned char*>(out.data()), &len) != 1 ||
      len != 32)
    throw Error("sign.key", "cannot read the Ed25519 public key");
  return out;
}

PkeyPtr public_key_from(std::string_view key) {
  if (key.size() == 32) {
    PkeyPtr k(EVP_PKEY_new_raw_public_key(EVP_PKEY_ED25519, nullptr,
                                          reinterpret_cast<const unsigned char*>(key.data()), 32));
    if (!k) throw Error("sign.key", "invalid raw Ed25519 public key");
    return k;
  }
  BioPtr bio(BIO_new_mem_buf(key.data(), static_cast<int>(key.size())));
  PkeyPtr k(PEM_read_bio_PUBKEY(bio.get(), nullptr, nullptr, nullptr));
  if (!k || EVP_PKEY_get_id(k.get()) != EVP_PKEY_ED25519)
    throw Error("sign.key", "public key is neither 32 raw bytes nor an Ed25519 PEM key");
  return k;
}

}  // namespace

struct SigningKey::Impl {
  PkeyPtr key;
};

SigningKey::~SigningKey() = default;
SigningKey::SigningKey(SigningKey&&) noexcept = default;
SigningKey& SigningKey::operator=(SigningKey&&) noexcept = default;

SigningKey SigningKey::generate() {
  SigningKey k;
  k.impl_ = std::make_unique<Impl>();
  EVP_PKEY* raw = nullptr;
  EVP_PKEY_CTX* ctx = EVP_PKEY_CTX_new_id(EVP_PKEY_ED25519, nullptr);
  bool ok = ctx && EVP_PKEY_keygen_init(ctx) == 1 && EVP_PKEY_keygen(ctx, &raw) == 1;
  EVP_PKEY_CTX_free(ctx);
  if (!ok) throw Error("sign.keygen", "Ed25519 key generation failed");
  k.impl_->key.reset(raw);
  return k;
}

SigningKey SigningKey::load_pem(const std::filesystem::path& path) {
  UniqueFd fd = open_nofollow(path, O_RDONLY);
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) throw_errno("fs.stat", "stat " + path.string(), errno);
  if (st.st_mode & 077) {
    char mode[8];
    snprintf(mode, sizeof mode, "%03o", st.st_mode & 0777);
    throw Error("sign.key_permissions", "private key " + path.string() + " has mode " + mode +
                                            ", readable by group or others; it must be 0600");
  }
  std::string pem = read_file(path, 64 * 1024);
  BioPtr bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  PkeyPtr key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
  if (!key || EVP_PKEY_get_id(key.get()) != EVP_PKEY_ED25519)
    throw Error("sign.key", path.string() + " holds no Ed25519 private key");
  SigningKey k;
  k.impl_ = std::make_unique<Impl>();
  k.impl_->key = std::move(key);
  return k;
}

SigningKey SigningKey::load_or_create(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::symlink_status(path, ec).type() == std::filesystem::file_type::not_found) {
    SigningKey k = generate();
    k.save_pem(path);
    return k;
  }
  return load_pem(path);
}

void SigningKey::save_pem(const std::filesystem::path& path) const {
  BioPtr bio(BIO_new(BIO_s_mem()));
  if (PEM_write_bio_PrivateKey(bio.get(), impl_->key.get(), nullptr, nullptr, 0, nullptr,
                               nullptr) != 1)
    throw Error("sign.key", "cannot encode the private key");
  atomic_write_file(path, bio_to_string(bio.get()), 0600);
}

std::string SigningKey::public_key_pem() const {
  BioPtr bio(BIO_new(BIO_s_mem()));
  if (PEM_write_bio_PUBKEY(bio.get(), impl_->key.get()) != 1)
    throw Error("sign.key", "cannot encode the public key");
  return bio_to_string(bio.get());
}

std::string SigningKey::public_key_raw() const {
  return raw_public(impl_->key.get());
}

std::string SigningKey::key_id() const {
  return sha256_id(public_key_raw());
}

std::string SigningKey::sign(std::string_view message) const {
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  std::string sig(64, '\0');
  std::size_t len = sig.size();
  bool ok =
      ctx && EVP_DigestSignInit(ctx, nullptr, nullptr, nullptr, impl_->key.get()) == 1 &&
      EVP_DigestSign(ctx, reinterpret_cast<unsigned char*>(sig.data()), &len,
                     reinterpret_cast<const unsigned char*>(message.data()), message.size()) == 1;
  EVP_MD_CTX_free(ctx);
  if (!ok || len != 64) throw Error("sign.failed", "Ed25519 signing failed");
  return sig;
}

bool ed25519_verify(std::string_view public_key, std::string_view message,
                    std::string_view signature) {
  PkeyPtr key = public_key_from(public_key);
  if (signature.size() != 64) return false;
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  bool ok = ctx && EVP_DigestVerifyInit(ctx, nullptr, nullptr, nullptr, key.get()) == 1 &&
            EVP_DigestVerify(
                ctx, reinterpret_cast<const unsigned char*>(signature.data()), signature.size(),
                reinterpret_cast<const unsigned char*>(message.data()), message.size()) == 1;
  EVP_MD_CTX_free(ctx);
  return ok;
}

std::string public_key_raw_from_pem(std::string_view pem) {
  PkeyPtr key = public_key_from(pem);
  return raw_public(key.get());
}

std::string base64_encode(std::string_view bytes) {
  std::string out(4 * ((bytes.size() + 2) / 3) + 1, '\0');
  int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                          reinterpret_cast<const unsigned char*>(bytes.data()),
                          static_cast<int>(bytes.size()));
  out.resize(static_cast<std::size_t>(n));
  return out;
}

std::string base64_decode(std::string_view text) {
  auto is_b64 = [](char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '+' ||
           c == '/';
  };
  if (text.size() % 4 != 0)
    throw Error("sign.base64",
                "base64 text of length " + std::to_string(text.size()) + " is not a multiple of 4");
  std::size_t pad = 0;
  for (std::size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    if (c == '=') {
      if (i + 2 < text.size()) throw Error("sign.base64", "misplaced '=' in base64 text");
      ++pad;
    } else if (!is_b64(c) || pad) {
      throw Error("sign.base64", "invalid character in base64 text at offset " + std::to_string(i));
    }
  }
  std::string out(3 * (text.size() / 4), '\0');
  int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                          reinterpret_cast<const unsigned char*>(text.data()),
                          static_cast<int>(text.size()));
  if (n < 0) throw Error("sign.base64", "malformed base64 text");
  // The bits of the last character before the padding that no output byte uses must be zero,
  // or several texts would decode to the same bytes.
  if (pad) {
    std::size_t at = text.size() - pad - 1;
    static constexpr std::string_view kAlphabet =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    auto value = kAlphabet.find(text[at]);
    unsigned unused_mask = pad == 1 ? 0x3 : 0xf;
    if (value & unused_mask)
      throw Error("sign.base64", "non-canonical base64: the unused bits of '" +
                                     std::string(1, text[at]) + "' at offset " +
                                     std::to_string(at) + " are not zero");
  }
  out.resize(static_cast<std::size_t>(n) - pad);
  return out;
}

std::string dsse_pae(std::string_view payload_type, std::string_view payload) {
  std::string out = "DSSEv1 ";
  out += std::to_string(payload_type.size());
  out += ' ';
  out += payload_type;
  out += ' ';
  out += std::to_string(payload.size());
  out += ' ';
  out += payload;
  return out;
}

Json dsse_sign(std::string_view payload_type, std::string_view payload, const SigningKey& key) {
  std::string sig = key.sign(dsse_pae(payload_type, payload));
  return Json{
      {"payload", base64_encode(payload)},
      {"payloadType", std::string(payload_type)},
      {"signatures", Json::array({Json{{"keyid", key.key_id()}, {"sig", base64_encode(sig)}}})}};
}

VerifiedEnvelope dsse_open(const Json& envelope, std::string_view public_key) {
  auto fail = [](const std::string& m) -> void { throw Error("sign.envelope", m); };
  if (!envelope.is_object()) fail("a DSSE envelope must be a JSON object");
  for (const auto& item : envelope.items())
    if (const std::string& key = item.key();
        key != "payload" && key != "payloadType" && key != "signatures")
      fail("unknown member \"" + key +
           "\" in the DSSE envelope (payload, payloadType, signatures)");
  for (const char* key : {"payload", "payloadType"})
    if (!envelope.contains(key) || !envelope[key].is_string())
      fail(std::string("the DSSE envelope's ") + key + " must be a string");
  if (!envelope.contains("signatures") || !envelope["signatures"].is_array() ||
      envelope["signatures"].empty())
    fail("the DSSE envelope's signatures must be a non-empty array");
  const Json& sigs = envelope["signatures"];

  std::string raw_key =
      public_key.size() == 32 ? std::string(public_key) : public_key_raw_from_pem(public_key);
  std::string key_id = sha256_id(raw_key);
  VerifiedEnvelope out;
  out.payload_type = envelope["payloadType"].get<std::string>();
  try {
    out.payload = base64_decode(envelope["payload"].get<std::string>());
  } catch (const Error& e) {
    throw Error(e.code(), std::string("payload: ") + e.what());
  }
  std::string pae = dsse_pae(out.payload_type, out.payload);
  for (std::size_t i = 0; i < sigs.size(); ++i) {
    std::string where = "signatures[" + std::to_string(i) + "]";
    const Json& s = sigs[i];
    if (!s.is_object()) fail(where + " must be an object");
    for (const auto& item : s.items())
      if (const std::string& key = item.key(); key != "keyid" && key != "sig")
        fail("unknown member \"" + key + "\" in " + where + " (keyid, sig)");
    if (!s.contains("sig") || !s["sig"].is_string()) fail(where + ".sig must be a string");
    VerifiedSignature v{.index = i, .key_id = key_id, .keyid = ""};
    if (s.contains("keyid")) {
      if (!s["keyid"].is_string()) fail(where + ".keyid must be a string");
      v.keyid = s["keyid"].get<std::string>();
      if (!v.keyid.empty() && !is_identity(v.keyid))
        fail(where + ".keyid \"" + v.keyid + "\" is not \"sha256:<64 lowercase hex>\"");
    }
    std::string sig;
    try {
      sig = base64_decode(s["sig"].get<std::string>());
    } catch (const Error& e) {
      throw Error(e.code(), where + ".sig: " + e.what());
    }
    if (sig.size() != 64)
      fail(where + ".sig decodes to " + std::to_string(sig.size()) +
           " bytes; an Ed25519 signature has 64");
    if (!ed25519_verify(raw_key, pae, sig))
      throw Error("sign.verify_failed", where +
                                            (v.keyid.empty() ? "" : " (keyid " + v.keyid + ")") +
                                            " does not verify with the given key " + key_id);
    if (!v.keyid.empty() && v.keyid != key_id)
      throw Error("sign.keyid_mismatch",
                  where + " verifies with key " + key_id + " but its keyid names " + v.keyid);
    out.signatures.push_back(std::move(v));
  }
  return out;
}

std::string dsse_verify(const Json& envelope, std::string_view public_key) {
  return dsse_open(envelope, public_key).payload;
}

Json intoto_statement(const std::vector<Subject>& subjects, std::string_view predicate_type,
                      const Json& predicate) {
  Json subj = Json::array();
  for (const auto& s : subjects)
    subj.push_back(Json{{"name", s.name}, {"digest", Json{{"sha256", s.sha256_hex}}}});
  return Json{{"_type", std::string(kInTotoStatementType)},
              {"subject", subj},
              {"predicateType", std::string(predicate_type)},
              {"predicate", predicate}};
}

}  // namespace assay::common
