#include "supervisor/jobs/events.h"

#include "common/error.h"

namespace assay::supervisor {

std::uint64_t Watchers::watch(const Job& job, Sink sink) {
  bool terminal = is_terminal(job.state);
  if (!terminal && count_ >= max_streams_)
    throw common::Error("api.too_many_streams",
                        "event streams are at their limit of " + std::to_string(max_streams_));
  for (std::size_t i = 0; i < job.events.size(); ++i)
    sink(job.events[i].dump() + "\n", terminal && i + 1 == job.events.size());
  if (terminal) return 0;
  std::uint64_t handle = next_++;
  by_job_[job.id][handle] = std::move(sink);
  ++count_;
  return handle;
}

void Watchers::unwatch(const std::string& id, std::uint64_t handle) {
  auto it = by_job_.find(id);
  if (it == by_job_.end()) return;
  count_ -= it->second.erase(handle);
  if (it->second.empty()) by_job_.erase(it);
}

void Watchers::publish(const Job& job) {
  auto it = by_job_.find(job.id);
  if (it == by_job_.end() || job.events.empty()) return;
  bool last = is_terminal(job.state);
  std::string line = job.events.back().dump() + "\n";
  auto sinks = it->second;  // a sink may unwatch while we iterate
  if (last) {
    count_ -= it->second.size();
    by_job_.erase(it);
  }
  for (auto& [h, sink] : sinks) sink(line, last);
}

}  // namespace assay::supervisor
