#include <doctest/doctest.h>

#include <sys/stat.h>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/sign.h"
#include "test_util.h"

using namespace assay::common;

TEST_CASE("DSSE PAE equals the spec's vector") {
  CHECK(dsse_pae("http://example.com/HelloWorld", "hello world") ==
        "DSSEv1 29 http://example.com/HelloWorld 11 hello world");
}

TEST_CASE("base64 follows RFC 4648 and refuses malformed text") {
  CHECK(base64_encode("") == "");
  CHECK(base64_encode("f") == "Zg==");
  CHECK(base64_encode("foobar") == "Zm9vYmFy");
  CHECK(base64_decode("Zm9vYg==") == "foob");
  CHECK(base64_decode("Zm9vYmE=") == "fooba");
  CHECK_THROWS_AS(base64_decode("Zm9"), Error);
  CHECK_THROWS_AS(base64_decode("Zm9v!mFy"), Error);
  CHECK_THROWS_AS(base64_decode("Z=9vYmFy"), Error);
}

TEST_CASE("an Ed25519 signature verifies, and fails for another message or key") {
  SigningKey k = SigningKey::generate();
  std::string sig = k.sign("message");
  CHECK(sig.size() == 64);
  CHECK(ed25519_verify(k.public_key_raw(), "message", sig));
  CHECK(ed25519_verify(k.public_key_pem(), "message", sig));
  CHECK_FALSE(ed25519_verify(k.public_key_raw(), "messagf", sig));
  SigningKey other = SigningKey::generate();
  CHECK_FALSE(ed25519_verify(other.public_key_raw(), "message", sig));
  CHECK(k.key_id() == sha256_id(k.public_key_raw()));
  CHECK(public_key_raw_from_pem(k.public_key_pem()) == k.public_key_raw());
}

