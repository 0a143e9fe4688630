// Resident oracle workers (assayd's resident_models): a second job on an unchanged model runs
// on the worker that already holds it, a changed shard makes the next job load a new one, a
// job the worker refuses fails alone, and a worker that died or idled out is replaced.
#include <sys/mman.h>
#include <sys/stat.h>

#include <csignal>
#include <fstream>
#include <set>

#include "common/fs.h"
#include "tests/integration/harness.h"

namespace assay::test {
namespace {

struct Resident {
  TempDir tmp;
  fs::path model;
  std::unique_ptr<Daemon> d;
  explicit Resident(double idle_seconds = 120, const std::string& oracle = kOracle,
                    Json config = Json::object()) {
    model = fixture_model(tmp.path / "llama-tiny");
    if (!config.contains("resident_models"))
      config["resident_models"] = {{"count", 1}, {"idle_seconds", idle_seconds}};
    spit(tmp.path / "assayd.json", config.dump());
    d = std::make_unique<Daemon>(
        tmp.path / "state", tmp.path / "assayd.sock",
        std::vector<std::string>{"--containment", containment(), "--fingerprint-worker",
                                 kFingerprint, "--oracle-worker", oracle, "--config",
                                 (tmp.path / "assayd.json").string()});
  }
  // Submits `request` and waits for its end; the job document.
  Json run(const Json& request) {
    auto sub = request_json(*d, request);
    REQUIRE_MESSAGE(sub.status == 201, sub.body);
    return wait_job(d->socket(), sub.json()["id"], terminal, 300);
  }
  Json result(const Json& job) {
    auto r = request_get(*d, "/v1/jobs/" + job["id"].get<std::string>() + "/result");
    REQUIRE_MESSAGE(r.status == 200, r.body);
    return r.json();
  }
};

Json numbered(const fs::path& model, int n) {
  Json r = next_token_request("resident-" + std::to_string(n), model);
  return r;
}

// Changes one weight byte of `shard` in place (same inode, new ctime), near its end.
void flip_weight_byte(const fs::path& shard) {
  std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
  auto size = fs::file_size(shard);
  f.seekg(static_cast<std::streamoff>(size - 2));
  char c = 0;
  f.read(&c, 1);
  c ^= 1;
  f.seekp(static_cast<std::streamoff>(size - 2));
  f.write(&c, 1);
}

// The pids of running `assay-oracle serve` processes.
std::vector<pid_t> serving_pids() {
  std::vector<pid_t> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string cmd = slurp(e.path() / "cmdline");
    std::replace(cmd.begin(), cmd.end(), '\0', ' ');
    if (cmd.find("assay-oracle serve ") != std::string::npos ||
        cmd.find("/proxy-slow serve ") != std::string::npos)
      out.push_back(std::stoi(name));
  }
  return out;
}

bool gone_within(const std::vector<pid_t>& pids, double seconds) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    bool any = false;
    for (pid_t p : pids) any = any || ::kill(p, 0) == 0;
    if (!any) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// A hostile resident worker: `assay-oracle serve` itself behind a proxy on its control socket
// that, as each job is done, either replaces the job's directory with a link to it ("link") or
// keeps the job's logits file open and writes into it a second later ("late-write"); or that
// holds each job 3 s before the worker sees it, with a file "holding" in its workspace ("slow").
fs::path hostile_proxy(const fs::path& dir, const std::string& mode) {
  fs::path p = dir / ("proxy-" + mode);
  spit(p, "#!" + std::string(ASSAY_PYTHON3) + R"(
import json, os, select, socket, subprocess, sys, threading, time
mode, real = ")" +
              mode + R"(", ")" + kOracle + R"("
outer = socket.socket(fileno=3)
inner, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
fds = [m["fd"] for m in json.load(open("input.json"))["model_fds"]]
child = subprocess.Popen([real] + sys.argv[1:], pass_fds=[3] + fds,
                         preexec_fn=lambda: os.dup2(child_end.fileno(), 3))
child_end.close()
held = []
def late(f):
    time.sleep(1.0)
    f.seek(200); f.write(bytes([255]) * 64); f.flush()
while True:
    ready, _, _ = select.select([outer, inner], [], [])
    if outer in ready:
        m = outer.recv(4096)
        if not m: break
        if mode == "slow" and m.startswith(b"run "):
            open("holding", "w").close()
            time.sleep(3.0)
        inner.send(m)
    if inner in ready:
        m = inner.recv(4096)
        if not m: break
        if m.startswith(b"done "):
            name = m[5:].decode()
            if mode == "link":
                os.rename(name, name + ".real")
                os.symlink(os.path.abspath(name + ".real"), name)
            else:
                f = open(os.path.join(name, "logits.safetensors"), "r+b")
                held.append(f)
                threading.Thread(target=late, args=(f,)).start()
        outer.send(m)
child.kill()
)");
  ::chmod(p.c_str(), 0755);
  return p;
}

}  // namespace

