#include "supervisor/api/answer.h"

#include <spdlog/spdlog.h>

#include "common/text.h"

namespace assay::supervisor::api {

using common::Json;

namespace {

struct CodeStatus {
  const char* code;  // exact code, or a prefix ending in '.'
  unsigned status;
};

// Exact codes first, then prefixes; the first match wins.
constexpr CodeStatus kTable[] = {
    {"api.not_found", 404},
    {"api.no_such_job", 404},
    {"api.method_not_allowed", 405},
    {"api.duplicate", 409},
    {"api.not_ready", 409},
    {"api.already_finished", 409},
    {"api.body_too_large", 413},
    {"api.uri_too_long", 414},
    {"api.header_too_large", 431},
    {"api.queue_full", 429},
    {"api.too_many_connections", 503},
    {"api.too_many_streams", 503},
    {"api.busy", 503},
    {"request.forbidden", 403},
    {"fs.no_space", 507},
    {"fs.read_only", 503},
    {"api.", 400},
    {"json.", 400},
    {"request.", 422},
    {"preflight.", 422},
};

}  // namespace

unsigned status_for(const std::string& code) {
  for (const auto& [c, status] : kTable) {
    std::string_view key(c);
    if (key.back() == '.' ? code.rfind(key, 0) == 0 : code == key) return status;
  }
  return 500;
}

Answer json_answer(unsigned status, const Json& j) {
  return Answer{status, "application/json", j.dump() + "\n", {}, {}, {}};
}

Answer error_answer(unsigned status, const std::string& code, const std::string& message) {
  // Messages may quote a client's bytes: the answer is valid UTF-8 whatever they were.
  std::string text = common::is_valid_utf8(message) ? message : common::printable(message, 4096);
  std::string c = common::is_valid_utf8(code) ? code : common::printable(code, 64);
  return json_answer(status, Json{{"error", {{"code", c}, {"message", text}}}});
}

Answer error_answer(const common::Error& e) {
  if (e.code() == "fs.no_space")
    return error_answer(507, "store.full",
                        std::string("the state directory has no space left; nothing of this "
                                    "request was stored: ") +
                            e.what());
  if (status_for(e.code()) >= 500)
    spdlog::error("answering {}: {}", e.code(), common::printable(e.what(), 1000));
  return error_answer(status_for(e.code()), e.code(), e.what());
}

Answer internal_error(const std::exception& e) {
  spdlog::error("internal error: {}", common::printable(e.what(), 1000));
  return error_answer(500, "supervisor.internal", std::string("internal error: ") + e.what());
}

}  // namespace assay::supervisor::api
