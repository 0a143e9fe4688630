// Jobs through assayd with `executor: slurm`, against the real single-node Slurm cluster that
// tests/slurm/run.sh starts (it sets SLURM_CONF and ASSAY_TEST_SHARED and runs these cases with
// -tc="slurm:*"); skipped where no cluster is up. Every worker step is a Slurm batch job running
// `assayd contain` on the node; the results verify offline like local ones.
#include <doctest/doctest.h>

#include <functional>
#include <map>
#include <set>
#include <thread>

#include "common/identity.h"
#include "common/sign.h"
#include "tests/integration/harness.h"

using namespace assay::test;
namespace common = assay::common;

namespace {

bool have_cluster() {
  if (!std::getenv("ASSAY_TEST_SHARED") || !std::getenv("SLURM_CONF")) {
    MESSAGE("skipped: no Slurm cluster (tests/slurm/run.sh runs these)");
    return false;
  }
  if (have(kFingerprint) && have(kOracle) && have(kCompare)) return true;
  MESSAGE("skipped: a worker was not built");
  return false;
}

// A daemon whose steps run in Slurm, workspaces under the cluster's shared directory.
std::unique_ptr<Daemon> slurm_daemon(const TempDir& tmp, const std::string& oracle) {
  fs::path shared = fs::path(std::getenv("ASSAY_TEST_SHARED")) / tmp.path.filename();
  fs::create_directories(shared);
  Json config{
      {"executor", "slurm"},
      {"slurm", {{"shared_dir", shared.string()}, {"node_assayd", ASSAYD_PATH}, {"poll_ms", 200}}}};
  spit(tmp.path / "config.json", config.dump());
  return std::make_unique<Daemon>(
      tmp.path / "state", tmp.path / "assayd.sock",
      std::vector<std::string>{"--config", (tmp.path / "config.json").string(), "--containment",
                               containment(), "--fingerprint-worker", kFingerprint,
                               "--oracle-worker", oracle, "--compare-worker", kCompare});
}

fs::path shared_of(const TempDir& tmp) {
  return fs::path(std::getenv("ASSAY_TEST_SHARED")) / tmp.path.filename();
}

// The worker reads the model by path on the node, as the worker user: the directories must let
// it through.
fs::path readable_model(const TempDir& tmp) {
  ::chmod(tmp.path.c_str(), 0755);
  fs::path model = fixture_model(tmp.path / "llama-tiny");
  std::system(("chmod -R a+rX " + model.string()).c_str());
  return model;
}

std::string read_line(const fs::path& p) {
  std::string s = slurp(p);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

bool wait_for_file(const fs::path& p, double seconds) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    std::error_code ec;
    if (fs::exists(p, ec) && !read_line(p).empty()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

std::string squeue_state(const std::string& id) {
  std::string r = run_capture("squeue -h -t all -j " + id + " -o %T");
  r = r.substr(r.find(':') + 1);
  while (!r.empty() && (r.back() == '\n' || r.back() == ' ')) r.pop_back();
  return r;
}

}  // namespace

TEST_CASE(
    "slurm: a next-token and a fidelity job run their steps as Slurm jobs contained on the node; "
    "the evidence names the Slurm job and node, and the results verify offline like local ones") {
  if (!have_cluster()) return;
  TempDir tmp;
  fs::path model = readable_model(tmp);
  auto d = slurm_daemon(tmp, kOracle);
  REQUIRE_MESSAGE(d->start(), d->log());

  auto sub = request_json(*d, next_token_request("via-slurm", model));
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  std::string id = sub.json()["id"];
  Json job = wait_job(d->socket(), id, terminal, 300);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d->log());
  auto reply = request_get(*d, "/v1/jobs/" + id + "/result");
  REQUIRE(reply.status == 200);
  Json result = reply.json();
  fs::path shared = shared_of(tmp);
  for (const auto& [role, process] :
       {std::pair{"fingerprint", result["model_fingerprint"]["process"]},
        std::pair{"oracle", result["oracle"]["process"]}}) {
    const Json& e = process["executor"];
    CHECK(e["kind"] == "slurm");
    CHECK(e["node"] == "assay-node");
    CHECK(e["state"] == "COMPLETED");
    fs::path step = shared / "slurm" / (id + "-" + role);
    CHECK(e["slurm_job_id"] == read_line(step / "slurm_job_id"));
    // The node's own document, hashed by the head when it read it.
    CHECK(e["evidence_sha256"] == common::sha256_file_id(step / "evidence.json"));
    CHECK(process["mode"] != "none");
    CHECK(process["exit"]["code"] == 0);
  }
  // The job's events show the Slurm states, and /metrics counts the submissions.
  Json status = request_get(*d, "/v1/jobs/" + id).json();
  CHECK(status["events"].dump().find("Slurm job") != std::string::npos);
  std::string metrics = request_get(*d, "/metrics").body;
  CHECK(metrics.find("assay_slurm_steps_submitted_total 2") != std::string::npos);
  std::string validate =
      validate_schemas({{"next-token-oracle-result", (d->state() / "jobs" / id / "result.json")}});
  CHECK_MESSAGE(validate.rfind("0:", 0) == 0, validate);
  if (have(kClient)) {
    spit(tmp.path / "result.json", reply.body);
    spit(tmp.path / "result.dsse.json", request_get(*d, "/v1/jobs/" + id + "/attestation").body);
    std::string v =
        run_capture(kClient + " verify " + (tmp.path / "result.json").string() + " --pubkey " +
                    (d->state() / "keys" / "host.pub").string() + " --artifact " +
                    (d->state() / "jobs" / id / "logits.safetensors").string());
    CHECK_MESSAGE(v.rfind("0:", 0) == 0, v);
  }

  // A fidelity job: fingerprints, captures and the comparison, each a Slurm job.
  Json fidelity{{"schema", "assay.fidelity-request.v1"},
                {"id", "self"},
                {"reference", {{"model_dir", model.string()}}},
                {"candidate", {{"model_dir", model.string()}, {"label", "itself"}}},
                {"panel", {{"contexts", {{{"id", "hello"}, {"token_ids", {72, 101, 108, 108}}}}}}},
                {"reproduction_confirmation", true}};
  auto fsub = request_json(*d, fidelity);
  REQUIRE_MESSAGE(fsub.status == 201, fsub.body);
  std::string fid = fsub.json()["id"];
  Json fjob = wait_job(d->socket(), fid, terminal, 300);
  REQUIRE_MESSAGE(fjob["state"] == "succeeded", fjob.dump(2) << "\n" << d->log());
  Json receipt = request_get(*d, "/v1/jobs/" + fid + "/result").json();
  CHECK(receipt["gates"]["status"] == "passed");
  CHECK(receipt["comparison"]["metrics"]["kl"]["max"] == 0.0);
  CHECK(receipt["comparison"]["process"]["executor"]["kind"] == "slurm");
}

TEST_CASE(
    "slurm: after kill -9 of assayd while a step runs in Slurm, the restart re-attaches to it by "
    "its job id instead of running it again; cancel is scancel") {
  if (!have_cluster()) return;
  TempDir tmp;
  fs::path model = readable_model(tmp);
  // The oracle step takes a few seconds (a real oracle run after a sleep).
  fs::path slow = slow_wrapper(tmp.path, kOracle, 4);
  auto d = slurm_daemon(tmp, slow.string());
  REQUIRE_MESSAGE(d->start(), d->log());
  auto sub = request_json(*d, next_token_request("reattach", model));
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  std::string id = sub.json()["id"];
  fs::path step = shared_of(tmp) / "slurm" / (id + "-oracle");
  REQUIRE_MESSAGE(wait_for_file(step / "slurm_job_id", 120), d->log());
  std::string slurm_id = read_line(step / "slurm_job_id");
  d->kill9();

  d = slurm_daemon(tmp, slow.string());
  REQUIRE_MESSAGE(d->start(), d->log());
  Json job = wait_job(d->socket(), id, terminal, 300);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d->log());
  Json result = request_get(*d, "/v1/jobs/" + id + "/result").json();
  // The very Slurm job submitted before the kill: not submitted again.
  CHECK(result["oracle"]["process"]["executor"]["slurm_job_id"] == slurm_id);
  CHECK(read_line(step / "slurm_job_id") == slurm_id);
  std::string events = request_get(*d, "/v1/jobs/" + id).json()["events"].dump();
  CHECK(events.find("re-attaching") != std::string::npos);
  CHECK(events.find("collected, not run again") != std::string::npos);
  std::string metrics = request_get(*d, "/metrics").body;
  CHECK(metrics.find("assay_slurm_steps_submitted_total 0") != std::string::npos);

