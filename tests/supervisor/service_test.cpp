// The daemon's core driven without a socket: the route table and the Service facade, as a
// hostile or unlucky client would call them.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <fstream>

#include <sys/stat.h>
#include <unistd.h>
#include <boost/asio/io_context.hpp>

#include "common/error.h"
#include "common/json.h"
#include "common/text.h"
#include "supervisor/api/routes.h"
#include "supervisor/metrics.h"
#include "supervisor/pipelines/documents.h"
#include "supervisor/service.h"
#include "tests/support/process.h"

namespace sup = assay::supervisor;
using assay::common::Json;
namespace fs = std::filesystem;

namespace {

struct Fixture {
  assay::test_support::TempDir tmp;
  boost::asio::io_context io;
  std::unique_ptr<sup::Service> service;
  sup::Peer root{0, 0, 1, true};
  sup::Peer user{65534, 65534, 2, false};

  explicit Fixture(std::function<void(sup::Config&)> tweak = {}) {
    sup::Config c;
    c.state_dir = tmp.path() / "state";
    c.containment.mode = assay::contain::Mode::kNone;
    c.fingerprint_worker = c.oracle_worker = c.compare_worker = "/bin/false";
    if (tweak) tweak(c);
    c.finalize();
    service = std::make_unique<sup::Service>(io, c);
  }

  // A model directory with a config.json, mode `mode`.
  fs::path model(const std::string& name, mode_t mode = 0755) {
    fs::path dir = tmp.path() / name;
    fs::create_directories(dir);
    std::ofstream(dir / "config.json") << R"({"vocab_size": 260})";
    ::chmod(dir.c_str(), mode);
    ::chmod(tmp.path().c_str(), 0755);
    return dir;
  }

  sup::api::Answer call(const std::string& method, const std::string& target,
                        const std::string& body = "", const sup::Peer* peer = nullptr) {
    return sup::api::route(*service, method, target, body, peer ? *peer : root);
  }
};

std::string request(const fs::path& model_dir, const std::string& extra = "") {
  return R"({"schema":"assay.next-token-request.v1","id":"t","model_dir":")" + model_dir.string() +
         R"(","input_token_ids":[1,2,3],"candidates":[{"engine":"a","token_id":65,"text":"A"},)"
         R"({"engine":"b","token_id":66,"text":"B"}])" +
         extra + "}";
}

Json body_of(const sup::api::Answer& a) {
  CHECK(assay::common::is_valid_utf8(a.body));
  return assay::common::parse_strict(a.body);
}

}  // namespace

TEST_CASE("targets that are not UTF-8 once decoded are answered 400, in valid UTF-8") {
  Fixture f;
  for (std::string target : {"/v1/jobs?%FF=1", "/v1/jobs?state=%FF", "/v1/jobs?model_dir=/%C3",
                             "/v1/\xff", "/v1/jobs/j-\xc3"}) {
    auto a = f.call(target.find("model_dir") != std::string::npos ? "POST" : "GET", target, "{}");
    CHECK_MESSAGE(a.status == 400, target);
    CHECK(body_of(a)["error"]["code"] == "api.bad_target");
  }
}

TEST_CASE("JSON bodies holding invalid UTF-8 are answered 400 json.invalid") {
  Fixture f;
  for (std::string bad : {"\xc3\x28", "\xc0\xaf", "\xed\xa0\x80"}) {
    auto a = f.call("POST", "/v1/jobs", R"({"schema":"x","id":")" + bad + "\"}");
    CHECK(a.status == 400);
    CHECK(body_of(a)["error"]["code"] == "json.invalid");
  }
}

// Found by bench/api_fuzz.sh (schemathesis, 1000 examples, seed 23): a "schema" that is not a
// string was a 500 supervisor.internal ("type must be string, but is array").
TEST_CASE("a request whose schema is not a string is 422 request.invalid naming the field") {
  Fixture f;
  fs::path model = f.model("m");
  for (std::string schema : {"[\"assay.next-token-request.v1\"]", "{}", "7", "null", "true"}) {
    std::string body = request(model);
    body.replace(body.find("\"assay.next-token-request.v1\""),
                 std::string("\"assay.next-token-request.v1\"").size(), schema);
    auto a = f.call("POST", "/v1/jobs", body);
    CAPTURE(schema);
    CAPTURE(a.body);
    CHECK(a.status == 422);
    CHECK(body_of(a)["error"]["code"] == "request.invalid");
    CHECK(body_of(a)["error"]["message"].get<std::string>().find("\"schema\"") !=
          std::string::npos);
  }
}

