// Issue 23 through the daemon, as a user in the socket group (nobody) would try it: what the
// submitter cannot read stays unread. A path swapped for a link while its job waits in the queue
// (held there behind another job), a link to a root-only directory inside a named path, and a
// digest mismatch that would name a secret file's sha256 each fail without reading anything.
#include <doctest/doctest.h>

#include <grp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "common/identity.h"
#include "tests/integration/harness.h"

using namespace assay::test;
namespace common = assay::common;

namespace {

constexpr uid_t kNobody = 65534;

// One exchange with the daemon as nobody:nogroup.
HttpReply as_nobody(const fs::path& socket, const std::string& method, const std::string& target,
                    const std::string& body = "") {
  return request_as(kNobody, kNobody, socket, method, target, body);
}

// Hands a tree to nobody, as if nobody had made it.
void give_to_nobody(const fs::path& p) {
  ::chown(p.c_str(), kNobody, kNobody);
  if (fs::is_directory(p))
    for (const auto& e : fs::recursive_directory_iterator(p))
      ::lchown(e.path().c_str(), kNobody, kNobody);
}

// A fingerprint worker that holds a job whose model directory is named ".../blocker" until it is
// cancelled, and runs the real worker for every other job: the job after it waits in the queue.
fs::path holding_fingerprint(const fs::path& dir) {
  fs::path p = dir / "holding-fingerprint";
  spit(p,
       "#!/bin/sh\ncase \"$(cat input.json)\" in *'/blocker\"'*) exec sleep 120;; esac\nexec \"" +
           kFingerprint + "\" \"$@\"\n");
  ::chmod(p.c_str(), 0755);
  return p;
}

Json fidelity_request(const std::string& id, const fs::path& model, const fs::path& logits,
                      const std::string& sha256) {
  return Json{
      {"schema", "assay.fidelity-request.v1"},
      {"id", id},
      {"reference", {{"model_dir", model.string()}}},
      {"candidate",
       {{"logits", {{{"path", logits.string()}, {"sha256", sha256}}}}, {"label", "test logits"}}},
      {"panel", {{"contexts", {{{"id", "a"}, {"token_ids", {72, 101, 108}}}}}}}};
}

// The layout of every case: tmp (0755) holds root's 0700 `private` and nobody's own `u`, and a
// daemon whose socket nobody may use.
struct Setup {
  TempDir tmp;
  fs::path priv, user;
  std::unique_ptr<Daemon> d;
  Setup() {
    REQUIRE_MESSAGE(::getgrnam("nogroup") != nullptr, "the group nogroup (65534) must exist");
    ::chmod(tmp.path.c_str(), 0755);
    priv = tmp.path / "private";
    user = tmp.path / "u";
    fs::create_directories(priv);
    ::chmod(priv.c_str(), 0700);
    fs::create_directories(user);
    spit(tmp.path / "config.json", R"({"socket_group":"nogroup"})");
  }
  // Starts assayd with `extra` arguments; a fingerprint worker that holds ".../blocker" jobs
  // unless one is given.
  void start(std::vector<std::string> extra = {}) {
    std::vector<std::string> args{"--config", (tmp.path / "config.json").string()};
    if (extra.empty())
      extra = {"--containment", containment(), "--fingerprint-worker",
               holding_fingerprint(tmp.path).string()};
    args.insert(args.end(), extra.begin(), extra.end());
    d = std::make_unique<Daemon>(tmp.path / "state", tmp.path / "assayd.sock", args);
    REQUIRE_MESSAGE(d->start(), d->log());
  }
  // A job that holds the queue until it is cancelled.
  std::string hold(const fs::path& blocker, int n) {
    auto held = request_json(*d, next_token_request("blocker-" + std::to_string(n), blocker));
    REQUIRE_MESSAGE(held.status == 201, held.body);
    return held.json()["id"];
  }
  void release(const std::string& held) {
    CHECK(request(d->socket(), "DELETE", "/v1/jobs/" + held).status / 100 == 2);
  }
  ~Setup() {
    if (d) d->stop_within(10);
  }
};

// The model of root's that the attacker's path comes to lead to, and nobody's own copy.
void two_models(const Setup& s, const fs::path& root_model, const fs::path& own_model) {
  fs::path made = fixture_model(s.tmp.path / "fixture");
  fs::create_directories(root_model.parent_path());
  fs::copy(made, root_model, fs::copy_options::recursive);
  fs::copy(made, own_model, fs::copy_options::recursive);
  give_to_nobody(own_model);
}

void swap_for_link(const fs::path& path, const fs::path& target) {
  fs::rename(path, path.string() + ".orig");
  fs::create_directory_symlink(target, path);
  ::lchown(path.c_str(), kNobody, kNobody);
}

}  // namespace