  // Cancel while the oracle's Slurm job runs: scancel, and the job ends cancelled.
  Json other = next_token_request("to-cancel", model);
  auto sub2 = request_json(*d, other);
  REQUIRE_MESSAGE(sub2.status == 201, sub2.body);
  std::string id2 = sub2.json()["id"];
  fs::path step2 = shared_of(tmp) / "slurm" / (id2 + "-oracle");
  REQUIRE_MESSAGE(wait_for_file(step2 / "slurm_job_id", 120), d->log());
  std::string slurm_id2 = read_line(step2 / "slurm_job_id");
  auto cancel = request(d->socket(), "DELETE", "/v1/jobs/" + id2);
  CHECK_MESSAGE(cancel.status / 100 == 2, cancel.body);
  Json cancelled = wait_job(d->socket(), id2, terminal, 120);
  CHECK(cancelled["state"] == "cancelled");
  std::string state = squeue_state(slurm_id2);
  CHECK_MESSAGE((state == "CANCELLED" || state.empty()), state);
}

TEST_CASE(
    "slurm: a batch's oracle is one Slurm job; after kill -9 of assayd the restart re-attaches to "
    "it and records every state once") {
  if (!have_cluster()) return;
  TempDir tmp;
  fs::path model = readable_model(tmp);
  fs::path slow = slow_wrapper(tmp.path, kOracle, 4);
  auto d = slurm_daemon(tmp, slow.string());
  REQUIRE_MESSAGE(d->start(), d->log());
  Json states = Json::array();
  for (int i = 0; i < 3; ++i) {
    Json s = next_token_request("state-" + std::to_string(i), model);
    s.erase("model_dir");
    s["input_token_ids"] = {72, 101, 108 + i};
    states.push_back(s);
  }
  Json batch{{"schema", "assay.next-token-batch-request.v1"}, {"id", "sweep"}, {"states", states}};
  auto sub = request(d->socket(), "POST", "/v1/jobs?model_dir=" + model.string(), batch.dump());
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  std::string id = sub.json()["id"];
  fs::path step = shared_of(tmp) / "slurm" / (id + "-oracle");
  REQUIRE_MESSAGE(wait_for_file(step / "slurm_job_id", 120), d->log());
  std::string slurm_id = read_line(step / "slurm_job_id");
  d->kill9();

  d = slurm_daemon(tmp, slow.string());
  REQUIRE_MESSAGE(d->start(), d->log());
  Json job = wait_job(d->socket(), id, terminal, 300);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d->log());
  Json summary = request_get(*d, "/v1/jobs/" + id + "/result").json();
  CHECK(summary["counts"]["succeeded"] == 3);
  CHECK(read_line(step / "slurm_job_id") == slurm_id);
  for (const Json& s : summary["states"]) {
    Json result = request_get(*d, "/v1/jobs/" + s["job_id"].get<std::string>() + "/result").json();
    CHECK(result["oracle"]["process"]["executor"]["slurm_job_id"] == slurm_id);
    CHECK(result["batch"]["index"] == s["index"]);
  }
  std::string events = request_get(*d, "/v1/jobs/" + id).json()["events"].dump();
  CHECK(events.find("re-attaching") != std::string::npos);
}