TEST_CASE("405 names the allowed methods, and HEAD is answered where GET is") {
  Fixture f;
  auto a = f.call("PUT", "/v1/jobs");
  CHECK(a.status == 405);
  CHECK(a.allow == "POST, GET, HEAD");
  CHECK(f.call("HEAD", "/v1/health").status == 200);
  CHECK(f.call("GET", "/v2/nothing").status == 404);
}

TEST_CASE("a model directory the submitter cannot reach is 403 whether or not it exists") {
  Fixture f;
  fs::path secret = f.model("secret", 0700);
  fs::path real = secret / "inner";
  fs::create_directories(real);
  std::ofstream(real / "config.json") << R"({"vocab_size": 260})";
  auto exists = f.call("POST", "/v1/jobs", request(real), &f.user);
  auto missing = f.call("POST", "/v1/jobs", request(secret / "nothing"), &f.user);
  CHECK(exists.status == 403);
  CHECK(missing.status == 403);
  std::string a = body_of(exists)["error"]["message"], b = body_of(missing)["error"]["message"];
  CHECK(a.find("not readable by uid 65534") != std::string::npos);
  CHECK(a.find("exist") == std::string::npos);
  CHECK(b.find("exist") == std::string::npos);
  // Root may: the same request is accepted.
  CHECK(f.call("POST", "/v1/jobs", request(real)).status == 201);
}

TEST_CASE("request limits above the configured maxima are refused naming both values") {
  Fixture f([](sup::Config& c) {
    c.worker_timeout_seconds = 60;
    c.worker_memory_max = 2ull << 30;
  });
  fs::path m = f.model("m");
  auto a = f.call("POST", "/v1/jobs", request(m, R"(,"limits":{"timeout_seconds":604800})"));
  CHECK(a.status == 422);
  std::string msg = body_of(a)["error"]["message"];
  CHECK(msg.find("604800") != std::string::npos);
  CHECK(msg.find("60.0") != std::string::npos);
  auto b = f.call("POST", "/v1/jobs", request(m, R"(,"limits":{"memory_bytes":1099511627776})"));
  CHECK(b.status == 422);
  CHECK(body_of(b)["error"]["code"] == "request.limit_above_max");
  CHECK(f.call("POST", "/v1/jobs", request(m, R"(,"limits":{"timeout_seconds":30})")).status ==
        201);
}

TEST_CASE(
    "another user's identical request is a job of their own: nothing of the first user's is "
    "revealed or blocks it; /./ does not evade dedup") {
  Fixture f;
  fs::path m = f.model("m");
  auto first = f.call("POST", "/v1/jobs", request(m));
  REQUIRE(first.status == 201);
  std::string id = body_of(first)["id"];
  auto other = f.call("POST", "/v1/jobs", request(m), &f.user);
  CHECK(other.status == 201);
  CHECK(other.body.find(id) == std::string::npos);
  CHECK(other.body.find("another user") == std::string::npos);
  CHECK(body_of(other)["duplicate"] == false);
  fs::path spelled = m.parent_path() / "." / m.filename();
  CHECK(f.call("POST", "/v1/jobs", request(spelled)).status == 422);
  std::string kiln_like = request(m);  // the same request with the directory in the query
  auto first_q = f.call("POST", "/v1/jobs?model_dir=" + m.string(), kiln_like);
  auto dotted = f.call("POST", "/v1/jobs?model_dir=" + spelled.string() + "/", kiln_like);
  CHECK(first_q.status == 200);  // the query names the same directory: the same job
  CHECK(body_of(first_q)["id"] == id);
  CHECK(dotted.status == 200);
  CHECK(body_of(dotted)["id"] == id);
  CHECK(body_of(dotted)["duplicate"] == true);
}

TEST_CASE("a FIFO in place of config.json is refused without blocking") {
  Fixture f;
  fs::path m = f.tmp.path() / "fifo-model";
  fs::create_directories(m);
  REQUIRE(::mkfifo((m / "config.json").c_str(), 0644) == 0);
  auto a = f.call("POST", "/v1/jobs", request(m));
  CHECK(a.status == 422);
  CHECK(body_of(a)["error"]["message"].get<std::string>().find("not a regular file") !=
        std::string::npos);
}