TEST_CASE("a saved key is 0600, reloads to the same key id, and a loose mode is refused") {
  assay::test::TempDir dir;
  SigningKey k = SigningKey::load_or_create(dir / "key.pem");
  struct stat st {};
  REQUIRE(stat((dir / "key.pem").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  SigningKey again = SigningKey::load_or_create(dir / "key.pem");
  CHECK(again.key_id() == k.key_id());
  chmod((dir / "key.pem").c_str(), 0644);
  try {
    SigningKey::load_pem(dir / "key.pem");
    FAIL("no throw");
  } catch (const Error& e) {
    CHECK(e.code() == "sign.key_permissions");
    CHECK(std::string(e.what()).find("644") != std::string::npos);
  }
}

TEST_CASE("a signature made by assay verifies with the openssl command line") {
  assay::test::TempDir dir;
  SigningKey k = SigningKey::generate();
  std::string pae = dsse_pae(kInTotoPayloadType, R"({"hello":"world"})");
  assay::test::write_bytes(dir / "pub.pem", k.public_key_pem());
  assay::test::write_bytes(dir / "msg", pae);
  assay::test::write_bytes(dir / "sig", k.sign(pae));
  std::string cmd = "openssl pkeyutl -verify -pubin -inkey " + (dir / "pub.pem").string() +
                    " -rawin -in " + (dir / "msg").string() + " -sigfile " +
                    (dir / "sig").string() + " 2>&1";
  auto ok = assay::test::run_command(cmd);
  CHECK(ok.status == 0);
  CHECK(ok.output.find("Signature Verified Successfully") != std::string::npos);
  assay::test::write_bytes(dir / "msg", pae + " ");
  auto bad = assay::test::run_command(cmd);
  CHECK(bad.status != 0);
}

TEST_CASE("a DSSE envelope over an in-toto statement verifies and detects tampering") {
  SigningKey k = SigningKey::generate();
  Json statement = intoto_statement({{"result.json", std::string(64, 'a')}},
                                    "https://example.com/p/v1", Json{{"x", 1}});
  CHECK(statement["_type"] == "https://in-toto.io/Statement/v1");
  CHECK(statement["subject"][0]["digest"]["sha256"] == std::string(64, 'a'));
  std::string payload = canonical(statement);
  Json env = dsse_sign(kInTotoPayloadType, payload, k);
  CHECK(env["payloadType"] == "application/vnd.in-toto+json");
  CHECK(env["signatures"][0]["keyid"] == k.key_id());
  CHECK(dsse_verify(env, k.public_key_raw()) == payload);

  Json tampered = env;
  tampered["payload"] = base64_encode(payload + " ");
  CHECK_THROWS_AS(dsse_verify(tampered, k.public_key_raw()), Error);
  Json retyped = env;
  retyped["payloadType"] = "text/plain";
  CHECK_THROWS_AS(dsse_verify(retyped, k.public_key_raw()), Error);
  CHECK_THROWS_AS(dsse_verify(env, SigningKey::generate().public_key_raw()), Error);
  CHECK_THROWS_AS(dsse_verify(Json{{"payload", 1}}, k.public_key_raw()), Error);
}

TEST_CASE("base64_decode accepts exactly the texts base64_encode writes") {
  const std::string alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  CHECK_THROWS_WITH_AS(base64_decode("Zh=="), doctest::Contains("offset 1"), Error);
  CHECK_THROWS_AS(base64_decode("Zm9="), Error);  // "fo" is "Zm8="
  // Every padded final quantum: accepted iff it re-encodes to itself.
  std::size_t accepted = 0, total = 0;
  for (char a : alphabet)
    for (char b : alphabet) {
      for (char c : alphabet + "=") {
        std::string text = {a, b, c, '='};
        if (c == '=') text = {a, b, '=', '='};
        ++total;
        bool ok = true;
        std::string bytes;
        try {
          bytes = base64_decode(text);
        } catch (const Error& e) {
          CHECK(e.code() == "sign.base64");
          ok = false;
        }
        if (ok) {
          ++accepted;
          CHECK(base64_encode(bytes) == text);
        }
      }
    }
  CHECK(total == 64 * 64 * 65);
  CHECK(accepted == 256 + 256 * 256);  // one text per 1-byte and per 2-byte value
}

namespace {

Json signed_envelope(const SigningKey& k) {
  return dsse_sign(kInTotoPayloadType, R"({"_type":"https://in-toto.io/Statement/v1"})", k);
}

std::string refusal(const Json& env, const SigningKey& k) {
  try {
    dsse_open(env, k.public_key_raw());
  } catch (const Error& e) {
    return e.code() + ": " + e.what();
  }
  return "accepted";
}

}  // namespace

TEST_CASE("dsse_open says which signature verified with which key") {
  SigningKey k = SigningKey::generate();
  Json env = signed_envelope(k);
  VerifiedEnvelope v = dsse_open(env, k.public_key_pem());
  CHECK(v.payload == R"({"_type":"https://in-toto.io/Statement/v1"})");
  CHECK(v.payload_type == kInTotoPayloadType);
  REQUIRE(v.signatures.size() == 1);
  CHECK(v.signatures[0].index == 0);
  CHECK(v.signatures[0].key_id == k.key_id());
  CHECK(v.signatures[0].keyid == k.key_id());

  // keyid is an optional hint (DSSE): absent or empty is fine, the key decides.
  Json no_keyid = env;
  no_keyid["signatures"][0].erase("keyid");
  CHECK(refusal(no_keyid, k) == "accepted");
  Json empty_keyid = env;
  empty_keyid["signatures"][0]["keyid"] = "";
  CHECK(refusal(empty_keyid, k) == "accepted");
  Json twice = env;
  twice["signatures"].push_back(env["signatures"][0]);
  CHECK(dsse_open(twice, k.public_key_raw()).signatures.size() == 2);
}

TEST_CASE("dsse_open refuses an envelope whose unsigned parts were changed") {
  SigningKey k = SigningKey::generate();
  SigningKey other = SigningKey::generate();
  const Json env = signed_envelope(k);
  auto changed = [&](auto&& edit) {
    Json e = env;
    edit(e);
    return refusal(e, k);
  };
  CHECK(changed([&](Json& e) { e["signatures"][0]["keyid"] = other.key_id(); }) ==
        "sign.keyid_mismatch: signatures[0] verifies with key " + k.key_id() +
            " but its keyid names " + other.key_id());
  CHECK(changed([](Json& e) {
          e["signatures"][0]["keyid"] = "host-key";
        }).rfind("sign.envelope:", 0) == 0);
  CHECK(changed([](Json& e) { e["signatures"][0]["keyid"] = 1; }).rfind("sign.envelope:", 0) == 0);

  std::string bogus_sig = base64_encode(std::string(64, '\x5a'));
  std::string r = changed([&](Json& e) {
    e["signatures"].push_back(Json{{"keyid", other.key_id()}, {"sig", bogus_sig}});
  });
  CHECK(r == "sign.verify_failed: signatures[1] (keyid " + other.key_id() +
                 ") does not verify with the given key " + k.key_id());
  // A real signature by another key is refused too: every entry must verify with the key.
  Json by_other = signed_envelope(other);
  CHECK(changed([&](Json& e) {
          e["signatures"].push_back(by_other["signatures"][0]);
        }).rfind("sign.verify_failed: signatures[1]", 0) == 0);
  CHECK(changed([&](Json& e) {
          e["signatures"].insert(e["signatures"].begin(), Json{{"sig", bogus_sig}});
        }).rfind("sign.verify_failed: signatures[0] does not verify", 0) == 0);

  CHECK(changed([](Json& e) { e["signatures"][0]["note"] = "x"; }).rfind("sign.envelope:", 0) == 0);
  CHECK(changed([](Json& e) { e["signed_by"] = "x"; }).rfind("sign.envelope:", 0) == 0);
  CHECK(changed([](Json& e) { e["signatures"] = Json::array(); }).rfind("sign.envelope:", 0) == 0);
  CHECK(changed([](Json& e) {
          e["signatures"][0]["sig"] = base64_encode(std::string(63, 'x'));
        }).rfind("sign.envelope:", 0) == 0);

  // Non-canonical base64 of the same bytes: the last character before '=' with unused bits set.
  auto bump_last = [](std::string text) {
    auto at = text.find('=') - 1;
    text[at] = static_cast<char>(text[at] + 1);
    return text;
  };
  std::string payload = env["payload"];
  REQUIRE(payload.back() == '=');
  CHECK(changed([&](Json& e) {
          e["payload"] = bump_last(payload);
        }).rfind("sign.base64: payload:", 0) == 0);
  std::string sig = env["signatures"][0]["sig"];
  REQUIRE(sig.substr(sig.size() - 2) == "==");  // 64 bytes: 4 unused bits
  CHECK(changed([&](Json& e) {
          e["signatures"][0]["sig"] = bump_last(sig);
        }).rfind("sign.base64: signatures[0].sig:", 0) == 0);
}
