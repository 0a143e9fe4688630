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
