// The route table: method and path -> a call on the Service facade. The only code besides the
// session that knows request targets; it never knows Beast.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "supervisor/api/answer.h"
#include "supervisor/service.h"

namespace assay::supervisor::api {

// Splits and decodes a request target; throws Error("api.bad_target") for a target that is not
// valid UTF-8 once decoded, Error("api.bad_query") for a repeated parameter.
struct Target {
  std::vector<std::string> segments;
  std::map<std::string, std::string> query;
};
Target parse_target(const std::string& target);

// Answers one request; never throws (errors become answers, see answer.h). HEAD is answered as
// GET (the session drops the body).
Answer route(Service& service, const std::string& method, const std::string& target,
             const std::string& body, const Peer& peer);

// Prometheus text for /metrics.
std::string render_metrics(Service& service);

}  // namespace assay::supervisor::api