TEST_CASE("a config.json of any JSON shape is read or refused by name, never with another error") {
  // fuzz_model_config counted "cannot use value() with number" and "... with string": a config
  // that is a number or a string reached Json::value in execution_dtype.
  assay::test_support::TempDir tmp;
  fs::path m = tmp.path() / "model";
  fs::create_directories(m);
  const std::vector<std::pair<std::string, std::string>> cases{
      {"5", "bfloat16"},
      {"\"float32\"", "bfloat16"},
      {"[]", "bfloat16"},
      {"null", "bfloat16"},
      {R"({"torch_dtype":5})", "bfloat16"},
      {R"({"torch_dtype":"float32"})", "float32"},
      {R"({"text_config":5,"torch_dtype":"float32"})", "float32"},
      {R"({"text_config":{"torch_dtype":7},"torch_dtype":"float32"})", "bfloat16"},
      {R"({"text_config":{"torch_dtype":"float32"}})", "float32"}};
  for (const auto& [config, dtype] : cases) {
    CAPTURE(config);
    std::ofstream(m / "config.json", std::ios::trunc) << config;
    std::string got;
    CHECK_NOTHROW(got = assay::supervisor::execution_dtype(m.string()));
    CHECK(got == dtype);
    auto named = [](auto&& read) {
      try {
        read();
      } catch (const assay::common::Error&) {
      }
    };
    CHECK_NOTHROW(named([&] { (void)assay::supervisor::read_vocab_size(m); }));
    CHECK_NOTHROW(named([&] { (void)assay::supervisor::read_hidden_size(m); }));
    CHECK_NOTHROW(named([&] { (void)assay::supervisor::read_max_positions(m); }));
    CHECK_NOTHROW(named([&] { (void)assay::supervisor::read_eos_token_ids(m); }));
    CHECK_NOTHROW(named([&] { (void)assay::supervisor::estimate_required_bytes(m, 64, 64); }));
  }
}

TEST_CASE("a failed job runs again only when resubmitted with retry") {
  Fixture f;
  fs::path m = f.model("m");
  std::string id = body_of(f.call("POST", "/v1/jobs", request(m)))["id"];
  // /bin/false as the fingerprint worker: the job fails.
  for (int i = 0; i < 200 && f.service->list(sup::JobState::kFailed, f.root)["jobs"].empty(); ++i)
    f.io.run_for(std::chrono::milliseconds(20));
  REQUIRE(f.service->list(sup::JobState::kFailed, f.root)["jobs"].size() == 1);
  auto again = f.call("POST", "/v1/jobs", request(m));
  CHECK(again.status == 200);
  CHECK(body_of(again)["state"] == "failed");
  auto retried = f.call("POST", "/v1/jobs?retry=1", request(m));
  CHECK(retried.status == 201);
  CHECK(body_of(retried)["id"] == id);
  CHECK(body_of(retried)["state"] == "queued");
  CHECK(body_of(retried)["retried"] == true);
}

TEST_CASE("duration windows are bounded and keep their totals") {
  sup::Durations d;
  for (int i = 0; i < 5000; ++i) d.add(i < 4000 ? 100.0 : 1.0);
  CHECK(d.recent.size() == sup::Durations::kWindow);
  CHECK(d.count == 5000);
  CHECK(d.median() == 1.0);
}

TEST_CASE(
    "the memory estimate grows with the sequence: heads x T x T attention, T x vocab logits") {
  assay::test_support::TempDir tmp;
  fs::path dir = tmp.path() / "model";
  fs::create_directories(dir);
  std::ofstream(dir / "config.json")
      << R"({"num_attention_heads": 4, "vocab_size": 1000, "torch_dtype": "bfloat16"})";
  std::ofstream(dir / "model.safetensors") << std::string(4096, 'x');
  const std::uint64_t t = 3500;
  // bf16: scores and weights at 2 bytes and the float32 softmax (8 bytes per head per pair),
  // the mask (11 per pair), the logits at 2 + 4 bytes per row and token.
  CHECK(sup::estimate_sequence_bytes(dir, t, t) == 4 * t * t * 8 + t * t * 11 + t * 1000 * 6);
  CHECK(sup::estimate_sequence_bytes(dir, t, 64) == 4 * t * t * 8 + t * t * 11 + 64 * 1000 * 6);
  CHECK(sup::estimate_sequence_bytes(dir, 0, 0) == 0);
  std::uint64_t base = sup::estimate_required_bytes(dir);
  CHECK(sup::estimate_required_bytes(dir, t) == base + sup::estimate_sequence_bytes(dir, t, t));
  CHECK(sup::estimate_required_bytes(dir, t, 64) ==
        base + sup::estimate_sequence_bytes(dir, t, 64));
  // A config without the numbers still sizes something, and an absurd length saturates.
  std::ofstream(dir / "config.json") << "{}";
  CHECK(sup::estimate_sequence_bytes(dir, 10, 10) > 0);
  CHECK(sup::estimate_sequence_bytes(dir, std::uint64_t{1} << 40, 1) == UINT64_MAX);
}