namespace {

// A daemon whose steps run on a Slurm worker pool: one pool job (one node), a resident worker
// on it.
std::unique_ptr<Daemon> pool_daemon(const TempDir& tmp, const std::string& oracle,
                                    unsigned nodes = 1, const std::string& listen = "127.0.0.1:0") {
  fs::path shared = shared_of(tmp);
  fs::create_directories(shared);
  Json config{{"executor", "slurm"},
              {"device_slots", nodes},
              {"slurm",
               {{"shared_dir", shared.string()},
                {"node_assayd", ASSAYD_PATH},
                {"poll_ms", 200},
                {"pool",
                 {{"nodes", nodes},
                  {"listen", listen},
                  {"idle_seconds", 120},
                  {"memory_bytes", 2ULL << 30}}}}}};
  spit(tmp.path / "config.json", config.dump());
  return std::make_unique<Daemon>(
      tmp.path / "state", tmp.path / "assayd.sock",
      std::vector<std::string>{"--config", (tmp.path / "config.json").string(), "--containment",
                               containment(), "--fingerprint-worker", kFingerprint,
                               "--oracle-worker", oracle, "--compare-worker", kCompare});
}

}  // namespace

TEST_CASE(
    "slurm: a worker pool runs every step of two disputes on one long-lived pool job; the model "
    "is loaded once on the node, the evidence names the pool, node and resident worker, and the "
    "results verify offline; the pool job ends with assayd") {
  if (!have_cluster()) return;
  TempDir tmp;
  fs::path model = readable_model(tmp);
  auto d = pool_daemon(tmp, kOracle);
  REQUIRE_MESSAGE(d->start(), d->log());

  std::vector<Json> results;
  std::vector<std::string> ids;
  for (const char* name : {"pool-first", "pool-second"}) {
    auto sub = request_json(*d, next_token_request(name, model));
    REQUIRE_MESSAGE(sub.status == 201, sub.body);
    std::string id = sub.json()["id"];
    Json job = wait_job(d->socket(), id, terminal, 300);
    REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d->log());
    auto reply = request_get(*d, "/v1/jobs/" + id + "/result");
    REQUIRE(reply.status == 200);
    results.push_back(reply.json());
    ids.push_back(id);
    if (have(kClient)) {
      spit(tmp.path / "result.json", reply.body);
      spit(tmp.path / "result.dsse.json", request_get(*d, "/v1/jobs/" + id + "/attestation").body);
      std::string v =
          run_capture(kClient + " verify " + (tmp.path / "result.json").string() + " --pubkey " +
                      (d->state() / "keys" / "host.pub").string() + " --artifact " +
                      (d->state() / "jobs" / id / "logits.safetensors").string());
      CHECK_MESSAGE(v.rfind("0:", 0) == 0, v);
    }
  }
  std::string pool_job;
  for (const Json& result : results)
    for (const Json* process :
         {&result["model_fingerprint"]["process"], &result["oracle"]["process"]}) {
      const Json& e = (*process)["executor"];
      CHECK(e["kind"] == "slurm-pool");
      CHECK(e["node"].is_string());
      if (pool_job.empty()) pool_job = e["slurm_job_id"];
      CHECK(e["slurm_job_id"] == pool_job);  // one pool job ran all four steps
      CHECK((*process)["mode"] != "none");
      CHECK(e["evidence_sha256"] == common::sha256_canonical_id([&] {
              Json node = *process;
              node.erase("executor");
              return node;
            }()));
    }
  // The second dispute ran on the worker the first loaded: the model was loaded once.
  const Json& first = results[0]["oracle"]["process"]["resident"];
  const Json& second = results[1]["oracle"]["process"]["resident"];
  REQUIRE_MESSAGE(first.is_object(), results[0]["oracle"]["process"].dump(2));
  REQUIRE(second.is_object());
  CHECK(second["worker"] == first["worker"]);
  CHECK(first["jobs_before"] == 0);
  CHECK(second["jobs_before"] == 1);
  CHECK(results[0]["oracle"]["argmax"] == results[1]["oracle"]["argmax"]);
  // One sbatch for the whole pool.
  std::string metrics = request_get(*d, "/metrics").body;
  CHECK(metrics.find("assay_slurm_steps_submitted_total 1") != std::string::npos);
  std::string events = request_get(*d, "/v1/jobs/" + ids[1]).json()["events"].dump();
  CHECK(events.find("pool node") != std::string::npos);
  std::string validate = validate_schemas(
      {{"next-token-oracle-result", (d->state() / "jobs" / ids[1] / "result.json")}});
  CHECK_MESSAGE(validate.rfind("0:", 0) == 0, validate);

  // Strangers on the pool's port: bytes that fail the MAC, a hello under the right key (read,
  // as root, from the pool's directory) for a Slurm job that is none of this pool's, and one
  // whose fields have the wrong types. Each is dropped, and the daemon and its node go on.
  fs::path pool_dir = fs::directory_iterator(shared_of(tmp) / "pools")->path();
  Json node_json = Json::parse(slurp(pool_dir / "node.json"));
  const std::string probe = R"PY(