TEST_CASE(
    "resident: a worker that makes its job directory a link fails that job and is replaced; one "
    "that writes its logits file after the job cannot change the signed artifact") {
  if (!have(kFingerprint) || !have(kOracle)) {
    MESSAGE("skipped: assay-fingerprint or assay-oracle was not built");
    return;
  }
  {
    TempDir proxies;
    Resident r(120, hostile_proxy(proxies.path, "link"));
    REQUIRE_MESSAGE(r.d->start(), r.d->log());
    Json linked = r.run(numbered(r.model, 1));
    CHECK(linked["state"] == "failed");
    CHECK_MESSAGE(linked["error"]["code"] == "worker.oracle_output", linked.dump(2));
    CHECK_MESSAGE(linked["error"]["message"].get<std::string>().find("unusable job directory") !=
                      std::string::npos,
                  linked.dump(2));
    // The worker that did it is stopped; the next job loads another (which does it again).
    Json next = r.run(numbered(r.model, 2));
    CHECK(next["state"] == "failed");
    CHECK_MESSAGE(r.d->log().find("its job directory is unusable") != std::string::npos,
                  r.d->log());
  }
  TempDir proxies;
  Resident r(120, hostile_proxy(proxies.path, "late-write"));
  REQUIRE_MESSAGE(r.d->start(), r.d->log());
  Json job = r.run(numbered(r.model, 1));
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << r.d->log());
  std::this_thread::sleep_for(std::chrono::seconds(2));  // the proxy has written by now
  Json result = r.result(job);
  auto artifact = request_get(*r.d, "/v1/jobs/" + job["id"].get<std::string>() + "/artifact");
  REQUIRE(artifact.status == 200);
  CHECK(common::sha256_id(artifact.body) == result["reference_artifact"]["sha256"]);
}

