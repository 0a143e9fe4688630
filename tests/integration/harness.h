// Test harness: starts a real assayd on a temporary socket and state directory and talks HTTP/1.1
// to it over the unix socket with plain POSIX calls (no client library between test and daemon).
#pragma once

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>
#include <csignal>

#include <doctest/doctest.h>

#include "common/identity.h"
#include "common/json.h"
#include "common/request.h"

namespace assay::test {

namespace fs = std::filesystem;
using common::Json;

struct HttpReply {
  int status = 0;
  std::string headers;
  std::string body;
  Json json() const { return common::parse_strict(body); }
};

inline int connect_unix(const fs::path& socket) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", socket.c_str());
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

inline void write_all(int fd, const std::string& data) {
  std::size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return;
    off += static_cast<std::size_t>(n);
  }
}

inline std::string read_all(int fd) {
  std::string out;
  char buf[65536];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0) out.append(buf, static_cast<std::size_t>(n));
  return out;
}

// Decodes a chunked body (for the events stream).
inline std::string dechunk(const std::string& body) {
  std::string out;
  std::size_t pos = 0;
  while (pos < body.size()) {
    auto eol = body.find("\r\n", pos);
    if (eol == std::string::npos) break;
    std::size_t len = std::stoul(body.substr(pos, eol - pos), nullptr, 16);
    if (len == 0) break;
    out += body.substr(eol + 2, len);
    pos = eol + 2 + len + 2;
  }
  return out;
}

inline HttpReply parse_reply(const std::string& raw) {
  HttpReply r;
  auto head_end = raw.find("\r\n\r\n");
  if (raw.size() < 12 || head_end == std::string::npos) return r;
  r.status = std::atoi(raw.substr(9, 3).c_str());
  r.headers = raw.substr(0, head_end);
  r.body = raw.substr(head_end + 4);
  if (r.headers.find("chunked") != std::string::npos) r.body = dechunk(r.body);
  return r;
}

// Sends raw bytes (a whole HTTP request) and reads until the daemon closes.
inline HttpReply raw_request(const fs::path& socket, const std::string& bytes) {
  int fd = connect_unix(socket);
  if (fd < 0) return {};
  write_all(fd, bytes);
  std::string raw = read_all(fd);
  ::close(fd);
  return parse_reply(raw);
}

inline HttpReply request(const fs::path& socket, const std::string& method,
                         const std::string& target, const std::string& body = "") {
  std::string req = method + " " + target + " HTTP/1.1\r\nHost: assayd\r\nConnection: close\r\n";
  if (!body.empty() || method == "POST")
    req +=
        "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  req += "\r\n" + body;
  return raw_request(socket, req);
}

// One exchange with a deadline for all of it (connect, send, read to the close): status 0 when
// the daemon did not answer in time. Connects non-blocking, retrying while the backlog is full,
// so a daemon that stopped accepting or a hung I/O thread cannot block the test.
inline HttpReply request_within(const fs::path& socket, const std::string& method,
                                const std::string& target, double seconds,
                                const std::string& body = "") {
  using Clock = std::chrono::steady_clock;
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(seconds));
  auto left_ms = [&] {
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    return static_cast<int>(std::max<long long>(0, ms.count()));
  };
  std::string req = method + " " + target + " HTTP/1.1\r\nHost: assayd\r\nConnection: close\r\n";
  if (!body.empty() || method == "POST")
    req +=
        "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  req += "\r\n" + body;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", socket.c_str());
  int fd = -1;
  while (true) {
    fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) break;
    int err = errno;
    ::close(fd);
    fd = -1;
    if ((err != EAGAIN && err != ECONNREFUSED && err != ENOENT) || left_ms() == 0) return {};
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::size_t off = 0;
  std::string raw;
  bool failed = false;
  while (!failed) {
    pollfd p{fd, static_cast<short>(off < req.size() ? POLLIN | POLLOUT : POLLIN), 0};
    if (::poll(&p, 1, left_ms()) <= 0) {
      failed = true;
      break;
    }
    if (p.revents & POLLIN || (p.revents & (POLLHUP | POLLERR) && !(p.revents & POLLOUT))) {
      char buf[65536];
      ssize_t n = ::read(fd, buf, sizeof buf);
      if (n == 0) break;
      if (n < 0 && errno != EAGAIN) break;
      if (n > 0) raw.append(buf, static_cast<std::size_t>(n));
    } else if (p.revents & POLLOUT) {
      ssize_t n = ::send(fd, req.data() + off, req.size() - off, MSG_NOSIGNAL);
      if (n < 0 && errno != EAGAIN) break;
      if (n > 0) off += static_cast<std::size_t>(n);
    }
  }
  ::close(fd);
  if (failed) return {};
  return parse_reply(raw);
}