TEST_SUITE("robustness") {
  TEST_CASE(
      "a model directory swapped for a link to a root-only model while its job waits fails at "
      "start, after a restart too, and nothing of the root model is read") {
    if (!have(kFingerprint)) {
      MESSAGE("skipped: assay-fingerprint was not built");
      return;
    }
    Setup s;
    fs::path root_model = s.priv / "m", own = s.user / "m";
    two_models(s, root_model, own);
    give_to_nobody(s.user);
    fs::path blocker = s.tmp.path / "blocker";
    fs::copy(own, blocker, fs::copy_options::recursive);
    s.start();

    std::string held = s.hold(blocker, 1);
    auto sub =
        as_nobody(s.d->socket(), "POST", "/v1/jobs", next_token_request("victim", own).dump());
    REQUIRE_MESSAGE(sub.status == 201, sub.body);
    std::string id = Json::parse(sub.body)["id"];
    CHECK(Json::parse(sub.body)["state"] == "queued");

    swap_for_link(own, root_model);
    // The restart re-queues both; the held job holds the queue again until it is cancelled.
    s.d->kill9();
    REQUIRE_MESSAGE(s.d->start(), s.d->log());
    Json before = wait_job(
        s.d->socket(), id, [](const Json&) { return true; }, 5);
    CHECK(before["state"] == "queued");
    s.release(held);

    Json job = wait_job(s.d->socket(), id, terminal, 60);
    CAPTURE(job.dump(2));
    CHECK(job["state"] == "failed");
    std::string code = job["error"].value("code", "");
    CHECK((code == "job.files_changed" || code == "request.bad_model"));
    std::string message = job["error"].value("message", "");
    CHECK(message.find(own.string()) != std::string::npos);
    CHECK(message.find("symlink") != std::string::npos);
    // No worker was started for it: nothing of root's model was hashed or handed over.
    fs::path dir = s.d->state() / "jobs" / id;
    CHECK_FALSE(fs::exists(dir / "fingerprint"));
    CHECK_FALSE(fs::exists(dir / "result.json"));
    CHECK(request_within(s.d->socket(), "GET", "/v1/health", 1.0).status == 200);
  }

  TEST_CASE(
      "a fidelity candidate path through a symlinked directory is refused at admission, naming "
      "the link, even when the file it leads to is world-readable") {
    Setup s;
    fs::path model = s.user / "model";
    fs::create_directories(model);
    spit(model / "config.json",
         R"({"model_type":"llama","vocab_size":260,"max_position_embeddings":64})");
    fs::path secret_dir = s.priv / "d";
    fs::create_directories(secret_dir);
    spit(secret_dir / "c.safetensors", "root's logits");
    ::chmod((secret_dir / "c.safetensors").c_str(), 0644);
    fs::create_directory_symlink(secret_dir, s.user / "link");
    give_to_nobody(s.user);
    s.start({"--containment", "none", "--fingerprint-worker", "/bin/false"});
    fs::path path = s.user / "link" / "c.safetensors";
    auto r = as_nobody(s.d->socket(), "POST", "/v1/jobs",
                       fidelity_request("through-link", model, path,
                                        common::sha256_file_id(secret_dir / "c.safetensors"))
                           .dump());
    CAPTURE(r.body);
    CHECK(r.status == 422);
    CHECK(r.body.find("request.bad_logits_file") != std::string::npos);
    CHECK(r.body.find("symlink at \\\"" + (s.user / "link").string()) != std::string::npos);
    // A model directory reached through the same link is refused the same way.
    fs::path linked_model = s.user / "link";
    fs::create_directories(secret_dir / "m");
    r = as_nobody(s.d->socket(), "POST", "/v1/jobs",
                  next_token_request("model-through-link", linked_model / "m").dump());
    CHECK(r.status == 422);
    CHECK(r.body.find("symlink") != std::string::npos);
  }

  TEST_CASE(
      "a logits file's directory swapped for a link to a root-only one while the job waits: the "
      "job fails at start, no digest of the root file is told, nothing is signed") {
    if (!have(kFingerprint)) {
      MESSAGE("skipped: assay-fingerprint was not built");
      return;
    }
    Setup s;
    fs::path model = s.user / "model";
    fs::copy(fixture_model(s.tmp.path / "fixture"), model, fs::copy_options::recursive);
    fs::path own_dir = s.user / "d", secret_dir = s.priv / "d";
    fs::create_directories(own_dir);
    fs::create_directories(secret_dir);
    spit(own_dir / "c.safetensors", "my own logits");
    spit(secret_dir / "c.safetensors", "TOPSECRET logits of root's");
    ::chmod((secret_dir / "c.safetensors").c_str(), 0600);
    const std::string secret_sha = common::sha256_file_id(secret_dir / "c.safetensors");
    const std::string own_sha = common::sha256_file_id(own_dir / "c.safetensors");
    give_to_nobody(s.user);
    fs::path blocker = s.tmp.path / "blocker";
    fs::copy(model, blocker, fs::copy_options::recursive);
    s.start();

    // Twice: with the user's own digest (a leak would tell the secret file's), then with the
    // secret file's digest (which a leak would have made a succeeded, signed result).
    int round = 0;
    for (const std::string& sha : {own_sha, secret_sha}) {
      CAPTURE(sha);
      if (fs::is_symlink(own_dir)) {
        fs::remove(own_dir);
        fs::rename(own_dir.string() + ".orig", own_dir);
      }
      std::string held = s.hold(blocker, ++round);
      auto sub = as_nobody(
          s.d->socket(), "POST", "/v1/jobs",
          fidelity_request("race-" + std::to_string(round), model, own_dir / "c.safetensors", sha)
              .dump());
      REQUIRE_MESSAGE(sub.status == 201, sub.body);
      std::string id = Json::parse(sub.body)["id"];
      swap_for_link(own_dir, secret_dir);
      Json job = wait_job(
          s.d->socket(), id, [](const Json&) { return true; }, 5);
      CHECK(job["state"] == "queued");  // still behind the held job
      s.release(held);
      job = wait_job(s.d->socket(), id, terminal, 60);
      CAPTURE(job.dump(2));
      CHECK(job["state"] == "failed");
      std::string code = job["error"].value("code", "");
      CHECK((code == "job.files_changed" || code == "request.bad_logits_file"));
      CHECK(job["error"]["message"].get<std::string>().find("symlink") != std::string::npos);
      if (sha == own_sha) CHECK(job.dump().find(secret_sha.substr(7)) == std::string::npos);
      fs::path dir = s.d->state() / "jobs" / id;
      CHECK_FALSE(fs::exists(dir / "fingerprint-reference"));
      CHECK_FALSE(fs::exists(dir / "compare"));
      CHECK_FALSE(fs::exists(dir / "result.json"));
    }
    CHECK(request_within(s.d->socket(), "GET", "/v1/health", 1.0).status == 200);
  }

  TEST_CASE("an identical request of another user is its own job: the answer names no other user") {
    Setup s;
    fs::path model = s.tmp.path / "model";
    fs::create_directories(model);
    spit(model / "config.json", R"({"model_type":"llama","vocab_size":260})");
    s.start({"--containment", "none", "--fingerprint-worker", "/bin/false"});
    Json req = next_token_request("same", model);
    auto mine = request_json(*s.d, req);
    REQUIRE_MESSAGE(mine.status == 201, mine.body);
    auto theirs = as_nobody(s.d->socket(), "POST", "/v1/jobs", req.dump());
    CAPTURE(theirs.body);
    CHECK(theirs.status == 201);
    CHECK(theirs.body.find("another user") == std::string::npos);
    CHECK(Json::parse(theirs.body)["id"] != mine.json()["id"]);
    // Each sees their own as a duplicate of itself.
    auto again = as_nobody(s.d->socket(), "POST", "/v1/jobs", req.dump());
    CHECK(again.status == 200);
    CHECK(Json::parse(again.body)["id"] == Json::parse(theirs.body)["id"]);
  }

  TEST_CASE(
      "trajectory: tokens after a continuation's first end-of-sequence are refused, naming the "
      "continuation, the EOS and its index; a continuation ending at its EOS is taken") {
    TempDir tmp;
    fs::path model = tmp.path / "m";
    fs::create_directories(model);
    Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
             {"--containment", "none", "--fingerprint-worker", "/bin/false"});
    REQUIRE_MESSAGE(d.start(), d.log());
    auto submit = [&](const Json& eos, const Json& a, const std::string& id) {
      spit(model / "config.json",
           Json{{"model_type", "llama"}, {"vocab_size", 300}, {"eos_token_id", eos}}.dump());
      Json req{
          {"schema", "assay.trajectory-request.v1"},
          {"id", id},
          {"model_dir", model.string()},
          {"prompt_token_ids", {72, 101}},
          {"continuations",
           {{{"engine", "a"}, {"token_ids", a}}, {{"engine", "b"}, {"token_ids", {32, 116}}}}}};
      return request_json(d, req);
    };
    auto r = submit(2, {32, 116, 2, 104, 101}, "padded");
    CAPTURE(r.body);
    CHECK(r.status == 422);
    CHECK(r.body.find("request.tokens_after_eos") != std::string::npos);
    CHECK(r.body.find("continuations[0] (engine \\\"a\\\") has 2 tokens after its first "
                      "end-of-sequence token 2 at index 2") != std::string::npos);
    // A list of EOS ids (Llama 3 style), the first one met counts.
    r = submit(Json::array({7, 2}), {32, 7, 2}, "list");
    CHECK(r.status == 422);
    CHECK(r.body.find("token 7 at index 1") != std::string::npos);
    CHECK(submit(2, {32, 116, 2}, "ends-at-eos").status == 201);
  }

  TEST_CASE(
      "a job directory that did not load is replaced whole when its request comes again: no "
      "stale checks.json or result survives into the new job") {
    TempDir tmp;
    fs::path model = tmp.path / "m";
    fs::create_directories(model);
    spit(model / "config.json", R"({"model_type":"llama","vocab_size":260})");
    Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
             {"--containment", "none", "--fingerprint-worker", "/bin/false"});
    REQUIRE_MESSAGE(d.start(), d.log());
    Json request = next_token_request("leftover", model);
    auto sub = request_json(d, request);
    REQUIRE_MESSAGE(sub.status == 201, sub.body);
    std::string id = sub.json()["id"];
    REQUIRE(wait_job(d.socket(), id, terminal, 30)["state"] == "failed");
    CHECK(d.stop_within(10) == 0);
    fs::path dir = d.state() / "jobs" / id;
    spit(dir / "job.json", "{not json");
    spit(dir / "checks.json", R"({"receipts":"stale"})");
    spit(dir / "result.json", R"({"stale":true})");
    REQUIRE_MESSAGE(d.start(), d.log());
    CHECK(request_get(d, "/v1/jobs/" + id).status == 404);
    sub = request_json(d, request);
    REQUIRE_MESSAGE(sub.status == 201, sub.body);
    CHECK(sub.json()["id"] == id);
    CHECK(wait_job(d.socket(), id, terminal, 30)["state"] == "failed");
    // The new admission's own checks.json, not the planted one.
    REQUIRE(fs::exists(dir / "checks.json"));
    CHECK(slurp(dir / "checks.json").find("stale") == std::string::npos);
    CHECK(common::parse_strict(slurp(dir / "checks.json"))["receipts"].is_object());
    CHECK_FALSE(fs::exists(dir / "result.json"));
    CHECK(fs::exists(dir / "request.json"));
  }

  TEST_CASE(
      "a job's events are appended to events.jsonl, not kept in job.json, and read back after a "
      "restart") {
    TempDir tmp;
    fs::path model = tmp.path / "m";
    fs::create_directories(model);
    spit(model / "config.json", R"({"model_type":"llama","vocab_size":260})");
    Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
             {"--containment", "none", "--fingerprint-worker", "/bin/false"});
    REQUIRE_MESSAGE(d.start(), d.log());
    auto sub = request_json(d, next_token_request("events", model));
    REQUIRE_MESSAGE(sub.status == 201, sub.body);
    std::string id = sub.json()["id"];
    Json job = wait_job(d.socket(), id, terminal, 30);
    REQUIRE(job["state"] == "failed");
    fs::path dir = d.state() / "jobs" / id;
    Json on_disk = Json::parse(slurp(dir / "job.json"));
    CHECK_FALSE(on_disk.contains("events"));
    std::string log = slurp(dir / "events.jsonl");
    auto lines = static_cast<std::size_t>(std::count(log.begin(), log.end(), '\n'));
    CHECK(lines == job["events"].size());
    CHECK(lines == job["events_total"]);
    CHECK_FALSE(job.contains("events_omitted"));
    CHECK(lines >= 2);
    CHECK(d.stop_within(10) == 0);
    REQUIRE_MESSAGE(d.start(), d.log());
    CHECK(request_get(d, "/v1/jobs/" + id).json()["events"] == job["events"]);
  }

  TEST_CASE(
      "an oracle output.json that is not an object, or breaks its schema, fails the job by "
      "worker.oracle_output naming the JSON pointer, before any step reads it") {
    if (!have(kFingerprint)) {
      MESSAGE("skipped: assay-fingerprint was not built");
      return;
    }
    TempDir tmp;
    fs::path model = fixture_model(tmp.path / "llama-tiny");
    auto fails_with = [&](const std::string& name, const std::string& document) {
      // A stand-in oracle that exits 0 having written `document`.
      fs::path liar = tmp.path / ("oracle-" + name);
      spit(liar, "#!/bin/sh\necho '" + document + "' > output.json\n");
      ::chmod(liar.c_str(), 0755);
      Daemon d(tmp.path / ("state-" + name), tmp.path / (name + ".sock"),
               {"--containment", containment(), "--fingerprint-worker", kFingerprint,
                "--oracle-worker", liar.string()});
      REQUIRE_MESSAGE(d.start(), d.log());
      auto sub = request_json(d, next_token_request(name, model));
      REQUIRE_MESSAGE(sub.status == 201, sub.body);
      Json job = wait_job(d.socket(), sub.json()["id"], terminal, 120);
      CHECK(job["state"] == "failed");
      CHECK(job["error"]["code"] == "worker.oracle_output");
      return job["error"]["message"].get<std::string>();
    };
    std::string m = fails_with("array", "[1,2]");
    CHECK_MESSAGE(m.find("is not a JSON object with a string \"schema\"") != std::string::npos, m);
    m = fails_with("typed", R"({"schema":"assay.oracle-output.v1","argmax":"seven"})");
    CHECK_MESSAGE(m.find("oracle worker's output.json is not a valid assay.oracle-output.v1:") !=
                      std::string::npos,
                  m);
    // The first errors, by pointer (the rest counted).
    CHECK_MESSAGE(m.find("/: required: \"architecture\" is missing;") != std::string::npos, m);
    CHECK_MESSAGE(m.find(" more") != std::string::npos, m);
  }
}