TEST_CASE(
    "resident: a second job runs on the worker that holds the model, with the same bytes and "
    "logits; a changed shard makes the next job load a new worker") {
  if (!have(kFingerprint) || !have(kOracle)) {
    MESSAGE("skipped: assay-fingerprint or assay-oracle was not built");
    return;
  }
  Resident r;
  REQUIRE_MESSAGE(r.d->start(), r.d->log());
  Json first = r.run(numbered(r.model, 1));
  REQUIRE_MESSAGE(first["state"] == "succeeded", first.dump(2) << r.d->log());
  Json a = r.result(first);
  const Json& ra = a["oracle"]["process"]["resident"];
  REQUIRE_MESSAGE(ra.is_object(), a["oracle"]["process"].dump(2));
  CHECK(ra["jobs_before"] == 0);
  CHECK(a["oracle"]["process"]["exit"].is_null());
  CHECK(a["oracle"]["resident"]["jobs_before"] == 0);

  Json second = r.run(numbered(r.model, 2));
  REQUIRE_MESSAGE(second["state"] == "succeeded", second.dump(2) << r.d->log());
  Json b = r.result(second);
  const Json& rb = b["oracle"]["process"]["resident"];
  CHECK(rb["worker"] == ra["worker"]);
  CHECK(rb["loaded_at"] == ra["loaded_at"]);
  CHECK(rb["jobs_before"] == 1);
  // Nothing loaded for this job; the bytes it computed with are the fingerprint's.
  CHECK(b["oracle"]["load_seconds"] == 0.0);
  CHECK(b["oracle"]["bytes_used"] == a["oracle"]["bytes_used"]);
  CHECK(b["oracle"]["bytes_used"]["weight_files"] == b["model_identity"]["weight_files"]);
  CHECK(b["oracle"]["logits_sha256"] == a["oracle"]["logits_sha256"]);
  // Per-job counters: the job's own wall time, and its share of the worker's CPU.
  const Json& pb = b["oracle"]["process"];
  CHECK(pb["normalised"]["exit_code"].is_null());
  CHECK(pb["wall_usec"].get<std::uint64_t>() < 60'000'000);
  for (const auto& [schema, doc] : std::vector<std::pair<std::string, Json>>{
           {"next-token-oracle-result", b}, {"process-containment", pb}}) {
    spit(r.tmp.path / (schema + ".json"), doc.dump());
    std::string v = validate_schemas({{schema, r.tmp.path / (schema + ".json")}});
    CHECK_MESSAGE(v.rfind("0:", 0) == 0, schema << ": " << v);
  }
  if (have(kClient)) {
    fs::path dir = r.d->state() / "jobs" / second["id"].get<std::string>();
    spit(r.tmp.path / "result.json",
         request_get(*r.d, "/v1/jobs/" + second["id"].get<std::string>() + "/result").body);
    spit(r.tmp.path / "result.dsse.json",
         request_get(*r.d, "/v1/jobs/" + second["id"].get<std::string>() + "/attestation").body);
    std::string v = run_capture(kClient + " verify " + (r.tmp.path / "result.json").string() +
                                " --pubkey " + (r.d->state() / "keys" / "host.pub").string() +
                                " --artifact " + (dir / "logits.safetensors").string());
    CHECK_MESSAGE(v.rfind("0:", 0) == 0, v);
  }

  // One weight byte changes in place (same inode, new ctime): the fingerprint sees it, and the
  // worker that holds the old bytes is replaced before the job runs.
  flip_weight_byte(r.model / "model.safetensors");
  Json third = r.run(numbered(r.model, 3));
  REQUIRE_MESSAGE(third["state"] == "succeeded", third.dump(2) << r.d->log());
  Json c = r.result(third);
  const Json& rc = c["oracle"]["process"]["resident"];
  CHECK(rc["worker"] != ra["worker"]);
  CHECK(rc["jobs_before"] == 0);
  CHECK(c["oracle"]["bytes_used"]["weight_files"] == c["model_identity"]["weight_files"]);
  CHECK(c["model_identity"]["content_sha256"] != a["model_identity"]["content_sha256"]);
  auto events = request_get(*r.d, "/v1/jobs/" + third["id"].get<std::string>() + "/events");
  CHECK_MESSAGE(
      events.body.find("replacing " + ra["worker"].get<std::string>()) != std::string::npos,
      events.body);
  CHECK(serving_pids().size() == 1);
  r.d->stop();
  CHECK_MESSAGE(gone_within(serving_pids(), 10), "a resident worker outlived assayd");
  // Reaped before assayd exited: nothing left for the next start to clean up as an orphan.
  CHECK(fs::is_empty(r.d->state() / "resident"));
  REQUIRE_MESSAGE(r.d->start(), r.d->log());
  CHECK_MESSAGE(r.d->log().find("orphan") == std::string::npos, r.d->log());
  CHECK(r.d->stop() == 0);
}