import hashlib, hmac, json, socket, struct, sys
host, port = sys.argv[1].rsplit(":", 1)
key, pool = bytes.fromhex(sys.argv[2]), sys.argv[3]
def dropped(data):
    s = socket.create_connection((host, int(port)), timeout=20)
    s.sendall(data)
    try:
        return s.recv(16) == b""
    except ConnectionResetError:
        return True
print(dropped(b"\x00\x00\x00\x05" + b"x" * 37))
hello = json.dumps({"type": "hello", "pool": pool, "node": "intruder",
                    "slurm_job_id": "999999", "nonce": "00"}).encode()
def keyed(message):
    payload = json.dumps(message).encode()
    mac = hmac.new(key, b"n" + struct.pack(">Q", 0) + payload, hashlib.sha256).digest()
    return struct.pack(">I", len(payload)) + mac + payload
print(dropped(keyed(json.loads(hello))))
# Under the key, but a field of the wrong type: the head's reader must not fall over.
print(dropped(keyed({"type": "hello", "pool": pool, "node": 7, "slurm_job_id": 5,
                     "nonce": []})))
)PY";
  spit(tmp.path / "probe.py", probe);
  std::string probed = run_capture(
      "python3 " + (tmp.path / "probe.py").string() + " " + node_json["head"].get<std::string>() +
      " " + read_line(pool_dir / "key") + " " + node_json["pool"].get<std::string>());
  CHECK_MESSAGE(probed == "0:True\nTrue\nTrue\n", probed);
  CHECK_MESSAGE(d->log().find("an unusable message") != std::string::npos, d->log());
  CHECK_MESSAGE(d->log().find("failed its HMAC") != std::string::npos, d->log());
  CHECK_MESSAGE(d->log().find("refused a node") != std::string::npos, d->log());
  auto third = request_json(*d, next_token_request("pool-third", model));
  REQUIRE_MESSAGE(third.status == 201, third.body);
  Json third_job = wait_job(d->socket(), third.json()["id"], terminal, 300);
  CHECK_MESSAGE(third_job["state"] == "succeeded", third_job.dump(2) << "\n" << d->log());
  CHECK(request_get(*d, "/metrics").body.find("assay_pool_nodes_lost_total 0") !=
        std::string::npos);

  // assayd stops: the node loses its head and exits, and its Slurm job ends.
  d->stop();
  std::string state;
  for (int i = 0; i < 300; ++i) {
    state = squeue_state(pool_job);
    if (state != "RUNNING" && state != "COMPLETING") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  CHECK_MESSAGE((state == "COMPLETED" || state.empty()), state);
}

