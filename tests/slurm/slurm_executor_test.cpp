// The Slurm executor against the real single-node cluster run.sh started (SLURM_CONF). Needs
// ASSAY_TEST_ASSAYD (the `assayd` the node runs) and ASSAY_TEST_SHARED (the shared directory).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include <boost/asio/io_context.hpp>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/json.h"
#include "supervisor/contain/spawn_spec_json.h"
#include "supervisor/executors/command.h"
#include "supervisor/executors/slurm.h"

namespace fs = std::filesystem;
using namespace assay;
using executors::SlurmExecutor;
using executors::SlurmOptions;
using executors::SlurmResult;
using executors::SlurmStep;
using Clock = std::chrono::steady_clock;

namespace {

fs::path shared_dir() {
  return std::getenv("ASSAY_TEST_SHARED");
}

SlurmOptions options() {
  SlurmOptions o;
  o.shared_dir = shared_dir();
  o.node_assayd = std::getenv("ASSAY_TEST_ASSAYD");
  o.poll = std::chrono::milliseconds(200);
  o.default_memory_bytes = 256ULL << 20;
  o.evidence_wait = std::chrono::seconds(2);
  return o;
}

int counter = 0;

// A worker spec whose workspace lives in the shared directory.
contain::SpawnSpec spec(const std::string& script,
                        std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  contain::SpawnSpec s;
  s.name = "t" + std::to_string(::getpid()) + "-" + std::to_string(++counter);
  s.workdir = shared_dir() / ("ws-" + s.name);
  fs::create_directories(s.workdir);
  s.argv = {"/bin/sh", "-c", script};
  s.env = {"PATH=/usr/bin:/bin"};
  s.stdout_path = s.workdir / "stdout";
  s.stderr_path = s.workdir / "stderr";
  s.limits.timeout = timeout;
  s.limits.kill_grace = std::chrono::seconds(1);
  return s;
}

// Runs `io` until `until` holds or `limit` passes.
template <class Pred>
bool run_until(boost::asio::io_context& io, Pred until, std::chrono::seconds limit) {
  auto end = Clock::now() + limit;
  while (!until() && Clock::now() < end) {
    io.restart();
    io.run_for(std::chrono::milliseconds(50));
  }
  return until();
}

std::string command_out(std::vector<std::string> argv) {
  boost::asio::io_context io;
  std::optional<executors::CommandResult> r;
  executors::run_command(io, std::move(argv),
                         [&](executors::CommandResult x) { r = std::move(x); });
  io.run();
  return r->out;
}

std::string squeue_state(const std::string& id) {
  std::string s = command_out({"squeue", "-h", "-t", "all", "-j", id, "-o", "%T"});
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

struct Collected {
  std::optional<SlurmResult> result;
  std::optional<SlurmStep> submitted;
  std::vector<SlurmStep> progress;
  executors::SlurmCallbacks callbacks() {
    return {[this](const SlurmStep& s) { submitted = s; },
            [this](const SlurmStep& s) { progress.push_back(s); },
            [this](SlurmResult r) { result = std::move(r); }};
  }
};

}  // namespace

TEST_CASE("a spawn spec survives its JSON document exactly, and the reader is strict") {
  auto s = spec("true");
  s.uid = 65534;
  s.limits.memory_max = 64ULL << 20;
  s.hidden_paths = {"/etc/secret"};
  auto back = contain::spawn_spec_from_json(contain::spawn_spec_to_json(s));
  CHECK(back.name == s.name);
  CHECK(back.argv == s.argv);
  CHECK(back.workdir == s.workdir);
  CHECK(back.env == s.env);
  CHECK(back.stdout_path == s.stdout_path);
  CHECK(back.hidden_paths == s.hidden_paths);
  CHECK(back.uid == s.uid);
  CHECK(!back.gid);
  CHECK(back.limits == s.limits);
  CHECK(back.node_env.empty());
  CHECK_FALSE(contain::spawn_spec_to_json(s).contains("node_env"));
  s.node_env = {"CUDA_VISIBLE_DEVICES"};
  CHECK(contain::spawn_spec_from_json(contain::spawn_spec_to_json(s)).node_env == s.node_env);
  auto bad_env = contain::spawn_spec_to_json(s);
  bad_env["node_env"] = common::Json::array({"PATH"});
  CHECK_THROWS_WITH_AS(contain::spawn_spec_from_json(bad_env), doctest::Contains("node_env"),
                       common::Error);
  s.node_env.clear();
  auto j = contain::spawn_spec_to_json(s);
  j["limits"]["cpu_max"] = 1;
  CHECK_THROWS_WITH_AS(contain::spawn_spec_from_json(j), doctest::Contains("limits.cpu_max"),
                       common::Error);
  j = contain::spawn_spec_to_json(s);
  j["argv"] = common::Json::array({"sh"});
  CHECK_THROWS_WITH_AS(contain::spawn_spec_from_json(j), doctest::Contains("argv"), common::Error);
}

TEST_CASE("a step runs on the node inside assayd contain and its evidence comes back hashed") {
  boost::asio::io_context io;
  SlurmExecutor ex(io, options());
  auto s = spec("echo out-of-node; exit 0");
  Collected c;
  auto running = ex.start(s, c.callbacks());
  REQUIRE(run_until(
      io, [&] { return c.result.has_value(); }, std::chrono::seconds(60)));
  const SlurmResult& r = *c.result;
  INFO(r.error_code, ": ", r.error_message);
  REQUIRE(r.ok());
  REQUIRE(c.submitted);
  CHECK(c.submitted->slurm_job_id == r.step.slurm_job_id);
  CHECK(r.step.state == "COMPLETED");
  CHECK(r.step.node == "assay-node");
  CHECK(r.step.partition == "assay");
  CHECK(r.step.exit_code == 0);
  REQUIRE(r.evidence);
  CHECK(r.evidence->name == s.name);
  CHECK(r.evidence->mode == "cgroup-v1");
  CHECK(r.evidence->exit->code == 0);
  CHECK(r.evidence->spawn->argv == s.argv);
  CHECK(r.evidence->network->private_namespace);
  fs::path file = ex.step_dir(s.name) / "evidence.json";
  CHECK(r.evidence_sha256 == common::sha256_file_id(file));
  CHECK(common::read_file(s.stdout_path, 100) == "out-of-node\n");
  CHECK(common::read_file(ex.step_dir(s.name) / "slurm_job_id", 100) == r.step.slurm_job_id + "\n");
  auto e = r.executor_json();
  CHECK(e["kind"] == "slurm");
  CHECK(e["slurm_job_id"] == r.step.slurm_job_id);
  CHECK(e["node"] == "assay-node");
  CHECK(e["partition"] == "assay");
  CHECK(e["evidence_sha256"] == r.evidence_sha256);
  CHECK(e["memory_limit_hit"].is_null());
  // The head's evidence document (the node's plus `executor`) is valid by the schema.
  auto doc = r.evidence->to_json();
  doc["executor"] = e;
  fs::path doc_file = s.workdir / "head-evidence.json";
  common::atomic_write_file(doc_file, doc.dump());
  std::string verdict = command_out(
      {"python3", "-c",
       "import json,sys,jsonschema; jsonschema.validate(json.load(open(sys.argv[1])), "
       "json.load(open(sys.argv[2]))); print('valid')",
       doc_file.string(),
       std::string(std::getenv("ASSAY_TEST_SCHEMAS")) + "/process-containment.schema.json"});
  CHECK(verdict == "valid\n");
  CHECK(running->pid() == 0);
}

TEST_CASE("node_env takes a variable's value from the node (how a step sees its GPUs)") {
  // Slurm sets SLURM_JOB_ID in every job as it sets CUDA_VISIBLE_DEVICES for allocated GPUs.
  boost::asio::io_context io;
  SlurmExecutor ex(io, options());
  auto s = spec("printf '%s' \"$SLURM_JOB_ID\" > \"$PWD/job-id\"");
  s.env.push_back("SLURM_JOB_ID=the-head-s-value");
  s.node_env = {"SLURM_JOB_ID"};
  Collected c;
  auto running = ex.start(s, c.callbacks());
  REQUIRE(run_until(
      io, [&] { return c.result.has_value(); }, std::chrono::seconds(120)));
  REQUIRE_MESSAGE(c.result->ok(), c.result->error_code << ": " << c.result->error_message);
  std::ifstream in(s.workdir / "job-id");
  std::string seen((std::istreambuf_iterator<char>(in)), {});
  CHECK(seen == c.result->step.slurm_job_id);
}

TEST_CASE("a worker that fails is the evidence's business, not a Slurm error") {
  boost::asio::io_context io;
  SlurmExecutor ex(io, options());
  Collected c;
  auto running = ex.start(spec("exit 3"), c.callbacks());
  REQUIRE(run_until(
      io, [&] { return c.result.has_value(); }, std::chrono::seconds(60)));
  CHECK(c.result->ok());
  CHECK(c.result->step.state == "COMPLETED");
  REQUIRE(c.result->evidence);
  CHECK(c.result->evidence->exit->code == 3);
  CHECK(c.result->evidence->failure_reason() == "exited with code 3");
}

TEST_CASE("an OOM inside the step is assay's cgroup limit, met before Slurm's --mem") {
  boost::asio::io_context io;
  SlurmExecutor ex(io, options());
  auto s = spec("exec python3 -c 'x = bytearray(1 << 30)'");
  s.limits.memory_max = 64ULL << 20;
  Collected c;
  auto running = ex.start(s, c.callbacks());
  REQUIRE(run_until(
      io, [&] { return c.result.has_value(); }, std::chrono::seconds(60)));
  const SlurmResult& r = *c.result;
  INFO(r.error_code, ": ", r.error_message);
  CHECK(r.ok());
  CHECK(r.step.state == "COMPLETED");
  REQUIRE(r.evidence);
  CHECK(r.evidence->oom_killed == true);
  CHECK(r.evidence->limits->memory_max == 64ULL << 20);
  CHECK(r.memory_limit_hit == "assay-cgroup");
  CHECK(r.executor_json()["memory_limit_hit"] == "assay-cgroup");
  CHECK_FALSE(r.evidence->succeeded());
}

TEST_CASE("cancel is scancel: the job ends CANCELLED and the node still measured the worker") {
  boost::asio::io_context io;
  SlurmExecutor ex(io, options());
  Collected c;
  auto s = spec("touch started; exec sleep 120");
  auto running = ex.start(s, c.callbacks());
  // RUNNING is Slurm's allocation; the worker itself runs once the node launched the script.
  REQUIRE(run_until(
      io, [&] { return fs::exists(s.workdir / "started"); }, std::chrono::seconds(30)));
  // and squeue says so at the next poll.
  REQUIRE(run_until(
      io, [&] { return !c.progress.empty() && c.progress.back().state == "RUNNING"; },
      std::chrono::seconds(10)));
  CHECK(c.progress.back().node == "assay-node");
  auto t0 = Clock::now();
  running->kill();
  REQUIRE(run_until(
      io, [&] { return c.result.has_value(); }, std::chrono::seconds(60)));
  const SlurmResult& r = *c.result;
  CHECK(Clock::now() - t0 < std::chrono::seconds(20));
  CHECK(r.error_code == "slurm.cancelled");
  CHECK(r.error_message.find("cancelled by assay") != std::string::npos);
  CHECK(r.step.state == "CANCELLED");
  CHECK(squeue_state(r.step.slurm_job_id) == "CANCELLED");
  // Slurm's SIGTERM reached the worker (proctrack signals every process of the job) and
  // `assayd contain`, which outlived it (KillWait) and measured the worker's end.
  REQUIRE(r.evidence);
  REQUIRE(r.evidence->exit);
  CHECK(r.evidence->exit->signal_name == "SIGTERM");
  CHECK(!r.evidence->succeeded());
  CHECK(r.evidence_sha256.starts_with("sha256:"));
}

TEST_CASE("a node where assayd contain cannot contain refuses the step and runs nothing") {
  boost::asio::io_context io;
  auto o = options();
  o.contain_args = {"--mode", "v2"};  // this node has cgroup v1 only
  SlurmExecutor ex(io, o);
  auto s = spec("touch ran");
  Collected c;
  auto running = ex.start(s, c.callbacks());
  REQUIRE(run_until(
      io, [&] { return c.result.has_value(); }, std::chrono::seconds(60)));
  const SlurmResult& r = *c.result;
  CHECK(r.error_code == "slurm.contain_refused");
  CHECK(r.step.state == "FAILED");
  CHECK(r.step.exit_code == 1);
  CHECK(!r.evidence);
  CHECK(r.error_message.find("contain.unavailable") != std::string::npos);
  CHECK(!fs::exists(s.workdir / "ran"));
}

TEST_CASE(
    "after the executor dies mid-step a new one re-attaches by id and collects, not re-runs") {
  auto s = spec("echo run >> runs; sleep 3; exit 0");
  std::string id;
  fs::path dir;
  {
    boost::asio::io_context io;
    SlurmExecutor ex(io, options());
    Collected c;
    auto running = ex.start(s, c.callbacks());
    REQUIRE(run_until(
        io, [&] { return !c.progress.empty() && c.progress.back().state == "RUNNING"; },
        std::chrono::seconds(30)));
    id = c.submitted->slurm_job_id;
    dir = ex.step_dir(s.name);
    // assayd is gone (kill -9): no scancel, no more polling.
  }
  CHECK(squeue_state(id) == "RUNNING");
  boost::asio::io_context io;
  SlurmExecutor ex(io, options());
  Collected c;
  auto running = ex.attach(dir, c.callbacks());
  REQUIRE(run_until(
      io, [&] { return c.result.has_value(); }, std::chrono::seconds(60)));
  const SlurmResult& r = *c.result;
  INFO(r.error_code, ": ", r.error_message);
  CHECK(r.ok());
  CHECK(r.step.slurm_job_id == id);
  REQUIRE(r.evidence);
  CHECK(r.evidence->exit->code == 0);
  CHECK(common::read_file(s.workdir / "runs", 100) == "run\n");
  CHECK(!c.submitted);  // nothing was submitted again
}

TEST_CASE("a job submitted just before assayd died is found by the token in its name") {
  auto s = spec("exit 0");
  boost::asio::io_context io;
  SlurmExecutor ex(io, options());
  Collected first;
  auto running = ex.start(s, first.callbacks());
  REQUIRE(run_until(
      io, [&] { return first.result.has_value(); }, std::chrono::seconds(60)));
  REQUIRE(first.result->ok());
  fs::path dir = ex.step_dir(s.name);
  fs::remove(dir / "slurm_job_id");  // as if assayd died between sbatch's answer and the write
  Collected c;
  auto again = ex.attach(dir, c.callbacks());
  REQUIRE(run_until(
      io, [&] { return c.result.has_value(); }, std::chrono::seconds(30)));
  CHECK(c.result->ok());
  CHECK(c.result->step.slurm_job_id == first.result->step.slurm_job_id);
  CHECK(c.result->evidence_sha256 == first.result->evidence_sha256);
  CHECK(common::read_file(dir / "slurm_job_id", 100) == first.result->step.slurm_job_id + "\n");
}

TEST_CASE("a step whose Slurm job vanished without evidence is reported for a re-run") {
  boost::asio::io_context io;
  SlurmExecutor ex(io, options());
  fs::path dir = ex.step_dir("vanished-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  common::atomic_write_file(dir / "slurm_job_id", "987654\n");
  Collected c;
  auto running = ex.attach(dir, c.callbacks());
  REQUIRE(run_until(
      io, [&] { return c.result.has_value(); }, std::chrono::seconds(30)));
  CHECK(c.result->error_code == "slurm.vanished");
  CHECK(c.result->step.state == "VANISHED");
  CHECK(!c.result->evidence);
}

TEST_CASE("a step that outlives its Slurm --time ends TIMEOUT, with the node's evidence") {
  boost::asio::io_context io;
  auto o = options();
  o.sbatch_args = {"--time=1"};  // one minute, Slurm's smallest, below the step's own timeout
  SlurmExecutor ex(io, o);
  Collected c;
  auto s = spec("touch started; exec sleep 600", std::chrono::seconds(600));
  auto running = ex.start(s, c.callbacks());
  REQUIRE(run_until(
      io, [&] { return fs::exists(s.workdir / "started"); }, std::chrono::seconds(30)));
  // Slurm keeps limits in minutes; the test moves the limit to now rather than wait one.
  command_out({"scontrol", "update", "JobId=" + c.submitted->slurm_job_id, "TimeLimit=0"});
  REQUIRE(run_until(
      io, [&] { return c.result.has_value(); }, std::chrono::seconds(150)));
  const SlurmResult& r = *c.result;
  INFO(r.error_code, ": ", r.error_message);
  CHECK(r.error_code == "slurm.timeout");
  CHECK(r.step.state == "TIMEOUT");
  REQUIRE(r.evidence);
  CHECK(!r.evidence->timed_out);  // assay's own timeout (600 s) was not the one that hit
  REQUIRE(r.evidence->exit);
  CHECK(r.evidence->exit->signal_name == "SIGTERM");
}

// bench/slurm.sh: per-step overhead against `assayd contain` run here, and a queue of steps.
TEST_CASE("bench: slurm executor overhead and throughput" * doctest::skip(true)) {
  auto env_int = [](const char* name, int fallback) {
    const char* v = std::getenv(name);
    return v ? std::atoi(v) : fallback;
  };
  const int local_n = env_int("ASSAY_BENCH_LOCAL", 20),
            serial_n = env_int("ASSAY_BENCH_SERIAL", 10),
            queued_n = env_int("ASSAY_BENCH_QUEUED", 50);
  boost::asio::io_context io;
  auto o = options();
  o.poll = std::chrono::milliseconds(env_int("ASSAY_BENCH_POLL_MS", 100));
  auto ms = [](Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); };

  // Local: `assayd contain -- /bin/true`, each to its end.
  auto t0 = Clock::now();
  for (int i = 0; i < local_n; ++i) {
    std::optional<executors::CommandResult> r;
    executors::run_command(io, {std::getenv("ASSAY_TEST_ASSAYD"), "contain", "--", "/bin/true"},
                           [&](executors::CommandResult x) { r = std::move(x); });
    REQUIRE(run_until(
        io, [&] { return r.has_value(); }, std::chrono::seconds(30)));
    REQUIRE(r->status == 0);
  }
  double local_ms = ms(Clock::now() - t0) / local_n;

  // Slurm: one step at a time, start() to done.
  SlurmExecutor ex(io, o);
  t0 = Clock::now();
  for (int i = 0; i < serial_n; ++i) {
    Collected c;
    auto running = ex.start(spec("exec /bin/true"), c.callbacks());
    REQUIRE(run_until(
        io, [&] { return c.result.has_value(); }, std::chrono::seconds(60)));
    REQUIRE(c.result->ok());
  }
  double slurm_ms = ms(Clock::now() - t0) / serial_n;

  // Queued: all submitted at once, all must complete.
  std::vector<Collected> cs(queued_n);
  std::vector<std::shared_ptr<contain::Running>> rs;
  t0 = Clock::now();
  for (auto& c : cs) rs.push_back(ex.start(spec("exec /bin/true"), c.callbacks()));
  auto all_done = [&] {
    for (auto& c : cs)
      if (!c.result) return false;
    return true;
  };
  REQUIRE(run_until(io, all_done, std::chrono::seconds(600)));
  double queued_s = ms(Clock::now() - t0) / 1000;
  int ok = 0;
  for (auto& c : cs) {
    bool good = c.result->ok() && c.result->evidence && c.result->evidence->exit->code == 0;
    ok += good;
    if (!good)
      std::printf("step %s: %s %s: %s\n", c.result->step.slurm_job_id.c_str(),
                  c.result->step.state.c_str(), c.result->error_code.c_str(),
                  c.result->error_message.c_str());
  }
  CHECK(ok == queued_n);
  std::printf(
      "local assayd contain /bin/true: %.1f ms/step (n=%d)\n"
      "slurm executor /bin/true, one at a time: %.1f ms/step (n=%d, poll %lld ms)\n"
      "overhead: %.1f ms/step, ratio %.1fx\n"
      "%d queued steps: %d completed in %.2f s, %.2f steps/s\n",
      local_ms, local_n, slurm_ms, serial_n, static_cast<long long>(o.poll.count()),
      slurm_ms - local_ms, slurm_ms / local_ms, queued_n, ok, queued_s, queued_n / queued_s);
}

int main(int argc, char** argv) {
  if (!std::getenv("SLURM_CONF") || !std::getenv("ASSAY_TEST_ASSAYD") ||
      !std::getenv("ASSAY_TEST_SHARED") || !std::getenv("ASSAY_TEST_SCHEMAS")) {
    std::fprintf(stderr,
                 "SKIP: run through tests/slurm/run.sh (needs SLURM_CONF, ASSAY_TEST_ASSAYD, "
                 "ASSAY_TEST_SHARED, ASSAY_TEST_SCHEMAS)\n");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
