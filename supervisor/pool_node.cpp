// assayd node: one node of a Slurm worker pool (executors/pool.h), run by the pool's batch
// script on a compute node. It dials the head named in the pool's directory, proves it holds
// the pool's key (pool_channel.h), and runs each step the head sends, one at a time: a step the
// head marks resident on a resident worker of its own (executors/resident.h, exactly as on the
// head: the model loaded once and kept while what it loaded is what the head expects), any
// other in a contained process of its own (exactly as `assayd contain --spec`). What a step
// leaves is in its workspace in the shared directory; its evidence goes back over the channel.
// It signs nothing and judges nothing: the head checks and signs. It exits when the head tells
// it to, when the channel ends (the head is gone), or on SIGTERM (scancel), after stopping its
// workers.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <spdlog/spdlog.h>
#include <unistd.h>
#include <CLI/CLI.hpp>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>

#include "common/error.h"
#include "common/fs.h"
#include "common/json.h"
#include "supervisor/commands.h"
#include "supervisor/config.h"
#include "supervisor/contain/contain_cli.h"
#include "supervisor/contain/spawn_spec_json.h"
#include "supervisor/executors/pool_channel.h"
#include "supervisor/executors/resident.h"

namespace assay::supervisor {

using common::Error;
using common::Json;
namespace fs = std::filesystem;
using tcp = boost::asio::ip::tcp;

namespace {

constexpr std::size_t kMaxNodeJson = 64u << 10;
constexpr auto kDialFor = std::chrono::seconds(30);  // the head may be restarting its listener

class PoolNode final : public StepHost {
 public:
  PoolNode(boost::asio::io_context& io, Config config, contain::Runtime& runtime, Json node,
           std::string key)
      : io_(io),
        config_(std::move(config)),
        runtime_(runtime),
        node_(std::move(node)),
        key_(std::move(key)),
        resident_(io, config_, runtime, *this, true),
        retry_(io) {}

  void dial(std::chrono::steady_clock::time_point until) {
    const std::string head = node_.at("head").get<std::string>();
    const tcp::endpoint endpoint = parse_endpoint(head, "node.json's head");
    auto socket = std::make_shared<tcp::socket>(io_);
    socket->async_connect(endpoint, [this, socket, until, head](boost::system::error_code ec) {
      if (!ec) return connected(std::move(*socket));
      if (std::chrono::steady_clock::now() > until) {
        spdlog::error("cannot reach the head at {}: {}", head, ec.message());
        return finish(3);
      }
      retry_.expires_after(std::chrono::milliseconds(500));
      retry_.async_wait([this, until](boost::system::error_code e) {
        if (!e) dial(until);
      });
    });
  }

  void stop(const std::string& why) {
    if (stopping_) return;
    stopping_ = true;
    spdlog::info("node stops: {}", why);
    if (channel_) channel_->close(why);
    resident_.stop();
    for (auto& [id, job] : jobs_)
      if (job.process) job.process->kill();
    wait_for_workers(std::chrono::steady_clock::now() + std::chrono::seconds(20));
  }

  int exit_code() const { return exit_code_; }

