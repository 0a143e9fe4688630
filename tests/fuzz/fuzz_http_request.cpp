// assayd's HTTP/1.1 framing: the bytes a client writes on the socket, read as
// supervisor/api/session.cpp reads them (Beast's request_parser<string_body> with the header and
// body limits of the default Config, async_read_header, the body's size checked against
// max_body_bytes, async_read, the 2048-byte target bound, keep-alive to the next request on the
// same buffer), each request's target split by api::parse_target (routes.cpp) and a POST
// /v1/jobs body parsed as routes.cpp parses it. The session's steps are restated here in a few
// lines: they live in its connection object, which needs a Service. The outcome (each request's
// method, target and body, then how the connection ended) must not depend on how the bytes
// arrive: the input is read whole, then again a few bytes per read.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include <boost/beast/_experimental/test/stream.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "common/error.h"
#include "common/request.h"
#include "supervisor/api/routes.h"
#include "supervisor/config.h"
#include "tests/fuzz/fuzz.h"

namespace {

namespace beast = boost::beast;
namespace http = beast::http;
using namespace assay;

// Pipelined requests read on one connection, at most.
constexpr int kMaxRequests = 16;

// What the session would do with the connection, request by request.
std::vector<std::string> serve(std::string_view bytes, std::size_t read_size) {
  static const supervisor::Config config;
  boost::asio::io_context io;
  beast::test::stream stream(io, beast::string_view(bytes.data(), bytes.size()));
  if (read_size) stream.read_size(read_size);
  stream.close_remote();
  beast::flat_buffer buffer;
  std::vector<std::string> outcome;
  auto ended = [&](beast::error_code ec) {
    if (ec == http::error::end_of_stream || ec == boost::asio::error::eof)
      outcome.push_back("closed");
    else if (ec == http::error::body_limit)
      outcome.push_back("413");
    else if (ec == http::error::header_limit)
      outcome.push_back("431");
    else  // the message names where Beast noticed, which can depend on how the bytes came
      outcome.push_back("400");
  };
  for (int n = 0; n < kMaxRequests; ++n) {
    std::optional<http::request_parser<http::string_body>> parser;
    parser.emplace();
    parser->header_limit(static_cast<std::uint32_t>(config.max_header_bytes));
    parser->body_limit(config.max_body_bytes);
    beast::error_code ec;
    http::async_read_header(stream, buffer, *parser,
                            [&](beast::error_code e, std::size_t) { ec = e; });
    io.run();
    io.restart();
    if (ec) return ended(ec), outcome;
    std::uint64_t need =
        parser->content_length().value_or(parser->chunked() ? config.max_body_bytes : 0);
    if (need > config.max_body_bytes) return outcome.push_back("413 declared"), outcome;
    http::async_read(stream, buffer, *parser, [&](beast::error_code e, std::size_t) { ec = e; });
    io.run();
    io.restart();
    if (ec) return ended(ec), outcome;
    auto& req = parser->get();
    std::string target(req.target());
    if (target.size() > 2048) return outcome.push_back("414"), outcome;
    std::string method(req.method_string());
    std::string answer = method + " " + target + " " + std::to_string(req.body().size());
    try {
      supervisor::api::Target t = supervisor::api::parse_target(target);
      for (const auto& s : t.segments)
        if (s.empty()) std::abort();  // parse_target drops empty segments
      if (method == "POST" && t.segments == std::vector<std::string>{"v1", "jobs"})
        (void)common::parse_strict(req.body(), {.max_bytes = common::kMaxRequestBytes});
    } catch (const common::Error& e) {
      answer += " " + e.code();
    }
    outcome.push_back(answer);
    if (!req.keep_alive()) return outcome.push_back("closed"), outcome;
  }
  return outcome;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string_view bytes = fuzz::as_text(data, size);
  auto whole = serve(bytes, 0);
  if (size > 4096) return 0;
  auto pieces = serve(bytes, 1 + size % 7);
  if (pieces != whole) {
    for (const auto& [how, outcome] : {std::pair{"whole", whole}, std::pair{"in pieces", pieces}})
      for (const auto& line : outcome) std::fprintf(stderr, "%s: %s\n", how, line.c_str());
    std::abort();
  }
  return 0;
}
