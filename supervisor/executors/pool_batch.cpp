// The pool executor's batches (pool.h, Batch): a batch's states sharded across the pool's
// nodes, each shard handed to the engine as a run of the batch's worker of its own, a lost
// node's shard given to the others.
#include <algorithm>

#include <spdlog/spdlog.h>
#include <boost/asio/post.hpp>

#include "common/error.h"
#include "common/json.h"
#include "common/protocol.h"
#include "common/text.h"
#include "supervisor/executors/pool.h"

namespace assay::supervisor {

using common::Error;
using common::Json;
namespace fs = std::filesystem;

bool PoolExecutor::continue_batch(const std::string& id, StepLaunch& launch) {
  // The engine asks for the batch's states still to do after a shard's harvest: those on
  // nodes now are not run again; those a dead worker left are queued again.
  Pending& pending = steps_.at(id);
  Batch& batch = *pending.batch;
  batch.handing = false;
  bool queued = std::find(queue_.begin(), queue_.end(), id) != queue_.end();
  for (const Json& state : launch.input.at("states")) {
    const std::size_t index = state.at("index").get<std::size_t>();
    // On a node, waiting for a node, or ended and waiting to be handed over: not again.
    if (batch.flying.count(index) || batch.unharvested.count(index) ||
        std::find(batch.queue.begin(), batch.queue.end(), index) != batch.queue.end())
      continue;
    batch.states[index] = state;
    batch.queue.push_front(index);
  }
  if (!batch.queue.empty() && !queued) queue_.push_back(id);
  boost::asio::post(io_, [this, id] {
    hand_over(id);
    dispatch();
  });
  return true;
}

void PoolExecutor::send_shard(Node& node, const std::string& id, Pending& pending) {
  Batch& batch = *pending.batch;
  Step* step = host_.current_step(id);
  if (!step || step->role != pending.role) {
    batch.queue.clear();
    return;
  }
  // Guided self-scheduling: a share of what is left, smaller as fewer states wait.
  const std::size_t nodes = std::max<std::size_t>(1, config_.slurm.pool.nodes);
  const std::size_t size =
      std::max<std::size_t>(1, (batch.queue.size() + 2 * nodes - 1) / (2 * nodes));
  Shard shard;
  shard.job = id;
  shard.node = node.number;
  const std::string wire = id + "#" + std::to_string(batch.shards);
  shard.workspace = workspace(id, "shard-" + std::to_string(batch.shards++)) / pending.role;
  Json run = pending.run;
  Json states = Json::array();
  for (std::size_t i = 0; i < size && !batch.queue.empty(); ++i) {
    const std::size_t index = batch.queue.front();
    batch.queue.pop_front();
    shard.states.push_back(index);
    batch.flying.insert(index);
    states.push_back(batch.states.at(index));
  }
  run["job"] = wire;
  run["spec"]["workdir"] = shard.workspace.string();
  run["resident"]["input"]["states"] = std::move(states);
  run["resident"]["progress"] = false;
  run["resident"] = resident_for(node, id, *step, pending.key, run["resident"]);
  std::error_code ec;
  fs::create_directories(shard.workspace.parent_path(), ec);
  node.idle.cancel();
  node.job = wire;
  host_.phase(id, pending.role,
              "states " + std::to_string(shard.states.front()) + ".." +
                  std::to_string(shard.states.back()) + " (" + std::to_string(shard.states.size()) +
                  ") sent to pool node " + node.name + " (Slurm job " + node.slurm_job_id + ")");
  shards_[wire] = std::move(shard);
  node.channel->send(run);
}

void PoolExecutor::shard_message(Node& node, const std::string& wire, const Json& m) {
  const std::string type = m.value("type", std::string());
  Shard& shard = shards_.at(wire);
  const std::string id = shard.job;
  auto s = steps_.find(id);
  Step* step = host_.current_step(id);
  const bool live = s != steps_.end() && s->second.batch && step && step->role == s->second.role;
  if (type == "phase") {
    if (live)
      host_.phase(id, s->second.role,
                  "node " + node.name + ": " + common::printable(m.value("message", ""), 400));
    return;
  }
  Shard done = std::move(shard);
  shards_.erase(wire);
  node.job.clear();
  node.steps += 1;
  free_node(node);
  if (!live) return batch_done_if_idle(id);
  Pending& pending = s->second;
  Batch& batch = *pending.batch;
  for (std::size_t index : done.states) batch.flying.erase(index);
  std::error_code ec;
  if (batch.cancelling || type != "ended") {
    if (!batch.cancelling) {
      // The node could not run it (it says why): its states wait for another node.
      spdlog::warn("pool node {} did not run shard {}: {} {}", node.name, wire,
                   common::printable(m.value("code", ""), 80),
                   common::printable(m.value("message", ""), 400));
      for (auto it = done.states.rbegin(); it != done.states.rend(); ++it)
        batch.queue.push_front(*it);
      if (std::find(queue_.begin(), queue_.end(), id) == queue_.end()) queue_.push_back(id);
      if (++pending.lost >= kMostLost)
        return host_.failed(id, common::printable(m.value("code", "pool.failed"), 80),
                            "pool nodes could not run the batch's states " +
                                std::to_string(kMostLost) + " times, the last on " + node.name +
                                ": " + common::printable(m.value("message", ""), 2000));
    }
    fs::remove_all(done.workspace.parent_path(), ec);
    return batch_done_if_idle(id);
  }
  contain::Evidence evidence;
  try {
    evidence = ended_evidence(node, *step, pending.key, m);
  } catch (const Error& e) {
    batch.cancelling = true;
    return host_.failed(id, e.code(), e.what());
  }
  Json given = Json::array();
  for (std::size_t index : done.states) given.push_back(index);
  (*evidence.executor)["states"] = std::move(given);
  // The shard's files join the step's workspace (the same file system: a rename each).
  const fs::path ws = host_.job_dir(id) / pending.role;
  for (std::size_t index : done.states)
    for (const char* ext : {".json", ".safetensors"}) {
      const std::string name = "state-" + std::to_string(index) + ext;
      if (fs::is_regular_file(fs::symlink_status(done.workspace / name, ec)))
        fs::rename(done.workspace / name, ws / name, ec);
    }
  for (std::string_view name : {protocol::kStdoutFile, protocol::kStderrFile})
    if (fs::is_regular_file(fs::symlink_status(done.workspace / name, ec)))
      fs::rename(done.workspace / name, ws / name, ec);
  fs::remove_all(done.workspace.parent_path(), ec);
  for (std::size_t index : done.states) batch.unharvested.insert(index);
  batch.ready.push_back(std::move(evidence));
  hand_over(id);
}

// One shard at a time: the engine harvests it and asks again (start) before the next.
void PoolExecutor::hand_over(const std::string& id) {
  auto s = steps_.find(id);
  if (s == steps_.end() || !s->second.batch) return;
  Batch& batch = *s->second.batch;
  if (batch.handing || batch.ready.empty() || batch.cancelling) return;
  contain::Evidence evidence = std::move(batch.ready.front());
  batch.ready.pop_front();
  for (const Json& index : (*evidence.executor)["states"])
    batch.unharvested.erase(index.get<std::size_t>());
  batch.handing = true;
  const std::string role = s->second.role;
  // The last shard: nothing of the batch is left here (a state it left comes back by start).
  if (batch.ready.empty() && batch.flying.empty() && batch.queue.empty()) steps_.erase(s);
  host_.ended(id, role, std::move(evidence));
}

void PoolExecutor::batch_done_if_idle(const std::string& id) {
  auto s = steps_.find(id);
  if (s == steps_.end() || !s->second.batch) return;
  Batch& batch = *s->second.batch;
  if (!batch.flying.empty()) return;
  Step* step = host_.current_step(id);
  if (batch.cancelling) {
    const std::string role = s->second.role;
    steps_.erase(s);
    if (step && step->role == role && host_.cancel_requested(id))
      host_.cancelled(id, "cancelled while the batch's states ran on pool nodes");
    return;
  }
  if (!step) steps_.erase(s);
}

void PoolExecutor::shard_lost(const std::string& wire, const std::string& node,
                              const std::string& why) {
  auto sh = shards_.find(wire);
  if (sh == shards_.end()) return;
  Shard shard = std::move(sh->second);
  shards_.erase(sh);
  const std::string id = shard.job;
  auto s = steps_.find(id);
  if (s == steps_.end() || !s->second.batch) return;
  Pending& pending = s->second;
  Batch& batch = *pending.batch;
  for (std::size_t index : shard.states) batch.flying.erase(index);
  std::error_code ec;
  fs::remove_all(shard.workspace.parent_path(), ec);
  Step* step = host_.current_step(id);
  if (batch.cancelling || !step || step->role != pending.role) return batch_done_if_idle(id);
  if (++pending.lost >= kMostLost) {
    batch.cancelling = true;
    host_.failed(id, "pool.node_lost",
                 "the batch lost " + std::to_string(kMostLost) + " pool nodes, the last " + node +
                     ": " + why);
    return batch_done_if_idle(id);
  }
  // Its states run again on the other nodes: none of them was handed to the engine.
  host_.phase(id, pending.role,
              "pool node " + node + " was lost (" + why + "): its " +
                  std::to_string(shard.states.size()) + " states go to the other nodes");
  for (auto it = shard.states.rbegin(); it != shard.states.rend(); ++it)
    batch.queue.push_front(*it);
  if (std::find(queue_.begin(), queue_.end(), id) == queue_.end()) queue_.push_back(id);
}

}  // namespace assay::supervisor
