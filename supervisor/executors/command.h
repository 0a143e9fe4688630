// Runs a short command (sbatch, squeue, scontrol, scancel) without blocking the io_context:
// its stdout and stderr are collected through pipes, its exit through a pidfd.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>

namespace assay::executors {

struct CommandResult {
  int status = -1;       // exit code; 128 + signal when killed; -1 when it could not be started
  std::string out, err;  // each capped at 4 MiB
  std::string describe() const;  // "exit 1: <stderr>", for messages
};

// argv[0] is looked up in PATH; the environment is this process's. After `timeout` the command
// is killed (status 128 + SIGKILL). `done` runs on `io`, exactly once.
void run_command(boost::asio::io_context& io, std::vector<std::string> argv,
                 std::function<void(CommandResult)> done,
                 std::chrono::milliseconds timeout = std::chrono::seconds(60));

}  // namespace assay::executors
