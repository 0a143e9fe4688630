// Argument handling and errors of the `assay` command line that need no daemon.
#include <cstdio>
#include <cstdlib>

#include <doctest/doctest.h>

#include <sys/wait.h>

#include "client/format.h"
#include "common/fs.h"
#include "common/json.h"
#include "support.h"

namespace {

using assay::client::test::run;
using assay::client::test::TempDir;

}  // namespace

TEST_CASE("help lists every command and the exit codes") {
  auto r = run({"--help"});
  CHECK(r.status == 0);
  for (const char* cmd : {"submit", "wait", "status", "list", "result", "artifact", "cancel",
                          "verify", "keys", "health", "request", "fidelity"})
    CHECK_MESSAGE(r.out.find(std::string("  ") + cmd + " ") != std::string::npos, cmd);
  CHECK(r.out.find("8  --wait-timeout expired") != std::string::npos);
  CHECK(run({"verify", "--help"}).status == 0);
  // A command's help names the options every command takes, not the whole exit table again.
  for (std::vector<std::string> args :
       {std::vector<std::string>{"status", "--help"}, {"fidelity", "submit", "--help"}}) {
    auto h = run(args);
    CAPTURE(h.out);
    CHECK(h.status == 0);
    CHECK(h.out.find("--socket PATH") != std::string::npos);
    CHECK(h.out.find("--json") != std::string::npos);
    CHECK(h.out.find("Exit status: see `assay --help`") != std::string::npos);
    CHECK(h.out.find("4  assayd refused the request") == std::string::npos);
  }
}

TEST_CASE("bad command lines exit 2 with a message and without contacting assayd") {
  assay::client::Environment env{.socket = "/nonexistent/assayd.sock"};
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  std::vector<Case> cases{
      {{}, "A subcommand is required"},
      {{"frobnicate"}, "unknown command \"frobnicate\""},
      {{"status"}, "ID is required"},
      {{"artifact", "j-000000000000000000000000"}, "--output is required"},
      {{"verify", "/nonexistent/result.json"}, "/nonexistent/result.json"},
      {{"request"}, "A subcommand is required"},
      {{"--timeout", "-1", "health"}, "--timeout"},
      {{"status", "../../etc"}, "is not a job id"},
      {{"status", "a/b"}, "is not a job id"},
      {{"status", "j-123"}, "\"j-123\" is not a job id"},
      {{"result", "J-0123456789ABCDEF01234567"}, "is not a job id"},
      {{"cancel", "j-0123456789abcdef012345678"}, "is not a job id"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.says);
    auto r = run(c.args, env);
    CHECK(r.status == 2);
    CHECK(r.err.find(c.says) != std::string::npos);
    CHECK(r.err.find("cannot connect") == std::string::npos);
  }
}

TEST_CASE("an unreachable daemon exits 3 and names the socket from --socket or ASSAY_SOCKET") {
  TempDir dir;
  std::string env_sock = (dir / "from-env.sock").string();
  auto r = run({"health"}, {.socket = env_sock});
  CHECK(r.status == 3);
  CHECK(r.err.find("cannot connect to assayd at " + env_sock) != std::string::npos);

  std::string flag_sock = (dir / "from-flag.sock").string();
  r = run({"status", "j-000000000000000000000000", "--socket", flag_sock}, {.socket = env_sock});
  CHECK(r.status == 3);
  CHECK(r.err.find(flag_sock) != std::string::npos);

  r = run({"list"}, {});
  CHECK(r.err.find("/run/assay/assayd.sock") != std::string::npos);
}

TEST_CASE("submit refuses an invalid request locally with exit 7") {
  TempDir dir;
  auto r = run({"submit", dir.write("bad.json", R"({"schema":"nope"})")},
               {.socket = "/nonexistent/assayd.sock"});
  CHECK(r.status == 7);
  CHECK(r.err.find("[request.unknown_schema]") != std::string::npos);
}

