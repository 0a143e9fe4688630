#include "supervisor/metrics.h"

#include <algorithm>
#include <vector>

namespace assay::supervisor {

void Durations::add(double seconds) {
  recent.push_back(seconds);
  if (recent.size() > kWindow) recent.pop_front();
  sum += seconds;
  ++count;
}

double Durations::median() const {
  if (recent.empty()) return 0;
  std::vector<double> v(recent.begin(), recent.end());
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

}  // namespace assay::supervisor
