// contain::Evidence: its one writer and its one reader agree, the reader refuses what the
// schema refuses (naming the field), and the outcome is judged from typed fields.
#include <doctest/doctest.h>

#include <functional>
#include <string>
#include <vector>

#include "common/error.h"
#include "supervisor/contain/evidence.h"
#include "tests/contain/test_util.h"

namespace {

using assay::common::Json;
using namespace assay::contain;

// Every field set, every kind of counter (a number, keys with and without a value, absent).
Evidence full_evidence() {
  Evidence e;
  e.name = "job-7_oracle.1";
  e.mode = "cgroup-v1";
  e.cgroup = CgroupEvidence{"/assayd-1-2.job-7_oracle.1",
                            {{"memory", "/sys/fs/cgroup/memory/assayd-1-2.job-7_oracle.1"},
                             {"pids", "/sys/fs/cgroup/pids/assayd-1-2.job-7_oracle.1"}},
                            true};
  e.spawn = SpawnEvidence{
      "clone3-self-attach",
      {"/usr/lib/assay/assay-oracle", "next-token"},
      "/var/lib/assay/jobs/7/oracle",
      {"PATH", "LANG"},
      65534,
      65534,
      4096,
      2,
      Capabilities{0, 0, 0, 0x1ffffffffffULL, 0},
      SeccompEvidence{"sha256:" + std::string(64, 'a'), "x86_64", {"mount", "ptrace"}, {"clone3"}}};
  Limits limits;
  limits.memory_max = 8ULL << 30;
  limits.pids_max = 64;
  limits.timeout = std::chrono::milliseconds(600000);
  limits.kill_grace = std::chrono::milliseconds(0);
  e.limits = limits;
  e.network = NetworkEvidence{true, {"lo"}};
  e.pid_namespace_private = true;
  e.mounts = MountsEvidence{{"/run/assayd", "/var/lib/assay"}, {"/missing"}};
  e.started_at = "2024-05-01T12:00:00.123Z";
  e.wall_usec = 1234567;
  e.exit = ExitStatus{std::nullopt, 9, "SIGKILL", false};
  e.cpu = CpuEvidence{1000, 2000, 2500};
  e.timed_out = true;
  e.sigterm_sent = true;
  e.cgroup_killed = true;
  e.leftover_processes_killed = 2;
  e.oom_killed = false;
  e.memory_peak_bytes = 123456789;
  e.pids_peak = 3;
  e.counters =
      Counters{{"memory.max_usage_in_bytes", Counter{123456789, std::nullopt}},
               {"memory.memsw.failcnt", Counter{}},
               {"memory.oom_control", Counter{std::nullopt, {{{"oom_kill", 0}, {"under_oom", 0}}}}},
               {"pids.events", Counter{std::nullopt, {{{"max", std::nullopt}}}}}};
  e.output = OutputEvidence{
      {"/var/lib/assay/jobs/7/oracle/stdout.log", 10, 0}, {std::nullopt, 0, 0}, 8 << 20};
  e.errors = {"waitid: Interrupted system call"};
  return e;
}

}  // namespace

TEST_CASE("evidence read back from its JSON is the same evidence, and the JSON is valid") {
  Evidence e = full_evidence();
  Json doc = e.to_json();
  CHECK(doc["schema"] == "assay.process-containment.v1");
  CHECK(doc["exit"] ==
        Json{{"code", nullptr}, {"signal", 9}, {"signal_name", "SIGKILL"}, {"core_dumped", false}});
  CHECK(doc["spawn"]["rlimits"] == Json{{"core", 0}, {"nofile", 4096}});
  CHECK(doc["spawn"]["no_new_privs"] == true);
  CHECK(doc["network"] == Json{{"namespace", "private"}, {"interfaces", {"lo"}}});
  CHECK(doc["pid_namespace"] == Json{{"namespace", "private"}});
  CHECK(doc["mounts"]["proc"] == "pid-namespace");
  CHECK(doc["mounts"]["sys"] == "network-namespace");
  CHECK(doc["spawn"]["pass_fds"] == 2);
  CHECK(doc["spawn"]["dumpable_before_exec"] == false);
  CHECK(doc["spawn"]["capabilities"]["bounding"] == "000001ffffffffff");
  CHECK(doc["spawn"]["capabilities"]["effective"] == "0000000000000000");
  CHECK(doc["spawn"]["seccomp"]["enosys"] == Json{"clone3"});
  CHECK(doc["spawn"]["seccomp"]["clone_namespace_flags"] == "EPERM");
  CHECK(doc["counters"]["memory.memsw.failcnt"].is_null());
  CHECK(doc["counters"]["pids.events"] == Json{{"max", nullptr}});
  CHECK(doc["counters"]["memory.max_usage_in_bytes"] == 123456789);
  CHECK(doc["memory"]["swap_peak_bytes"].is_null());
  CHECK(doc["output"]["stderr"]["path"].is_null());
  CHECK(doc["limits"]["memory_high"].is_null());
  CHECK(doc["limits"]["kill_grace_ms"] == 0);
  Evidence back = Evidence::from_json(doc);
  CHECK(back == e);
  CHECK(back.to_json() == doc);
  // Through text, as a node's evidence arrives.
  CHECK(Evidence::from_json(Json::parse(doc.dump())) == e);
  assay::contain::test::TempDir dir;
  assay::contain::test::check_schema(doc, dir.path);
}

