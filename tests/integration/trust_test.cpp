// Issue 14 through the daemon: a result never binds one model's identity to another's logits,
// and a worker replaced by a hostile stand-in reaches neither the key, the socket, the model nor
// assayd.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/integration/harness.h"

using namespace assay::test;

namespace {

fs::path seeded_fixture(const fs::path& dir, int seed) {
  std::string cmd = std::string(ASSAY_PYTHON3) + " " + ASSAY_SOURCE_DIR +
                    "/tests/fixtures/make_fixture.py --arch llama --size tiny --seed " +
                    std::to_string(seed) + " --out " + dir.string() + " > " + dir.string() +
                    ".log 2>&1";
  REQUIRE_MESSAGE(std::system(cmd.c_str()) == 0, slurp(dir.string() + ".log"));
  return dir;
}

// A stand-in worker script, executable by the worker user (the directories above it open).
fs::path script(const fs::path& path, const std::string& body) {
  spit(path, "#!/bin/sh\n" + body);
  ::chmod(path.c_str(), 0755);
  return path;
}

// Submits `doc` as a job and waits up to `seconds` for it to end: the job's id and status.
std::pair<std::string, Json> run_job(const fs::path& socket, const Json& doc, int seconds) {
  auto sub = request(socket, "POST", "/v1/jobs", doc.dump());
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  std::string id = sub.json()["id"];
  return {id, wait_job(socket, id, terminal, seconds)};
}

}  // namespace

