// The runtime's per-worker process (process.cpp), shared with the backend selection in runtime.cpp.
#pragma once

#include <chrono>
#include <memory>

#include <boost/asio/io_context.hpp>

#include "supervisor/contain/cgroup.h"
#include "supervisor/contain/contain.h"
#include "supervisor/contain/spawn.h"

namespace assay::contain::detail {

// How often a cgroup is polled for emptiness.
inline constexpr auto kEmptyPoll = std::chrono::milliseconds(5);

// The normalised view both backends share, next to the raw counters (none: all unknown).
void summarise_counters(Evidence& e);

// Starts one worker: checks its spec, spawns it (into a cgroup of `backend`, none in mode
// none; `early`: a child prespawned without a cgroup, or null) and watches it on a strand of
// `io` until `done` gets its evidence.
std::shared_ptr<Running> start_process(boost::asio::io_context& io, Backend* backend,
                                       const SpawnSpec& spec, CompletionHandler done,
                                       std::unique_ptr<Prespawned> early);

}  // namespace assay::contain::detail