  // StepHost: what the resident executor reports goes to the head.
  void phase(const std::string& id, const std::string& role, const std::string& message) override {
    send(Json{{"type", "phase"}, {"job", id}, {"role", role}, {"message", message}});
  }
  void ended(const std::string& id, const std::string& role, contain::Evidence evidence) override {
    Json used = nullptr;
    if (auto it = jobs_.find(id);
        it != jobs_.end() && it->second.bytes_used && *it->second.bytes_used)
      used = **it->second.bytes_used;
    send(Json{{"type", "ended"},
              {"job", id},
              {"role", role},
              {"evidence", evidence.to_json()},
              {"bytes_used", used}});
    done(id);
  }
  void failed(const std::string& id, const std::string& code, const std::string& message) override {
    send(Json{{"type", "failed"}, {"job", id}, {"code", code}, {"message", message}});
    done(id);
  }
  void cancelled(const std::string& id, const std::string& message) override {
    send(Json{{"type", "cancelled"}, {"job", id}, {"message", message}});
    done(id);
  }
  void again(const std::string& id) override {
    failed(id, "pool.node", "the step cannot run again on the node");
  }
  void collected(const std::string& id, const std::string&, const Json&,
                 const contain::Evidence&) override {
    failed(id, "pool.node", "a node collects no records");
  }
  Step* current_step(const std::string& id) override {
    auto it = jobs_.find(id);
    return it == jobs_.end() || it->second.over ? nullptr : it->second.step.get();
  }
  bool cancel_requested(const std::string& id) override {
    auto it = jobs_.find(id);
    return it != jobs_.end() && it->second.cancel;
  }
  void freed() override {}
  fs::path job_dir(const std::string& id) const override {
    auto it = jobs_.find(id);
    return it == jobs_.end() ? fs::path() : it->second.job_dir;
  }
  void hand_to_worker(const std::vector<fs::path>& paths) const override {
    if (!worker_uid_) return;
    for (const auto& p : paths)
      if (::chown(p.c_str(), *worker_uid_, *worker_gid_) != 0)
        common::throw_errno("worker.workspace", "cannot hand " + p.string() + " to the worker user",
                            errno);
  }

 private:
  struct Job {
    std::unique_ptr<Step> step;
    fs::path job_dir;
    std::shared_ptr<contain::Running> process;  // a step of its own (not resident)
    std::shared_ptr<std::optional<Json>> bytes_used;
    bool cancel = false, over = false;
  };

  void connected(tcp::socket socket) {
    const std::string nonce = random_hex(16);
    channel_ = std::make_shared<PoolChannel>(std::move(socket), key_, 'n');
    const char* slurm = std::getenv("SLURM_JOB_ID");
    // The node as Slurm names it (sinfo, scontrol), else its host name.
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    if (const char* name = std::getenv("SLURMD_NODENAME"); name && *name)
      std::snprintf(host, sizeof host, "%s", name);
    channel_->start(
        [this, nonce](Json m) { message(std::move(m), nonce); },
        [this](const std::string& why) { stop("the channel to the head ended: " + why); });
    channel_->send(Json{{"type", "hello"},
                        {"pool", node_.at("pool")},
                        {"node", std::string(host)},
                        {"slurm_job_id", slurm ? std::string(slurm) : std::string()},
                        {"nonce", nonce},
                        {"version", ASSAY_VERSION}});
  }

  void message(Json m, const std::string& nonce) {
    const std::string type = m.value("type", std::string());
    if (!welcomed_) {
      if (type != "welcome" || !m.value("nonce", Json()).is_string())
        return stop("the head's first frame is not a welcome");
      welcomed_ = true;
      channel_->rekey(pool_session_key(key_, nonce, m["nonce"].get<std::string>()));
      spdlog::info("joined pool {} at {}", node_.at("pool").get<std::string>(), channel_->peer());
      return;
    }
    try {
      if (type == "run") return run(m);
      if (type == "cancel") return cancel(m.at("job").get<std::string>());
      if (type == "stop") return stop("the head released this node");
    } catch (const std::exception& e) {
      return stop(std::string("an unusable message from the head: ") + e.what());
    }
    stop("an unknown message from the head: " + type);
  }