TEST_CASE(
    "resident: transformers-backend jobs run on a resident assay-hf-worker that holds the model: "
    "the second job loads nothing, its logits are the first's and the C++ oracle's; a changed "
    "shard makes the next job load a new worker") {
  if (!have(kFingerprint) || !have(kOracle) || !have(kHfWorker)) {
    MESSAGE("skipped: assay-fingerprint, assay-oracle or assay-hf-worker was not built");
    return;
  }
  // Two residents: the C++ oracle's job below does not displace the transformers worker.
  Resident r(
      120, kOracle,
      Json{{"hf_worker", kHfWorker}, {"resident_models", {{"count", 2}, {"idle_seconds", 120}}}});
  REQUIRE_MESSAGE(r.d->start(), r.d->log());
  auto hf = [&](int n) {
    Json q = numbered(r.model, n);
    q["oracle"] = {{"backend", "transformers"}};
    return q;
  };
  Json first = r.run(hf(1));
  REQUIRE_MESSAGE(first["state"] == "succeeded", first.dump(2) << r.d->log());
  Json a = r.result(first);
  CHECK(a["oracle"]["backend"] == "transformers");
  const Json& ra = a["oracle"]["process"]["resident"];
  REQUIRE_MESSAGE(ra.is_object(), a["oracle"]["process"].dump(2));
  CHECK(ra["jobs_before"] == 0);
  Json second = r.run(hf(2));
  REQUIRE_MESSAGE(second["state"] == "succeeded", second.dump(2) << r.d->log());
  Json b = r.result(second);
  const Json& rb = b["oracle"]["process"]["resident"];
  CHECK(rb["worker"] == ra["worker"]);
  CHECK(rb["jobs_before"] == 1);
  CHECK(b["oracle"]["load_seconds"] == 0.0);
  CHECK(b["oracle"]["backend"] == "transformers");
  CHECK(b["oracle"]["bytes_used"]["weight_files"] == b["model_identity"]["weight_files"]);
  CHECK(b["oracle"]["logits_sha256"] == a["oracle"]["logits_sha256"]);
  spit(r.tmp.path / "hf-result.json", b.dump());
  std::string v = validate_schemas({{"next-token-oracle-result", r.tmp.path / "hf-result.json"}});
  CHECK_MESSAGE(v.rfind("0:", 0) == 0, v);
  // The C++ oracle (on a resident worker of its own) computes the same logits, bit for bit.
  Json cpp = r.run(numbered(r.model, 3));
  REQUIRE_MESSAGE(cpp["state"] == "succeeded", cpp.dump(2) << r.d->log());
  CHECK(r.result(cpp)["oracle"]["logits_sha256"] == a["oracle"]["logits_sha256"]);

  // One weight byte changes in place: the next transformers job loads a new worker.
  flip_weight_byte(r.model / "model.safetensors");
  Json fourth = r.run(hf(4));
  REQUIRE_MESSAGE(fourth["state"] == "succeeded", fourth.dump(2) << r.d->log());
  Json d = r.result(fourth);
  CHECK(d["oracle"]["process"]["resident"]["worker"] != ra["worker"]);
  CHECK(d["oracle"]["process"]["resident"]["jobs_before"] == 0);
  CHECK(d["oracle"]["bytes_used"]["weight_files"] == d["model_identity"]["weight_files"]);
  CHECK(d["model_identity"]["content_sha256"] != a["model_identity"]["content_sha256"]);
  CHECK(r.d->stop() == 0);
}

TEST_CASE(
    "resident: replacing a worker for another user's job tells that user nothing of a file only "
    "root could read (issue 36, defect 5)") {
  if (!have(kFingerprint) || !have(kOracle)) {
    MESSAGE("skipped: assay-fingerprint or assay-oracle was not built");
    return;
  }
  constexpr uid_t kNobody = 65534;
  REQUIRE_MESSAGE(::getgrnam("nogroup") != nullptr, "the group nogroup (65534) must exist");
  Resident r(120, kOracle, Json{{"socket_group", "nogroup"}});
  fs::path shard = r.model / "model.safetensors";
  ::chmod(shard.c_str(), 0600);
  REQUIRE_MESSAGE(r.d->start(), r.d->log());
  Json first = r.run(numbered(r.model, 1));
  REQUIRE_MESSAGE(first["state"] == "succeeded", first.dump(2) << r.d->log());
  const Json old_shard = r.result(first)["model_identity"]["weight_files"][0];
  const std::string old_sha = old_shard["sha256"], old_hex = old_sha.substr(7);
  // The root-only shard gives way to a world-readable one with another byte.
  std::string bytes = slurp(shard);
  bytes[bytes.size() - 2] ^= 1;
  spit(r.model / "new.safetensors", bytes);
  ::chmod((r.model / "new.safetensors").c_str(), 0644);
  fs::rename(r.model / "new.safetensors", shard);
  auto sub =
      request_as(kNobody, kNobody, r.d->socket(), "POST", "/v1/jobs", numbered(r.model, 2).dump());
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  const std::string id = sub.json()["id"];
  Json second = wait_job(r.d->socket(), id, terminal, 300);
  REQUIRE_MESSAGE(second["state"] == "succeeded", second.dump(2) << r.d->log());
  // It ran on a new worker, and what nobody can read of the job says nothing of the old shard.
  CHECK(r.result(second)["oracle"]["process"]["resident"]["worker"] !=
        r.result(first)["oracle"]["process"]["resident"]["worker"]);
  for (const std::string& path :
       {"/v1/jobs/" + id, "/v1/jobs/" + id + "/events", "/v1/jobs/" + id + "/result"}) {
    auto seen = request_as(kNobody, kNobody, r.d->socket(), "GET", path);
    CAPTURE(path);
    REQUIRE(seen.status == 200);
    CHECK_MESSAGE(seen.body.find(old_hex) == std::string::npos, seen.body);
    if (path.ends_with("/events"))
      CHECK_MESSAGE(seen.body.find("replacing") != std::string::npos, seen.body);
  }
  CHECK(r.d->stop() == 0);
}

