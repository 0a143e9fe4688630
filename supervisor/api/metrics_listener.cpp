#include "supervisor/api/metrics_listener.h"

#include <string>

#include <spdlog/spdlog.h>
#include <boost/asio/ip/address.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "common/error.h"
#include "supervisor/api/answer.h"
#include "supervisor/api/routes.h"

namespace assay::supervisor::api {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

namespace {

// One connection: one request read (headers only; a body is refused), one answer, closed.
class MetricsSession : public std::enable_shared_from_this<MetricsSession> {
 public:
  MetricsSession(tcp::socket socket, Service& service, std::shared_ptr<std::size_t> open)
      : stream_(std::move(socket)), service_(service), open_(std::move(open)) {
    ++*open_;
  }
  ~MetricsSession() { --*open_; }

  void start() {
    parser_.header_limit(8 * 1024);
    parser_.body_limit(0);
    stream_.expires_after(MetricsListener::kTimeout);
    http::async_read(
        stream_, buffer_, parser_,
        [self = shared_from_this()](beast::error_code ec, std::size_t) { self->answer(ec); });
  }

 private:
  void answer(beast::error_code ec) {
    if (ec == http::error::end_of_stream || ec == beast::error::timeout) return;
    auto res = std::make_shared<http::response<http::string_body>>();
    res->version(11);
    res->set(http::field::server, "assayd");
    res->keep_alive(false);
    const auto& req = parser_.get();
    auto fail = [&](unsigned status, const std::string& code, const std::string& message) {
      Answer a = error_answer(status, code, message);
      res->result(status);
      res->set(http::field::content_type, "application/json");
      res->body() = a.body;
    };
    if (ec) {
      fail(400, "api.bad_request", "not a request this listener takes: " + ec.message());
    } else if (req.target() != "/metrics") {
      fail(404, "api.not_found",
           "this listener serves only GET /metrics; the API is on assayd's unix socket");
    } else if (req.method() != http::verb::get && req.method() != http::verb::head) {
      fail(405, "api.method_not_allowed", "/metrics takes GET or HEAD");
      res->set(http::field::allow, "GET, HEAD");
    } else {
      try {
        res->result(200);
        res->set(http::field::content_type, "text/plain; version=0.0.4");
        res->body() = render_metrics(service_);
      } catch (const std::exception& e) {
        fail(500, "supervisor.internal", std::string("internal error: ") + e.what());
      }
    }
    res->prepare_payload();
    if (!ec && req.method() == http::verb::head) res->body().clear();
    http::async_write(stream_, *res,
                      [self = shared_from_this(), res](beast::error_code, std::size_t) {
                        beast::error_code ignored;
                        self->stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
                      });
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  http::request_parser<http::empty_body> parser_;
  Service& service_;
  std::shared_ptr<std::size_t> open_;
};

}  // namespace

MetricsListener::MetricsListener(asio::io_context& io, Service& service,
                                 const ListenAddress& address)
    : service_(service), acceptor_(io) {
  tcp::endpoint endpoint(asio::ip::make_address(address.ip), address.port);
  beast::error_code ec;
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) acceptor_.bind(endpoint, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec)
    throw common::Error("config.invalid", "cannot listen for metrics on " + address.ip + ":" +
                                              std::to_string(address.port) + ": " + ec.message());
  spdlog::info("serving /metrics on {}:{}", address.ip, address.port);
}

void MetricsListener::start() {
  do_accept();
}

void MetricsListener::stop() {
  stopped_ = true;
  beast::error_code ignored;
  acceptor_.close(ignored);
}

void MetricsListener::do_accept() {
  acceptor_.async_accept([this](beast::error_code ec, tcp::socket socket) {
    if (stopped_) return;
    if (!ec) {
      if (*open_ >= kMaxConnections) {
        beast::error_code ignored;
        socket.close(ignored);  // a scraper retries; nothing is queued without bound
      } else {
        std::make_shared<MetricsSession>(std::move(socket), service_, open_)->start();
      }
    } else if (ec == asio::error::operation_aborted) {
      return;
    }
    do_accept();
  });
}

}  // namespace assay::supervisor::api
