// Engine-audit requests as assayd reads a submission's body (the strict parse with
// kMaxRequestBytes, as supervisor/api/routes.cpp does, then common::validate_audit_request).
// What it accepts keeps the header's promises and its canonical form is the same request again.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <set>

#include "common/audit.h"
#include "common/error.h"
#include "common/identity.h"
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace assay;
  common::AuditRequest r;
  try {
    r = common::validate_audit_request(
        common::parse_strict(fuzz::as_text(data, size), {.max_bytes = common::kMaxRequestBytes}));
  } catch (const common::Error&) {
    return 0;
  }
  if (r.model_dir.empty() || r.model_dir.front() != '/') std::abort();
  if (r.contexts.size() < 2 || r.contexts.size() > common::kMaxAuditContexts) std::abort();
  if (r.positions() > common::kMaxAuditPositions) std::abort();
  if (r.reduction_seeds < 1 || r.reduction_seeds > common::kMaxAuditReductionSeeds) std::abort();
  if (!(r.policy.alpha > 0 && r.policy.alpha <= 0.5)) std::abort();
  std::set<std::string> ids;
  std::int64_t top = 0;
  for (const auto& c : r.contexts) {
    if (c.logits_path.empty() || c.logits_path.front() != '/') std::abort();
    if (!common::is_identity(c.logits_sha256)) std::abort();
    if (c.token_ids.empty() || !ids.insert(c.id).second) std::abort();
    for (std::int64_t id : c.token_ids) top = std::max(top, id);
  }
  r.check_vocab(top + 1);
  if (r.member_names().size() != static_cast<std::size_t>(r.reduction_seeds) + (r.sdpa ? 2 : 1))
    std::abort();
  auto again = common::validate_audit_request(common::parse_strict(
      common::canonical(r.document), {.max_bytes = 1 << 26, .exact_integers = false}));
  if (again.request_sha256 != r.request_sha256) std::abort();
  return 0;
}
