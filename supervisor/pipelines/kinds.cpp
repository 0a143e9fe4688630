#include "common/audit.h"
#include "common/error.h"
#include "common/identity.h"
#include "common/layers.h"
#include "common/protocol.h"
#include "common/result.h"
#include "common/trajectory.h"
#include "supervisor/pipelines/pipeline.h"

namespace assay::supervisor {

const std::vector<JobKind>& kinds() {
  // Explicit, no static registration: the first kind whose schema matches, else the last (the
  // next-token kind reads both of its request schemas itself).
  static const std::vector<JobKind> all{
      {"fidelity", protocol::kFidelityRequest, common::kKlArtifactFileName, false, &admit_fidelity,
       &open_fidelity},
      {"trajectory", common::kTrajectoryRequest, common::kTrajectoryArtifactFileName, false,
       &admit_trajectory, &open_trajectory},
      {"layer-attribution", common::kLayerRequest, common::kLayerArtifactFileName, false,
       &admit_layers, &open_layers},
      {"engine-audit", common::kAuditRequest, common::kAuditArtifactFileName, false, &admit_audit,
       &open_audit},
      {"next-token-batch", protocol::kNextTokenBatchRequest, common::kBatchArtifactFileName, true,
       &admit_batch, &open_batch},
      {"next-token", "", common::kArtifactFileName, true, &admit_next_token, &open_next_token},
  };
  return all;
}

std::string part_job_id(const std::string& job_id, std::size_t index) {
  std::string digest = common::sha256_canonical_id(common::Json{{"job", job_id}, {"index", index}});
  return "j-" + digest.substr(7, 24);
}

const JobKind& kind_for_schema(std::string_view schema) {
  for (const JobKind& k : kinds())
    if (!k.request_schema.empty() && k.request_schema == schema) return k;
  return kinds().back();
}

}  // namespace assay::supervisor
