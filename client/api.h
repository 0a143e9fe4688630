// A small synchronous client for assayd's HTTP/1.1 API over a unix socket.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "common/error.h"
#include "common/json.h"

namespace assay::client {

// The daemon could not be reached (no socket, refused, permission, timeout, broken stream).
// Code "client.unreachable" or "client.timeout"; the message names the socket path.
class UnreachableError : public common::Error {
 public:
  using common::Error::Error;
};

// The daemon answered with an HTTP error status. code() is the daemon's error code when the
// body is {"error":{"code","message"}}, else "http.<status>".
class ApiError : public common::Error {
 public:
  ApiError(int status, std::string code, const std::string& message)
      : common::Error(std::move(code), message), status_(status) {}
  int status() const noexcept { return status_; }

 private:
  int status_;
};

struct Response {
  int status = 0;
  std::string content_type;
  std::string body;
};

struct ApiOptions {
  std::string socket_path;
  std::chrono::milliseconds timeout{60'000};  // connect + one whole request/response
  std::size_t max_body_bytes = 8ull << 30;    // artifacts can be large
};

class Api {
 public:
  explicit Api(ApiOptions options) : options_(std::move(options)) {}
  const std::string& socket_path() const { return options_.socket_path; }

  // One request on a fresh connection. Returns any 2xx response; throws ApiError otherwise.
  Response request(std::string_view method, std::string_view target, std::string body = {},
                   std::string_view content_type = "application/json") const;
  // request() + strict JSON parse of the body.
  common::Json get_json(std::string_view target) const;

  // Streams a newline-delimited response: on_line gets each complete line, on_tick is called
  // every tick_every while no data arrives (to refresh a progress line). Returns when the
  // server ends the response or a callback returns false.
  struct StreamHooks {
    std::function<bool(std::string_view)> on_line;
    std::function<bool()> on_tick;  // optional
    std::chrono::milliseconds tick_every{1000};
  };
  void stream_lines(std::string_view target, const StreamHooks& hooks) const;

 private:
  ApiOptions options_;
};

// "/v1/jobs/<id>" with the id checked to be a safe path segment (throws Error "client.bad_id").
std::string job_path(std::string_view id, std::string_view suffix = {});

}  // namespace assay::client