TEST_CASE("normalised evidence on cgroup v1 comes from failcnt, oom_control, max_usage and memsw") {
  Evidence e = full_evidence();
  e.exit = ExitStatus{3, std::nullopt, std::nullopt, false};
  (*e.counters)["memory.failcnt"] = Counter{7, std::nullopt};
  (*e.counters)["memory.oom_control"] =
      Counter{std::nullopt, {{{"oom_kill", 2}, {"under_oom", 0}}}};
  (*e.counters)["memory.usage_in_bytes"] = Counter{4096, std::nullopt};
  (*e.counters)["memory.memsw.usage_in_bytes"] = Counter{4096 + 8192, std::nullopt};
  Json n = e.to_json()["normalised"];
  CHECK(n["memory_high_events"].is_null());
  CHECK(n["memory_oom_events"].is_null());
  CHECK(n["memory_max_events"] == 7);
  CHECK(n["memory_oom_kill_events"] == 2);
  CHECK(n["memory_peak_bytes"] == 123456789);
  CHECK(n["memory_swap_bytes"] == 8192);
  CHECK(n["elapsed_seconds"] == 1.234567);
  CHECK(n["timeout_seconds"] == 600.0);
  CHECK(n["exit_code"] == 3);
  CHECK(n["sources"] ==
        Json{{"memory_max_events", "memory.failcnt"},
             {"memory_oom_kill_events", "memory.oom_control:oom_kill"},
             {"memory_peak_bytes", "memory.max_usage_in_bytes"},
             {"memory_swap_bytes", "memory.memsw.usage_in_bytes-memory.usage_in_bytes"},
             {"elapsed_seconds", "wall_usec"},
             {"timeout_seconds", "limits.timeout_ms"},
             {"exit_code", "exit.code"}});
  CHECK(Evidence::from_json(Json::parse(e.to_json().dump())) == e);
  assay::contain::test::TempDir dir;
  assay::contain::test::check_schema(e.to_json(), dir.path);
}

TEST_CASE("normalised evidence on cgroup v2 comes from memory.events, memory.peak and swap.peak") {
  Evidence e = full_evidence();
  e.mode = "cgroup-v2";
  e.counters = Counters{
      {"memory.events",
       Counter{std::nullopt, {{{"low", 0}, {"high", 5}, {"max", 4}, {"oom", 3}, {"oom_kill", 1}}}}},
      {"memory.peak", Counter{1 << 20, std::nullopt}},
      {"memory.swap.current", Counter{0, std::nullopt}},
      {"memory.swap.peak", Counter{65536, std::nullopt}}};
  NormalisedEvidence n = e.normalised();
  CHECK(n.memory_high_events == 5u);
  CHECK(n.memory_max_events == 4u);
  CHECK(n.memory_oom_events == 3u);
  CHECK(n.memory_oom_kill_events == 1u);
  CHECK(n.memory_peak_bytes == (1u << 20));
  CHECK(n.memory_swap_bytes == 65536u);
  CHECK(n.sources.at("memory_swap_bytes") == "memory.swap.peak");
  CHECK(n.sources.at("memory_high_events") == "memory.events:high");
  CHECK_FALSE(n.exit_code);  // killed by SIGKILL
  // A kernel without memory.swap.peak: the current value, named as such.
  e.counters->erase("memory.swap.peak");
  CHECK(e.normalised().memory_swap_bytes == 0u);
  CHECK(e.normalised().sources.at("memory_swap_bytes") == "memory.swap.current");
  CHECK(Evidence::from_json(e.to_json()) == e);
}

