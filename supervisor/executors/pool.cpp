// The pool executor (pool.h): the pool's jobs and nodes, single steps; its batches are
// pool_batch.cpp's.
#include "supervisor/executors/pool.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <sstream>

#include <spdlog/spdlog.h>
#include <boost/asio/post.hpp>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"
#include "common/json.h"
#include "common/protocol.h"
#include "common/text.h"
#include "common/time.h"
#include "supervisor/contain/spawn_spec_json.h"
#include "supervisor/executors/command.h"
#include "supervisor/executors/local.h"
#include "supervisor/executors/slurm_steps.h"
#include "supervisor/pipelines/documents.h"

namespace assay::supervisor {

using common::Error;
using common::Json;
namespace fs = std::filesystem;
using tcp = boost::asio::ip::tcp;

namespace {

// What a step must share with a node's resident worker to run on it (as resident.cpp's key).
std::string resident_key(const Step& step, const Json& input) {
  return step.model_dir + "\n" + step.worker.string() + "\n" +
         common::canonical(input.value("execution", Json()));
}

// Each line's first word to its second (squeue's "%i %T", sinfo's "%N %T").
std::map<std::string, std::string> first_two_words(const std::string& text) {
  std::map<std::string, std::string> out;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream words(line);
    std::string first, second;
    words >> first >> second;
    if (!first.empty()) out[first] = second;
  }
  return out;
}

// "assay-pool-<id>": the pool jobs' Slurm name.
std::string job_name(const std::string& pool) {
  return "assay-pool-" + pool;
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

}  // namespace

PoolExecutor::PoolExecutor(boost::asio::io_context& io, const Config& config, StepHost& host,
                           Metrics& metrics)
    : io_(io),
      config_(config),
      host_(host),
      metrics_(metrics),
      acceptor_(io),
      poll_(io),
      watch_(io) {
  const auto& pool = config_.slurm.pool;
  pool_ =
      std::to_string(static_cast<std::uint64_t>(common::now_unix() * 1000)) + "-" + random_hex(4);
  key_ = random_bytes(kPoolKeyBytes);
  tcp::endpoint endpoint = parse_endpoint(pool.listen, "slurm.pool.listen");
  boost::system::error_code ec;
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor_.bind(endpoint, ec);
  if (!ec) acceptor_.listen(64, ec);
  if (ec)
    throw Error("pool.listen",
                "cannot listen on slurm.pool.listen " + pool.listen + ": " + ec.message());
  auto bound = acceptor_.local_endpoint();
  head_ = (bound.address().is_v6() ? "[" + bound.address().to_string() + "]"
                                   : bound.address().to_string()) +
          ":" + std::to_string(bound.port());
  dir_ = config_.slurm.shared_dir / "pools" / pool_;
  std::error_code fs_ec;
  fs::create_directories(dir_.parent_path(), fs_ec);
  ::chmod(dir_.parent_path().c_str(), 0755);
  if (::mkdir(dir_.c_str(), 0700) != 0)
    common::throw_errno("pool.dir", "mkdir " + dir_.string(), errno);
  common::replace_file_fast(
      dir_ / "key",
      common::hex({reinterpret_cast<const std::uint8_t*>(key_.data()), key_.size()}) + "\n", 0600);
  Json node{{"schema", "assay.pool-node.v1"},
            {"pool", pool_},
            {"head", head_},
            {"resident_models", pool.resident_models},
            {"resident_memory_bytes", pool.memory_bytes},
            {"idle_seconds", config_.resident.idle_seconds}};
  common::replace_file_fast(dir_ / "node.json", common::canonical(node), 0600);
  std::string script = "#!/bin/sh\n# An assay pool node (pool " + pool_ + "): dials " + head_ +
                       " and runs the steps it is given until told to stop or the head is gone.\n" +
                       "exec " + shell_quote(config_.slurm.node_assayd.string()) + " node --dir " +
                       shell_quote(dir_.string());
  for (const auto& a : config_.slurm.contain_args) script += " " + shell_quote(a);
  common::replace_file_fast(dir_ / "node.sh", script + "\n", 0700);
  count_nodes();
  spdlog::info("pool {}: listening for its nodes on {} (up to {} nodes, directory {})", pool_,
               head_, pool.nodes, dir_.string());
  accept();
}

PoolExecutor::~PoolExecutor() {
  stop();
}

fs::path PoolExecutor::workspace(const std::string& id, const std::string& role) const {
  return config_.slurm.shared_dir / "jobs" / id / role;
}

void PoolExecutor::accept() {
  acceptor_.async_accept([this](boost::system::error_code ec, tcp::socket socket) {
    if (ec == boost::asio::error::operation_aborted || stopping_) return;
    if (!ec) {
      auto channel = std::make_shared<PoolChannel>(std::move(socket), key_, 'h');
      std::weak_ptr<PoolChannel> weak = channel;
      channel->start(
          [this, weak](Json m) {
            if (auto c = weak.lock()) hello(c, std::move(m));
          },
          [peer = channel->peer()](const std::string& why) {
            spdlog::info("pool: a connection from {} ended before its hello: {}", peer, why);
          });
    } else {
      spdlog::warn("pool: accept: {}", ec.message());
    }
    accept();
  });
}

void PoolExecutor::hello(const std::shared_ptr<PoolChannel>& channel, Json m) {
  const std::string slurm_id = m.value("slurm_job_id", std::string());
  // The key says the node is one of this pool's jobs; its Slurm job id must be one sbatch gave
  // (or may be about to give: a job can start before sbatch's answer is read).
  if (m.value("type", std::string()) != "hello" || m.value("pool", std::string()) != pool_ ||
      (!launching_.count(slurm_id) && submitting_ == 0) || !m.value("nonce", Json()).is_string() ||
      slurm_id.empty() || slurm_id.find_first_not_of("0123456789_") != std::string::npos) {
    spdlog::warn("pool: refused a node from {}: not a hello of one of this pool's jobs ({})",
                 channel->peer(), common::printable(m.dump(), 200));
    return channel->close("refused");
  }
  launching_.erase(slurm_id);
  const std::string nonce = random_hex(16);
  channel->send(Json{{"type", "welcome"}, {"nonce", nonce}});
  channel->rekey(pool_session_key(key_, m["nonce"].get<std::string>(), nonce));
  const int number = next_++;
  auto node = std::make_unique<Node>(io_);
  node->number = number;
  node->channel = channel;
  node->slurm_job_id = slurm_id;
  node->name = common::printable(m.value("node", std::string("?")), 64);
  if (nodes_.empty()) watch_nodes();
  spdlog::info("pool {}: node {} (Slurm job {}, {}) joined", pool_, node->name, slurm_id,
               channel->peer());
  channel->handle([this, number](Json message) { this->message(number, std::move(message)); },
                  [this, number](const std::string& why) { node_closed(number, why); });
  nodes_[number] = std::move(node);
  free_node(*nodes_[number]);
}

bool PoolExecutor::start(StepLaunch& launch) {
  Step& step = launch.step;
  if (config_.slurm.pool.nodes == 0 || stopping_ || !step.open_files.empty()) return false;
  const std::string id = launch.job_id;
  if (auto known = steps_.find(id); known != steps_.end() && known->second.batch)
    return continue_batch(id, launch);
  const fs::path ws = launch.spec.workdir;
  link_shared_workspace(host_, id, step.role, ws);
  prepare_workspace(step, launch.input, ws, host_);
  launch.spec.node_env = {"CUDA_VISIBLE_DEVICES"};
  Pending pending;
  pending.role = step.role;
  Json resident = nullptr;
  if (step.resident_bytes) {
    pending.key = resident_key(step, launch.input);
    Json input = launch.input;
    input.erase("model_fds");
    resident = Json{{"input", std::move(input)},
                    {"worker", step.worker.string()},
                    {"mode", step.mode},
                    {"model_dir", step.model_dir},
                    {"progress", static_cast<bool>(step.progress)}};
  }
  pending.run = Json{{"type", "run"},
                     {"job", id},
                     {"role", step.role},
                     {"spec", contain::spawn_spec_to_json(launch.spec)},
                     {"resident", std::move(resident)}};
  // A batch whose states may run on resident workers is sharded across the nodes.
  if (step.harvest && step.resident_bytes &&
      launch.input.value("schema", Json()) == protocol::kOracleBatchInput) {
    pending.batch = std::make_unique<Batch>();
    for (const Json& state : launch.input.at("states")) {
      const std::size_t index = state.at("index").get<std::size_t>();
      pending.batch->states[index] = state;
      pending.batch->queue.push_back(index);
    }
    pending.run["resident"]["input"]["states"] = Json::array();
  }
  auto previous = steps_.find(id);
  if (previous != steps_.end()) pending.lost = previous->second.lost;  // run again after a loss
  steps_[id] = std::move(pending);
  queue_.push_back(id);
  host_.phase(id, step.role, "waiting for a node of pool " + pool_);
  dispatch();
  return true;
}

void PoolExecutor::dispatch() {
  for (auto it = queue_.begin(); it != queue_.end();) {
    auto s = steps_.find(*it);
    if (s == steps_.end()) {
      it = queue_.erase(it);
      continue;
    }
    Node* chosen = nullptr;
    for (auto& [n, node] : nodes_) {
      if (!node->job.empty() || !node->channel->open() || !node->draining.empty()) continue;
      if (!s->second.key.empty() && node->holds.count(s->second.key)) {
        chosen = node.get();
        break;
      }
      if (!chosen) chosen = node.get();
    }
    if (!chosen) break;
    const std::string id = *it;
    if (Batch* batch = s->second.batch.get()) {
      send_shard(*chosen, id, s->second);
      if (batch->queue.empty()) it = queue_.erase(it);
      continue;  // the next free node pulls the next shard
    }
    it = queue_.erase(it);
    send_step(*chosen, id, s->second);
  }
  grow();
  count_nodes();
}

void PoolExecutor::count_nodes() {
  std::uint64_t busy = 0, draining = 0;
  for (const auto& [n, node] : nodes_)
    if (!node->job.empty())
      ++busy;
    else if (!node->draining.empty())
      ++draining;
  metrics_.pool_nodes["free"] = nodes_.size() - busy - draining;
  metrics_.pool_nodes["busy"] = busy;
  metrics_.pool_nodes["draining"] = draining;
  metrics_.pool_nodes["launching"] = launching_.size() + static_cast<std::uint64_t>(submitting_);
}

Json PoolExecutor::resident_for(const Node& node, const std::string& id, Step& step,
                                const std::string& key, Json resident) const {
  // A resident worker of this node that holds the step's model: this host checks its bytes
  // against the job's fingerprint (the node only compares what it is told to expect).
  if (key.empty()) return resident;
  if (auto held = node.holds.find(key); held != node.holds.end()) {
    try {
      step.resident_bytes(held->second);
      resident["expect"] = held->second;
    } catch (const Error& e) {
      spdlog::info("pool node {}'s worker does not hold job {}'s bytes: {}", node.name, id,
                   e.what());
      resident["reject"] = held->second;
    }
  }
  return resident;
}

contain::Evidence PoolExecutor::ended_evidence(Node& node, Step& step, const std::string& key,
                                               const Json& m) {
  contain::Evidence evidence;
  try {
    evidence = contain::Evidence::from_json(m.at("evidence"));
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error("pool.protocol",
                "pool node " + node.name + " sent unreadable evidence: " + e.what());
  }
  if (!key.empty()) {
    // What the node's resident worker computed with, checked here against this job's
    // fingerprint before anything of it is accepted: the node is trusted to run, not to judge.
    const Json& used = m.value("bytes_used", Json());
    if (!used.is_object())
      throw Error("pool.protocol",
                  "pool node " + node.name + " ran a resident step without its bytes_used");
    node.holds[key] = used;
    step.resident_bytes(used);
  }
  evidence.executor = Json{{"kind", "slurm-pool"},
                           {"pool", pool_},
                           {"node", node.name},
                           {"slurm_job_id", node.slurm_job_id},
                           {"evidence_sha256", common::sha256_canonical_id(m.at("evidence"))}};
  return evidence;
}

void PoolExecutor::send_step(Node& node, const std::string& id, Pending& pending) {
  Json run = pending.run;
  Step* step = host_.current_step(id);
  if (!step || step->role != pending.role) {
    steps_.erase(id);
    return;
  }
  run["resident"] = resident_for(node, id, *step, pending.key, run["resident"]);
  node.idle.cancel();
  node.job = id;
  pending.node = node.number;
  node.channel->send(run);
  // A batch's states as they end (the node copies them into the shared workspace), and its
  // stall, read here as for a Slurm step.
  if (step->progress) {
    pending.progress = std::make_unique<ProgressPoll>(
        io_, host_, id, pending.role, host_.job_dir(id) / pending.role, [this, id] { cancel(id); });
    pending.progress->start();
  }
  host_.phase(id, pending.role,
              "sent the " + pending.role + " step to pool node " + node.name + " (Slurm job " +
                  node.slurm_job_id + ")");
}

void PoolExecutor::message(int number, Json m) {
  auto it = nodes_.find(number);
  if (it == nodes_.end()) return;
  Node& node = *it->second;
  const std::string type = m.value("type", std::string());
  const std::string id = m.value("job", std::string());
  if (type == "stopping") return;  // a node going away on its own (its channel's end follows)
  if (!id.empty() && id == node.job && shards_.count(id)) return shard_message(node, id, m);
  if (id.empty() || id != node.job) {
    spdlog::warn("pool node {}: a {} message for job \"{}\", which it does not run", node.name,
                 common::printable(type, 40), common::printable(id, 80));
    return node.channel->close("a message about a job it does not run");
  }
  auto s = steps_.find(id);
  const std::string role = s == steps_.end() ? std::string() : s->second.role;
  if (type == "phase") {
    host_.phase(id, role,
                "node " + node.name + ": " + common::printable(m.value("message", ""), 400));
    return;
  }
  const std::string key = s == steps_.end() ? std::string() : s->second.key;
  steps_.erase(id);
  node.job.clear();
  node.steps += 1;
  Step* step = host_.current_step(id);
  if (type == "ended" && step && step->role == role) {
    contain::Evidence evidence;
    try {
      evidence = ended_evidence(node, *step, key, m);
    } catch (const Error& e) {
      free_node(node);
      return host_.failed(id, e.code(), e.what());
    }
    free_node(node);
    return host_.ended(id, role, std::move(evidence));
  }
  free_node(node);
  if (!step) return;
  if (type == "cancelled")
    return host_.cancelled(id, "cancelled on pool node " + node.name + ": " +
                                   common::printable(m.value("message", ""), 400));
  if (type == "failed")
    return host_.failed(
        id, common::printable(m.value("code", "pool.failed"), 80),
        "on pool node " + node.name + ": " + common::printable(m.value("message", ""), 2000));
  host_.failed(id, "pool.protocol",
               "pool node " + node.name + " answered with \"" + common::printable(type, 40) + "\"");
}

void PoolExecutor::free_node(Node& node) {
  if (stopping_) return;
  const int number = node.number;
  if (!node.draining.empty()) {
    // Its Slurm node is draining: the step it ran is done; no other goes there.
    boost::asio::post(io_, [this, number, why = node.draining] {
      auto it = nodes_.find(number);
      if (it != nodes_.end() && it->second->job.empty()) release(*it->second, why);
      dispatch();
    });
    return;
  }
  node.idle.expires_after(
      std::chrono::milliseconds(static_cast<long long>(config_.slurm.pool.idle_seconds * 1000)));
  node.idle.async_wait([this, number](boost::system::error_code ec) {
    auto it = nodes_.find(number);
    if (ec || it == nodes_.end() || !it->second->job.empty()) return;
    release(*it->second, "idle for " + fmt::format("{:g}", config_.slurm.pool.idle_seconds) + " s");
  });
  boost::asio::post(io_, [this] {
    dispatch();
    host_.freed();
  });
}

void PoolExecutor::release(Node& node, const std::string& why) {
  spdlog::info("pool {}: releasing node {} (Slurm job {}): {}", pool_, node.name, node.slurm_job_id,
               why);
  node.channel->send(Json{{"type", "stop"}});
  const std::string slurm_id = node.slurm_job_id;
  // The node exits when told; scancel makes sure its allocation ends.
  boost::asio::post(io_, [this, slurm_id] { scancel(slurm_id); });
  auto channel = node.channel;
  channel->close("released: " + why);
}

void PoolExecutor::node_closed(int number, const std::string& why) {
  auto it = nodes_.find(number);
  if (it == nodes_.end()) return;
  std::unique_ptr<Node> node = std::move(it->second);
  nodes_.erase(it);
  node->idle.cancel();
  if (stopping_) return;
  spdlog::info("pool {}: node {} (Slurm job {}) left: {}", pool_, node->name, node->slurm_job_id,
               why);
  if (!why.starts_with("released")) ++metrics_.pool_nodes_lost;
  if (!why.starts_with("released")) scancel(node->slurm_job_id);
  if (node->job.empty()) return dispatch();
  if (shards_.count(node->job)) {
    shard_lost(node->job, node->name, why);
    return dispatch();
  }
  const std::string id = node->job;
  auto s = steps_.find(id);
  if (s == steps_.end()) return dispatch();
  Pending& pending = s->second;
  const std::string role = pending.role;
  pending.lost += 1;
  pending.node = -1;
  pending.progress.reset();
  if (!host_.current_step(id)) {
    steps_.erase(s);
    return dispatch();
  }
  if (host_.cancel_requested(id)) {
    steps_.erase(s);
    host_.cancelled(id, "cancelled; pool node " + node->name + " was lost meanwhile (" + why + ")");
    return dispatch();
  }
  if (pending.lost >= kMostLost) {
    steps_.erase(s);
    host_.failed(id, "pool.node_lost",
                 "the " + role + " step lost " + std::to_string(kMostLost) +
                     " pool nodes under it, the last " + node->name + " (Slurm job " +
                     node->slurm_job_id + "): " + why);
    return dispatch();
  }
  host_.phase(id, role,
              "pool node " + node->name + " (Slurm job " + node->slurm_job_id + ") was lost (" +
                  why + "): the " + role + " step runs again from its start on another node");
  // Through the engine, as a step Slurm forgot: its input is built again and it is queued here.
  boost::asio::post(io_, [this, id] { host_.again(id); });
}

// Every few seconds while nodes are in the pool: Slurm's view of their nodes. A node an
// administrator drains (or Slurm marks down or failing) takes no new step; the one it runs
// ends there, and then it is released. A node whose Slurm node is gone from sinfo's answer is
// left to its channel (a lost node's ends within kPoolSilence).
void PoolExecutor::watch_nodes() {
  watch_.expires_after(kWatchNodes);
  watch_.async_wait([this](boost::system::error_code ec) {
    if (ec || stopping_ || nodes_.empty()) return;
    std::string names;  // the pool's nodes only, not the whole cluster's
    for (const auto& [n, node] : nodes_) names += (names.empty() ? "" : ",") + node->name;
    executors::run_command(
        io_, {"sinfo", "-h", "-N", "-n", names, "-o", "%N %T"},
        [this](executors::CommandResult r) {
          if (stopping_) return;
          if (r.status == 0) {
            const std::map<std::string, std::string> states = first_two_words(r.out);
            for (auto& [n, node] : nodes_) {
              auto it = states.find(node->name);
              if (it == states.end() || !node->draining.empty()) continue;
              const std::string& state = it->second;
              if (state.find("drain") == std::string::npos && !state.starts_with("down") &&
                  !state.starts_with("fail"))
                continue;
              node->draining = "its Slurm node is " + state;
              spdlog::info("pool {}: node {} takes no more steps: {}", pool_, node->name,
                           node->draining);
              if (node->job.empty()) free_node(*node);
            }
            grow();
            count_nodes();
          }
          watch_nodes();
        },
        std::chrono::seconds(30));
  });
}

void PoolExecutor::grow() {
  if (stopping_) return;
  std::size_t free = 0, serving = 0;  // draining nodes neither serve nor count
  for (auto& [n, node] : nodes_) {
    if (!node->draining.empty()) continue;
    ++serving;
    if (node->job.empty()) ++free;
  }
  const std::size_t coming = launching_.size() + static_cast<std::size_t>(submitting_);
  // A batch wants as many nodes as it has states waiting.
  std::size_t waiting = 0;
  for (const std::string& id : queue_)
    if (auto s = steps_.find(id); s != steps_.end())
      waiting += s->second.batch ? s->second.batch->queue.size() : 1;
  std::size_t want = waiting > free + coming ? waiting - free - coming : 0;
  const std::size_t room =
      config_.slurm.pool.nodes > serving + coming ? config_.slurm.pool.nodes - serving - coming : 0;
  for (std::size_t i = 0; i < std::min(want, room); ++i) submit_pool_job();
}

void PoolExecutor::submit_pool_job() {
  const auto& slurm = config_.slurm;
  std::vector<std::string> argv = {
      "sbatch", "--parsable", "--export=NONE", "--nodes=1", "--ntasks=1",
      // One pool job per node: a node's resident workers are the pool's there.
      "--exclusive", "--job-name=" + job_name(pool_),
      "--mem=" + std::to_string((slurm.pool.memory_bytes + (1ULL << 20) - 1) >> 20) + "M",
      "--output=" + (dir_ / "node-%j.out").string(), "--error=" + (dir_ / "node-%j.err").string(),
      "--chdir=" + dir_.string()};
  if (slurm.pool.time_minutes) argv.push_back("--time=" + std::to_string(slurm.pool.time_minutes));
  const std::string& partition =
      slurm.pool.partition.empty() ? slurm.partition : slurm.pool.partition;
  if (!partition.empty()) argv.push_back("--partition=" + partition);
  if (slurm.pool.gpus) argv.push_back("--gres=gpu:" + std::to_string(slurm.pool.gpus));
  if (!slurm.account.empty()) argv.push_back("--account=" + slurm.account);
  if (!slurm.qos.empty()) argv.push_back("--qos=" + slurm.qos);
  argv.insert(argv.end(), slurm.sbatch_args.begin(), slurm.sbatch_args.end());
  argv.insert(argv.end(), slurm.pool.sbatch_args.begin(), slurm.pool.sbatch_args.end());
  argv.push_back((dir_ / "node.sh").string());
  ++submitting_;
  executors::run_command(io_, argv, [this](executors::CommandResult r) {
    --submitting_;
    if (stopping_) return;
    std::string id = r.out.substr(0, r.out.find_first_of(";\n"));
    if (r.status != 0 || id.empty() || id.find_first_not_of("0123456789_") != std::string::npos) {
      spdlog::error("pool {}: sbatch refused a pool job: {}", pool_, r.describe());
      if (nodes_.empty() && launching_.empty() && submitting_ == 0)
        fail_waiting("pool.submit_failed", "sbatch refused the pool's job: " + r.describe());
      return;
    }
    ++metrics_.slurm_submitted;
    for (auto& [n, node] : nodes_)
      if (node->slurm_job_id == id) return;  // it dialled in before sbatch's answer was read
    launching_[id] = std::chrono::steady_clock::now();
    count_nodes();
    spdlog::info("pool {}: Slurm job {} submitted for a node", pool_, id);
    for (const std::string& job : queue_)
      if (auto s = steps_.find(job); s != steps_.end())
        host_.phase(job, s->second.role, "pool job " + id + " submitted for a node");
    poll_launching();
  });
}

// Every poll_ms while pool jobs are submitted and have not dialled in: one squeue for all of
// them. A job that ended (or that Slurm no longer knows) without dialling in, or that has not
// dialled in after start_timeout_seconds, is given up; steps that then have no node coming
// fail with what the node's log says.
void PoolExecutor::poll_launching() {
  if (launching_.empty() || stopping_) return;
  poll_.expires_after(std::chrono::milliseconds(config_.slurm.poll_ms));
  poll_.async_wait([this](boost::system::error_code ec) {
    if (ec || launching_.empty() || stopping_) return;
    std::string ids;
    for (const auto& [id, at] : launching_) ids += (ids.empty() ? "" : ",") + id;
    executors::run_command(
        io_, {"squeue", "-h", "-t", "all", "-j", ids, "-o", "%i %T %R"},
        [this](executors::CommandResult r) {
          if (stopping_) return;
          const std::map<std::string, std::string> states = first_two_words(r.out);
          const auto now = std::chrono::steady_clock::now();
          const auto timeout = std::chrono::milliseconds(
              static_cast<long long>(config_.slurm.pool.start_timeout_seconds * 1000));
          std::vector<std::pair<std::string, std::string>> gone;
          for (const auto& [id, at] : launching_) {
            auto s = states.find(id);
            const std::string state = s == states.end() ? "VANISHED" : s->second;
            const bool alive = state == "PENDING" || state == "RUNNING" || state == "CONFIGURING" ||
                               state == "COMPLETING";
            if (r.status == 0 && !alive)
              gone.emplace_back(id, "ended " + state + " before it dialled in");
            else if (now - at > timeout)
              gone.emplace_back(
                  id, "did not dial in within " +
                          fmt::format("{:g}", config_.slurm.pool.start_timeout_seconds) + " s (" +
                          state + ")");
          }
          for (const auto& [id, why] : gone) {
            launching_.erase(id);
            scancel(id);
            std::string log = node_log_tail(id);
            spdlog::error("pool {}: pool job {} {}{}", pool_, id, why,
                          log.empty() ? "" : ": " + log);
            if (nodes_.empty() && launching_.empty() && submitting_ == 0)
              fail_waiting("pool.start_failed", "the pool's Slurm job " + id + " " + why +
                                                    (log.empty() ? "" : "; its log: " + log));
          }
          count_nodes();
          poll_launching();
        },
        std::chrono::seconds(30));
  });
}

std::string PoolExecutor::node_log_tail(const std::string& slurm_job_id) const {
  std::string out;
  for (const char* ext : {".err", ".out"}) {
    std::string text = tail_file(dir_ / ("node-" + slurm_job_id + ext), 1000);
    if (!text.empty()) out += (out.empty() ? "" : " | ") + common::printable(text, 1000);
  }
  return out;
}

void PoolExecutor::fail_waiting(const std::string& code, const std::string& message) {
  std::deque<std::string> waiting;
  waiting.swap(queue_);
  for (const std::string& id : waiting) {
    steps_.erase(id);
    if (host_.current_step(id)) host_.failed(id, code, message);
  }
}

void PoolExecutor::scancel(const std::string& slurm_job_id) {
  executors::run_command(io_, {"scancel", slurm_job_id},
                         [slurm_job_id](executors::CommandResult r) {
                           if (r.status != 0)
                             spdlog::warn("scancel {}: {}", slurm_job_id, r.describe());
                         });
}

bool PoolExecutor::cancel(const std::string& id) {
  auto s = steps_.find(id);
  if (s == steps_.end()) return false;
  if (Batch* batch = s->second.batch.get()) {
    batch->cancelling = true;
    batch->queue.clear();
    batch->ready.clear();
    batch->unharvested.clear();
    std::erase(queue_, id);
    for (auto& [wire, shard] : shards_)
      if (shard.job == id)
        if (auto node = nodes_.find(shard.node); node != nodes_.end())
          node->second->channel->send(Json{{"type", "cancel"}, {"job", wire}});
    if (batch->flying.empty()) batch_done_if_idle(id);
    return true;
  }
  if (s->second.node < 0) {
    std::erase(queue_, id);
    steps_.erase(s);
    host_.cancelled(id, "cancelled while it waited for a pool node");
    return true;
  }
  auto node = nodes_.find(s->second.node);
  if (node == nodes_.end()) return false;
  node->second->channel->send(Json{{"type", "cancel"}, {"job", id}});
  return true;
}

void PoolExecutor::stop() {
  if (stopping_) return;
  stopping_ = true;
  poll_.cancel();
  watch_.cancel();
  boost::system::error_code ignored;
  acceptor_.close(ignored);
  // A node exits when its channel ends: its Slurm job ends with it. Jobs not yet dialled in
  // would find nobody to dial and exit too.
  std::vector<std::shared_ptr<PoolChannel>> channels;
  for (auto& [n, node] : nodes_) {
    node->idle.cancel();
    channels.push_back(node->channel);
  }
  for (auto& channel : channels) channel->close("assayd stops");
  for (const auto& [id, at] : launching_) scancel(id);
  launching_.clear();
}

}  // namespace assay::supervisor