TEST_CASE(
    "resident: bytes written through a shared mapping into a page it had dirtied (the file's "
    "times unchanged) never reach a signed result as the old digest") {
  if (!have(kFingerprint) || !have(kOracle)) {
    MESSAGE("skipped: assay-fingerprint or assay-oracle was not built");
    return;
  }
  Resident r;
  REQUIRE_MESSAGE(r.d->start(), r.d->log());
  // On the state directory's filesystem (ext4 here), and on tmpfs, which never moves a mapped
  // file's times.
  std::vector<fs::path> models{r.model};
  std::unique_ptr<TempDir> shm;
  if (fs::is_directory("/dev/shm")) {
    shm = std::make_unique<TempDir>("/dev/shm");
    fs::copy(r.model, shm->path / "llama-tiny", fs::copy_options::recursive);
    for (const auto& e : fs::recursive_directory_iterator(shm->path))
      ::chmod(e.path().c_str(), e.is_directory() ? 0755 : 0644);
    models.push_back(shm->path / "llama-tiny");
  }
  int n = 0;
  for (const fs::path& model : models) {
    CAPTURE(model);
    const fs::path shard = model / "model.safetensors";
    const auto size = fs::file_size(shard);
    common::UniqueFd fd(::open(shard.c_str(), O_RDWR | O_CLOEXEC));
    REQUIRE(fd);
    void* map = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    REQUIRE(map != MAP_FAILED);
    auto* bytes = static_cast<unsigned char*>(map);
    auto digest = [&] { return common::sha256_id(common::read_file(shard, 64u << 20)); };
    bytes[size - 2] ^= 1;  // the page's first write fault moves mtime and ctime
    // Older than the cache's 2 s racy window, so that the first job keeps its digest.
    std::this_thread::sleep_for(std::chrono::milliseconds(2200));
    Json first = r.run(numbered(model, ++n));
    REQUIRE_MESSAGE(first["state"] == "succeeded", first.dump(2) << r.d->log());
    Json a = r.result(first);
    CHECK(a["model_identity"]["weight_files"][0]["sha256"] == digest());
    struct stat before {};
    REQUIRE(::stat(shard.c_str(), &before) == 0);
    bytes[size - 3] ^= 1;  // the same page
    struct stat after {};
    REQUIRE(::stat(shard.c_str(), &after) == 0);
    const bool times_moved = before.st_ctim.tv_nsec != after.st_ctim.tv_nsec ||
                             before.st_ctim.tv_sec != after.st_ctim.tv_sec;
    // tmpfs never moves them; on ext4 the first job's fingerprint wrote the page back, so this
    // write faulted again (before the fix it did not, and the times stayed).
    if (model != r.model) CHECK_FALSE(times_moved);
    MESSAGE("times moved by the second mapped write: " << times_moved);
    Json second = r.run(numbered(model, ++n));
    REQUIRE_MESSAGE(second["state"] == "succeeded", second.dump(2) << r.d->log());
    Json b = r.result(second);
    const std::string now = digest();
    CHECK(b["model_identity"]["weight_files"][0]["sha256"] == now);
    CHECK(b["oracle"]["bytes_used"]["weight_files"][0]["sha256"] == now);
    CHECK(b["oracle"]["process"]["resident"]["worker"] !=
          a["oracle"]["process"]["resident"]["worker"]);
    ::munmap(map, size);
  }
  CHECK(r.d->stop() == 0);
}