TEST_CASE("normalised evidence is null where there is no cgroup") {
  Evidence e = full_evidence();
  e.mode = "none";
  e.cgroup.reset();
  e.counters.reset();
  NormalisedEvidence n = e.normalised();
  CHECK_FALSE(n.memory_peak_bytes);
  CHECK_FALSE(n.memory_max_events);
  CHECK_FALSE(n.memory_swap_bytes);
  CHECK(n.elapsed_seconds == 1.234567);
}

TEST_CASE("the evidence reader refuses a malformed document and names the field") {
  struct Case {
    const char* what;
    std::function<void(Json&)> mutate;
    const char* message;
  };
  std::vector<Case> cases = {
      {"not an object", [](Json& d) { d = Json::array(); }, "evidence: expected an object"},
      {"missing", [](Json& d) { d.erase("exit"); }, "\"exit\" is missing"},
      {"unknown", [](Json& d) { d["extra"] = 1; }, "\"extra\" is not in the schema"},
      {"nested missing", [](Json& d) { d["output"]["stdout"].erase("bytes"); },
       "\"output.stdout.bytes\" is missing"},
      {"nested unknown", [](Json& d) { d["exit"]["status"] = 0; },
       "\"exit.status\" is not in the schema"},
      {"schema", [](Json& d) { d["schema"] = "assay.process-containment.v2"; }, "\"schema\""},
      {"name", [](Json& d) { d["name"] = "../escape"; }, "\"name\""},
      {"mode", [](Json& d) { d["mode"] = "cgroup-v3"; }, "\"mode\""},
      {"code type", [](Json& d) { d["exit"]["code"] = "0"; }, "\"exit.code\""},
      {"code range", [](Json& d) { d["exit"]["code"] = 1LL << 40; }, "\"exit.code\""},
      {"negative count", [](Json& d) { d["memory"]["peak_bytes"] = -1; }, "\"memory.peak_bytes\""},
      {"fraction", [](Json& d) { d["wall_usec"] = 1.5; }, "\"wall_usec\""},
      {"timeout", [](Json& d) { d["limits"]["timeout_ms"] = 0; }, "\"limits.timeout_ms\""},
      {"no_new_privs", [](Json& d) { d["spawn"]["no_new_privs"] = false; },
       "\"spawn.no_new_privs\""},
      {"core", [](Json& d) { d["spawn"]["rlimits"]["core"] = 1; }, "\"spawn.rlimits.core\""},
      {"stdin", [](Json& d) { d["spawn"]["stdin"] = "/dev/zero"; }, "\"spawn.stdin\""},
      {"method", [](Json& d) { d["spawn"]["method"] = "fork"; }, "\"spawn.method\""},
      {"argv empty", [](Json& d) { d["spawn"]["argv"] = Json::array(); }, "\"spawn.argv\""},
      {"uid", [](Json& d) { d["spawn"]["uid"] = -1; }, "\"spawn.uid\""},
      {"started_at", [](Json& d) { d["started_at"] = "2024-05-01 12:00:00"; }, "\"started_at\""},
      {"network", [](Json& d) { d["network"]["namespace"] = "host"; }, "\"network.namespace\""},
      {"mounts", [](Json& d) { d["mounts"]["namespace"] = "shared"; }, "\"mounts.namespace\""},
      {"proc", [](Json& d) { d["mounts"]["proc"] = "host"; }, "\"mounts.proc\""},
      {"pid namespace", [](Json& d) { d["pid_namespace"]["namespace"] = "host"; },
       "\"pid_namespace.namespace\""},
      {"dumpable", [](Json& d) { d["spawn"]["dumpable_before_exec"] = true; },
       "\"spawn.dumpable_before_exec\""},
      {"pass_fds", [](Json& d) { d["spawn"]["pass_fds"] = -1; }, "\"spawn.pass_fds\""},
      {"capability hex",
       [](Json& d) { d["spawn"]["capabilities"]["effective"] = "0000000000000X00"; },
       "\"spawn.capabilities.effective\""},
      {"capability length", [](Json& d) { d["spawn"]["capabilities"]["bounding"] = "0"; },
       "\"spawn.capabilities.bounding\""},
      {"policy", [](Json& d) { d["spawn"]["seccomp"]["policy_sha256"] = "sha256:AB"; },
       "\"spawn.seccomp.policy_sha256\""},
      {"seccomp arch", [](Json& d) { d["spawn"]["seccomp"]["arch"] = "i386"; },
       "\"spawn.seccomp.arch\""},
      {"clone flags", [](Json& d) { d["spawn"]["seccomp"]["clone_namespace_flags"] = "ALLOW"; },
       "\"spawn.seccomp.clone_namespace_flags\""},
      {"kill_scope", [](Json& d) { d["kill_scope"] = "host"; }, "\"kill_scope\""},
      {"leftover", [](Json& d) { d["leftover_processes_killed"] = -2; },
       "\"leftover_processes_killed\""},
      {"oom_killed", [](Json& d) { d["oom_killed"] = 1; }, "\"oom_killed\""},
      {"counter key", [](Json& d) { d["counters"]["memory.oom_control"]["oom_kill"] = "x"; },
       "\"counters.memory.oom_control.oom_kill\""},
      {"counter", [](Json& d) { d["counters"]["memory.failcnt"] = true; },
       "\"counters.memory.failcnt\""},
      {"hierarchy", [](Json& d) { d["cgroup"]["hierarchies"]["memory"] = 1; },
       "\"cgroup.hierarchies.memory\""},
      {"errors", [](Json& d) { d["errors"] = Json::array({1}); }, "\"errors.0\""},
      {"cpu null", [](Json& d) { d["cpu"] = nullptr; }, "\"cpu\""},
      {"normalised disagrees with the counters",
       [](Json& d) { d["normalised"]["memory_peak_bytes"] = 1; },
       "\"normalised.memory_peak_bytes\""},
      {"normalised missing", [](Json& d) { d["normalised"].erase("exit_code"); },
       "\"normalised.exit_code\" is missing"},
      {"normalised source", [](Json& d) { d["normalised"]["sources"]["memory_peak_bytes"] = "x"; },
       "\"normalised.sources\""},
  };
  for (const auto& c : cases) {
    CAPTURE(c.what);
    Json doc = full_evidence().to_json();
    c.mutate(doc);
    try {
      Evidence::from_json(doc);
      FAIL("accepted: " << doc.dump());
    } catch (const assay::common::Error& err) {
      CHECK(err.code() == "contain.bad_evidence");
      CHECK_MESSAGE(std::string(err.what()).find(c.message) != std::string::npos, err.what());
    }
  }
}

