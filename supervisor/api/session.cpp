#include "supervisor/api/session.h"

#include <array>
#include <deque>
#include <optional>

#include <spdlog/spdlog.h>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "supervisor/api/routes.h"

namespace assay::supervisor::api {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using local = asio::local::stream_protocol;
using Stream = beast::basic_stream<local, asio::any_io_executor, beast::unlimited_rate_policy>;

namespace {

// What one /events stream may hold unsent (its replay of a job's earlier events included).
constexpr std::size_t kMaxPendingStreamBytes = 4 << 20;

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(local::socket socket, Service& service, const Peer& peer, std::shared_ptr<Budget> budget)
      : stream_(std::move(socket)), service_(service), peer_(peer), budget_(std::move(budget)) {
    ++budget_->connections;
    ++budget_->per_user[peer_.uid];
  }
  ~Session() {
    release_body();
    --budget_->connections;
    if (--budget_->per_user[peer_.uid] == 0) budget_->per_user.erase(peer_.uid);
    if (watch_handle_) service_.unwatch(watch_id_, watch_handle_);
  }

  void read_header() {
    parser_.emplace();
    const Config& c = service_.config();
    parser_->header_limit(static_cast<std::uint32_t>(c.max_header_bytes));
    parser_->body_limit(c.max_body_bytes);
    // One deadline for the whole request: a client that trickles bytes is cut off. A keep-alive
    // connection may first sit idle for idle_timeout_ms before its next request starts.
    stream_.expires_after(
        std::chrono::milliseconds(c.read_timeout_ms + (served_ ? c.idle_timeout_ms : 0)));
    http::async_read_header(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, std::size_t) { self->on_header(ec); });
  }

 private:
  bool read_failed(beast::error_code ec) {
    if (!ec) return false;
    if (ec == http::error::end_of_stream || ec == beast::error::timeout ||
        ec == asio::error::connection_reset || ec == asio::error::operation_aborted ||
        ec == asio::error::eof)
      close();
    else if (ec == http::error::body_limit)
      send_error(413, "api.body_too_large",
                 "request body exceeds max_body_bytes = " +
                     std::to_string(service_.config().max_body_bytes));
    else if (ec == http::error::header_limit)
      send_error(431, "api.header_too_large",
                 "request header exceeds max_header_bytes = " +
                     std::to_string(service_.config().max_header_bytes));
    else
      send_error(400, "api.bad_http", "malformed HTTP request: " + ec.message());
    return true;
  }

