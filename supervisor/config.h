// assayd serve's settings: defaults that work for a run in a temporary directory, overridden by
// a JSON config file (--config), overridden by command-line flags.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/request.h"
#include "supervisor/contain/contain.h"

namespace assay::supervisor {

struct Config {
  std::filesystem::path socket;     // empty: systemd socket activation (sd_listen_fds)
  std::filesystem::path state_dir;  // required
  std::string socket_group;         // group of the socket (0660); empty: the daemon's group
  std::string admin_group;          // members may read and cancel every job
  // "HOST:PORT" of a TCP listener that serves only GET /metrics (Prometheus), on a loopback
  // address only (127.0.0.0/8, [::1], localhost); empty: none (the default).
  std::string metrics_listen;
  std::filesystem::path fingerprint_worker;  // default: found next to assayd
  std::filesystem::path oracle_worker;       // default: found next to assayd
  std::string oracle_backend = "libtorch";   // or "transformers", "both": a request's default
  std::filesystem::path hf_worker;           // assay-hf-worker (transformers); default: as above
  std::filesystem::path compare_worker;      // fidelity jobs' KL; default: found next to assayd
  contain::RuntimeOptions containment;
  std::string oracle_device = "cpu";  // cpu, cuda, cuda:N
  // When assayd runs as root, workers run as this user; empty: the package's assay-worker, else
  // a transient uid/gid (contain::default_worker_identity). Never root, unless
  // allow_root_workers (development only; the worker still holds no capabilities).
  std::string worker_user;
  bool allow_root_workers = false;

  int device_slots = 1;
  std::size_t max_queue = 256;
  std::size_t max_connections = 512;
  std::size_t max_body_bytes = 17 * 1024 * 1024;
  std::size_t max_header_bytes = 16 * 1024;
  std::uint32_t read_timeout_ms = 10'000;  // a whole request must arrive within this
  std::uint32_t idle_timeout_ms = 60'000;  // keep-alive connections with nothing to do
  std::uint64_t memory_reserve_bytes = 256ull << 20;
  double worker_timeout_seconds = 600;  // each worker's timeout, and the most a request may ask
  // The chat-template render step's own limit (Kiln's prompt check): a template that loops must
  // not hold a worker for the job's whole timeout. The step gets the smaller of the two.
  double prompt_render_timeout_seconds = 120;
  // The most memory.max a worker may get; a request may ask for less, never more. Without a
  // request's memory_bytes a worker gets the preflight estimate times worker_memory_margin.
  std::optional<std::uint64_t> worker_memory_max;
  double worker_memory_margin = 2.0;
  // What a job does when a worker saw memory pressure (common::MemoryPolicy): "record" (the
  // default: evidence only) or "reject" (the job fails with worker.memory_pressure).
  common::MemoryPolicy memory_events = common::MemoryPolicy::kRecord;
  std::uint64_t worker_pids_max = 4097;  // the worker's processes plus its init (pid 1)
  // Transport limits that keep one client from starving the others (supervisor/api/).
  std::size_t max_connections_per_user = 64;      // per uid; admins (root, admin_group) are exempt
  std::size_t max_event_streams = 256;            // open /events streams, all users together
  std::size_t max_buffered_bytes = 256ull << 20;  // request bodies in memory, all connections
  int fingerprint_threads = 2;
  // Intra-op threads of a reference worker (OMP_NUM_THREADS and its input's "threads"); 0: every
  // CPU assayd may run on. No core is kept back for assayd: a worker runs SCHED_BATCH at nice 10
  // (contain/child.cpp), so assayd, at nice 0, gets a core whenever it wants one.
  int worker_threads = 0;
  // Per-file digests kept in STATE/fingerprint-cache/ keyed by (device, inode, size, mtime,
  // ctime): an unchanged model is not hashed again. false: every job hashes every file.
  bool fingerprint_cache = true;
  std::uint32_t preflight_retry_ms = 2000;

  // Resident oracle workers ("resident_models": {...} in the config file): a libtorch oracle
  // that stays loaded after a next-token job, contained like every worker in a cgroup of its
  // own, and runs the next job on the same model if that job's fingerprint equals the bytes it
  // loaded (else it is replaced). Off by default: a resident worker keeps the model's bytes in
  // its own memory while idle, which a small host needs for other jobs (the preflight counts an
  // idle resident's memory as available only to a job on the same model, and evicts idle ones
  // when a job needs the room).
  struct Resident {
    unsigned count = 0;  // workers at most; 0: none (every job loads the model itself)
    // The most memory (their cgroups' memory.max together) resident workers may hold; unset:
    // no bound beyond the preflight.
    std::optional<std::uint64_t> memory_bytes;
    double idle_seconds = 600;  // an idle worker is stopped after this long
  } resident;