TEST_CASE(
    "resident: a job the worker refuses fails alone, and a worker that was killed or idled out "
    "is replaced by the next job") {
  if (!have(kFingerprint) || !have(kOracle)) {
    MESSAGE("skipped: assay-fingerprint or assay-oracle was not built");
    return;
  }
  Resident r(/*idle_seconds=*/3);
  REQUIRE_MESSAGE(r.d->start(), r.d->log());
  Json first = r.run(numbered(r.model, 1));
  REQUIRE_MESSAGE(first["state"] == "succeeded", first.dump(2) << r.d->log());
  const std::string w1 = r.result(first)["oracle"]["process"]["resident"]["worker"];

  // A candidate whose text is not its token's: the worker says so, the job fails with its
  // reason, and the worker serves the next job.
  Json bad = numbered(r.model, 2);
  bad["candidates"][0]["text"] = "not-A";
  Json refused = r.run(bad);
  CHECK(refused["state"] == "failed");
  CHECK_MESSAGE(refused["error"]["message"].get<std::string>().find(
                    "request.candidate_text_mismatch") != std::string::npos,
                refused.dump(2));
  Json third = r.run(numbered(r.model, 3));
  REQUIRE_MESSAGE(third["state"] == "succeeded", third.dump(2) << r.d->log());
  const Json r3 = r.result(third)["oracle"]["process"]["resident"];
  CHECK(r3["worker"] == w1);
  CHECK(r3["jobs_before"] == 2);

  // Killed between jobs (as an OOM kill or a crash would): the next job loads a new worker.
  auto pids = serving_pids();
  REQUIRE(pids.size() == 1);
  ::kill(pids[0], SIGKILL);
  REQUIRE(gone_within(pids, 10));
  Json fourth = r.run(numbered(r.model, 4));
  REQUIRE_MESSAGE(fourth["state"] == "succeeded", fourth.dump(2) << r.d->log());
  const std::string w4 = r.result(fourth)["oracle"]["process"]["resident"]["worker"];
  CHECK(w4 != w1);

  // Idle for longer than idle_seconds: stopped, and its cgroup and workspace are gone.
  pids = serving_pids();
  REQUIRE(pids.size() == 1);
  CHECK_MESSAGE(gone_within(pids, 15), "the idle resident worker was not stopped");
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  CHECK(fs::is_empty(r.d->state() / "resident"));
  Json fifth = r.run(numbered(r.model, 5));
  REQUIRE_MESSAGE(fifth["state"] == "succeeded", fifth.dump(2) << r.d->log());
  CHECK(r.result(fifth)["oracle"]["process"]["resident"]["worker"] != w4);
  CHECK(r.d->stop() == 0);
}

}  // namespace assay::test

namespace assay::test {

TEST_CASE("resident: a bad resident_models setting is refused at start, naming the value") {
  TempDir tmp;
  for (const auto& [config, message] : std::vector<std::pair<std::string, std::string>>{
           {R"({"resident_models": {"count": 65}})",
            "config.resident_models.count must be in 0..64, got 65"},
           {R"({"resident_models": {"count": 1, "idle_seconds": 0}})",
            "config.resident_models.idle_seconds must be a number in [1, 604800], got 0"},
           {R"({"resident_models": {"count": 1, "memory_bytes": 1024}})",
            "config.resident_models.memory_bytes must be at least 64 MiB, got 1024"},
           {R"({"resident_models": {"workers": 1}})", "workers"},
           {R"({"resident_models": 1})", "config.resident_models must be an object"}}) {
    spit(tmp.path / "assayd.json", config);
    Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
             {"--containment", "none", "--config", (tmp.path / "assayd.json").string()});
    CHECK_FALSE(d.start());
    CHECK_MESSAGE(d.log().find(message) != std::string::npos, d.log());
  }
}

}  // namespace assay::test