TEST_CASE("the assay binary reads ASSAY_SOCKET and returns the documented exit status") {
  TempDir dir;
  std::string sock = (dir / "env.sock").string();
  std::string cmd = "ASSAY_SOCKET='" + sock + "' '" ASSAY_CLIENT_BIN "' health 2>'" +
                    (dir / "err").string() + "'";
  int raw = std::system(cmd.c_str());
  REQUIRE(WIFEXITED(raw));
  CHECK(WEXITSTATUS(raw) == 3);
  CHECK(assay::common::read_file(dir / "err", 4096).find(sock) != std::string::npos);
  raw = std::system("'" ASSAY_CLIENT_BIN "' --version >/dev/null");
  CHECK(WEXITSTATUS(raw) == 0);
}

TEST_CASE("verify without --pubkey needs the daemon and says how to stay offline") {
  TempDir dir;
  auto r =
      run({"verify", dir.write("result.json", "{}")}, {.socket = (dir / "none.sock").string()});
  CHECK(r.status == 3);
  CHECK(r.err.find("give --pubkey FILE to verify offline") != std::string::npos);
}

TEST_CASE(
    "verify --kiln on a Kiln path-attribution record says it is a kind assay does not check: "
    "exit 10, neither verified nor refused (exit 6 is for a record that fails a check)") {
  TempDir dir;
  std::string record =
      dir.write("path.json",
                R"({"schema":"kiln.rocm-hf-path-attribution-result.v2","result_sha256":"sha256:)" +
                    std::string(64, '0') + R"("})");
  auto r = run({"verify", "--kiln", record});
  CHECK(r.status == 10);
  CHECK(r.out.find("NOT CHECKED (Kiln record): " + record +
                   " is a kiln.rocm-hf-path-attribution-result.v2 record, a kind assay does not "
                   "check") != std::string::npos);
  auto j = run({"verify", "--kiln", record, "--json"});
  CHECK(j.status == 10);
  auto doc = assay::common::parse_strict(j.out);
  CHECK(doc["ok"] == false);
  CHECK(doc["not_checked"] == "kiln.rocm-hf-path-attribution-result.v2");
  // Not a Kiln record at all: a check fails (exit 6), as before.
  auto other = run({"verify", "--kiln", dir.write("x.json", R"({"schema":"something.else"})")});
  CHECK(other.status == 6);
}

TEST_CASE("fidelity submit checks the request locally; fidelity show needs an id") {
  TempDir dir;
  assay::client::Environment env{.socket = "/nonexistent/assayd.sock"};
  // A next-token request is not a fidelity request.
  auto r = run({"fidelity", "submit",
                dir.write("nt.json", R"({"schema":"assay.next-token-request.v1","id":"x"})")},
               env);
  CHECK(r.status == 7);
  // A fidelity request with overlapping ranges is refused before any connection.
  std::string bad =
      R"({"schema":"assay.fidelity-request.v1","id":"f","reference":{"model_dir":"/m"},
    "candidate":{"model_dir":"/c"},"panel":{"contexts":[{"token_ids":[1,2,3],
    "positions":[[0,2],[1,3]]}]}})";
  r = run({"fidelity", "submit", dir.write("bad.json", bad)}, env);
  CHECK(r.status == 7);
  CHECK(r.err.find("overlaps") != std::string::npos);
  CHECK(r.err.find("cannot connect") == std::string::npos);
  // A valid one gets as far as the (absent) daemon; --model does not apply to it.
  std::string good =
      R"({"schema":"assay.fidelity-request.v1","id":"f","reference":{"model_dir":"/m"},
    "candidate":{"model_dir":"/c"},"panel":{"contexts":[{"token_ids":[1,2,3]}]}})";
  r = run({"fidelity", "submit", dir.write("good.json", good)}, env);
  CHECK(r.status == 3);
  r = run({"submit", dir.write("good2.json", good), "--model", "/x"}, env);
  CHECK(r.status == 2);
  CHECK(r.err.find("--model does not apply") != std::string::npos);
  // request check reports a fidelity request's identities.
  r = run({"request", "check", dir / "good.json"}, env);
  CHECK(r.status == 0);
  CHECK(r.out.find("\"panel_sha256\"") != std::string::npos);
  CHECK(r.out.find("\"scored_positions\": 3") != std::string::npos);
  r = run({"fidelity", "show"}, env);
  CHECK(r.status == 2);
  r = run({"fidelity"}, env);
  CHECK(r.status == 2);
}

