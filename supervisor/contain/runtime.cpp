// The containment runtime: one Job per started worker, driven by its pidfd, two output pipes
// and the timeout timers on one strand; the evidence is read after the worker was reaped and
// its cgroup emptied, and before the cgroup is removed.
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <ctime>
#include <thread>

#include <fcntl.h>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>

#include "common/error.h"
#include "common/fs.h"
#include "common/protocol.h"
#include "supervisor/contain/cgroup.h"
#include "supervisor/contain/contain.h"
#include "supervisor/contain/spawn.h"

namespace assay::contain {

namespace {

namespace asio = boost::asio;
namespace fs = std::filesystem;
using common::Json;
using detail::Backend;
using detail::Cgroup;
using Clock = std::chrono::steady_clock;

constexpr auto kEmptyPoll = std::chrono::milliseconds(5);
constexpr auto kEmptyDeadline = std::chrono::seconds(10);
// Output still open after every process is gone (mode none: an escaped grandchild holds it).
constexpr auto kOutputDeadline = std::chrono::seconds(2);

std::string read_proc(const char* path) {
  auto text = detail::read_cgroup_file(path);
  if (!text) throw common::Error("contain.unavailable", std::string("cannot read ") + path);
  return *text;
}

std::string utc_now() {
  auto now = std::chrono::system_clock::now();
  std::time_t t = std::chrono::system_clock::to_time_t(now);
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()) % 1000;
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[80];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
                tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                static_cast<int>(ms.count()));
  return buf;
}

Json opt_json(const std::optional<std::uint64_t>& v) {
  if (v) return *v;
  return nullptr;
}

const char* signal_name(int sig) {
  switch (sig) {
    case SIGHUP:
      return "SIGHUP";
    case SIGINT:
      return "SIGINT";
    case SIGQUIT:
      return "SIGQUIT";
    case SIGILL:
      return "SIGILL";
    case SIGTRAP:
      return "SIGTRAP";
    case SIGABRT:
      return "SIGABRT";
    case SIGBUS:
      return "SIGBUS";
    case SIGFPE:
      return "SIGFPE";
    case SIGKILL:
      return "SIGKILL";
    case SIGUSR1:
      return "SIGUSR1";
    case SIGSEGV:
      return "SIGSEGV";
    case SIGUSR2:
      return "SIGUSR2";
    case SIGPIPE:
      return "SIGPIPE";
    case SIGALRM:
      return "SIGALRM";
    case SIGTERM:
      return "SIGTERM";
    case SIGXCPU:
      return "SIGXCPU";
    case SIGXFSZ:
      return "SIGXFSZ";
    case SIGSYS:
      return "SIGSYS";
  }
  return nullptr;
}

// The normalised view both backends share, next to the raw counters.
void add_memory_summary(Json& evidence, const Json& counters) {
  auto get = [&](const char* file, const char* key = nullptr) -> Json {
    if (counters.is_null() || !counters.contains(file)) return nullptr;
    const Json& v = counters[file];
    if (!key) return v;
    if (v.is_null() || !v.contains(key)) return nullptr;
    return v[key];
  };
  Json peak = get("memory.peak");
  if (peak.is_null()) peak = get("memory.max_usage_in_bytes");
  Json oom = nullptr;
  if (!get("memory.events").is_null()) {
    Json k = get("memory.events", "oom_kill"), g = get("memory.events", "oom_group_kill");
    oom = (k.is_number() && k.get<std::uint64_t>() > 0) ||
          (g.is_number() && g.get<std::uint64_t>() > 0);
  } else if (!get("memory.oom_control").is_null()) {
    Json k = get("memory.oom_control", "oom_kill");
    if (k.is_number()) oom = k.get<std::uint64_t>() > 0;
  }
  evidence["oom_killed"] = oom;
  evidence["memory"] = Json{{"peak_bytes", peak},
                            {"swap_current_bytes", get("memory.swap.current")},
                            {"swap_peak_bytes", get("memory.swap.peak")}};
  evidence["pids_peak"] = get("pids.peak");
  Json cpu = get("cpu.stat", "usage_usec");
  if (cpu.is_null()) {
    Json ns = get("cpuacct.usage");
    if (ns.is_number()) cpu = ns.get<std::uint64_t>() / 1000;
  }
  evidence["cpu"]["cgroup_usage_usec"] = cpu;
}

