// Fidelity requests as assayd reads a submission's body (common::parse_fidelity_request). What it
// accepts keeps the header's promises (sorted, disjoint, in-range positions; one logits file per
// context), its canonical form is the same request again, and its thresholds evaluate against
// the statistics of a real fidelity result (tests/client/fixtures/report/fidelity-result.json).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "common/error.h"
#include "common/fidelity.h"
#include "tests/fuzz/fuzz.h"

namespace {

const assay::common::Json& statistics() {
  static const assay::common::Json s = assay::common::parse_strict(
      assay::fuzz::source_file("tests/client/fixtures/report/fidelity-result.json"),
      {.exact_integers = false})["comparison"]["statistics"];
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace assay;
  common::FidelityRequest r;
  try {
    r = common::parse_fidelity_request(fuzz::as_text(data, size));
  } catch (const common::Error&) {
    return 0;
  }
  if (r.panel.empty() || r.candidate_model.has_value() == !r.candidate_logits.empty()) std::abort();
  if (!r.candidate_logits.empty() && r.candidate_logits.size() != r.panel.size()) std::abort();
  std::int64_t top = 0, longest = 0;
  for (const auto& c : r.panel) {
    auto length = static_cast<std::int64_t>(c.token_ids.size());
    std::int64_t end = 0;
    for (const auto& [b, e] : c.positions) {
      if (b < end || b >= e || e > length) std::abort();
      end = e;
    }
    if (common::count_positions(c.positions) != c.scored) std::abort();
    if (common::parse_position_ranges(common::position_ranges_json(c.positions), length, "p") !=
        c.positions)
      std::abort();
    for (std::int64_t id : c.token_ids) top = std::max(top, id);
    longest = std::max(longest, length);
  }
  (void)r.scored_positions();
  r.check_vocab(top + 1);
  r.check_context_length(longest);
  common::Json gates{{"thresholds", common::evaluate_thresholds(r.thresholds, statistics())}};
  (void)common::gates_text(common::finalize_gates(gates));
  common::FidelityRequest again = common::validate_fidelity_request(common::parse_strict(
      common::canonical(r.document), {.max_bytes = 1 << 26, .exact_integers = false}));
  if (again.request_sha256 != r.request_sha256 || again.panel_sha256 != r.panel_sha256)
    std::abort();
  return 0;
}
