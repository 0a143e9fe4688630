#include "client/api.h"

#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

namespace assay::client {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using Local = asio::local::stream_protocol;
using Stream = beast::basic_stream<Local, asio::any_io_executor, beast::unlimited_rate_policy>;

namespace {

// One connection; every operation runs on its own io_context with a deadline, because Asio's
// synchronous calls ignore SO_RCVTIMEO.
class Connection {
 public:
  Connection(const std::string& socket_path, std::chrono::milliseconds timeout)
      : path_(socket_path), stream_(io_) {
    beast::error_code ec;
    stream_.expires_after(timeout);
    stream_.async_connect(Local::endpoint(path_), [&](beast::error_code e) { ec = e; });
    run();
    if (ec) fail("connect to", ec);
  }

  void write(http::request<http::string_body>& req, std::chrono::milliseconds timeout) {
    beast::error_code ec;
    stream_.expires_after(timeout);
    http::async_write(stream_, req, [&](beast::error_code e, std::size_t) { ec = e; });
    run();
    if (ec) fail("send request to", ec);
  }

  template <class Parser>
  void read_header(Parser& parser, std::chrono::milliseconds timeout) {
    beast::error_code ec;
    stream_.expires_after(timeout);
    http::async_read_header(stream_, buffer_, parser,
                            [&](beast::error_code e, std::size_t) { ec = e; });
    run();
    if (ec) fail("read response from", ec);
  }

  template <class Parser>
  void read(Parser& parser, std::chrono::milliseconds timeout) {
    beast::error_code ec;
    stream_.expires_after(timeout);
    http::async_read(stream_, buffer_, parser, [&](beast::error_code e, std::size_t) { ec = e; });
    run();
    if (ec) fail("read response from", ec);
  }

  // Reads some body bytes into a buffer_body parser, calling on_tick every tick_every while
  // waiting (no deadline: a job's events can be minutes apart). Returns false when a tick
  // asked to stop; check parser.is_done() for the end of the message.
  template <class Parser>
  bool read_some(Parser& parser, std::chrono::milliseconds tick_every,
                 const std::function<bool()>& on_tick) {
    beast::error_code ec;
    bool done = false, stopped = false;
    asio::steady_timer timer(io_);
    std::function<void()> arm = [&] {
      timer.expires_after(tick_every);
      timer.async_wait([&](beast::error_code e) {
        if (e || done) return;
        if (!on_tick()) {
          stopped = true;
          stream_.socket().cancel();
          return;
        }
        arm();
      });
    };
    stream_.expires_never();
    http::async_read_some(stream_, buffer_, parser, [&](beast::error_code e, std::size_t) {
      ec = e;
      done = true;
      timer.cancel();
    });
    if (on_tick) arm();
    run();
    if (stopped) return false;
    if (ec == http::error::need_buffer) ec = {};
    if (ec) fail("read response from", ec);
    return true;
  }

  void close() {
    beast::error_code ignored;
    stream_.socket().shutdown(Local::socket::shutdown_both, ignored);
  }

 private:
  void run() {
    io_.restart();
    io_.run();
  }
  [[noreturn]] void fail(const char* what, const beast::error_code& ec) {
    if (ec == beast::error::timeout)
      throw UnreachableError("client.timeout",
                             std::string("timed out trying to ") + what + " assayd at " + path_);
    throw UnreachableError("client.unreachable", std::string("cannot ") + what + " assayd at " +
                                                     path_ + ": " + ec.message() +
                                                     " (is assayd running? see --socket)");
  }