TEST_CASE("success is exit code 0, not timed out, not OOM-killed; the reason says which failed") {
  auto with = [](std::function<void(Evidence&)> f) {
    Evidence e;
    e.name = "w";
    e.mode = "cgroup-v2";
    e.exit = ExitStatus{0, std::nullopt, std::nullopt, false};
    e.oom_killed = false;
    f(e);
    return e;
  };
  Evidence ok = with([](Evidence&) {});
  CHECK(ok.succeeded());
  CHECK(ok.failure_reason() == "");
  Evidence cancelled_after_exit = with([](Evidence& e) { e.cancelled = true; });
  CHECK(cancelled_after_exit.succeeded());
  Evidence unknown_oom = with([](Evidence& e) { e.oom_killed = std::nullopt; });  // mode none
  CHECK(unknown_oom.succeeded());

  Evidence timed_out = with([](Evidence& e) {
    e.timed_out = true;
    e.oom_killed = true;  // the timeout is named first
  });
  CHECK_FALSE(timed_out.succeeded());
  CHECK(timed_out.failure_reason() == "timed out and was killed");
  Evidence oom = with([](Evidence& e) { e.oom_killed = true; });
  CHECK_FALSE(oom.succeeded());
  CHECK(oom.failure_reason() == "was OOM-killed (memory limit reached)");
  Evidence sig = with([](Evidence& e) { e.exit = ExitStatus{std::nullopt, 9, "SIGKILL", false}; });
  CHECK_FALSE(sig.succeeded());
  CHECK(sig.failure_reason() == "was killed by signal SIGKILL");
  Evidence rt_sig = with([](Evidence& e) { e.exit = ExitStatus{std::nullopt, 34, {}, false}; });
  CHECK(rt_sig.failure_reason() == "was killed by signal 34");
  Evidence code = with([](Evidence& e) { e.exit->code = 3; });
  CHECK_FALSE(code.succeeded());
  CHECK(code.failure_reason() == "exited with code 3");
  Evidence none = with([](Evidence& e) {
    e.exit.reset();
    e.errors = {"waitid: No child processes", "rmdir /x: Device or resource busy"};
  });
  CHECK_FALSE(none.succeeded());
  CHECK(none.failure_reason() ==
        "left no exit status in its evidence: waitid: No child processes; rmdir /x: Device or "
        "resource busy");
  Evidence bare = with([](Evidence& e) { e.exit.reset(); });
  CHECK(bare.failure_reason() == "left no exit status in its evidence");
}