TEST_SUITE("trust") {
  TEST_CASE(
      "a checkpoint swapped in between fingerprint and oracle fails the job naming the shard") {
    if (!have(kFingerprint) || !have(kOracle)) {
      MESSAGE("skipped: assay-fingerprint or assay-oracle was not built");
      return;
    }
    TempDir tmp;
    ::chmod(tmp.path.c_str(), 0755);
    fs::path model = seeded_fixture(tmp.path / "model", 1);
    fs::path other = seeded_fixture(tmp.path / "other", 2);
    // The model directory is open to the worker user so that the stand-in can swap the shard
    // the way a hostile co-tenant would, after the real fingerprint worker hashed it.
    ::chmod(model.c_str(), 0777);
    fs::path swap =
        model / "swap.bin";  // inside the directory: a rename there needs only its w bit
    fs::copy_file(other / "model.safetensors", swap);
    ::chmod(swap.c_str(), 0666);
    fs::path wrapper =
        script(tmp.path / "fingerprint-then-swap",
               "\"" + kFingerprint + "\" \"$@\"; rc=$?\nmv -f \"" + swap.string() + "\" \"" +
                   (model / "model.safetensors").string() + "\" || exit 99\nexit $rc\n");
    Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
             {"--containment", containment(), "--fingerprint-worker", wrapper.string(),
              "--oracle-worker", kOracle});
    REQUIRE_MESSAGE(d.start(), d.log());
    auto [id, job] = run_job(d.socket(), next_token_request("swap", model), 300);
    CAPTURE(job.dump(2));
    REQUIRE(fs::exists(swap) == false);  // the swap happened
    CHECK(job["state"] == "failed");
    CHECK(job["error"]["code"] == "job.bytes_mismatch");
    CHECK(job["error"]["message"].get<std::string>().find("model.safetensors") !=
          std::string::npos);
    CHECK_FALSE(fs::exists(d.state() / "jobs" / id / "result.json"));
    CHECK(request(d.socket(), "GET", "/v1/jobs/" + id + "/result").status == 409);
  }

  TEST_CASE(
      "a cold job reads a settled shard once: the fingerprint leaves it to the oracle, the result "
      "names the whole identity, and the next job takes its digest from the cache") {
    if (!have(kFingerprint) || !have(kOracle)) {
      MESSAGE("skipped: assay-fingerprint or assay-oracle was not built");
      return;
    }
    TempDir tmp;
    ::chmod(tmp.path.c_str(), 0755);
    fs::path model = seeded_fixture(tmp.path / "model", 1);
    ::usleep(2'100'000);  // settled: its times are a sound cache key (fingerprint README)
    // The identity of the whole directory, every byte hashed by the command.
    std::string whole = run_capture("\"" + kFingerprint + "\" --model " + model.string() +
                                    " --id model 2>/dev/null");
    REQUIRE_MESSAGE(whole.rfind("0:", 0) == 0, whole);
    Json identity = assay::common::parse_strict(whole.substr(2))["model_identity"];
    Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
             {"--containment", containment(), "--fingerprint-worker", kFingerprint,
              "--oracle-worker", kOracle});
    REQUIRE_MESSAGE(d.start(), d.log());
    auto succeeded_job = [&](const std::string& name) {
      auto [id, job] = run_job(d.socket(), next_token_request(name, model), 300);
      CAPTURE(job.dump(2));
      REQUIRE(job["state"] == "succeeded");
      return id;
    };
    std::string first = succeeded_job("cold");
    fs::path jobs = d.state() / "jobs";
    Json fp = assay::common::parse_strict(slurp(jobs / first / "fingerprint" / "output.json"));
    CHECK(fp.contains("pending_identity"));
    CHECK(fp["stats"]["deferred_files"] == 1);
    Json oracle_in = assay::common::parse_strict(slurp(jobs / first / "oracle" / "input.json"));
    REQUIRE(oracle_in["unchanged_files"].size() == 1);
    CHECK(oracle_in["unchanged_files"][0]["name"] == "model.safetensors");
    Json result = assay::common::parse_strict(slurp(jobs / first / "result.json"));
    CHECK(result["model_identity"] == identity);
    bool read_by_oracle = false;
    for (const Json& f : result["model_fingerprint"]["files"])
      if (f["name"] == "model.safetensors")
        read_by_oracle = f["source"] == "reader" && f["reader"] == "oracle";
    CHECK(read_by_oracle);

    // A new file at the top keeps the whole fingerprint from being reused (a job with every
    // file unchanged runs no fingerprint worker), so that the shard's cached digest is used.
    spit(model / "README.md", "notes\n");
    std::string second = succeeded_job("warm");
    Json fp2 = assay::common::parse_strict(slurp(jobs / second / "fingerprint" / "output.json"));
    CHECK(fp2["model_identity"] == identity);
    CHECK(fp2["stats"]["cached_files"] == 1);
    Json oracle_in2 = assay::common::parse_strict(slurp(jobs / second / "oracle" / "input.json"));
    CHECK_FALSE(oracle_in2.contains("unchanged_files"));
    Json result2 = assay::common::parse_strict(slurp(jobs / second / "result.json"));
    CHECK(result2["model_identity"] == identity);
  }

  TEST_CASE(
      "a job on a model whose every file is unchanged runs no fingerprint worker and names the "
      "job whose fingerprint it reuses; a write through a mapping dirtied before it, a rewrite "
      "in place with the same bytes or a new file makes the next job fingerprint again") {
    if (!have(kFingerprint) || !have(kOracle)) {
      MESSAGE("skipped: assay-fingerprint or assay-oracle was not built");
      return;
    }
    TempDir tmp;
    ::chmod(tmp.path.c_str(), 0755);
    fs::path model = seeded_fixture(tmp.path / "model", 1);
    // config.json mapped shared and one page dirtied before any job: a later write through the
    // same mapping changes the bytes without a write() call.
    fs::path config = model / "config.json";
    std::string text = slurp(config);
    std::size_t space = text.find(' ');
    REQUIRE(space != std::string::npos);
    int fd = ::open(config.c_str(), O_RDWR);
    REQUIRE(fd >= 0);
    auto* map =
        static_cast<char*>(::mmap(nullptr, text.size(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    REQUIRE(map != MAP_FAILED);
    map[space] = ' ';     // dirty, same byte
    ::usleep(2'100'000);  // settled
    Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
             {"--containment", containment(), "--fingerprint-worker", kFingerprint,
              "--oracle-worker", kOracle});
    REQUIRE_MESSAGE(d.start(), d.log());
    fs::path jobs = d.state() / "jobs";
    auto succeeded_job = [&](const std::string& name) {
      auto [id, job] = run_job(d.socket(), next_token_request(name, model), 300);
      CAPTURE(job.dump(2));
      REQUIRE(job["state"] == "succeeded");
      return std::pair{id, assay::common::parse_strict(slurp(jobs / id / "result.json"))};
    };
    auto fingerprinted = [&](const std::string& id) {
      return fs::exists(jobs / id / "fingerprint" / "output.json");
    };
    auto [first, r1] = succeeded_job("first");
    CHECK(fingerprinted(first));
    CHECK(r1["model_fingerprint"]["process"].is_object());
    CHECK_FALSE(r1["model_fingerprint"].contains("reused"));

    auto [second, r2] = succeeded_job("second");
    CHECK_FALSE(fingerprinted(second));
    CHECK(r2["model_identity"] == r1["model_identity"]);
    CHECK(r2["model_fingerprint"]["process"].is_null());
    CHECK(r2["model_fingerprint"]["reused"]["job"] == first);
    for (const Json& f : r2["model_fingerprint"]["files"]) {
      CAPTURE(f.dump());
      CHECK(f["source"] == "cache");
      CHECK(f["job"] == first);
    }
    std::string events = slurp(jobs / second / "events.jsonl");
    CHECK(events.find("the fingerprint of an earlier job stands") != std::string::npos);
    if (have(kClient)) {
      spit(tmp.path / "r2.json", slurp(jobs / second / "result.json"));
      std::string v = run_capture(kClient + " verify " + (tmp.path / "r2.json").string() +
                                  " --envelope " + (jobs / second / "result.dsse.json").string() +
                                  " --pubkey " + (d.state() / "keys" / "host.pub").string());
      CHECK_MESSAGE(v.rfind("0:", 0) == 0, v);
    }

    // A tab for a space through the mapping: no write() call, but the page was written back
    // and write-protected before the fingerprint read it, so the fault moves the ctime.
    map[space] = '\t';
    ::munmap(map, text.size());
    ::close(fd);
    auto [third, r3] = succeeded_job("third");
    CHECK(fingerprinted(third));
    CHECK(r3["model_identity"]["config_hash"] != r1["model_identity"]["config_hash"]);
    CHECK_FALSE(r3["model_fingerprint"].contains("reused"));

    // The same bytes written again in place: the state moved, so the fingerprint runs again.
    ::usleep(2'100'000);
    auto [fourth, r4] = succeeded_job("fourth");  // settled again: stores the record
    CHECK(fingerprinted(fourth));
    auto [fifth, r5] = succeeded_job("fifth");
    CHECK_FALSE(fingerprinted(fifth));
    CHECK(r5["model_identity"] == r3["model_identity"]);
    spit(config, slurp(config));
    auto [sixth, r6] = succeeded_job("sixth");
    CHECK(fingerprinted(sixth));
    CHECK(r6["model_identity"] == r3["model_identity"]);
    // A file added at the top.
    ::usleep(2'100'000);
    succeeded_job("seventh");
    spit(model / "notes.txt", "x\n");
    auto [eighth, r8] = succeeded_job("eighth");
    CHECK(fingerprinted(eighth));
  }

  TEST_CASE(
      "a settled shard rewritten in place (same inode, same size) after the fingerprint left it "
      "to the oracle fails the job naming the shard; nothing is signed or cached") {
    if (!have(kFingerprint) || !have(kOracle)) {
      MESSAGE("skipped: assay-fingerprint or assay-oracle was not built");
      return;
    }
    TempDir tmp;
    ::chmod(tmp.path.c_str(), 0755);
    fs::path model = seeded_fixture(tmp.path / "model", 1);
    fs::path other = seeded_fixture(tmp.path / "other", 2);
    fs::path shard = model / "model.safetensors";
    REQUIRE(fs::file_size(shard) == fs::file_size(other / "model.safetensors"));
    ::chmod(shard.c_str(), 0666);  // the stand-in, as the worker user, writes it in place
    ::chmod((other / "model.safetensors").c_str(), 0644);
    struct stat before {};
    REQUIRE(::stat(shard.c_str(), &before) == 0);
    ::usleep(2'100'000);  // settled, so that the fingerprint defers the shard
    fs::path wrapper = script(tmp.path / "fingerprint-then-rewrite",
                              "\"" + kFingerprint + "\" \"$@\"; rc=$?\ncat \"" +
                                  (other / "model.safetensors").string() + "\" > \"" +
                                  shard.string() + "\" || exit 99\nexit $rc\n");
    Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
             {"--containment", containment(), "--fingerprint-worker", wrapper.string(),
              "--oracle-worker", kOracle});
    REQUIRE_MESSAGE(d.start(), d.log());
    auto [id, job] = run_job(d.socket(), next_token_request("rewrite", model), 300);
    CAPTURE(job.dump(2));
    struct stat after {};
    REQUIRE(::stat(shard.c_str(), &after) == 0);
    REQUIRE(after.st_ino == before.st_ino);  // rewritten in place, not replaced
    REQUIRE(slurp(shard) == slurp(other / "model.safetensors"));
    Json fp =
        assay::common::parse_strict(slurp(d.state() / "jobs" / id / "fingerprint" / "output.json"));
    CHECK(fp.contains("pending_identity"));  // the shard was left to the oracle
    CHECK(job["state"] == "failed");
    CHECK(job["error"]["code"] == "job.bytes_mismatch");
    std::string message = job["error"]["message"];
    CHECK(message.find("weight file model.safetensors changed after the fingerprint left it to "
                       "the oracle worker (mtime_ns ") != std::string::npos);
    CHECK_FALSE(fs::exists(d.state() / "jobs" / id / "oracle" / "output.json"));  // never ran
    CHECK_FALSE(fs::exists(d.state() / "jobs" / id / "result.json"));
    // Nothing of the rewritten model was kept as a digest of the fingerprinted one.
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(d.state() / "fingerprint-cache", ec))
      CHECK(slurp(e.path()).find("model.safetensors") == std::string::npos);
  }

  TEST_CASE("a hostile stand-in worker reaches neither the key, the socket, the model nor assayd") {
    TempDir tmp;
    ::chmod(tmp.path.c_str(), 0755);
    fs::path model = tmp.path / "model";
    fs::create_directories(model);
    spit(model / "config.json", R"({"vocab_size": 260})");
    ::chmod(model.c_str(), 0755);
    fs::path state = tmp.path / "state", sock = tmp.path / "assayd.sock";
    // Each probe prints "<name> ok" when the attack worked, "<name> refused" when it failed.
    std::string probes =
        "probe() { name=$1; shift; if \"$@\" >/dev/null 2>&1; then echo \"$name ok\"; else echo "
        "\"$name refused\"; fi; }\n"
        "probe key cat '" +
        (state / "keys" / "host.key").string() +
        "'\n"
        "probe socket curl -sf --max-time 2 --unix-socket '" +
        sock.string() +
        "' http://x/v1/health\n"
        "probe model touch '" +
        (model / "planted").string() +
        "'\n"
        "probe mount mount -t tmpfs x /tmp\n"
        "probe unshare unshare -n true\n"
        "probe assayd kill -0 \"$ASSAYD_PID\"\n"
        "probe assayd-proc test -e /proc/\"$ASSAYD_PID\"/root\n"
        "ls /proc | grep -c '^[0-9]' | sed 's/^/pids /'\n"
        "exit 3\n";
    fs::path hostile =
        script(tmp.path / "hostile", "ASSAYD_PID=$(cat '" + (tmp.path / "assayd.pid").string() +
                                         "' 2>/dev/null)\n" + probes);
    Daemon d(state, sock,
             {"--containment", containment(), "--fingerprint-worker", hostile.string()});
    REQUIRE_MESSAGE(d.start(), d.log());
    spit(tmp.path / "assayd.pid", std::to_string(d.pid()));
    ::chmod((tmp.path / "assayd.pid").c_str(), 0644);
    auto [id, job] = run_job(d.socket(), next_token_request("hostile", model), 60);
    CHECK(job["state"] == "failed");
    std::string out = slurp(state / "jobs" / id / "fingerprint" / "stdout.log");
    CAPTURE(out);
    for (const char* probe :
         {"key", "socket", "model", "mount", "unshare", "assayd", "assayd-proc"})
      CHECK(out.find(std::string(probe) + " refused") != std::string::npos);
    CHECK(out.find(" ok") == std::string::npos);
    CHECK_FALSE(fs::exists(model / "planted"));
    CHECK(request(d.socket(), "GET", "/v1/health").status == 200);
    Json evidence = Json::parse(slurp(state / "jobs" / id / "fingerprint" / "evidence.json"));
    CHECK(evidence["spawn"]["uid"] != 0);
    CHECK(evidence["spawn"]["capabilities"]["effective"] == "0000000000000000");
  }

  TEST_CASE(
      "files a worker leaves are not followed: an artifact or a stderr.log replaced by a symlink "
      "or a FIFO fails the job without touching the target, leaking it or stopping assayd") {
    if (!have(kFingerprint) || !have(kOracle)) {
      MESSAGE("skipped: assay-fingerprint or assay-oracle was not built");
      return;
    }
    TempDir tmp;
    ::chmod(tmp.path.c_str(), 0755);
    fs::path model = seeded_fixture(tmp.path / "model", 1);
    fs::path target = tmp.path / "target";  // a file of root's the artifact link points at
    spit(target, "not yours\n");
    ::chmod(target.c_str(), 0644);
    fs::path secret = tmp.path / "secret";
    spit(secret, "TOPSECRET-42\n");
    ::chmod(secret.c_str(), 0600);
    struct Case {
      std::string name, after;
    };
    // Each stand-in runs the real oracle (so its output passes every check), then leaves a
    // hostile file in its workspace (its cwd).
    std::vector<Case> cases{
        {"artifact-symlink",
         "rm -f logits.safetensors; ln -s '" + target.string() + "' logits.safetensors; exit 0"},
        {"artifact-fifo", "rm -f logits.safetensors; mkfifo logits.safetensors; exit 0"},
        {"stderr-symlink", "rm -f stderr.log; ln -s '" + secret.string() + "' stderr.log; exit 1"},
        {"stderr-fifo", "rm -f stderr.log; mkfifo stderr.log; exit 1"}};
    for (const Case& c : cases) {
      CAPTURE(c.name);
      fs::path wrapper = script(tmp.path / ("oracle-" + c.name),
                                "\"" + kOracle + "\" \"$@\" || exit 98\n" + c.after + "\n");
      Daemon d(tmp.path / ("state-" + c.name), tmp.path / "assayd.sock",
               {"--containment", containment(), "--fingerprint-worker", kFingerprint,
                "--oracle-worker", wrapper.string()});
      REQUIRE_MESSAGE(d.start(), d.log());
      auto [id, job] = run_job(d.socket(), next_token_request(c.name, model), 120);
      CAPTURE(job.dump(2));
      CHECK(job["state"] == "failed");
      CHECK(job.dump().find("TOPSECRET") == std::string::npos);
      CHECK(request_within(d.socket(), "GET", "/v1/health", 1.0).status == 200);
      struct stat st {};
      REQUIRE(::stat(target.c_str(), &st) == 0);
      CHECK((st.st_mode & 07777) == 0644);  // not chmod-ed through the link
      CHECK(slurp(target) == "not yours\n");
      CHECK_FALSE(fs::exists(d.state() / "jobs" / id / "result.json"));
      CHECK(d.stop_within(10) == 0);
    }
  }

  TEST_CASE(
      "the transformers worker's interpreter, contained for Kiln's prompt check, reaches no "
      "network, holds no capability and runs under the seccomp filter") {
    if (!have(kFingerprint) || !have(kOracle) || !have(kHfWorker)) {
      MESSAGE("skipped: assay-fingerprint, assay-oracle or assay-hf-worker was not built");
      return;
    }
    if (containment() == "none") {
      MESSAGE("skipped: without containment there is no private network to test");
      return;
    }
    TempDir tmp;
    ::chmod(tmp.path.c_str(), 0755);
    std::string cmd = std::string(ASSAY_PYTHON3) + " " + ASSAY_SOURCE_DIR +
                      "/tests/hf/kiln_chat_fixture.py " + (tmp.path / "chat").string() + " > " +
                      (tmp.path / "fixture.log").string() + " 2>&1";
    REQUIRE_MESSAGE(std::system(cmd.c_str()) == 0, slurp(tmp.path / "fixture.log"));
    // A listener on the host's loopback: reaching it from the worker would be a leak.
    int listener = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
    REQUIRE(::listen(listener, 4) == 0);
    socklen_t len = sizeof addr;
    ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
    int port = ntohs(addr.sin_port);
    // The worker's own Python, as assay-hf-worker runs it, tries first; then the real worker
    // runs in the same process (exec), so the job goes on as any other.
    spit(tmp.path / "probe.py",
         "import socket\n"
         "def tcp(host, port):\n"
         "    s = socket.socket(); s.settimeout(3)\n"
         "    try:\n"
         "        s.connect((host, port)); print(f'tcp {host} ok')\n"
         "    except OSError as e:\n"
         "        print(f'tcp {host} refused {e.errno}')\n"
         "tcp('127.0.0.1', " +
             std::to_string(port) +
             ")\n"
             "tcp('1.1.1.1', 53)\n"
             "for line in open('/proc/self/status'):\n"
             "    if line.split(':')[0] in ('CapEff', 'CapPrm', 'Seccomp', 'NoNewPrivs'):\n"
             "        print(' '.join(line.split()))\n"
             "import transformers, torch\n"
             "print('imports ok', transformers.__version__, torch.__version__)\n");
    ::chmod((tmp.path / "probe.py").c_str(), 0644);
    fs::path wrapper =
        script(tmp.path / "probing-hf-worker",
               std::string(ASSAY_PYTHON3) + " -I " + (tmp.path / "probe.py").string() +
                   " > probe.txt 2>&1\nexec " + kHfWorker + " \"$@\"\n");
    Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
             {"--containment", containment(), "--fingerprint-worker", kFingerprint,
              "--oracle-worker", kOracle, "--hf-worker", wrapper.string()});
    REQUIRE_MESSAGE(d.start(), d.log());
    Json doc = Json::parse(slurp(tmp.path / "chat" / "request.json"));
    auto sub = request(d.socket(), "POST",
                       "/v1/jobs?model_dir=" + (tmp.path / "chat" / "model").string(), doc.dump());
    REQUIRE_MESSAGE(sub.status == 201, sub.body);
    std::string id = sub.json()["id"];
    Json job = wait_job(d.socket(), id, terminal, 300);
    ::close(listener);
    CHECK_MESSAGE(job["state"] == "succeeded", job.dump(2));
    std::string out = slurp(d.state() / "jobs" / id / "prompt" / "probe.txt");
    CAPTURE(out);
    CHECK(out.find("tcp 127.0.0.1 refused") != std::string::npos);
    CHECK(out.find("tcp 1.1.1.1 refused") != std::string::npos);
    CHECK(out.find(" ok") == out.find("imports ok") + 7);  // no connection worked
    CHECK(out.find("CapEff: 0000000000000000") != std::string::npos);
    CHECK(out.find("CapPrm: 0000000000000000") != std::string::npos);
    CHECK(out.find("NoNewPrivs: 1") != std::string::npos);
    CHECK(out.find("Seccomp: 2") != std::string::npos);
    CHECK(out.find("imports ok 5.13.1") != std::string::npos);
  }
}