void check_name(const std::string& name) {
  bool ok = !name.empty() && name.size() <= 200 && name.front() != '.' &&
            name.find_first_not_of(
                "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                "0123456789._-") == std::string::npos;
  if (!ok) {
    throw common::Error("contain.spawn_failed",
                        "worker name \"" + name +
                            "\" must be 1-200 characters of [A-Za-z0-9._-], not starting with '.'");
  }
}

// Copies a pipe into a file, up to a cap; the rest is counted and dropped.
struct OutputSink {
  OutputSink(const asio::strand<asio::io_context::executor_type>& ex) : pipe(ex) {}
  asio::posix::stream_descriptor pipe;
  common::UniqueFd file;
  std::string path;
  std::uint64_t cap = 0;
  std::uint64_t written = 0;
  std::uint64_t dropped = 0;
  bool open = false;
  std::array<char, 65536> buf{};

  Json evidence() const {
    return Json{{"path", path.empty() ? Json(nullptr) : Json(path)},
                {"bytes", written},
                {"dropped_bytes", dropped}};
  }
};

class Job : public std::enable_shared_from_this<Job> {
 public:
  Job(asio::io_context& io, Backend* backend, SpawnSpec spec, CompletionHandler done,
      std::unique_ptr<detail::Prespawned> early)
      : strand_(asio::make_strand(io)),
        backend_(backend),
        spec_(std::move(spec)),
        done_(std::move(done)),
        early_(std::move(early)),
        pidfd_(strand_),
        timeout_timer_(strand_),
        grace_timer_(strand_),
        poll_timer_(strand_),
        out_(strand_),
        err_(strand_) {}

  void start() {
    check_name(spec_.name);
    // v2 clones the child into its cgroup, which must exist first; otherwise the cgroup is
    // made while the child makes its namespaces (an early child has been at it for a while).
    const bool into_cgroup = backend_ && backend_->supports_clone_into_cgroup();
    try {
      open_output(out_, spec_.stdout_path);
      open_output(err_, spec_.stderr_path);
      started_at_ = utc_now();
      start_time_ = Clock::now();
      if (into_cgroup) make_cgroup();
      auto child = early_ ? std::move(early_) : detail::prespawn(spec_, cgroup_.get());
      if (!into_cgroup) make_cgroup();  // a throw kills and reaps the child
      spawned_ = detail::finish_spawn(std::move(child), cgroup_.get());
    } catch (...) {
      if (cgroup_) cgroup_->remove();
      throw;
    }
    pid_ = spawned_.pid;
    pidfd_.assign(spawned_.pidfd.release());
    out_.pipe.assign(spawned_.stdout_read.release());
    err_.pipe.assign(spawned_.stderr_read.release());
    out_.open = err_.open = true;
    auto self = shared_from_this();
    pidfd_.async_wait(asio::posix::stream_descriptor::wait_read,
                      [self](boost::system::error_code) { self->on_exit(); });
    read_more(out_);
    read_more(err_);
    timeout_timer_.expires_after(spec_.limits.timeout);
    timeout_timer_.async_wait([self](boost::system::error_code ec) {
      if (!ec) self->on_timeout();
    });
  }

  pid_t pid() const { return pid_; }

  void request_kill() {
    if (finished_) return;  // nothing to kill, and the io_context may be gone
    auto self = shared_from_this();
    asio::post(strand_, [self] {
      if (self->finished_ || self->exited_) return;
      self->cancelled_ = true;
      self->kill_everything();
    });
  }

 private:
  // The worker's cgroup with its limits (none in mode none).
  void make_cgroup() {
    if (!backend_) return;
    cgroup_ = backend_->create(spec_.name);
    cgroup_->set_limits(spec_.limits);
  }

  void open_output(OutputSink& sink, const fs::path& path) {
    sink.cap = spec_.output_cap_bytes;
    if (path.empty()) return;
    sink.path = path.string();
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) common::throw_errno("contain.spawn_failed", "open " + path.string(), errno);
    sink.file = common::UniqueFd(fd);
  }

  void read_more(OutputSink& sink) {
    auto self = shared_from_this();
    sink.pipe.async_read_some(
        asio::buffer(sink.buf), [self, &sink](boost::system::error_code ec, std::size_t n) {
          if (n > 0) {
            std::uint64_t room = sink.cap > sink.written ? sink.cap - sink.written : 0;
            std::size_t keep = static_cast<std::size_t>(std::min<std::uint64_t>(room, n));
            if (keep > 0 && sink.file) {
              const char* p = sink.buf.data();
              std::size_t left = keep;
              while (left > 0) {
                ssize_t w = ::write(sink.file.get(), p, left);
                if (w < 0 && errno == EINTR) continue;
                if (w < 0) {
                  self->errors_.push_back("write " + sink.path + ": " + std::strerror(errno));
                  break;
                }
                p += w;
                left -= static_cast<std::size_t>(w);
              }
            }
            sink.written += keep;
            sink.dropped += n - keep;
          }
          if (ec) {
            sink.open = false;
            boost::system::error_code ignored;
            sink.pipe.close(ignored);
            self->maybe_finish();
            return;
          }
          self->read_more(sink);
        });
  }

  void kill_everything() {
    if (cgroup_) {
      try {
        cgroup_->kill_all();
        cgroup_killed_ = true;
      } catch (const common::Error& e) {
        errors_.push_back(e.what());
        ::kill(-pid_, SIGKILL);
      }
    } else {
      ::kill(-pid_, SIGKILL);
      cgroup_killed_ = false;
    }
  }

  void on_timeout() {
    if (exited_) return;
    timed_out_ = true;
    sigterm_sent_ = ::kill(-pid_, SIGTERM) == 0;
    auto self = shared_from_this();
    grace_timer_.expires_after(spec_.limits.kill_grace);
    grace_timer_.async_wait([self](boost::system::error_code ec) {
      if (!ec && !self->exited_) self->kill_everything();
    });
  }

  void on_exit() {
    siginfo_t info{};
    struct rusage ru {};
    long r;
    do {
      r = ::syscall(SYS_waitid, P_PIDFD, pidfd_.native_handle(), &info, WEXITED, &ru);
    } while (r < 0 && errno == EINTR);
    exit_time_ = Clock::now();
    exited_ = true;
    boost::system::error_code ignored;
    timeout_timer_.cancel();
    grace_timer_.cancel();
    pidfd_.close(ignored);
    if (r == 0) {
      exit_ = Json::object();
      bool by_signal = info.si_code == CLD_KILLED || info.si_code == CLD_DUMPED;
      exit_["code"] = by_signal ? Json(nullptr) : Json(info.si_status);
      exit_["signal"] = by_signal ? Json(info.si_status) : Json(nullptr);
      const char* name = by_signal ? signal_name(info.si_status) : nullptr;
      exit_["signal_name"] = name ? Json(name) : Json(nullptr);
      exit_["core_dumped"] = info.si_code == CLD_DUMPED;
      cpu_ = Json{{"user_usec", static_cast<std::uint64_t>(ru.ru_utime.tv_sec) * 1000000 +
                                    static_cast<std::uint64_t>(ru.ru_utime.tv_usec)},
                  {"system_usec", static_cast<std::uint64_t>(ru.ru_stime.tv_sec) * 1000000 +
                                      static_cast<std::uint64_t>(ru.ru_stime.tv_usec)}};
    } else {
      errors_.push_back(std::string("waitid: ") + std::strerror(errno));
    }
    // The worker's lifetime is its main process's: whatever it left running dies now.
    bool empty = !cgroup_;
    if (cgroup_) {
      try {
        auto left = cgroup_->pids();
        empty = left.empty();
        if (!empty) leftover_killed_ = cgroup_->kill_all();
      } catch (const common::Error& e) {
        errors_.push_back(e.what());
      }
    } else {
      ::kill(-pid_, SIGKILL);
    }
    empty_deadline_ = Clock::now() + kEmptyDeadline;
    wait_empty(empty);
  }

  // `known_empty`: the cgroup was just read and held no process.
  void wait_empty(bool known_empty = false) {
    bool empty = true;
    if (cgroup_ && !known_empty) {
      try {
        empty = cgroup_->pids().empty();
        if (!empty && Clock::now() > empty_deadline_) {
          errors_.push_back("cgroup " + cgroup_->path() + " still has processes after " +
                            std::to_string(kEmptyDeadline.count()) + " s");
          empty = true;
        } else if (!empty) {
          cgroup_->kill_all();
        }
      } catch (const common::Error& e) {
        errors_.push_back(e.what());
      }
    }
    auto self = shared_from_this();
    if (!empty) {
      poll_timer_.expires_after(kEmptyPoll);
      poll_timer_.async_wait([self](boost::system::error_code) { self->wait_empty(); });
      return;
    }
    empty_ = true;
    poll_timer_.expires_after(kOutputDeadline);
    poll_timer_.async_wait([self](boost::system::error_code ec) {
      if (ec) return;
      boost::system::error_code ignored;
      for (OutputSink* s : {&self->out_, &self->err_}) {
        if (s->open) {
          self->errors_.push_back("output pipe still open after every process exited");
          s->pipe.close(ignored);
        }
      }
    });
    maybe_finish();
  }

  void maybe_finish() {
    if (finished_ || !exited_ || !empty_ || out_.open || err_.open) return;
    finished_ = true;
    boost::system::error_code ignored;
    poll_timer_.cancel();
    Json evidence = build_evidence();
    auto done = std::move(done_);
    if (done) done(std::move(evidence));
  }

  Json build_evidence() {
    Json e;
    e["schema"] = std::string(protocol::kProcessContainment);
    e["name"] = spec_.name;
    e["mode"] = backend_ ? backend_->name() : "none";
    e["orphan"] = false;
    Json counters = nullptr;
    if (cgroup_) {
      try {
        counters = cgroup_->counters();
      } catch (const common::Error& err) {
        errors_.push_back(err.what());
      }
      bool removed = false;
      try {
        cgroup_->remove();
        removed = true;
      } catch (const common::Error& err) {
        errors_.push_back(err.what());
      }
      e["cgroup"] = Json{
          {"path", cgroup_->path()}, {"hierarchies", cgroup_->hierarchies()}, {"removed", removed}};
    } else {
      e["cgroup"] = nullptr;
    }
    Json env_keys = Json::array();
    for (const auto& kv : spec_.env) env_keys.push_back(kv.substr(0, kv.find('=')));
    e["spawn"] = Json{{"method", spawned_.method},
                      {"argv", spec_.argv},
                      {"workdir", spec_.workdir.empty() ? "/" : spec_.workdir.string()},
                      {"environment_keys", env_keys},
                      {"uid", spec_.uid ? Json(*spec_.uid) : Json(nullptr)},
                      {"gid", spec_.gid ? Json(*spec_.gid) : Json(nullptr)},
                      {"no_new_privs", true},
                      {"rlimits", Json{{"core", 0}, {"nofile", spec_.nofile}}},
                      {"stdin", "/dev/null"}};
    const Limits& l = spec_.limits;
    e["limits"] =
        Json{{"memory_max", opt_json(l.memory_max)}, {"memory_high", opt_json(l.memory_high)},
             {"swap_max", opt_json(l.swap_max)},     {"pids_max", opt_json(l.pids_max)},
             {"timeout_ms", l.timeout.count()},      {"kill_grace_ms", l.kill_grace.count()}};
    e["network"] = spawned_.network;
    e["mounts"] = spawned_.mounts;
    e["started_at"] = started_at_;
    e["wall_usec"] =
        std::chrono::duration_cast<std::chrono::microseconds>(exit_time_ - start_time_).count();
    e["exit"] = exit_.is_null() ? Json(nullptr) : exit_;
    e["cpu"] = cpu_.is_null() ? Json{{"user_usec", nullptr}, {"system_usec", nullptr}} : cpu_;
    e["timed_out"] = timed_out_;
    e["cancelled"] = cancelled_;
    e["sigterm_sent"] = sigterm_sent_;
    e["cgroup_killed"] = cgroup_killed_;
    e["kill_scope"] = cgroup_ ? "cgroup" : "process-group";
    e["leftover_processes_killed"] = leftover_killed_;
    e["counters"] = counters;
    add_memory_summary(e, counters);
    e["output"] = Json{{"stdout", out_.evidence()},
                       {"stderr", err_.evidence()},
                       {"cap_bytes", spec_.output_cap_bytes}};
    e["errors"] = errors_;
    return e;
  }

  asio::strand<asio::io_context::executor_type> strand_;
  Backend* backend_;
  SpawnSpec spec_;
  CompletionHandler done_;
  std::unique_ptr<detail::Prespawned> early_;
  std::unique_ptr<Cgroup> cgroup_;
  detail::Spawned spawned_;
  pid_t pid_ = -1;
  asio::posix::stream_descriptor pidfd_;
  asio::steady_timer timeout_timer_, grace_timer_, poll_timer_;
  OutputSink out_, err_;
  std::string started_at_;
  Clock::time_point start_time_, exit_time_, empty_deadline_;
  Json exit_ = nullptr, cpu_ = nullptr;
  std::vector<std::string> errors_;
  bool exited_ = false, empty_ = false;
  std::atomic<bool> finished_{false};
  bool timed_out_ = false, cancelled_ = false, sigterm_sent_ = false, cgroup_killed_ = false;
  int leftover_killed_ = 0;
};

