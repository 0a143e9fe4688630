#include "client/batch.h"

#include <sstream>

#include "common/batch.h"
#include "common/error.h"
#include "common/protocol.h"

namespace assay::client {

using common::Error;
using common::Json;

BatchDocument batch_from_jsonl(const std::string& jsonl, const std::string& id) {
  Json states = Json::array();
  std::vector<std::size_t> lines;  // line number of each state
  std::size_t line_no = 0, begin = 0;
  while (begin < jsonl.size()) {
    std::size_t end = jsonl.find('\n', begin);
    if (end == std::string::npos) end = jsonl.size();
    std::string_view line(jsonl.data() + begin, end - begin);
    ++line_no;
    begin = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    try {
      states.push_back(common::parse_strict(line, {.max_bytes = common::kMaxRequestBytes}));
    } catch (const Error& e) {
      throw Error(e.code(), "line " + std::to_string(line_no) + ": " + e.what());
    }
    lines.push_back(line_no);
  }
  if (states.empty()) throw Error("request.invalid", "no requests in the file (one per line)");
  Json doc{{"schema", protocol::kNextTokenBatchRequest}, {"id", id}, {"states", std::move(states)}};
  try {
    common::BatchRequest b = common::validate_batch_request(doc);
    return BatchDocument{common::canonical(doc), b.request_sha256, b.states.size()};
  } catch (const Error& e) {
    // "states[K]: ..." names line lines[K] of the file.
    std::string message = e.what();
    if (message.starts_with("states[")) {
      std::size_t close = message.find(']');
      std::size_t k = std::stoul(message.substr(7, close - 7));
      if (k < lines.size()) message = "line " + std::to_string(lines[k]) + " (" + message + ")";
    }
    throw Error(e.code(), message);
  }
}

std::string batch_report(const Json& r) {
  std::ostringstream out;
  const Json& counts = r.value("counts", Json::object());
  out << "batch " << r.value("request", Json::object()).value("id", "") << ": "
      << counts.value("succeeded", 0) << " of " << counts.value("states", 0)
      << " states succeeded, " << counts.value("failed", 0) << " failed\n";
  const Json verdicts = counts.value("argmax_candidate", Json::object());
  for (const auto& [engine, n] : verdicts.items())
    out << "  reference argmax -> " << engine << ": " << n.dump() << "\n";
  const Json states = r.value("states", Json::array());
  for (const Json& s : states) {
    out << "  [" << s.value("index", 0) << "] " << s.value("job_id", "") << "  "
        << s.value("state", "");
    if (s.contains("argmax_candidate"))
      out << "  argmax " << s["argmax_token_id"].dump() << " -> "
          << s["argmax_candidate"].get<std::string>();
    if (s.contains("error"))
      out << "  " << s["error"].value("code", "") << ": " << s["error"].value("message", "");
    out << "\n";
  }
  out << "result_sha256 " << r.value("result_sha256", "") << "\n";
  return out.str();
}

}  // namespace assay::client