  std::string path_;
  asio::io_context io_;
  Stream stream_;
  beast::flat_buffer buffer_;
};

http::verb verb_of(std::string_view method) {
  http::verb v = http::string_to_verb({method.data(), method.size()});
  if (v == http::verb::unknown)
    throw common::Error("client.bad_method", "unknown HTTP method \"" + std::string(method) + "\"");
  return v;
}

http::request<http::string_body> make_request(std::string_view method, std::string_view target,
                                              std::string body, std::string_view content_type) {
  http::request<http::string_body> req{verb_of(method), std::string(target), 11};
  req.set(http::field::host, "localhost");
  req.set(http::field::user_agent, "assay-client");
  req.set(http::field::connection, "close");
  if (!body.empty() || req.method() == http::verb::post) {
    req.set(http::field::content_type,
            beast::string_view(content_type.data(), content_type.size()));
    req.body() = std::move(body);
  }
  req.prepare_payload();
  return req;
}

[[noreturn]] void throw_api_error(int status, std::string_view body) {
  std::string code = "http." + std::to_string(status);
  std::string message;
  try {
    common::Json doc = common::parse_strict(body);
    const common::Json& e = doc.at("error");
    code = e.at("code").get<std::string>();
    message = e.at("message").get<std::string>();
  } catch (const std::exception&) {
    // Not the daemon's error shape (a proxy, an old daemon): show the start of the raw body.
    message = std::string(body.substr(0, 500));
  }
  throw ApiError(status, code,
                 "assayd answered HTTP " + std::to_string(status) + " " + code +
                     (message.empty() ? "" : ": " + message));
}

}  // namespace

Response Api::request(std::string_view method, std::string_view target, std::string body,
                      std::string_view content_type) const {
  Connection conn(options_.socket_path, options_.timeout);
  auto req = make_request(method, target, std::move(body), content_type);
  conn.write(req, options_.timeout);
  http::response_parser<http::string_body> parser;
  parser.body_limit(options_.max_body_bytes);
  conn.read(parser, options_.timeout);
  conn.close();
  auto& res = parser.get();
  Response out;
  out.status = static_cast<int>(res.result_int());
  out.content_type = std::string(res[http::field::content_type]);
  out.body = std::move(res.body());
  if (out.status < 200 || out.status > 299) throw_api_error(out.status, out.body);
  return out;
}

common::Json Api::get_json(std::string_view target) const {
  Response r = request("GET", target);
  try {
    return common::parse_strict(r.body);
  } catch (const common::Error& e) {
    throw common::Error("client.bad_response", "assayd's answer to GET " + std::string(target) +
                                                   " is not valid JSON: " + e.what());
  }
}

void Api::stream_lines(std::string_view target, const StreamHooks& hooks) const {
  Connection conn(options_.socket_path, options_.timeout);
  auto req = make_request("GET", target, {}, {});
  conn.write(req, options_.timeout);
  http::response_parser<http::buffer_body> parser;
  parser.body_limit(boost::none);  // a stream lasts as long as the job
  conn.read_header(parser, options_.timeout);
  int status = static_cast<int>(parser.get().result_int());

  std::string pending;
  char chunk[8192];
  while (!parser.is_done()) {
    parser.get().body().data = chunk;
    parser.get().body().size = sizeof chunk;
    if (!conn.read_some(parser, hooks.tick_every, status >= 300 ? nullptr : hooks.on_tick)) {
      conn.close();
      return;
    }
    pending.append(chunk, sizeof chunk - parser.get().body().size);
    if (status >= 300) continue;
    std::size_t start = 0;
    for (std::size_t nl; (nl = pending.find('\n', start)) != std::string::npos; start = nl + 1) {
      std::string_view line(pending.data() + start, nl - start);
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      if (line.empty()) continue;  // keep-alive blank lines
      if (!hooks.on_line(line)) {
        conn.close();
        return;
      }
    }
    pending.erase(0, start);
  }
  if (status < 200 || status > 299) throw_api_error(status, pending);
  if (!pending.empty()) hooks.on_line(pending);  // a last line without its newline
  conn.close();
}

std::string job_path(std::string_view id, std::string_view suffix) {
  bool ok = !id.empty() && id.size() <= 128;
  for (char c : id)
    ok = ok && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                c == '-' || c == '_' || c == '.' || c == ':');
  if (!ok || id == "." || id == "..")
    throw common::Error("client.bad_id",
                        "\"" + std::string(id) + "\" is not a job id (letters, digits, - _ . :)");
  std::string path = "/v1/jobs/" + std::string(id);
  if (!suffix.empty()) path += "/" + std::string(suffix);
  return path;
}

}  // namespace assay::client