TEST_CASE(
    "slurm: after kill -9 of assayd while a pool node runs a step, the node exits with its "
    "workers and the restarted assayd runs the step again on a new pool; the fingerprint that "
    "ended before is collected, not run again") {
  if (!have_cluster()) return;
  TempDir tmp;
  fs::path model = readable_model(tmp);
  fs::path slow = slow_wrapper(tmp.path, kOracle, 4);  // the resident worker starts 4 s late
  auto d = pool_daemon(tmp, slow.string());
  REQUIRE_MESSAGE(d->start(), d->log());
  auto sub = request_json(*d, next_token_request("pool-restart", model));
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  std::string id = sub.json()["id"];
  bool sent = false;
  for (int i = 0; i < 1500 && !sent; ++i) {
    sent = request_get(*d, "/v1/jobs/" + id)
               .json()["events"]
               .dump()
               .find("sent the oracle step to pool node") != std::string::npos;
    if (!sent) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  REQUIRE_MESSAGE(sent, d->log());
  std::string events = request_get(*d, "/v1/jobs/" + id).json()["events"].dump();
  auto at = events.find("(Slurm job ");
  REQUIRE(at != std::string::npos);
  std::string old_pool_job = events.substr(at + 11, events.find(')', at) - at - 11);
  d->kill9();
  // The node loses its head: it stops its worker and exits, and its Slurm job ends.
  std::string state;
  for (int i = 0; i < 300; ++i) {
    state = squeue_state(old_pool_job);
    if (state != "RUNNING" && state != "COMPLETING") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  CHECK_MESSAGE((state == "COMPLETED" || state.empty()), state);

  d = pool_daemon(tmp, slow.string());
  REQUIRE_MESSAGE(d->start(), d->log());
  Json job = wait_job(d->socket(), id, terminal, 300);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d->log());
  Json result = request_get(*d, "/v1/jobs/" + id + "/result").json();
  CHECK(result["oracle"]["process"]["executor"]["kind"] == "slurm-pool");
  CHECK(result["oracle"]["process"]["executor"]["slurm_job_id"] != old_pool_job);
  CHECK(result["model_fingerprint"]["process"]["executor"]["slurm_job_id"] == old_pool_job);
  std::string after = request_get(*d, "/v1/jobs/" + id).json()["events"].dump();
  CHECK(after.find("collected, not run again") != std::string::npos);
}

// The three-node cases: tests/slurm/pool_run.sh starts a cluster of three slurmd nodes, each in
// network and UTS namespaces of its own, and runs these (-tc="pool:*") inside the cluster's hub
// namespace, where the head listens on the bridge's address (ASSAY_TEST_POOL_LISTEN).
namespace {

bool have_pool_cluster() {
  if (!std::getenv("ASSAY_TEST_POOL_LISTEN") || !std::getenv("ASSAY_TEST_CLUSTER")) {
    MESSAGE("skipped: no three-node cluster (tests/slurm/pool_run.sh runs these)");
    return false;
  }
  return have_cluster();
}

// A three-node pool whose nodes' resident workers each take 3 s more to start: the pool's
// other nodes join while the first loads, and a node acted on the moment it is given a shard
// surely still has it.
std::unique_ptr<Daemon> pool3_daemon(const TempDir& tmp) {
  fs::path slow = slow_wrapper(tmp.path, kOracle, 3);
  return pool_daemon(tmp, slow.string(), 3, std::getenv("ASSAY_TEST_POOL_LISTEN"));
}

// "node: states ..." for messages.
std::string split_of(const std::map<std::string, int>& nodes) {
  std::string split;
  for (const auto& [node, n] : nodes) split += node + ": " + std::to_string(n) + " ";
  return split;
}

Json batch_request(const fs::path& model, int count, const std::string& name = "sweep") {
  Json states = Json::array();
  for (int i = 0; i < count; ++i) {
    Json s = next_token_request("state-" + std::to_string(i), model);
    s.erase("model_dir");
    s["input_token_ids"] = {72, 101 + i % 7, 108 + i / 7, 33};
    states.push_back(s);
  }
  return Json{{"schema", "assay.next-token-batch-request.v1"}, {"id", name}, {"states", states}};
}

// Checks a finished batch: every state once, succeeded, its result's evidence naming the pool
// node and resident worker that computed it; returns the states' nodes.
std::map<std::string, int> check_batch(Daemon& d, const std::string& id, int count,
                                       const TempDir& tmp) {
  Json summary = request_get(d, "/v1/jobs/" + id + "/result").json();
  CHECK(summary["counts"]["succeeded"] == count);
  std::set<int> indices;
  std::map<std::string, int> nodes;
  for (const Json& s : summary["states"]) {
    CHECK(indices.insert(s["index"].get<int>()).second);  // recorded once
    const std::string job = s["job_id"];
    auto reply = request_get(d, "/v1/jobs/" + job + "/result");
    REQUIRE(reply.status == 200);
    Json result = reply.json();
    const Json& process = result["oracle"]["process"];
    CHECK(process["executor"]["kind"] == "slurm-pool");
    CHECK(process["resident"]["worker"].is_string());
    const Json& given = process["executor"]["states"];
    CHECK(std::find(given.begin(), given.end(), s["index"]) != given.end());
    nodes[process["executor"]["node"].get<std::string>()] += 1;
    // Every state verifies offline.
    if (have(kClient)) {
      spit(tmp.path / "state.json", reply.body);
      spit(tmp.path / "state.dsse.json", request_get(d, "/v1/jobs/" + job + "/attestation").body);
      std::string v =
          run_capture(kClient + " verify " + (tmp.path / "state.json").string() + " --pubkey " +
                      (d.state() / "keys" / "host.pub").string() + " --artifact " +
                      (d.state() / "jobs" / job / "logits.safetensors").string());
      CHECK_MESSAGE(v.rfind("0:", 0) == 0, v);
    }
  }
  CHECK(indices.size() == static_cast<std::size_t>(count));
  // The summary names every run of the worker: its node, its resident worker, its states.
  // Each state ended in exactly one run (only a run whose worker died gives its other states
  // to a later run).
  std::size_t given = 0, ended = 0;
  std::string runs;
  for (const Json& run : summary["oracle_runs"]) {
    CHECK(run["process"]["executor"]["kind"] == "slurm-pool");
    CHECK(run["process"]["executor"]["node"].is_string());
    CHECK(run["process"]["resident"]["worker"].is_string());
    given += run["states_given"].get<std::size_t>();
    ended += run["states_ended"].get<std::size_t>();
    CHECK(run["states_given"] == run["process"]["executor"]["states"].size());
    // A run whose worker did not die ended every state it was given: none was computed twice
    // (a state ended on one node and not yet harvested was once given to another node too).
    if (run["exit"] == "succeeded")
      CHECK_MESSAGE(run["states_given"] == run["states_ended"], run.dump());
    runs += run["process"]["executor"]["node"].get<std::string>() + " " +
            run["process"]["resident"]["worker"].get<std::string>() + " given " +
            run["states_given"].dump() + " ended " + run["states_ended"].dump() + " " +
            run["exit"].dump() + "\n";
  }
  CHECK_MESSAGE(ended == static_cast<std::size_t>(count), runs);
  CHECK_MESSAGE(given >= ended, runs);
  if (given != ended) MESSAGE("runs that left states to others:\n" << runs);
  if (have(kClient)) {
    spit(tmp.path / "summary.json", request_get(d, "/v1/jobs/" + id + "/result").body);
    spit(tmp.path / "summary.dsse.json", request_get(d, "/v1/jobs/" + id + "/attestation").body);
    spit(tmp.path / "summary.artifact", request_get(d, "/v1/jobs/" + id + "/artifact").body);
    std::string v = run_capture(kClient + " verify " + (tmp.path / "summary.json").string() +
                                " --pubkey " + (d.state() / "keys" / "host.pub").string() +
                                " --envelope " + (tmp.path / "summary.dsse.json").string() +
                                " --artifact " + (tmp.path / "summary.artifact").string());
    CHECK_MESSAGE(v.rfind("0:", 0) == 0, v);
  }
  return nodes;
}

// Submits a batch to a three-node pool and, the moment its first shard goes to a node, does
// `act` to that node (its name); returns the batch's id and the node.
std::pair<std::string, std::string> batch_then(Daemon& d, const fs::path& model, int count,
                                               const std::function<void(const std::string&)>& act,
                                               const std::string& name = "sweep") {
  auto sub = request(d.socket(), "POST", "/v1/jobs?model_dir=" + model.string(),
                     batch_request(model, count, name).dump());
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  std::string id = sub.json()["id"];
  const std::string sent = "sent to pool node assay-node";
  for (int i = 0; i < 3000; ++i) {
    std::string events = request_get(d, "/v1/jobs/" + id).json()["events"].dump();
    if (auto at = events.find(sent); at != std::string::npos) {
      std::string node = "assay-node" + events.substr(at + sent.size(), 1);
      act(node);
      return {id, node};
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  FAIL("no shard was sent: " << d.log());
  return {};
}

}  // namespace

TEST_CASE(
    "pool: a batch is sharded across three nodes; every state is recorded once, names its node "
    "and worker, and verifies offline") {
  if (!have_pool_cluster()) return;
  TempDir tmp;
  fs::path model = readable_model(tmp);
  auto d = pool3_daemon(tmp);
  REQUIRE_MESSAGE(d->start(), d->log());
  const int count = 48;
  auto sub = request(d->socket(), "POST", "/v1/jobs?model_dir=" + model.string(),
                     batch_request(model, count).dump());
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  std::string id = sub.json()["id"];
  Json job = wait_job(d->socket(), id, terminal, 400);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d->log());
  std::map<std::string, int> nodes = check_batch(*d, id, count, tmp);
  const std::string split = split_of(nodes);
  MESSAGE("states per node: " << split);
  CHECK_MESSAGE(nodes.size() == 3, split);
  std::string metrics = request_get(*d, "/metrics").body;
  CHECK(metrics.find("assay_slurm_steps_submitted_total 3") != std::string::npos);
  CHECK(metrics.find("assay_pool_nodes{state=\"free\"} 3") != std::string::npos);
  CHECK(metrics.find("assay_pool_nodes_lost_total 0") != std::string::npos);
}

TEST_CASE(
    "pool: a node killed mid-batch (slurmd, its job and its workers) loses and duplicates no "
    "state: its shard runs on the other nodes") {
  if (!have_pool_cluster()) return;
  TempDir tmp;
  fs::path model = readable_model(tmp);
  auto d = pool3_daemon(tmp);
  REQUIRE_MESSAGE(d->start(), d->log());
  const int count = 48;
  // The moment the batch's first shard goes to a node (whose resident worker then loads the
  // model), that node is lost: every process of its namespace and below is killed, as by a
  // power cut.
  auto [id, lost] = batch_then(*d, model, count, [](const std::string& node) {
    std::string out =
        run_capture(std::string(ASSAY_SOURCE_DIR) + "/tests/slurm/cluster.sh kill-node " +
                    std::getenv("ASSAY_TEST_CLUSTER") + " " + node.substr(node.size() - 1));
    CHECK_MESSAGE(out.rfind("0:", 0) == 0, out);
  });
  Json job = wait_job(d->socket(), id, terminal, 400);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d->log());
  std::map<std::string, int> nodes = check_batch(*d, id, count, tmp);
  std::string events = request_get(*d, "/v1/jobs/" + id).json()["events"].dump();
  CHECK_MESSAGE(events.find("pool node " + lost + " was lost") != std::string::npos, events);
  // What the lost node held was never handed over: no state names it.
  const std::string split = split_of(nodes);
  MESSAGE("lost " << lost << "; states per node: " << split);
  CHECK_MESSAGE(nodes.count(lost) == 0, split);
  CHECK_MESSAGE(nodes.size() == 2, split);
  std::string metrics = request_get(*d, "/metrics").body;
  CHECK(metrics.find("assay_pool_nodes_lost_total 1") != std::string::npos);
}

TEST_CASE(
    "pool: a node drained mid-batch finishes its shard and leaves the pool; a pool job cancelled "
    "mid-batch (scancel) gives its shard to the others; no state is lost or recorded twice") {
  if (!have_pool_cluster()) return;
  TempDir tmp;
  fs::path model = readable_model(tmp);
  auto d = pool3_daemon(tmp);
  REQUIRE_MESSAGE(d->start(), d->log());
  const int count = 36;

  // Drained: Slurm lets the pool job run; the pool sends it nothing more and releases it.
  auto [drained_id, drained] = batch_then(*d, model, count, [](const std::string& node) {
    std::string out =
        run_capture("scontrol update nodename=" + node + " state=drain reason=assay-test");
    CHECK_MESSAGE(out.rfind("0:", 0) == 0, out);
  });
  Json job = wait_job(d->socket(), drained_id, terminal, 400);
  run_capture("scontrol update nodename=" + drained + " state=resume");
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d->log());
  std::map<std::string, int> nodes = check_batch(*d, drained_id, count, tmp);
  const std::string split = split_of(nodes);
  MESSAGE("drained " << drained << "; states per node: " << split);
  // Its first shard ended there (with the shard's evidence); it got no second.
  CHECK_MESSAGE(nodes.count(drained) == 1, split);
  CHECK_MESSAGE(d->log().find("node " + drained + " takes no more steps: its Slurm node is dr") !=
                    std::string::npos,
                d->log());
  CHECK(d->log().find("releasing node " + drained) != std::string::npos);

  // Cancelled: the node's assayd gets SIGTERM, stops its worker and exits; its shard runs on
  // the others.
  auto [cancelled_id, cancelled] = batch_then(
      *d, model, count,
      [&](const std::string& node) {
        std::string ids = run_capture("squeue -h -w " + node + " -o %i -t running");
        ids = ids.substr(ids.find(':') + 1);
        while (!ids.empty() && (ids.back() == '\n' || ids.back() == ' ')) ids.pop_back();
        REQUIRE_MESSAGE(!ids.empty(), "no pool job on " << node);
        std::string out = run_capture("scancel " + ids);
        CHECK_MESSAGE(out.rfind("0:", 0) == 0, out);
      },
      "sweep-cancelled");
  job = wait_job(d->socket(), cancelled_id, terminal, 400);
  REQUIRE_MESSAGE(job["state"] == "succeeded", job.dump(2) << "\n" << d->log());
  nodes = check_batch(*d, cancelled_id, count, tmp);
  std::string events = request_get(*d, "/v1/jobs/" + cancelled_id).json()["events"].dump();
  CHECK_MESSAGE(events.find("pool node " + cancelled + " was lost") != std::string::npos, events);
}