namespace assay::test {

TEST_CASE(
    "resident: assayd stopped while a resident worker runs a job reaps the worker and leaves the "
    "job running, and the next start runs it to success") {
  if (!have(kFingerprint) || !have(kOracle)) {
    MESSAGE("skipped: assay-fingerprint or assay-oracle was not built");
    return;
  }
  TempDir scripts;
  Resident r(/*idle_seconds=*/120, hostile_proxy(scripts.path, "slow").string());
  REQUIRE_MESSAGE(r.d->start(), r.d->log());
  auto sub = request_json(*r.d, numbered(r.model, 1));
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  const std::string id = sub.json()["id"];
  // The worker holds the job (the proxy keeps it 3 s before the worker runs it).
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  auto holding = [&] {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(r.d->state() / "resident", ec))
      if (fs::exists(e.path() / "holding")) return true;
    return false;
  };
  while (!holding()) {
    REQUIRE_MESSAGE(std::chrono::steady_clock::now() < deadline, r.d->log());
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  auto pids = serving_pids();
  REQUIRE(!pids.empty());
  CHECK(r.d->stop_within(15) == 0);
  CHECK_MESSAGE(gone_within(pids, 5), "a resident worker outlived assayd");
  CHECK(fs::is_empty(r.d->state() / "resident"));
  const std::string first_log = r.d->log();

  REQUIRE_MESSAGE(r.d->start(), r.d->log());
  Json job = wait_job(r.d->socket(), id, terminal, 300);
  CHECK_MESSAGE(job["state"] == "succeeded", job.dump(2) << r.d->log());
  auto events = request_get(*r.d, "/v1/jobs/" + id + "/events");
  CHECK_MESSAGE(events.body.find("re-queued: assayd restarted") != std::string::npos,
                events.body << first_log);
  CHECK_MESSAGE(r.d->log().find("orphan") == std::string::npos, r.d->log());
  CHECK(r.d->stop() == 0);
}

}  // namespace assay::test

namespace assay::test {

TEST_CASE(
    "resident: a batch loads a resident worker and reports its progress; a single job after it "
    "runs on that worker with the logits of the batch's state") {
  if (!have(kFingerprint) || !have(kOracle)) {
    MESSAGE("skipped: assay-fingerprint or assay-oracle was not built");
    return;
  }
  Resident r;
  REQUIRE_MESSAGE(r.d->start(), r.d->log());
  // States long enough (~0.2 s each) for progress to be read while the batch runs; the batch's
  // worker gets the memory of its longest state, which the single job after it fits in.
  Json same = numbered(r.model, 10), bad = numbered(r.model, 12);
  bad["candidates"][0]["text"] = "not-A";
  Json states = Json::array();
  for (Json* s : {&same, &bad}) {
    s->erase("model_dir");
    states.push_back(*s);
  }
  for (int i = 0; i < 5; ++i) {
    Json long_state = numbered(r.model, 20 + i);
    long_state.erase("model_dir");
    std::vector<std::int64_t> seq;
    for (int t = 0; t < 2000; ++t) seq.push_back(32 + (t * 7 + i) % 90);
    long_state["input_token_ids"] = seq;
    states.push_back(long_state);
  }
  Json batch{
      {"schema", "assay.next-token-batch-request.v1"}, {"id", "on-resident"}, {"states", states}};
  auto sub = request(r.d->socket(), "POST", "/v1/jobs?model_dir=" + r.model.string(), batch.dump());
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  const std::string id = sub.json()["id"];
  Json job = wait_job(r.d->socket(), id, terminal, 300);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << r.d->log());
  Json summary = r.result(job);
  CHECK(summary["counts"]["succeeded"] == 6);
  CHECK(summary["counts"]["failed"] == 1);
  CHECK(summary["oracle_runs"].size() == 1);
  CHECK(summary["states"][1]["error"]["code"] == "request.candidate_text_mismatch");
  auto events = request_get(*r.d, "/v1/jobs/" + id + "/events").body;
  CHECK_MESSAGE(events.find("on resident worker") != std::string::npos, events);
  // Progress copied from the worker's directory while it ran: "oracle: state 3 argmax 80 (4/7
  // states done)" (not every state: a poll may see several at once).
  CHECK_MESSAGE(events.find("states done)") != std::string::npos, events << r.d->log());
  const std::string part = summary["states"][0]["job_id"];
  Json state0 = r.result(request_get(*r.d, "/v1/jobs/" + part).json());
  const Json& rs = state0["oracle"]["process"]["resident"];
  const std::string w1 = rs["worker"];
  CHECK(rs["jobs_before"] == 0);
  CHECK(state0["oracle"]["bytes_used"]["weight_files"] == state0["model_identity"]["weight_files"]);
  std::string checked =
      validate_schemas({{"next-token-oracle-result", r.d->state() / "jobs" / part / "result.json"},
                        {"next-token-batch-result", r.d->state() / "jobs" / id / "result.json"}});
  CHECK_MESSAGE(checked.rfind("0:", 0) == 0, checked);