  // Where worker steps run: "local" (this host's contained runtime) or "slurm" (each step a
  // Slurm batch job on a compute node, inside `assayd contain` there: executors/slurm.h).
  std::string executor = "local";
  // executor "slurm" ("slurm": {...} in the config file).
  struct Slurm {
    // Visible at the same path on this host and every node; the workers' workspaces live there
    // (never the state directory: the signing key stays on this host).
    std::filesystem::path shared_dir;
    std::string partition, account, qos;           // empty: Slurm's default
    std::vector<std::string> sbatch_args;          // appended to every sbatch command line
    std::filesystem::path node_assayd = "assayd";  // on the nodes: absolute, or in their PATH
    std::vector<std::string> contain_args;         // node-side `assayd contain` options
    // Oracle steps ask for --gres=gpu:N when oracle_device is a GPU.
    unsigned oracle_gpus = 1;
    std::uint32_t poll_ms = 1000;  // squeue interval (one call for every step)
    // Worker pools ("pool": {...}; executors/pool.h): long-lived Slurm jobs, one per node, each
    // running `assayd node`, which hosts resident workers and takes every step from this host
    // over an authenticated TCP channel. Off unless `nodes` > 0.
    struct Pool {
      unsigned nodes = 0;  // pool jobs at most (one node each); 0: every step its own sbatch
      // "ADDRESS:PORT" this host listens on for its nodes (an address they reach; port 0: any
      // free port, told to the nodes through the pool's directory).
      std::string listen;
      double idle_seconds = 300;  // a node without a step this long is released
      std::string partition;      // the pool jobs' partition; empty: slurm.partition
      unsigned gpus = 0;          // --gres=gpu:N for each pool job (its node's oracles share them)
      std::vector<std::string> sbatch_args;      // a pool job's own, after slurm.sbatch_args
      std::uint64_t memory_bytes = 16ULL << 30;  // --mem of a pool job (its workers together)
      unsigned time_minutes = 0;                 // --time of a pool job; 0: the partition's
      unsigned resident_models = 1;              // resident workers on each node
      // A pool job that has not dialled in this long after sbatch is given up (and scancel'd).
      double start_timeout_seconds = 600;
    } pool;
  } slurm;

  // Whether a step that may run on a resident worker gets the chance: local resident workers,
  // or a Slurm pool's (whose nodes host them).
  bool resident_steps() const {
    return resident.count > 0 || (executor == "slurm" && slurm.pool.nodes > 0);
  }

  // JSON keys are the field names above; "containment" is "auto|v2|v1|none".
  void load_file(const std::filesystem::path& path);
  // Fills defaults that depend on the environment (worker paths) and checks the result;
  // throws common::Error("config.invalid") naming the bad value.
  void finalize();
  std::string describe() const;

 private:
  void load_limits(const nlohmann::json& j);    // the numeric keys of load_file
  void load_slurm(const nlohmann::json& j);     // "slurm": {...}
  void load_resident(const nlohmann::json& j);  // "resident_models": {...}
  void load_pool(const nlohmann::json& j);      // "slurm": {"pool": {...}}
  void finalize_executor();
};

// The keys a config file may hold (Config::load_file refuses any other), for `assayd serve
// --help`; each is described in supervisor/README.md, "Limits (config keys)".
std::span<const std::string_view> config_keys();

// A TCP address assayd listens on: a numeric IP (v4 or v6) and a port.
struct ListenAddress {
  std::string ip;
  std::uint16_t port = 0;
};
// config.metrics_listen parsed: "127.0.0.1:9464", "[::1]:9464" or "localhost:9464" (taken as
// 127.0.0.1). Throws Error("config.invalid") naming the value unless the address is a loopback
// one (127.0.0.0/8, ::1) and the port is 1..65535: metrics are for this host's Prometheus only.
ListenAddress metrics_endpoint(const std::string& value);

contain::Mode mode_from_name(const std::string& name);
std::string_view mode_name(contain::Mode mode);

}  // namespace assay::supervisor
