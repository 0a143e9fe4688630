// The client tests' running assayd: a real `assayd serve` on a temporary socket and state
// directory, and the requests and workers the daemon tests give it (daemon_test.cpp,
// kiln_daemon_test.cpp).
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <thread>
#include "common/identity.h"
#include "common/protocol.h"
#include "common/sign.h"
#include "support.h"

#include <doctest/doctest.h>

namespace assay::client::test {

using assay::common::Json;

class Daemon {
 public:
  explicit Daemon(std::vector<std::string> extra_args = {}) {
    socket_ = (dir_ / "assayd.sock").string();
    args_ = {ASSAY_DAEMON_BIN,          "serve",         "--socket", socket_,       "--state-dir",
             (dir_ / "state").string(), "--containment", "none",     "--log-level", "warn"};
#ifdef ASSAY_FINGERPRINT_BIN
    if (std::find(extra_args.begin(), extra_args.end(), "--fingerprint-worker") == extra_args.end())
      args_.insert(args_.end(), {"--fingerprint-worker", ASSAY_FINGERPRINT_BIN});
#endif
    args_.insert(args_.end(), extra_args.begin(), extra_args.end());
    start();
  }
  ~Daemon() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    int status;
    ::waitpid(pid_, &status, 0);
  }
  // Starts assayd on the same socket and state directory and waits until it answers.
  void start() {
    std::string log = (dir_ / "assayd.log").string();
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      std::vector<char*> argv;
      for (auto& a : args_) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    for (int i = 0; i < 300; ++i) {  // up to 30 s on a loaded machine
      if (run({"health"}, env()).status == 0) return;
      int status;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        FAIL("assayd exited during start-up: " << common::read_file(log, 1 << 16));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    FAIL("assayd did not answer on " << socket_ << ": " << common::read_file(log, 1 << 16));
  }
  void kill9() {
    ::kill(pid_, SIGKILL);
    int status;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }
  assay::client::Environment env() const {
    return {.socket = socket_};
  }
  const TempDir& dir() const {
    return dir_;
  }

 private:
  TempDir dir_;
  std::string socket_;
  std::vector<std::string> args_;
  pid_t pid_ = -1;
};

inline Json request_doc(const std::string& id) {
  return Json{{"schema", std::string(assay::protocol::kNextTokenRequest)},
              {"id", id},
              {"input_token_ids", {1, 2, 3}},
              {"candidates", Json::array({{{"engine", "kiln"}, {"token_id", 5}, {"text", "a"}},
                                          {{"engine", "vllm"}, {"token_id", 9}, {"text", "b"}}})}};
}

// A model directory the request parses against (vocab 100) but no worker can run: the job is
// accepted and then fails inside the pipeline.
inline std::string broken_model(const TempDir& dir) {
  std::filesystem::create_directories(dir / "model");
  dir.write("model/config.json",
            R"({"architectures":["LlamaForCausalLM"],"model_type":"llama","vocab_size":100})");
  return (dir / "model").string();
}

// The oracle worker: $ASSAY_ORACLE_BIN, else the one in this build tree (built with LibTorch).
inline std::string oracle_bin() {
  const char* env = std::getenv("ASSAY_ORACLE_BIN");
  std::string path = env ? env : ASSAY_ORACLE_BIN_DEFAULT;
  return ::access(path.c_str(), X_OK) == 0 ? path : "";
}

// The transformers worker (its wrapper in the build), or "" where it was not built.
inline std::string hf_worker_bin() {
  return ::access(ASSAY_HF_WORKER_DEFAULT, X_OK) == 0 ? ASSAY_HF_WORKER_DEFAULT : "";
}

}  // namespace assay::client::test
