#include "supervisor/executors/command.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <memory>

#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>

extern char** environ;

namespace assay::executors {

namespace asio = boost::asio;

namespace {

constexpr std::size_t kCap = 4 * 1024 * 1024;

struct Run : std::enable_shared_from_this<Run> {
  Run(asio::io_context& io) : out(io), err(io), pidfd(io), timer(io) {}
  asio::posix::stream_descriptor out, err, pidfd;
  asio::steady_timer timer;
  pid_t pid = -1;
  int pending = 3;
  CommandResult result;
  std::array<char, 65536> buf_out{}, buf_err{};
  std::function<void(CommandResult)> done;

  void read(asio::posix::stream_descriptor& d, std::array<char, 65536>& buf, std::string& into) {
    d.async_read_some(asio::buffer(buf), [self = shared_from_this(), &d, &buf, &into](
                                             boost::system::error_code ec, std::size_t n) {
      if (!ec) {
        if (into.size() < kCap) into.append(buf.data(), std::min(n, kCap - into.size()));
        return self->read(d, buf, into);
      }
      self->one_done();
    });
  }

  void one_done() {
    if (--pending > 0) return;
    timer.cancel();
    auto d = std::move(done);
    d(std::move(result));
  }
};

}  // namespace

std::string CommandResult::describe() const {
  std::string text = err.empty() ? out : err;
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  if (text.size() > 2000) text = text.substr(0, 2000) + "...";
  std::string head = status < 0      ? "could not be started"
                     : status >= 128 ? "killed by signal " + std::to_string(status - 128)
                                     : "exit " + std::to_string(status);
  return text.empty() ? head : head + ": " + text;
}

void run_command(asio::io_context& io, std::vector<std::string> argv,
                 std::function<void(CommandResult)> done, std::chrono::milliseconds timeout) {
  auto run = std::make_shared<Run>(io);
  run->done = std::move(done);
  int out_pipe[2] = {-1, -1}, err_pipe[2] = {-1, -1};
  auto fail = [&](const std::string& why) {
    for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]})
      if (fd >= 0) ::close(fd);
    CommandResult r;
    r.err = argv.empty() ? why : argv[0] + ": " + why;
    asio::post(io, [d = std::move(run->done), r = std::move(r)]() mutable { d(std::move(r)); });
  };
  if (argv.empty()) return fail("empty command");
  if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0)
    return fail(std::string("pipe: ") + std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, out_pipe[1], 1);
  posix_spawn_file_actions_adddup2(&actions, err_pipe[1], 2);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  sigset_t all;
  sigfillset(&all);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  pid_t pid = -1;
  int rc = ::posix_spawnp(&pid, args[0], &actions, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  out_pipe[1] = err_pipe[1] = -1;
  if (rc != 0) return fail(std::strerror(rc));
  int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) {
    // No pidfd (Linux < 5.3): wait for the pipes, then reap (the command closes them at exit).
    int err = errno;
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    return fail(std::string("pidfd_open: ") + std::strerror(err));
  }
  run->pid = pid;
  run->out.assign(out_pipe[0]);
  run->err.assign(err_pipe[0]);
  run->pidfd.assign(pidfd);
  run->read(run->out, run->buf_out, run->result.out);
  run->read(run->err, run->buf_err, run->result.err);
  run->pidfd.async_wait(asio::posix::stream_descriptor::wait_read,
                        [run](boost::system::error_code) {
                          int status = 0;
                          while (::waitpid(run->pid, &status, 0) < 0 && errno == EINTR) {
                          }
                          run->result.status = WIFEXITED(status)     ? WEXITSTATUS(status)
                                               : WIFSIGNALED(status) ? 128 + WTERMSIG(status)
                                                                     : -1;
                          boost::system::error_code ignored;
                          run->pidfd.close(ignored);
                          run->one_done();
                        });
  run->timer.expires_after(timeout);
  run->timer.async_wait([run](boost::system::error_code ec) {
    if (!ec && run->pidfd.is_open())
      ::syscall(SYS_pidfd_send_signal, run->pidfd.native_handle(), SIGKILL, nullptr, 0);
  });
}

}  // namespace assay::executors