class RunningImpl : public Running {
 public:
  explicit RunningImpl(std::shared_ptr<Job> job) : job_(std::move(job)) {}
  ~RunningImpl() override { job_->request_kill(); }  // a no-op once it finished
  void kill() override { job_->request_kill(); }
  pid_t pid() const override { return job_->pid(); }

 private:
  std::shared_ptr<Job> job_;
};

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

  std::vector<Json> cleanup_orphans() override {
    std::vector<Json> out;
    if (!backend_) return out;
    for (auto& cg : backend_->orphans()) {
      Json e;
      e["schema"] = std::string(protocol::kProcessContainment);
      e["name"] = cg->name();
      e["mode"] = backend_->name();
      e["orphan"] = true;
      Json errors = Json::array();
      int killed = 0;
      try {
        killed = cg->kill_all();
        for (int i = 0; i < 2000 && !cg->pids().empty(); ++i) {
          std::this_thread::sleep_for(kEmptyPoll);
        }
      } catch (const common::Error& err) {
        errors.push_back(err.what());
      }
      Json counters = nullptr;
      try {
        counters = cg->counters();
      } catch (const common::Error& err) {
        errors.push_back(err.what());
      }
      bool removed = false;
      try {
        cg->remove();
        removed = true;
      } catch (const common::Error& err) {
        errors.push_back(err.what());
      }
      e["cgroup"] =
          Json{{"path", cg->path()}, {"hierarchies", cg->hierarchies()}, {"removed", removed}};
      e["spawn"] = nullptr;
      e["limits"] = nullptr;
      e["network"] = nullptr;
      e["mounts"] = nullptr;
      e["started_at"] = nullptr;
      e["wall_usec"] = nullptr;
      e["exit"] = nullptr;
      e["cpu"] = Json{{"user_usec", nullptr}, {"system_usec", nullptr}};
      e["timed_out"] = false;
      e["cancelled"] = false;
      e["sigterm_sent"] = false;
      e["cgroup_killed"] = killed > 0;
      e["kill_scope"] = "cgroup";
      e["leftover_processes_killed"] = killed;
      e["counters"] = counters;
      add_memory_summary(e, counters);
      e["output"] = nullptr;
      e["errors"] = errors;
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
    auto job = std::make_shared<Job>(io, backend_.get(), spec, std::move(done), std::move(child));
    job->start();
    return std::make_shared<RunningImpl>(job);
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

Json Runtime::run(const SpawnSpec& spec) {
  asio::io_context io;
  Json result;
  auto running = start(io, spec, [&](Json evidence) { result = std::move(evidence); });
  io.run();
  return result;
}

}  // namespace assay::contain