TEST_CASE(
    "pool: cancelling a batch sharded across the nodes stops its shards on every node; the job "
    "ends cancelled and the nodes, freed, take the next batch") {
  if (!have_pool_cluster()) return;
  TempDir tmp;
  fs::path model = readable_model(tmp);
  auto d = pool3_daemon(tmp);
  REQUIRE_MESSAGE(d->start(), d->log());
  auto [id, node] = batch_then(
      *d, model, 48,
      [](const std::string&) {
        // Until the other nodes have theirs too: the shards are loading on three nodes.
        std::this_thread::sleep_for(std::chrono::seconds(1));
      },
      "sweep-to-cancel");
  auto cancel = request(d->socket(), "DELETE", "/v1/jobs/" + id);
  CHECK_MESSAGE(cancel.status / 100 == 2, cancel.body);
  Json job = wait_job(d->socket(), id, terminal, 120);
  CHECK_MESSAGE(job["state"] == "cancelled", job.dump(2) << "\n" << d->log());
  // Nothing of it runs on any node any more: the next batch has all three free at once.
  const int count = 24;
  auto sub = request(d->socket(), "POST", "/v1/jobs?model_dir=" + model.string(),
                     batch_request(model, count, "after-cancel").dump());
  REQUIRE_MESSAGE(sub.status == 201, sub.body);
  std::string next = sub.json()["id"];
  Json after = wait_job(d->socket(), next, terminal, 400);
  REQUIRE_MESSAGE(after["state"] == "succeeded", after.dump(2) << "\n" << d->log());
  check_batch(*d, next, count, tmp);
  std::string metrics = request_get(*d, "/metrics").body;
  CHECK(metrics.find("assay_pool_nodes_lost_total 0") != std::string::npos);
}
