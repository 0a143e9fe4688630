// Job event streams: every watcher of a job gets each new event line; the last line (the job is
// terminal) ends the stream. Bounded: at most max_streams watchers at once.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "supervisor/jobs/store.h"

namespace assay::supervisor {

class Watchers {
 public:
  using Sink = std::function<void(const std::string& line, bool last)>;
  explicit Watchers(std::size_t max_streams) : max_streams_(max_streams) {}
  // Sends every existing event of `job` to `sink`, then registers it for the next ones unless
  // the job is terminal. Returns the handle to unwatch() (0: nothing registered). Throws
  // Error("api.too_many_streams") when max_streams watchers exist.
  std::uint64_t watch(const Job& job, Sink sink);
  void unwatch(const std::string& id, std::uint64_t handle);
  // Sends the job's newest event to its watchers; drops them when the job is terminal.
  void publish(const Job& job);
  std::size_t count() const { return count_; }

 private:
  std::size_t max_streams_;
  std::size_t count_ = 0;
  std::uint64_t next_ = 1;
  std::map<std::string, std::map<std::uint64_t, Sink>> by_job_;
};

}  // namespace assay::supervisor