  void run(const Json& m) {
    const std::string id = m.at("job").get<std::string>(), role = m.at("role").get<std::string>();
    bool busy = false;
    for (const auto& [other, job] : jobs_) busy = busy || !job.over;
    if (busy || jobs_.count(id)) {
      send(Json{{"type", "failed"},
                {"job", id},
                {"code", "pool.busy"},
                {"message", "this node runs a step already"}});
      return;
    }
    contain::SpawnSpec spec = contain::spawn_spec_from_json(m.at("spec"));
    Job& job = jobs_[id];
    job.job_dir = spec.workdir.parent_path();
    try {
      adopt_remote_spec(spec);
    } catch (const Error& e) {
      return failed(id, e.code(), e.what());
    }
    worker_uid_ = spec.uid;
    worker_gid_ = spec.gid;
    const Json& resident = m.at("resident");
    if (resident.is_null()) {
      try {
        // Cancelled or not, the head judges the end (its engine knows of the cancel).
        job.process = runtime_.start(io_, spec, [this, id, role](contain::Evidence evidence) {
          ended(id, role, std::move(evidence));
        });
      } catch (const Error& e) {
        return failed(id, e.code(), std::string("cannot start the worker: ") + e.what());
      }
      phase(id, role, "running the " + role + " worker");
      return;
    }
    auto step = std::make_unique<Step>();
    step->role = role;
    step->worker = resident.at("worker").get<std::string>();
    step->mode = resident.at("mode").get<std::string>();
    step->model_dir = resident.at("model_dir").get<std::string>();
    // The head checked the bytes_used it names against the job's fingerprint: a worker holding
    // exactly those may run it; one holding what the head rejected is replaced; a fresh
    // worker's bytes go back with the evidence, for the head to check before it accepts.
    job.bytes_used = std::make_shared<std::optional<Json>>();
    step->resident_bytes = [expect = resident.value("expect", Json()),
                            reject = resident.value("reject", Json()),
                            slot = job.bytes_used](const Json& used) {
      if (expect.is_object() && common::canonical(used) != common::canonical(expect))
        throw Error("pool.bytes", "the worker holds other bytes than the head expects");
      if (reject.is_object() && common::canonical(used) == common::canonical(reject))
        throw Error("pool.bytes", "the head found these bytes differ from the job's fingerprint");
      *slot = used;
    };
    if (resident.value("progress", false))
      step->progress = [](const fs::path&) { return std::vector<std::string>(); };
    job.step = std::move(step);
    StepLaunch launch{id, *job.step, Peer{::getuid(), ::getgid(), ::getpid(), false},
                      resident.at("input"), spec};
    try {
      if (!resident_.start(launch))
        return failed(id, "pool.node_full",
                      "no resident worker may start here (resident_models busy)");
    } catch (const Error& e) {
      return failed(id, e.code(), std::string("cannot start the resident worker: ") + e.what());
    }
  }

  void cancel(const std::string& id) {
    auto it = jobs_.find(id);
    if (it == jobs_.end()) return;
    it->second.cancel = true;
    if (it->second.process) return it->second.process->kill();
    resident_.cancel(id);
  }

  void send(const Json& m) {
    if (channel_ && channel_->open()) channel_->send(m);
  }

  // The job's record goes once its callback returned (the resident executor may still read it).
  void done(const std::string& id) {
    if (auto it = jobs_.find(id); it != jobs_.end()) it->second.over = true;
    boost::asio::post(io_, [this, id] { jobs_.erase(id); });
  }

  void wait_for_workers(std::chrono::steady_clock::time_point until) {
    bool running = resident_.alive() > 0;
    for (auto& [id, job] : jobs_)
      if (job.process && !job.over) running = true;
    if (!running || std::chrono::steady_clock::now() > until) return finish(exit_code_);
    retry_.expires_after(std::chrono::milliseconds(50));
    retry_.async_wait([this, until](boost::system::error_code) { wait_for_workers(until); });
  }

  void finish(int code) {
    exit_code_ = code;
    retry_.cancel();
    io_.stop();
  }