TEST_CASE("executor slurm needs a shared directory apart from the state directory") {
  assay::test_support::TempDir tmp;
  auto finalize = [&](const std::string& executor, const fs::path& shared) {
    sup::Config c;
    c.state_dir = tmp.path() / "state";
    c.fingerprint_worker = c.oracle_worker = c.compare_worker = "/bin/false";
    c.executor = executor;
    c.slurm.shared_dir = shared;
    try {
      c.finalize();
    } catch (const assay::common::Error& e) {
      return std::string(e.code()) + ": " + e.what();
    }
    return std::string("ok");
  };
  fs::create_directories(tmp.path() / "state" / "shared");
  fs::create_directories(tmp.path() / "shared");
  CHECK(finalize("local", "") == "ok");
  CHECK(finalize("slurm", tmp.path() / "shared") == "ok");
  CHECK(finalize("slurm", "").find("needs slurm.shared_dir") != std::string::npos);
  CHECK(finalize("slurm", tmp.path() / "missing").find("is not a directory") != std::string::npos);
  CHECK(finalize("slurm", tmp.path() / "state" / "shared").find("must not contain") !=
        std::string::npos);
  CHECK(finalize("slurm", tmp.path()).find("must not contain") != std::string::npos);
  CHECK(finalize("kubernetes", "").find("is not local or slurm") != std::string::npos);
}

// Kiln's verdict rule (issue 25): an engine gets the argmax only when its candidate alone holds
// it. Before, two engines with the same token gave the last of them, and "neither" could be
// called complete.
TEST_CASE("the verdict follows Kiln's rule: one match, none, both the same token, a tied top") {
  auto output = [](std::int64_t argmax, double margin, bool tie) {
    return Json{{"argmax", argmax},
                {"top_logit_margin", margin},
                {"top_logit_tie", tie},
                {"candidate_tokens",
                 {{{"engine", "kiln"}, {"logit", 1.5}}, {{"engine", "vllm"}, {"logit", 1.0}}}}};
  };
  assay::common::NextTokenRequest r;
  r.candidates = {{"kiln", 65, "A"}, {"vllm", 66, "B"}};
  SUBCASE("one match") {
    Json v = sup::make_verdict(r, output(65, 0.5, false));
    CHECK(v["argmax_candidate"] == "kiln");
    CHECK(v["argmax_token_id"] == 65);
    CHECK(v["candidate_attribution_complete"] == true);
  }
  SUBCASE("no match") {
    Json v = sup::make_verdict(r, output(67, 0.5, false));
    CHECK(v["argmax_candidate"] == "neither");
    CHECK(v["candidate_attribution_complete"] == false);
  }
  SUBCASE("both engines gave the argmax token") {
    r.candidates[1].token_id = 65;
    Json v = sup::make_verdict(r, output(65, 0.5, false));
    CHECK(v["argmax_candidate"] == "neither");
    CHECK(v["candidate_attribution_complete"] == false);
  }
  SUBCASE("both engines gave the same other token") {
    r.candidates[1].token_id = 65;
    Json v = sup::make_verdict(r, output(70, 0.5, false));
    CHECK(v["argmax_candidate"] == "neither");
    CHECK(v["candidate_attribution_complete"] == false);
  }
  SUBCASE("a tie at the top: the first index is the argmax, attributed but not completely") {
    Json v = sup::make_verdict(r, output(65, 0.0, true));
    CHECK(v["argmax_candidate"] == "kiln");
    CHECK(v["candidate_attribution_complete"] == false);
  }
  SUBCASE("an output missing a candidate's logit is not complete") {
    Json o = output(65, 0.5, false);
    o["candidate_tokens"].erase(1);
    CHECK(sup::make_verdict(r, o)["candidate_attribution_complete"] == false);
  }
}