  // The single job with state 0's ids: the same worker, the same logits.
  Json single = r.run(numbered(r.model, 1));
  REQUIRE_MESSAGE(single["state"] == "succeeded", single.dump(2) << r.d->log());
  Json result = r.result(single);
  CHECK(result["oracle"]["process"]["resident"]["worker"] == w1);
  CHECK(result["oracle"]["process"]["resident"]["jobs_before"] == 1);
  CHECK(result["oracle"]["logits_sha256"] == state0["oracle"]["logits_sha256"]);
  CHECK(serving_pids().size() == 1);
  CHECK(r.d->stop() == 0);
}

TEST_CASE(
    "resident: a resident worker killed part-way through a batch keeps the states it ended; the "
    "rest run on a new worker") {
  if (!have(kFingerprint) || !have(kOracle)) {
    MESSAGE("skipped: assay-fingerprint or assay-oracle was not built");
    return;
  }
  Resident r;
  REQUIRE_MESSAGE(r.d->start(), r.d->log());
  constexpr int kStates = 8;
  Json states = Json::array();
  for (int i = 0; i < kStates; ++i) {
    Json state = numbered(r.model, 30 + i);
    state.erase("model_dir");
    std::vector<std::int64_t> seq;
    for (int t = 0; t < 2000; ++t) seq.push_back(32 + (t * 7 + i) % 90);
    state["input_token_ids"] = seq;
    states.push_back(state);
  }
  Json batch{{"schema", "assay.next-token-batch-request.v1"}, {"id", "killed"}, {"states", states}};
  auto sub = request(r.d->socket(), "POST", "/v1/jobs?model_dir=" + r.model.string(), batch.dump());
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  const std::string id = sub.json()["id"];
  // The worker's own directory for the job holds state-1.json: kill it there.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  auto ended_two = [&] {
    std::error_code ec;
    for (const auto& w : fs::directory_iterator(r.d->state() / "resident", ec))
      if (fs::exists(w.path() / (id + "-oracle") / "state-1.json")) return true;
    return false;
  };
  while (!ended_two()) {
    REQUIRE_MESSAGE(std::chrono::steady_clock::now() < deadline, r.d->log());
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  auto pids = serving_pids();
  REQUIRE(pids.size() == 1);
  ::kill(pids[0], SIGKILL);
  Json job = wait_job(r.d->socket(), id, terminal, 300);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << r.d->log());
  Json summary = r.result(job);
  CHECK(summary["counts"]["succeeded"] == kStates);
  REQUIRE(summary["oracle_runs"].size() == 2);
  const Json& run1 = summary["oracle_runs"][0];
  CHECK(run1["states_ended"].get<int>() >= 2);
  CHECK(run1["exit"].get<std::string>().find("SIGKILL") != std::string::npos);
  CHECK(summary["oracle_runs"][1]["states_ended"].get<int>() ==
        kStates - run1["states_ended"].get<int>());
  // Each state by the worker that ran it: the first run's states by the killed worker.
  std::set<std::string> workers;
  for (const Json& s : summary["states"]) {
    Json part = r.result(request_get(*r.d, "/v1/jobs/" + s["job_id"].get<std::string>()).json());
    workers.insert(part["oracle"]["process"]["resident"]["worker"].get<std::string>());
  }
  CHECK(workers.size() == 2);
  CHECK(r.d->stop() == 0);
}

}  // namespace assay::test
