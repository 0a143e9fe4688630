// Trajectory requests as assayd reads a submission's body (the strict parse with
// kMaxRequestBytes, as supervisor/api/routes.cpp does, then common::validate_trajectory_request).
// What it accepts keeps the header's promises and its canonical form is the same request again.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <set>

#include "common/error.h"
#include "common/request.h"
#include "common/trajectory.h"
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace assay;
  common::TrajectoryRequest r;
  try {
    r = common::validate_trajectory_request(
        common::parse_strict(fuzz::as_text(data, size), {.max_bytes = common::kMaxRequestBytes}));
  } catch (const common::Error&) {
    return 0;
  }
  if (r.model_dir.empty() || r.model_dir.front() != '/') std::abort();
  if (r.model_dir.size() > 1 && r.model_dir.back() == '/') std::abort();
  if (r.continuations.size() < 2 || r.continuations.size() > common::kMaxTrajectoryEngines)
    std::abort();
  std::set<std::string> engines;
  std::int64_t top = 0, longest = 0;
  for (std::int64_t id : r.prompt_token_ids) top = std::max(top, id);
  for (std::size_t i = 0; i < r.continuations.size(); ++i) {
    const auto& c = r.continuations[i];
    if (c.engine == "neither" || !engines.insert(c.engine).second) std::abort();
    for (std::int64_t id : c.token_ids) top = std::max(top, id);
    auto n = static_cast<std::int64_t>(r.sequence(i).size());
    if (n != static_cast<std::int64_t>(r.prompt_token_ids.size() + c.token_ids.size()))
      std::abort();
    longest = std::max(longest, n);
  }
  if (r.first_scored() < 0) std::abort();
  r.check_vocab(top + 1);
  r.check_context_length(longest);
  auto again = common::validate_trajectory_request(common::parse_strict(
      common::canonical(r.document), {.max_bytes = 1 << 26, .exact_integers = false}));
  if (again.request_sha256 != r.request_sha256) std::abort();
  return 0;
}