TEST_CASE(
    "a resident worker's job evidence is per job: cumulative counters minus their start, reset "
    "counters as read, lifetime peaks null; it reads back and is schema-valid") {
  Evidence e = full_evidence();
  e.mode = "cgroup-v2";
  e.exit.reset();
  e.timed_out = e.sigterm_sent = e.cgroup_killed = false;
  e.cpu = CpuEvidence{};
  e.counters = Counters{
      {"memory.events",
       Counter{std::nullopt, {{{"low", 0}, {"high", 7}, {"max", 4}, {"oom", 1}, {"oom_kill", 0}}}}},
      {"memory.peak", Counter{9u << 20, std::nullopt}},
      {"memory.swap.current", Counter{0, std::nullopt}},
      {"memory.swap.peak", Counter{65536, std::nullopt}},
      {"pids.peak", Counter{40, std::nullopt}},
      {"cpu.stat", Counter{std::nullopt, {{{"usage_usec", 5000}}}}}};
  ResidentEvidence r;
  r.worker = "r-3-1796238521782";
  r.loaded_at = "2026-12-02T19:08:41.990Z";
  r.started_at = "2026-12-02T19:08:42.767Z";
  r.jobs_before = 4;
  r.counters_at_start = Counters{
      {"memory.events",
       Counter{std::nullopt, {{{"low", 0}, {"high", 5}, {"max", 4}, {"oom", 1}, {"oom_kill", 0}}}}},
      {"memory.peak", Counter{9u << 20, std::nullopt}},
      {"cpu.stat", Counter{std::nullopt, {{{"usage_usec", 3000}}}}}};
  e.resident = r;
  // What summarise_counters does after a snapshot.
  e.pids_peak.reset();
  e.memory_peak_bytes.reset();
  NormalisedEvidence n = e.normalised();
  CHECK(n.memory_high_events == 2u);  // 7 at the end, 5 at the start
  CHECK(n.memory_max_events == 0u);
  CHECK(n.memory_oom_events == 0u);
  CHECK_FALSE(n.memory_peak_bytes);  // memory.peak covers the worker's life
  CHECK(n.memory_swap_bytes == 0u);  // no per-job swap.peak: the current value
  CHECK_FALSE(n.exit_code);
  CHECK(e.job_counters()->at("cpu.stat").keys->at("usage_usec") == 2000u);
  CHECK(e.succeeded());
  CHECK(e.memory_pressure() == std::vector<std::string>{"memory.events:high = 2"});

  // cgroup v1: the peak and failcnt were reset as the job began, so they read per job.
  Evidence v1 = full_evidence();
  v1.exit.reset();
  v1.timed_out = false;
  (*v1.counters)["memory.failcnt"] = Counter{2, std::nullopt};
  (*v1.counters)["memory.oom_control"] =
      Counter{std::nullopt, {{{"oom_kill", 1}, {"under_oom", 0}}}};
  ResidentEvidence r1 = r;
  r1.counters_at_start = Counters{
      {"memory.failcnt", Counter{0, std::nullopt}},
      {"memory.oom_control", Counter{std::nullopt, {{{"oom_kill", 1}, {"under_oom", 0}}}}}};
  r1.reset = {"memory.max_usage_in_bytes", "memory.failcnt"};
  v1.resident = r1;
  NormalisedEvidence n1 = v1.normalised();
  CHECK(n1.memory_peak_bytes == 123456789u);
  CHECK(n1.memory_max_events == 2u);
  CHECK(n1.memory_oom_kill_events == 0u);  // the kill before this job is not this job's

  for (const Evidence& doc : {e, v1}) {
    Json j = doc.to_json();
    CHECK(j["resident"]["worker"] == "r-3-1796238521782");
    CHECK(Evidence::from_json(Json::parse(j.dump())) == doc);
    assay::contain::test::TempDir dir;
    assay::contain::test::check_schema(j, dir.path);
  }
  // The worker ended during the job: not a success, whatever its exit code.
  e.exit = ExitStatus{0, std::nullopt, std::nullopt, false};
  CHECK_FALSE(e.succeeded());
  Json bad = e.to_json();
  bad["resident"]["extra"] = 1;
  CHECK_THROWS_WITH_AS(Evidence::from_json(bad), doctest::Contains("resident.extra"),
                       assay::common::Error);
}
