// One watched Process per started worker, driven by its pidfd, two output pipes
// and the timeout timers on one strand; the evidence is read after the worker was reaped and
// its cgroup emptied, and before the cgroup is removed.
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <string_view>

#include <fcntl.h>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>

#include "common/error.h"
#include "common/fs.h"
#include "supervisor/contain/process.h"
#include "supervisor/contain/seccomp.h"
#include "supervisor/contain/spawn.h"

namespace assay::contain::detail {

namespace {

namespace asio = boost::asio;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr auto kEmptyDeadline = std::chrono::seconds(10);
// Output still open after every process is gone (mode none: an escaped grandchild holds it).
constexpr auto kOutputDeadline = std::chrono::seconds(2);

// By calendar arithmetic: glibc's gmtime_r reads /etc/localtime on its first call (tzset),
// a file open and parse on every one-shot spawn.
std::string utc_now() {
  using namespace std::chrono;
  const auto now = time_point_cast<milliseconds>(system_clock::now());
  const auto day = floor<days>(now);
  const year_month_day date{day};
  const hh_mm_ss<milliseconds> time{now - day};
  char buf[80];
  std::snprintf(buf, sizeof buf, "%04d-%02u-%02uT%02d:%02d:%02d.%03dZ",
                static_cast<int>(date.year()), static_cast<unsigned>(date.month()),
                static_cast<unsigned>(date.day()), static_cast<int>(time.hours().count()),
                static_cast<int>(time.minutes().count()), static_cast<int>(time.seconds().count()),
                static_cast<int>(time.subseconds().count()));
  return buf;
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

// The schema's pattern: ^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$.
void check_name(const std::string& name) {
  constexpr const char* kFirst = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_";
  bool ok = !name.empty() && name.size() <= 200 &&
            std::string_view(kFirst).find(name.front()) != std::string_view::npos &&
            name.find_first_not_of(
                "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                "0123456789._-") == std::string::npos;
  if (!ok) {
    throw common::Error("contain.spawn_failed",
                        "worker name \"" + name +
                            "\" must be 1-200 characters of [A-Za-z0-9._-], starting with a "
                            "letter, digit or '_'");
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
  // Not zeroed: only what a read put there is used, and untouched pages cost no fault.
  std::array<char, 65536> buf;

  StreamEvidence evidence() const {
    return {path.empty() ? std::nullopt : std::optional<std::string>(path), written, dropped};
  }
};

class Process : public std::enable_shared_from_this<Process> {
 public:
  Process(asio::io_context& io, Backend* backend, SpawnSpec spec, CompletionHandler done,
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
    detail::check_identity(spec_);
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
    init_status_ = std::move(spawned_.status_read);
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
    if (r < 0 && errno == EAGAIN && pidfd_.is_open()) {
      // The reactor made the descriptor non-blocking, and the process has not exited: that
      // readiness was not its exit (seen once in a bench run: the worker then failed with "no exit
      // status" while its worker still ran). Asked again after 10 ms, doubling up to 1 s: not a
      // new wait on the descriptor, whose edge may already have passed.
      exit_retry_ = exit_retry_.count() ? std::min(exit_retry_ * 2, std::chrono::milliseconds(1000))
                                        : std::chrono::milliseconds(10);
      auto self = shared_from_this();
      poll_timer_.expires_after(exit_retry_);
      poll_timer_.async_wait([self](boost::system::error_code ec) {
        if (!ec) self->on_exit();
      });
      return;
    }
    exit_time_ = Clock::now();
    exited_ = true;
    boost::system::error_code ignored;
    timeout_timer_.cancel();
    grace_timer_.cancel();
    pidfd_.close(ignored);
    if (r == 0) {
      bool by_signal = info.si_code == CLD_KILLED || info.si_code == CLD_DUMPED;
      ExitStatus status;
      if (by_signal) {
        status.signal = info.si_status;
        if (const char* name = signal_name(info.si_status)) status.signal_name = name;
      } else {
        status.code = info.si_status;
      }
      status.core_dumped = info.si_code == CLD_DUMPED;
      exit_ = std::move(status);
      // The init mirrors the worker's exit code, not its signal: its report says which.
      if (auto outcome = detail::read_init_report(init_status_.get())) {
        exit_ = outcome->exit;
        if (exit_->signal) {
          if (const char* name = signal_name(*exit_->signal)) exit_->signal_name = name;
        }
        leftover_killed_ = outcome->leftover_killed;
      }
      auto usec = [](const timeval& t) {
        return static_cast<std::uint64_t>(t.tv_sec) * 1000000 +
               static_cast<std::uint64_t>(t.tv_usec);
      };
      cpu_.user_usec = usec(ru.ru_utime);
      cpu_.system_usec = usec(ru.ru_stime);
    } else {
      errors_.push_back(std::string("waitid: ") + std::strerror(errno));
    }
    // The worker's lifetime is its main process's: whatever it left running dies now.
    bool empty = !cgroup_;
    if (cgroup_) {
      try {
        auto left = cgroup_->pids();
        empty = left.empty();
        if (!empty) leftover_killed_ += cgroup_->kill_all();
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
    Evidence evidence = build_evidence();
    auto done = std::move(done_);
    if (done) done(std::move(evidence));
  }

  Evidence build_evidence() {
    Evidence e;
    bool removed = false;
    if (cgroup_) {
      try {
        e.counters = cgroup_->counters();
      } catch (const common::Error& err) {
        errors_.push_back(err.what());
      }
      try {
        cgroup_->remove();
        removed = true;
      } catch (const common::Error& err) {
        errors_.push_back(err.what());
      }
    }
    describe(e, removed);
    e.wall_usec = static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(exit_time_ - start_time_).count());
    e.exit = exit_;
    e.cpu = cpu_;
    e.timed_out = timed_out_;
    e.cancelled = cancelled_;
    e.sigterm_sent = sigterm_sent_;
    e.cgroup_killed = cgroup_killed_;
    e.leftover_processes_killed = leftover_killed_;
    summarise_counters(e);
    e.output = OutputEvidence{out_.evidence(), err_.evidence(), spec_.output_cap_bytes};
    e.errors = errors_;
    return e;
  }

 public:
  // A resident worker between jobs (contain.h Running::snapshot).
  Evidence snapshot(const ResidentEvidence& resident) {
    Evidence e;
    std::vector<std::string> errors;
    if (cgroup_) {
      try {
        e.counters = cgroup_->counters();
      } catch (const common::Error& err) {
        errors.push_back(err.what());
      }
    }
    describe(e, false);
    e.started_at = resident.started_at;
    e.resident = resident;
    summarise_counters(e);
    e.errors = std::move(errors);
    return e;
  }
  std::vector<std::string> reset_peaks() {
    return cgroup_ ? cgroup_->reset_peaks() : std::vector<std::string>{};
  }
  std::optional<Counters> counters() {
    if (!cgroup_ || exited_) return std::nullopt;
    try {
      return cgroup_->counters();
    } catch (const common::Error&) {
      return std::nullopt;
    }
  }

 private:
  // What every evidence of this process says: its name, cgroup, spawn, limits and namespaces.
  void describe(Evidence& e, bool removed) const {
    e.name = spec_.name;
    e.mode = backend_ ? backend_->name() : "none";
    e.orphan = false;
    if (cgroup_) e.cgroup = CgroupEvidence{cgroup_->path(), cgroup_->hierarchies(), removed};
    SpawnEvidence spawn;
    spawn.method = spawned_.method;
    spawn.argv = spec_.argv;
    spawn.workdir = spec_.workdir.empty() ? "/" : spec_.workdir.string();
    for (const auto& kv : spec_.env) spawn.environment_keys.push_back(kv.substr(0, kv.find('=')));
    spawn.uid = spawned_.uid;
    spawn.gid = spawned_.gid;
    spawn.rlimit_nofile = spec_.nofile;
    spawn.pass_fds = static_cast<std::uint32_t>(spec_.pass_fds.size());
    spawn.capabilities = spawned_.capabilities;
    const auto& policy = detail::seccomp_policy();
    spawn.seccomp = {policy.sha256, policy.arch, policy.denied, policy.enosys};
    e.spawn = std::move(spawn);
    e.limits = spec_.limits;
    e.network = spawned_.network;
    e.pid_namespace_private = spawned_.pid_namespace_private;
    e.mounts = spawned_.mounts;
    e.started_at = started_at_;
    e.kill_scope = cgroup_ ? "cgroup" : "process-group";
  }

  asio::strand<asio::io_context::executor_type> strand_;
  Backend* backend_;
  SpawnSpec spec_;
  CompletionHandler done_;
  std::unique_ptr<detail::Prespawned> early_;
  std::unique_ptr<Cgroup> cgroup_;
  detail::Spawned spawned_;
  pid_t pid_ = -1;
  common::UniqueFd init_status_;
  asio::posix::stream_descriptor pidfd_;
  asio::steady_timer timeout_timer_, grace_timer_, poll_timer_;
  std::chrono::milliseconds exit_retry_{0};  // on_exit's next retry after a readiness too early
  OutputSink out_, err_;
  std::string started_at_;
  Clock::time_point start_time_, exit_time_, empty_deadline_;
  std::optional<ExitStatus> exit_;
  CpuEvidence cpu_;
  std::vector<std::string> errors_;
  bool exited_ = false, empty_ = false;
  std::atomic<bool> finished_{false};
  bool timed_out_ = false, cancelled_ = false, sigterm_sent_ = false, cgroup_killed_ = false;
  int leftover_killed_ = 0;
};

class RunningImpl : public Running {
 public:
  explicit RunningImpl(std::shared_ptr<Process> process) : process_(std::move(process)) {}
  ~RunningImpl() override { process_->request_kill(); }  // a no-op once it finished
  void kill() override { process_->request_kill(); }
  pid_t pid() const override { return process_->pid(); }
  Evidence snapshot(const ResidentEvidence& resident) override {
    return process_->snapshot(resident);
  }
  std::vector<std::string> reset_peaks() override { return process_->reset_peaks(); }
  std::optional<Counters> counters() override { return process_->counters(); }

 private:
  std::shared_ptr<Process> process_;
};

}  // namespace

void summarise_counters(Evidence& e) {
  const std::optional<Counters> job = e.job_counters();
  const Counters* c = job ? &*job : nullptr;
  auto counter = [&](const char* file) -> const Counter* {
    if (!c) return nullptr;
    auto it = c->find(file);
    return it == c->end() ? nullptr : &it->second;
  };
  auto value = [&](const char* file) -> std::optional<std::uint64_t> {
    const Counter* k = counter(file);
    return k ? k->value : std::nullopt;
  };
  // The file's keys, or null when the kernel does not offer the file.
  auto keyed = [&](const char* file) -> const std::map<std::string, std::optional<std::uint64_t>>* {
    const Counter* k = counter(file);
    return k && k->keys ? &*k->keys : nullptr;
  };
  auto key = [](const auto* keys, const char* name) -> std::optional<std::uint64_t> {
    if (!keys) return std::nullopt;
    auto it = keys->find(name);
    return it == keys->end() ? std::nullopt : it->second;
  };
  e.memory_peak_bytes = value("memory.peak");
  if (!e.memory_peak_bytes) e.memory_peak_bytes = value("memory.max_usage_in_bytes");
  e.oom_killed = std::nullopt;
  if (const auto* events = keyed("memory.events")) {
    e.oom_killed =
        key(events, "oom_kill").value_or(0) > 0 || key(events, "oom_group_kill").value_or(0) > 0;
  } else if (const auto* control = keyed("memory.oom_control")) {
    if (auto k = key(control, "oom_kill")) e.oom_killed = *k > 0;
  }
  e.memory_swap_current_bytes = value("memory.swap.current");
  if (!e.memory_swap_current_bytes) {
    auto memsw = value("memory.memsw.usage_in_bytes"), usage = value("memory.usage_in_bytes");
    if (memsw && usage) e.memory_swap_current_bytes = *memsw > *usage ? *memsw - *usage : 0;
  }
  e.memory_swap_peak_bytes = value("memory.swap.peak");
  e.pids_peak = value("pids.peak");
  e.cpu.cgroup_usage_usec = key(keyed("cpu.stat"), "usage_usec");
  if (!e.cpu.cgroup_usage_usec) {
    if (auto ns = value("cpuacct.usage")) e.cpu.cgroup_usage_usec = *ns / 1000;
  }
}

std::shared_ptr<Running> start_process(boost::asio::io_context& io, Backend* backend,
                                       const SpawnSpec& spec, CompletionHandler done,
                                       std::unique_ptr<Prespawned> early) {
  auto process = std::make_shared<Process>(io, backend, spec, std::move(done), std::move(early));
  process->start();
  return std::make_shared<RunningImpl>(process);
}

}  // namespace assay::contain::detail