inline std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

inline void spit(const fs::path& p, const std::string& s) {
  std::ofstream(p, std::ios::binary) << s;
}

// A fresh temporary directory removed at the end of the test.
struct TempDir {
  fs::path path;
  // Below `base` (/tmp, or e.g. /dev/shm for a tmpfs).
  explicit TempDir(const fs::path& base = "/tmp") {
    std::string tmpl = (base / "assay-it-XXXXXX").string();
    path = ::mkdtemp(tmpl.data());
    // Open like /usr/libexec: the workers run as an unprivileged user and must reach the
    // stand-in worker scripts the tests put here.
    ::chmod(path.c_str(), 0755);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

class Daemon {
 public:
  Daemon(fs::path state, fs::path socket, std::vector<std::string> extra)
      : state_(std::move(state)), socket_(std::move(socket)), extra_(std::move(extra)) {}
  ~Daemon() { stop(); }

  // Starts assayd and waits until /v1/health answers; false on failure.
  bool start() {
    log_ = state_.parent_path() / ("assayd-" + std::to_string(++starts_) + ".log");
    std::vector<std::string> args{ASSAYD_PATH,      "serve",       "--socket",
                                  socket_.string(), "--state-dir", state_.string()};
    args.insert(args.end(), extra_.begin(), extra_.end());
    pid_ = ::fork();
    if (pid_ == 0) {
      int fd = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    for (int i = 0; i < 300; ++i) {
      if (request(socket_, "GET", "/v1/health").status == 200) return true;
      int st;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  void kill9() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  int stop() {
    if (pid_ <= 0) return -1;
    ::kill(pid_, SIGTERM);
    int st = 0;
    ::waitpid(pid_, &st, 0);
    pid_ = -1;
    return st;
  }

  // Starts assayd and waits at most `seconds` for /v1/health, each probe bounded, so a daemon
  // that hangs cannot hang the test; false when it exited or did not answer in time.
  bool start_within(double seconds) {
    log_ = state_.parent_path() / ("assayd-" + std::to_string(++starts_) + ".log");
    std::vector<std::string> args{ASSAYD_PATH,      "serve",       "--socket",
                                  socket_.string(), "--state-dir", state_.string()};
    args.insert(args.end(), extra_.begin(), extra_.end());
    pid_ = ::fork();
    if (pid_ == 0) {
      int fd = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < deadline) {
      if (request_within(socket_, "GET", "/v1/health", 1.0).status == 200) return true;
      if (!alive()) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  // The daemon's pid (-1 when none runs or it has been reaped).
  pid_t pid() const { return pid_; }

  // False once the process has exited (it is reaped then; exit_status() says how).
  bool alive() {
    if (pid_ <= 0) return false;
    int st = 0;
    if (::waitpid(pid_, &st, WNOHANG) == pid_) {
      exit_status_ = st;
      pid_ = -1;
      return false;
    }
    return true;
  }
  int exit_status() const { return exit_status_; }

  // SIGTERM, then SIGKILL when it has not exited after `seconds`: a hung daemon cannot hang the
  // test's cleanup. Returns the wait status (-1 when none ran).
  int stop_within(double seconds) {
    if (pid_ <= 0) return -1;
    ::kill(pid_, SIGTERM);
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    int st = 0;
    while (::waitpid(pid_, &st, WNOHANG) != pid_) {
      if (std::chrono::steady_clock::now() >= deadline) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &st, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    pid_ = -1;
    exit_status_ = st;
    return st;
  }

  std::string log() const { return slurp(log_); }
  const fs::path& socket() const { return socket_; }
  const fs::path& state() const { return state_; }

 private:
  fs::path state_, socket_;
  std::vector<std::string> extra_;
  fs::path log_;
  pid_t pid_ = -1;
  int starts_ = 0;
  int exit_status_ = -1;
};

// Polls GET /v1/jobs/{id} until `pred(job)` or the deadline; returns the last job document.
template <typename Pred>
Json wait_job(const fs::path& socket, const std::string& id, Pred pred, double seconds = 120) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  Json job;
  while (std::chrono::steady_clock::now() < deadline) {
    auto r = request(socket, "GET", "/v1/jobs/" + id);
    if (r.status == 200) {
      job = r.json();
      if (pred(job)) return job;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return job;
}

// One exchange with the daemon as uid:gid (no supplementary groups), from a forked child: how
// another user reaches assayd. A socket pair, not a pipe: write_all sends with MSG_NOSIGNAL,
// which a pipe refuses (ENOTSOCK).
inline HttpReply request_as(uid_t uid, gid_t gid, const fs::path& socket, const std::string& method,
                            const std::string& target, const std::string& body = "") {
  int fds[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    if (::setgroups(0, nullptr) != 0 || ::setgid(gid) != 0 || ::setuid(uid) != 0) ::_exit(3);
    HttpReply r = request_within(socket, method, target, 10, body);
    write_all(fds[1], std::to_string(r.status) + "\n" + r.body);
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string out = read_all(fds[0]);
  ::close(fds[0]);
  int st = 0;
  ::waitpid(pid, &st, 0);
  HttpReply r;
  auto nl = out.find('\n');
  if (nl == std::string::npos) return r;
  r.status = std::atoi(out.substr(0, nl).c_str());
  r.body = out.substr(nl + 1);
  return r;
}

inline HttpReply request_json(const Daemon& d, const Json& body) {
  return request(d.socket(), "POST", "/v1/jobs", body.dump());
}
inline HttpReply request_get(const Daemon& d, const std::string& target) {
  return request(d.socket(), "GET", target);
}

inline bool terminal(const Json& job) {
  auto s = job.value("state", "");
  return s == "succeeded" || s == "failed" || s == "cancelled";
}

// ---------------------------------------------------------------------------------------------
// Shared by the test files: binaries, containment, fixtures.

// A syntactically valid model identity (no such model exists).
// A next-token request for `model_dir`: five prompt tokens, engines kiln (65) and vllm (66).
inline Json next_token_request(const std::string& id, const fs::path& model_dir) {
  return Json{{"schema", "assay.next-token-request.v1"},
              {"id", id},
              {"model_dir", model_dir.string()},
              {"input_token_ids", {72, 101, 108, 108, 111}},
              {"candidates",
               {{{"engine", "kiln"}, {"token_id", 65}, {"text", "A"}},
                {{"engine", "vllm"}, {"token_id", 66}, {"text", "B"}}}}};
}

inline Json fake_identity() {
  Json mi{{"id", "fixture"},
          {"config_hash", "sha256:" + std::string(64, 'a')},
          {"tokenizer_hash", "sha256:" + std::string(64, 'b')},
          {"chat_template_hash", nullptr},
          {"weight_files",
           {{{"path", "model.safetensors"},
             {"bytes", 10},
             {"sha256", "sha256:" + std::string(64, 'c')}}}}};
  mi["content_sha256"] = common::model_content_sha256(mi);
  return mi;
}

// A Kiln request as Kiln writes it (prompt "Hel" plus a two-token continuation prefix, ids
// 72 101 108 108 111) for the model whose identity is `identity`.
inline Json kiln_request(const Json& identity) {
  const std::string message = "Hel";
  Json receipt{{"path", "receipts/run.kiln.json"},
               {"file_sha256", "sha256:" + std::string(64, 'd')},
               {"content_sha256", "sha256:" + std::string(64, 'e')}};
  Json r{{"schema", "kiln.hf-next-token-request.v1"},
         {"id", "kiln-1"},
         {"source",
          {{"source_commit", std::string(40, 'f')},
           {"kiln_receipt", receipt},
           {"vllm_receipt", receipt}}},
         {"model_identity", identity},
         {"prompt",
          {{"generator",
            {{"run_id", "run-1"},
             {"phase", "measure-c001-r000"},
             {"request_index", 0},
             {"profile", "short"},
             {"template_version", "fixed-serving-profiles-v1"}}},
           {"messages", {{{"role", "user"}, {"content", message}}}},
           {"add_generation_prompt", true},
           {"template_kwargs", {{"enable_thinking", false}}},
           {"utf8_sha256", common::sha256_id(message)},
           {"token_count", 3},
           {"token_ids", {72, 101, 108}}}},
         {"continuation_prefix",
          {{{"token_id", 108}, {"text", "l"}}, {{"token_id", 111}, {"text", "o"}}}},
         {"input_token_ids", {72, 101, 108, 108, 111}},
         {"candidates",
          {{{"engine", "kiln"}, {"token_id", 65}, {"text", "A"}},
           {{"engine", "vllm"}, {"token_id", 66}, {"text", "B"}}}}};
  r["input_token_ids_sha256"] =
      common::token_ids_sha256(std::vector<std::int64_t>{72, 101, 108, 108, 111});
  return r;
}

// The worker and client executables: the build's own, or ASSAY_TEST_<NAME> from the environment
// (to run these tests against binaries built elsewhere).
inline std::string binary(const char* env, const char* built) {
  const char* e = std::getenv(env);
  return e && *e ? e : built;
}
inline const std::string kFingerprint = binary("ASSAY_TEST_FINGERPRINT", ASSAY_FINGERPRINT_PATH);
inline const std::string kOracle = binary("ASSAY_TEST_ORACLE", ASSAY_ORACLE_PATH);
inline const std::string kClient = binary("ASSAY_TEST_CLIENT", ASSAY_CLIENT_PATH);
inline const std::string kCompare = binary("ASSAY_TEST_COMPARE", ASSAY_COMPARE_PATH);
inline const std::string kHfWorker = binary("ASSAY_TEST_HF_WORKER", ASSAY_HF_WORKER_PATH);

// The containment mode for jobs with real workers: ASSAY_IT_CONTAINMENT (default "auto") when
// `assayd contain` can use it on this host, else "none" with a printed reason.
inline std::string containment() {
  static std::string mode = [] {
    std::string wanted = ASSAY_IT_CONTAINMENT;
    if (wanted == "none") return wanted;
    std::string cmd =
        std::string(ASSAYD_PATH) + " contain --mode " + wanted + " -- /bin/true > /dev/null 2>&1";
    if (std::system(cmd.c_str()) == 0) return wanted;
    MESSAGE("containment \"" << wanted
                             << "\" is unavailable on this host: real jobs run with none");
    return std::string("none");
  }();
  return mode;
}

inline bool have(const std::string& path) {
  return !path.empty() && ::access(path.c_str(), X_OK) == 0;
}

// A tiny llama fixture made by the oracle's fixture generator (cached per test process).
inline fs::path fixture_model(const fs::path& dir) {
  if (fs::exists(dir / "config.json")) return dir;
  std::string cmd = std::string(ASSAY_PYTHON3) + " " + ASSAY_SOURCE_DIR +
                    "/tests/fixtures/make_fixture.py --arch llama --size tiny --out " +
                    dir.string() + " > " + dir.string() + ".log 2>&1";
  REQUIRE_MESSAGE(std::system(cmd.c_str()) == 0,
                  "make_fixture.py failed: " << slurp(dir.string() + ".log"));
  return dir;
}

// A worker wrapper that sleeps before running the real worker, so a test can act while the
// worker "runs". It stays a real run of the real worker.
inline fs::path slow_wrapper(const fs::path& dir, const std::string& real, double seconds) {
  fs::path p = dir / ("slow-" + fs::path(real).filename().string());
  spit(p, "#!/bin/sh\nsleep " + std::to_string(seconds) + "\nexec " + real + " \"$@\"\n");
  ::chmod(p.c_str(), 0755);
  return p;
}

inline std::string run_capture(const std::string& cmd) {
  std::string out;
  FILE* f = ::popen((cmd + " 2>&1").c_str(), "r");
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  int st = ::pclose(f);
  return std::to_string(WEXITSTATUS(st)) + ":" + out;
}

// Validates each document against schemas/<name>.schema.json
// (tests/integration/validate_schemas.py): "0:" and its output when all are valid, else its exit
// status and the first failure.
inline std::string validate_schemas(const std::vector<std::pair<std::string, fs::path>>& docs) {
  std::string cmd = std::string(ASSAY_PYTHON3) + " " + ASSAY_SOURCE_DIR +
                    "/tests/integration/validate_schemas.py " + ASSAY_SOURCE_DIR + "/schemas";
  for (const auto& [name, path] : docs) cmd += " " + name + "=" + path.string();
  return run_capture(cmd);
}

}  // namespace assay::test