TEST_CASE("fidelity_report shows the metric table, per-context rows and the histogram") {
  using assay::common::Json;
  Json stats = {{"mean", 0.5},  {"median", 0.25}, {"p95", 1.0}, {"p99", 1.5},
                {"p99_9", 1.9}, {"max", 2.0},     {"min", 0.0}};
  Json r = {
      {"job_id", "j-0123456789abcdef01234567"},
      {"request", {{"id", "q4"}}},
      {"panel",
       {{"contexts", Json::array({Json::object(), Json::object()})},
        {"scored_positions", 40},
        {"vocab_size", 151936}}},
      {"reference",
       {{"model_dir", "/models/ref"},
        {"model_identity",
         {{"id", "qwen3"}, {"content_sha256", "sha256:" + std::string(64, 'a')}}}}},
      {"candidate",
       {{"kind", "logits"}, {"label", "kiln int4"}, {"logits_files", Json::array({1, 2})}}},
      {"reproduction",
       {{"confirmed", false}, {"digests_equal", false}, {"kl", stats}, {"top1_agreement", 0.9}}},
      {"comparison",
       {{"metrics",
         {{"kl", stats},
          {"max_at", {{"context", "b"}, {"position", 17}}},
          {"top1_agreement", 0.975},
          {"top1_agree_count", 39}}},
        {"contexts",
         {{{"id", "a"}, {"positions", 20}, {"kl", stats}, {"top1_agreement", 1.0}},
          {{"id", "b"}, {"positions", 20}, {"kl", stats}, {"top1_agreement", 0.95}}}},
        {"histogram",
         {{"zero", 3},
          {"negative", 0},
          {"edges", {1e-3, 1e-2, 1e-1}},
          {"counts", {0, 10, 20, 7}}}}}},
      {"result_sha256", "sha256:" + std::string(64, 'f')}};
  std::string text = assay::client::fidelity_report(r);
  INFO(text);
  for (const char* s :
       {"request \"q4\"", "kiln int4: logits supplied in 2 file(s)", "qwen3",
        "40 scored positions, vocab 151936", "p99.9", "1.9", "(context b, position 17)",
        "0.975  (39 of 40)", "NOT CONFIRMED", "per context", "0.95", "= 0", "[1e-03, 1e-02)",
        ">= 1e-01", "########################################  20"})
    CHECK_MESSAGE(text.find(s) != std::string::npos, s);
  // Leading and trailing empty bins are left out.
  CHECK(text.find("(0, 1e-03)") == std::string::npos);
}

TEST_CASE("next_token_report: the verdict, candidates with text, logit, rank and gap, humanised") {
  using assay::common::Json;
  Json r = assay::common::parse_strict(assay::common::read_file(
      std::string(ASSAY_CLIENT_TEST_DIR) + "/fixtures/report/result.json", 1 << 20));
  std::string text = assay::client::next_token_report(r);
  CAPTURE(text);
  CHECK(text.find("verdict:    kiln produced the reference argmax (token 135 \"\xef\xbf\xbd\")") !=
        std::string::npos);
  CHECK(text.find("ENGINE  TOKEN  TEXT") != std::string::npos);
  CHECK(text.find("kiln *  135") != std::string::npos);
  // vllm's token, its logit, rank 2 and its gap to the argmax's logit.
  CHECK(text.find("vllm    34     \"\\\"\"") != std::string::npos);
  CHECK(text.find("1.6328125  2     -0.03125") != std::string::npos);
  CHECK(text.find("\"\\u0019\"") != std::string::npos);  // a control byte, visible
  CHECK(text.find("memory peak 62.3 MiB (cgroup), RSS 130 MiB") != std::string::npos);
  CHECK(text.find("forward 37.1 ms") != std::string::npos);
  CHECK(text.find("(AMD EPYC)") != std::string::npos);
  // Neither engine.
  r["verdict"]["argmax_candidate"] = "neither";
  CHECK(assay::client::next_token_report(r).find("verdict:    neither engine produced") !=
        std::string::npos);
  CHECK(assay::client::format_bytes(512) == "512 B");
  CHECK(assay::client::format_bytes(268435456) == "256 MiB");
  CHECK(assay::client::format_bytes(8.0 * (1ull << 30)) == "8.00 GiB");
  CHECK(assay::client::format_duration(0.00085) == "850 us");
  CHECK(assay::client::format_duration(1.234) == "1.23 s");
}