  boost::asio::io_context& io_;
  Config config_;
  contain::Runtime& runtime_;
  Json node_;
  std::string key_;
  ResidentExecutor resident_;
  boost::asio::steady_timer retry_;
  std::shared_ptr<PoolChannel> channel_;
  std::map<std::string, Job> jobs_;
  std::optional<uid_t> worker_uid_;
  std::optional<gid_t> worker_gid_;
  bool welcomed_ = false, stopping_ = false;
  int exit_code_ = 0;
};

}  // namespace

int node_main(int argc, char** argv) {
  CLI::App app{
      "assayd node: one node of a Slurm worker pool (started by the pool's batch script, "
      "<shared_dir>/pools/<pool>/node.sh). Dials the head named in DIR/node.json with the key "
      "in DIR/key and runs the steps it is given, contained, until the head releases it or is "
      "gone.",
      "assayd node"};
  std::string dir, mode_name = "auto", base_cgroup, state_dir, log_level = "info";
  app.add_option("--dir", dir, "the pool's directory (node.json, key)")->required();
  app.add_option("--mode", mode_name, "containment backend: auto, v2, v1 or none (development)")
      ->check(CLI::IsMember({"auto", "v2", "v1", "none"}));
  app.add_option("--base-cgroup", base_cgroup,
                 "the cgroup below which worker cgroups are made (default: this process's own)");
  app.add_option("--state-dir", state_dir,
                 "where resident workers keep their workspaces (default: "
                 "$TMPDIR/assay-node-$SLURM_JOB_ID, removed at the end)");
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  spdlog::set_level(spdlog::level::from_str(log_level));
  Config config;
  Json node;
  std::string key;
  std::unique_ptr<contain::Runtime> runtime;
  bool made_state = false;
  try {
    node = common::parse_strict(common::read_file(fs::path(dir) / "node.json", kMaxNodeJson),
                                {.max_bytes = kMaxNodeJson, .exact_integers = false});
    if (node.value("schema", Json()) != "assay.pool-node.v1" ||
        !node.value("pool", Json()).is_string() || !node.value("head", Json()).is_string())
      throw Error("pool.node", dir + "/node.json is not an assay.pool-node.v1 document");
    key = read_pool_key((fs::path(dir) / "key").string());
    if (state_dir.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      const char* slurm = std::getenv("SLURM_JOB_ID");
      state_dir = std::string(tmp && *tmp ? tmp : "/tmp") + "/assay-node-" +
                  (slurm ? std::string(slurm) : std::to_string(::getpid()));
      made_state = true;
    }
    std::error_code ec;
    fs::create_directories(state_dir, ec);
    ::chmod(state_dir.c_str(), 0711);
    config.state_dir = state_dir;
    config.resident.count = node.value("resident_models", 1u);
    if (node.contains("resident_memory_bytes"))
      config.resident.memory_bytes = node["resident_memory_bytes"].get<std::uint64_t>();
    config.resident.idle_seconds = node.value("idle_seconds", 600.0);
    contain::RuntimeOptions options;
    options.mode = mode_name == "v2"     ? contain::Mode::kV2
                   : mode_name == "v1"   ? contain::Mode::kV1
                   : mode_name == "none" ? contain::Mode::kNone
                                         : contain::Mode::kAuto;
    options.base_cgroup = base_cgroup;
    runtime = contain::Runtime::create(options);
    // Worker cgroups of an earlier node whose assayd died with its workers (a lost node that
    // came back): removed, as assayd serve does at its start.
    if (auto orphans = runtime->cleanup_orphans(); !orphans.empty())
      spdlog::info("removed {} worker cgroups an earlier assayd left", orphans.size());
  } catch (const Error& e) {
    std::fprintf(stderr, "assayd node: %s\n", e.what());
    return 1;
  }
  boost::asio::io_context io;
  int code = 0;
  {
    PoolNode pool_node(io, config, *runtime, node, key);
    boost::asio::signal_set signals(io, SIGTERM, SIGINT);
    signals.async_wait([&](boost::system::error_code ec, int signal) {
      if (!ec) pool_node.stop(std::string("signal ") + std::to_string(signal));
    });
    try {
      pool_node.dial(std::chrono::steady_clock::now() + kDialFor);
    } catch (const Error& e) {
      std::fprintf(stderr, "assayd node: %s\n", e.what());
      return 1;
    }
    io.run();
    code = pool_node.exit_code();
  }
  if (made_state) {
    std::error_code ec;
    fs::remove_all(state_dir, ec);
  }
  return code;
}

}  // namespace assay::supervisor
