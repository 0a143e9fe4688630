// The pool executor (Config::slurm.pool, docs/slurm.md "Worker pools"): long-lived Slurm jobs,
// one per node, each running `assayd node` (supervisor/pool_node.cpp), which dials this host
// over an authenticated TCP channel (pool_channel.h) and runs the steps it is given there: a
// step that may run on a resident worker on one that stays loaded on that node (its model
// loaded once per node while the job's fingerprint matches what it loaded), any other step in
// a contained process of its own, exactly as `assayd contain` would. Workspaces are in the
// shared directory, as for a Slurm step; the evidence comes back over the channel, and the
// step's result is checked and signed here: the signing key never leaves this host.
//
// Steps wait in one queue and go to nodes as they free up (a node that holds the step's model
// first); pool jobs are submitted while steps wait and the pool is below `nodes`, and released
// (told to stop, then scancel) after `idle_seconds` without a step. A node lost mid-step (its
// channel closed or silent) gives the step back to the queue, to run again from its start on
// another node; a step lost that way three times fails (pool.node_lost).
//
// Pool directory <shared_dir>/pools/<pool id>/ (0700; a fresh id and key each time assayd
// starts): node.json (where to dial, the resident settings), key (64 hex digits, 0600), node.sh
// (the batch script), node-<slurm job id>.out/.err (the node's log).
#pragma once

#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

#include "supervisor/config.h"
#include "supervisor/executors/executor.h"
#include "supervisor/executors/local.h"
#include "supervisor/executors/pool_channel.h"
#include "supervisor/metrics.h"

namespace assay::supervisor {

inline constexpr auto kWatchNodes = std::chrono::seconds(2);
inline constexpr int kMostLost = 3;  // nodes lost under one step (or batch) before it fails

class PoolExecutor : public Executor {
 public:
  // Makes the pool's directory and key and listens on slurm.pool.listen; throws common::Error
  // ("pool.listen", "pool.dir") when it cannot.
  PoolExecutor(boost::asio::io_context& io, const Config& config, StepHost& host, Metrics& metrics);
  ~PoolExecutor() override;
  std::string name() const override { return "pool"; }
  // Takes every step but one that reads files by descriptor (the Slurm step executor refuses
  // those, with its reason).
  bool start(StepLaunch& launch) override;
  bool cancel(const std::string& id) override;
  std::filesystem::path workspace(const std::string& id, const std::string& role) const override;
  bool linked_workspaces() const override { return true; }
  bool local_files() const override { return false; }
  void stop() override;
  std::size_t alive() const override { return nodes_.size(); }

  // For /metrics and tests: nodes connected, pool jobs submitted and not yet dialled in.
  std::size_t connected() const { return nodes_.size(); }
  std::size_t launching() const { return launching_.size(); }
  std::string pool_id() const { return pool_; }

 private:
  struct Node {
    explicit Node(boost::asio::io_context& io) : idle(io) {}
    int number = 0;
    std::shared_ptr<PoolChannel> channel;
    std::string slurm_job_id, name;
    std::string job;                            // the step it runs (job id), empty when free
    std::map<std::string, common::Json> holds;  // resident key -> the bytes_used it loaded
    boost::asio::steady_timer idle;
    std::uint64_t steps = 0;
    std::string draining;  // why it takes no new step (its Slurm node drains), empty: it does
  };
  // A batch's states, sharded across nodes: each free node pulls the next few of its waiting
  // states (a smaller share as fewer are left, so that a slow node takes fewer), runs them on
  // its resident worker, and its shard's state files are handed to the engine one shard at a
  // time, each with its own evidence (naming the node, its resident worker and the states it
  // was given), as a run of the batch's worker.
  struct Batch {
    std::map<std::size_t, common::Json> states;  // each state's input entry, by index
    std::deque<std::size_t> queue;               // waiting for a node
    std::set<std::size_t> flying;                // in shards on nodes
    std::deque<contain::Evidence> ready;         // ended shards, their files in the workspace
    std::set<std::size_t> unharvested;           // the states of those, not yet handed over
    bool handing = false;  // a shard handed to the engine, which has not asked for more yet
    bool cancelling = false;
    int shards = 0;
  };
  struct Pending {          // a step taken: waiting in the queue, or on a node
    std::string role, key;  // key: the resident worker it may run on (empty: none)
    common::Json run;       // the "run" message without expect/reject
    int node = -1;
    int lost = 0;                            // nodes lost under it
    std::unique_ptr<ProgressPoll> progress;  // while on a node, where the step has progress
    std::unique_ptr<Batch> batch;            // a batch sharded across nodes
  };
  struct Shard {  // one node's part of a batch, by its id on the wire ("<job>#<n>")
    std::string job;
    std::vector<std::size_t> states;
    std::filesystem::path workspace;  // SHARED/jobs/<job>/shard-<n>/<role>
    int node = -1;
  };

  void accept();
  void hello(const std::shared_ptr<PoolChannel>& channel, common::Json message);
  void message(int number, common::Json message);
  void node_closed(int number, const std::string& why);
  void dispatch();
  void send_step(Node& node, const std::string& id, Pending& pending);
  // A batch's shards (pool_batch.cpp).
  bool continue_batch(const std::string& id, StepLaunch& launch);
  void send_shard(Node& node, const std::string& id, Pending& pending);
  void shard_message(Node& node, const std::string& wire, const common::Json& m);
  void shard_lost(const std::string& wire, const std::string& node, const std::string& why);
  void hand_over(const std::string& id);
  void batch_done_if_idle(const std::string& id);
  // The resident section of a run message for `node`: what its worker must hold (checked here
  // against the job's fingerprint) or must not.
  common::Json resident_for(const Node& node, const std::string& id, Step& step,
                            const std::string& key, common::Json resident) const;
  // The evidence of an "ended" message, the resident worker's bytes checked against the job's
  // fingerprint; throws common::Error.
  contain::Evidence ended_evidence(Node& node, Step& step, const std::string& key,
                                   const common::Json& m);
  void free_node(Node& node);
  void grow();
  void submit_pool_job();
  void poll_launching();
  void release(Node& node, const std::string& why);
  void count_nodes();  // the pool's gauges in /metrics
  void watch_nodes();  // Slurm's state of the pool's nodes (a drained node leaves the pool)
  void scancel(const std::string& slurm_job_id);
  void fail_waiting(const std::string& code, const std::string& message);
  std::string node_log_tail(const std::string& slurm_job_id) const;

  boost::asio::io_context& io_;
  const Config& config_;
  StepHost& host_;
  Metrics& metrics_;
  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::steady_timer poll_;
  boost::asio::steady_timer watch_;
  std::string pool_, key_, head_;  // pool id, key (raw), "ADDRESS:PORT" the nodes dial
  std::filesystem::path dir_;
  std::map<int, std::unique_ptr<Node>> nodes_;
  std::map<std::string, std::chrono::steady_clock::time_point> launching_;  // slurm id -> sbatch
  int submitting_ = 0;                    // sbatch commands not yet answered
  std::map<std::string, Pending> steps_;  // by job id
  std::map<std::string, Shard> shards_;   // by wire id
  std::deque<std::string> queue_;         // job ids waiting for a node, first come first
  int next_ = 0;
  bool stopping_ = false;
};

}  // namespace assay::supervisor
