// Argument handling and errors of the `assay` command line that need no daemon.
#include <cstdio>
#include <cstdlib>

#include <doctest/doctest.h>

#include <sys/wait.h>

#include "support.h"

namespace {

using assay::client::test::run;
using assay::client::test::TempDir;

}  // namespace

TEST_CASE("help lists every command and the exit codes") {
  auto r = run({"--help"});
  CHECK(r.status == 0);
  for (const char* cmd : {"submit", "wait", "status", "list", "result", "artifact", "cancel",
                          "verify", "keys", "health", "request"})
    CHECK_MESSAGE(r.out.find(std::string("  ") + cmd + " ") != std::string::npos, cmd);
  CHECK(r.out.find("8  wait --timeout expired") != std::string::npos);
  CHECK(run({"verify", "--help"}).status == 0);
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
      {{"artifact", "j1"}, "--output is required"},
      {{"verify", "/nonexistent/result.json"}, "/nonexistent/result.json"},
      {{"request"}, "A subcommand is required"},
      {{"--timeout", "-1", "health"}, "--timeout"},
      {{"status", "../../etc"}, "is not a job id"},
      {{"status", "a/b"}, "is not a job id"},
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
  r = run({"status", "j1", "--socket", flag_sock}, {.socket = env_sock});
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
