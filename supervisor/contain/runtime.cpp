// The containment runtime: picks the cgroup backend, removes orphaned cgroups and starts one
// process per worker (process.cpp).
#include <string>
#include <thread>

#include <boost/asio/io_context.hpp>

#include "common/error.h"
#include "supervisor/contain/cgroup.h"
#include "supervisor/contain/contain.h"
#include "supervisor/contain/process.h"
#include "supervisor/contain/spawn.h"

namespace assay::contain {

namespace {

namespace asio = boost::asio;
using common::Json;
using detail::Backend;

std::string read_proc(const char* path) {
  auto text = detail::read_cgroup_file(path);
  if (!text) throw common::Error("contain.unavailable", std::string("cannot read ") + path);
  return *text;
}

class RuntimeImpl : public Runtime {
 public:
  explicit RuntimeImpl(std::unique_ptr<Backend> backend) : backend_(std::move(backend)) {}
  ~RuntimeImpl() override {
    if (backend_) backend_->release();
  }

  std::string backend() const override { return backend_ ? backend_->name() : "none"; }
  Json describe() const override {
    if (!backend_) return Json{{"backend", "none"}};
    return backend_->describe();
  }

  std::vector<Evidence> cleanup_orphans() override {
    std::vector<Evidence> out;
    if (!backend_) return out;
    for (auto& cg : backend_->orphans()) {
      Evidence e;
      e.name = cg->name();
      e.mode = backend_->name();
      e.orphan = true;
      int killed = 0;
      try {
        killed = cg->kill_all();
        for (int i = 0; i < 2000 && !cg->pids().empty(); ++i) {
          std::this_thread::sleep_for(detail::kEmptyPoll);
        }
      } catch (const common::Error& err) {
        e.errors.push_back(err.what());
      }
      try {
        e.counters = cg->counters();
      } catch (const common::Error& err) {
        e.errors.push_back(err.what());
      }
      bool removed = false;
      try {
        cg->remove();
        removed = true;
      } catch (const common::Error& err) {
        e.errors.push_back(err.what());
      }
      e.cgroup = CgroupEvidence{cg->path(), cg->hierarchies(), removed};
      e.cgroup_killed = killed > 0;
      e.kill_scope = "cgroup";
      e.leftover_processes_killed = killed;
      detail::summarise_counters(e);
      out.push_back(std::move(e));
    }
    return out;
  }

  std::shared_ptr<Running> start(asio::io_context& io, const SpawnSpec& spec,
                                 CompletionHandler done) override {
    std::unique_ptr<EarlyChild> none;
    return start(io, spec, std::move(done), none);
  }

  std::shared_ptr<Running> start(asio::io_context& io, const SpawnSpec& spec,
                                 CompletionHandler done,
                                 std::unique_ptr<EarlyChild>& early) override {
    std::unique_ptr<detail::Prespawned> child;
    if (auto* p = dynamic_cast<detail::Prespawned*>(early.get())) {
      if (!(backend_ && backend_->supports_clone_into_cgroup())) {
        early.release();
        child.reset(p);
      } else {
        p->restore_affinity();  // the fresh child must inherit all of this thread's CPUs
      }
    }
    return detail::start_process(io, backend_.get(), spec, std::move(done), std::move(child));
  }

 private:
  std::unique_ptr<Backend> backend_;
};

}  // namespace

std::unique_ptr<Runtime> Runtime::create(const RuntimeOptions& options) {
  if (options.mode == Mode::kNone) return std::make_unique<RuntimeImpl>(nullptr);
  auto membership = detail::parse_proc_cgroup(read_proc("/proc/self/cgroup"));
  auto mounts = detail::parse_mountinfo_cgroups(read_proc("/proc/self/mountinfo"));
  if (options.mode == Mode::kV2) {
    return std::make_unique<RuntimeImpl>(detail::make_v2_backend(options, membership, mounts));
  }
  if (options.mode == Mode::kV1) {
    return std::make_unique<RuntimeImpl>(detail::make_v1_backend(options, membership, mounts));
  }
  if (detail::v2_has_memory(options, membership, mounts)) {
    return std::make_unique<RuntimeImpl>(detail::make_v2_backend(options, membership, mounts));
  }
  try {
    return std::make_unique<RuntimeImpl>(detail::make_v1_backend(options, membership, mounts));
  } catch (const common::Error& e) {
    throw common::Error("contain.unavailable",
                        std::string("no usable memory controller: cgroup v2 offers none here, "
                                    "and cgroup v1: ") +
                            e.what() + " (use --mode none for development only)");
  }
}

std::unique_ptr<EarlyChild> EarlyChild::start(const SpawnSpec& spec) {
  return detail::prespawn(spec, nullptr);
}

Evidence Running::snapshot(const ResidentEvidence& resident) {
  throw common::Error("contain.unsupported",
                      "resident worker " + resident.worker + ": this process has no snapshot");
}

Evidence Runtime::run(const SpawnSpec& spec) {
  asio::io_context io;
  std::optional<Evidence> result;
  auto running = start(io, spec, [&](Evidence evidence) { result = std::move(evidence); });
  io.run();
  if (!result) throw common::Error("contain.internal", "no evidence for " + spec.name);
  return std::move(*result);
}

}  // namespace assay::contain