  void on_header(beast::error_code ec) {
    if (read_failed(ec)) return;
    // The body is held in memory until answered: reserve its size from the shared budget first.
    const Config& c = service_.config();
    std::uint64_t need =
        parser_->content_length().value_or(parser_->chunked() ? c.max_body_bytes : 0);
    if (need > c.max_body_bytes)
      return send_error(413, "api.body_too_large",
                        "request body of " + std::to_string(need) +
                            " bytes exceeds max_body_bytes = " + std::to_string(c.max_body_bytes));
    if (budget_->buffered_bytes + need > c.max_buffered_bytes)
      return send_error(503, "api.busy",
                        "request bodies being received fill max_buffered_bytes = " +
                            std::to_string(c.max_buffered_bytes) + "; try again");
    reserved_ = need;
    budget_->buffered_bytes += need;
    http::async_read(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, std::size_t) { self->on_body(ec); });
  }

  void release_body() {
    budget_->buffered_bytes -= reserved_;
    reserved_ = 0;
  }

  void on_body(beast::error_code ec) {
    if (read_failed(ec)) return;
    auto& req = parser_->get();
    keep_alive_ = req.keep_alive();
    head_ = req.method() == http::verb::head;
    std::string target(req.target());
    if (target.size() > 2048)
      return send_error(414, "api.uri_too_long", "request target longer than 2048 bytes");
    Answer a = route(service_, std::string(req.method_string()), target, req.body(), peer_);
    parser_.reset();  // the body's memory goes back before the answer is written
    release_body();
    if (!a.stream_job.empty()) return start_events(a.stream_job);
    send(std::move(a));
  }

  void send_error(unsigned status, const std::string& code, const std::string& message) {
    keep_alive_ = false;
    send(error_answer(status, code, message));
  }

  template <class Body>
  void write(std::shared_ptr<http::response<Body>> res) {
    http::async_write(stream_, *res,
                      [self = shared_from_this(), res](beast::error_code ec, std::size_t) {
                        self->after_write(ec);
                      });
  }

  void send(Answer a) {
    stream_.expires_after(std::chrono::milliseconds(service_.config().read_timeout_ms * 6));
    auto decorate = [&](auto& res) {
      res.set(http::field::content_type, a.content_type);
      res.set(http::field::server, "assayd");
      if (!a.allow.empty()) res.set(http::field::allow, a.allow);
      res.keep_alive(keep_alive_);
    };
    if (!a.file.empty()) {
      http::file_body::value_type file;
      beast::error_code ec;
      file.open(a.file.c_str(), beast::file_mode::scan, ec);
      if (ec)
        return send_error(500, "api.artifact",
                          "cannot open " + a.file.string() + ": " + ec.message());
      if (head_) {
        auto res = std::make_shared<http::response<http::empty_body>>(http::status::ok, 11);
        decorate(*res);
        res->content_length(file.size());
        return write(res);
      }
      auto res = std::make_shared<http::response<http::file_body>>(
          std::piecewise_construct, std::make_tuple(std::move(file)),
          std::make_tuple(http::status::ok, 11));
      decorate(*res);
      res->prepare_payload();
      return write(res);
    }
    auto res = std::make_shared<http::response<http::string_body>>(
        static_cast<http::status>(a.status), 11);
    decorate(*res);
    res->body() = std::move(a.body);
    res->prepare_payload();
    if (head_) res->body().clear();  // Content-Length stays that of the GET answer
    write(res);
  }

  void after_write(beast::error_code ec) {
    ++served_;
    if (ec || !keep_alive_) return close();
    read_header();
  }

  void close() {
    beast::error_code ec;
    stream_.socket().shutdown(local::socket::shutdown_both, ec);
    stream_.close();
  }

  // Streaming: a chunked response, one NDJSON line per chunk, ending when the job is terminal.
  void start_events(const std::string& id) {
    std::weak_ptr<Session> weak = weak_from_this();
    try {
      watch_handle_ = service_.watch(id, peer_, [weak](const std::string& line, bool last) {
        if (auto self = weak.lock()) self->queue_chunk(line, last);
      });
    } catch (const common::Error& e) {
      pending_.clear();
      return send(error_answer(e));
    }
    watch_id_ = id;
    if (dropped_) {  // its replay alone was more than a stream may hold
      if (watch_handle_) service_.unwatch(id, watch_handle_);
      watch_handle_ = 0;
      return;
    }
    keep_alive_ = false;
    stream_.expires_never();
    auto res = std::make_shared<http::response<http::empty_body>>(http::status::ok, 11);
    res->set(http::field::content_type, "application/x-ndjson");
    res->chunked(true);
    auto sr = std::make_shared<http::response_serializer<http::empty_body>>(*res);
    http::async_write_header(
        stream_, *sr, [self = shared_from_this(), res, sr](beast::error_code ec, std::size_t) {
          if (ec) return self->close();
          self->header_sent_ = true;
          self->watch_peer_close();
          self->pump();
        });
  }

  // The pending read keeps the session alive while it waits for events, and notices a client
  // that goes away (it sends nothing after its request).
  void watch_peer_close() {
    stream_.socket().async_read_some(
        asio::buffer(scratch_), [self = shared_from_this()](beast::error_code ec, std::size_t) {
          if (!ec) return self->watch_peer_close();
          if (self->watch_handle_) self->service_.unwatch(self->watch_id_, self->watch_handle_);
          self->watch_handle_ = 0;
          self->close();
        });
  }

  void queue_chunk(const std::string& line, bool last) {
    if (dropped_) return;
    // A reader slower than the events is dropped, never buffered without limit: it may
    // reconnect and be sent every event again.
    if (pending_bytes_ + line.size() > kMaxPendingStreamBytes) {
      dropped_ = true;
      pending_.clear();
      pending_bytes_ = 0;
      if (watch_handle_ && !last) {
        // Not from inside publish()'s loop over the sinks: it copied them, so this is safe.
        service_.unwatch(watch_id_, watch_handle_);
      }
      watch_handle_ = 0;
      return close();
    }
    pending_bytes_ += line.size();
    pending_.push_back(line);
    if (last) {
      ended_ = true;
      watch_handle_ = 0;  // the service dropped us already
    }
    pump();
  }

  void pump() {
    if (!header_sent_ || writing_) return;
    if (pending_.empty()) {
      if (ended_ && !final_sent_) {
        final_sent_ = writing_ = true;
        asio::async_write(stream_, http::make_chunk_last(),
                          [self = shared_from_this()](beast::error_code, std::size_t) {
                            self->writing_ = false;
                            self->close();
                          });
      }
      return;
    }
    writing_ = true;
    auto line = std::make_shared<std::string>(std::move(pending_.front()));
    pending_.pop_front();
    pending_bytes_ -= line->size();
    asio::async_write(stream_, http::make_chunk(asio::buffer(*line)),
                      [self = shared_from_this(), line](beast::error_code ec, std::size_t) {
                        self->writing_ = false;
                        if (ec) return self->close();
                        self->pump();
                      });
  }

  Stream stream_;
  Service& service_;
  Peer peer_;
  std::shared_ptr<Budget> budget_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::uint64_t reserved_ = 0;
  bool keep_alive_ = false, head_ = false;
  std::uint64_t served_ = 0;  // answers written on this connection
  std::string watch_id_;
  std::uint64_t watch_handle_ = 0;
  std::deque<std::string> pending_;
  std::size_t pending_bytes_ = 0;
  bool dropped_ = false;
  bool header_sent_ = false, writing_ = false, ended_ = false, final_sent_ = false;
  std::array<char, 256> scratch_{};
};

}  // namespace

void start_session(local::socket socket, Service& service, const Peer& peer,
                   std::shared_ptr<Budget> budget) {
  std::make_shared<Session>(std::move(socket), service, peer, std::move(budget))->read_header();
}

}  // namespace assay::supervisor::api
