// `assay report`: one self-contained HTML page for a result (inline SVG and CSS, no script, no
// network), readable as plain HTML in a terminal browser too (every chart has a table beside it).
#pragma once

#include <filesystem>
#include <string>

#include "common/json.h"

namespace assay::client {

// A next-token result (assay.next-token-oracle-result.v1): the verdict, a bar chart of the top-10
// reference logits with the candidates marked (and their ranks when outside the top 10), the
// margin, the model identity and the containment evidence. A fidelity result
// (assay.fidelity-result.v1): gates, token-wise KL along positions per context, the KL histogram
// and its CDF on a log axis, the statistics table. The artifact beside the result
// (`artifact_dir`/logits.safetensors or kl.safetensors) is read when present and its sha256
// equals the result's; otherwise the charts use what the result itself holds. A layer-attribution
// result (assay.layer-attribution-result.v1): where the engine first leaves the reference and
// which departure decides the token, relative RMSE against depth on a log axis (exact zeros on a
// floor, omitted and undefined boundaries marked apart) with the first non-bitwise and the
// decisive boundary marked, and the per-boundary table. Throws
// Error("client.report") for a document of another schema. `verification` is shown at the top
// of the page (what was checked of the record before it was rendered), as verified or not.
std::string render_report(const common::Json& result, const std::filesystem::path& artifact_dir,
                          const std::string& verification, bool verified);

}  // namespace assay::client
