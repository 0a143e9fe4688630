#include "supervisor/http.h"

#include <array>
#include <fstream>
#include <sstream>

#include <grp.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "common/error.h"

namespace assay::supervisor {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using local = asio::local::stream_protocol;
using Stream = beast::basic_stream<local, asio::any_io_executor, beast::unlimited_rate_policy>;
using common::Error;

namespace {

bool in_group(pid_t pid, gid_t primary, gid_t wanted) {
  if (primary == wanted) return true;
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Groups:", 0) != 0) continue;
    std::istringstream groups(line.substr(7));
    gid_t g;
    while (groups >> g)
      if (g == wanted) return true;
  }
  return false;
}

Peer peer_of(int fd, const Config& config) {
  Peer p;
  struct ucred cred {};
  socklen_t len = sizeof cred;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
    common::throw_errno("http.peercred", "getsockopt(SO_PEERCRED)", errno);
  p.uid = cred.uid;
  p.gid = cred.gid;
  p.pid = cred.pid;
  p.admin = cred.uid == 0;
  if (!p.admin && !config.admin_group.empty()) {
    if (struct group* gr = ::getgrnam(config.admin_group.c_str()))
      p.admin = in_group(cred.pid, cred.gid, gr->gr_gid);
  }
  return p;
}

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(local::socket socket, Service& service, std::shared_ptr<std::size_t> connections)
      : stream_(std::move(socket)), service_(service), connections_(std::move(connections)) {
    ++*connections_;
  }
  ~Session() {
    --*connections_;
    if (watch_handle_) service_.unwatch(watch_id_, watch_handle_);
  }

  void start() {
    try {
      peer_ = peer_of(stream_.socket().native_handle(), service_.config());
    } catch (const Error& e) {
      spdlog::warn("dropping a connection: {}", e.what());
      return;
    }
    do_read();
  }

 private:
  void do_read() {
    parser_.emplace();
    parser_->header_limit(static_cast<std::uint32_t>(service_.config().max_header_bytes));
    parser_->body_limit(service_.config().max_body_bytes);
    // One deadline for the whole request: a client that trickles bytes is cut off. A keep-alive
    // connection may first sit idle for idle_timeout_ms before its next request starts.
    const Config& c = service_.config();
    stream_.expires_after(
        std::chrono::milliseconds(c.read_timeout_ms + (served_ ? c.idle_timeout_ms : 0)));
    http::async_read(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, std::size_t) { self->on_read(ec); });
  }

  void on_read(beast::error_code ec) {
    if (ec == http::error::end_of_stream || ec == beast::error::timeout ||
        ec == asio::error::connection_reset || ec == asio::error::operation_aborted)
      return close();
    if (ec == http::error::body_limit)
      return send_error(413, "api.body_too_large",
                        "request body exceeds max_body_bytes = " +
                            std::to_string(service_.config().max_body_bytes));
    if (ec == http::error::header_limit)
      return send_error(431, "api.header_too_large",
                        "request header exceeds max_header_bytes = " +
                            std::to_string(service_.config().max_header_bytes));
    if (ec) return send_error(400, "api.bad_http", "malformed HTTP request: " + ec.message());

    auto& req = parser_->get();
    keep_alive_ = req.keep_alive();
    std::string target(req.target());
    std::string method(req.method_string());
    if (target.size() > 2048)
      return send_error(414, "api.uri_too_long", "request target longer than 2048 bytes");

    // /v1/jobs/{id}/events streams; everything else is one response.
    const std::string prefix = "/v1/jobs/";
    const std::string suffix = "/events";
    if (method == "GET" && target.rfind(prefix, 0) == 0 &&
        target.size() > prefix.size() + suffix.size() &&
        target.compare(target.size() - suffix.size(), suffix.size(), suffix) == 0)
      return start_events(
          target.substr(prefix.size(), target.size() - prefix.size() - suffix.size()));

    ApiResponse r = service_.handle(method, target, req.body(), peer_);
    send(std::move(r));
  }

  void send_error(unsigned status, const std::string& code, const std::string& message) {
    keep_alive_ = false;
    send(error_response(status, code, message));
  }

  void send(ApiResponse r) {
    stream_.expires_after(std::chrono::milliseconds(service_.config().read_timeout_ms * 6));
    if (!r.file.empty()) {
      http::file_body::value_type file;
      beast::error_code ec;
      file.open(r.file.c_str(), beast::file_mode::scan, ec);
      if (ec)
        return send_error(500, "api.artifact",
                          "cannot open " + r.file.string() + ": " + ec.message());
      auto res = std::make_shared<http::response<http::file_body>>(
          std::piecewise_construct, std::make_tuple(std::move(file)),
          std::make_tuple(http::status::ok, 11));
      res->set(http::field::content_type, r.content_type);
      res->keep_alive(keep_alive_);
      res->prepare_payload();
      return http::async_write(stream_, *res,
                               [self = shared_from_this(), res](beast::error_code ec, std::size_t) {
                                 self->after_write(ec);
                               });
    }
    auto res = std::make_shared<http::response<http::string_body>>(
        static_cast<http::status>(r.status), 11);
    res->set(http::field::content_type, r.content_type);
    res->set(http::field::server, "assayd");
    res->keep_alive(keep_alive_);
    res->body() = std::move(r.body);
    res->prepare_payload();
    http::async_write(stream_, *res,
                      [self = shared_from_this(), res](beast::error_code ec, std::size_t) {
                        self->after_write(ec);
                      });
  }

  void after_write(beast::error_code ec) {
    ++served_;
    if (ec || !keep_alive_) return close();
    do_read();
  }

  void close() {
    beast::error_code ec;
    stream_.socket().shutdown(local::socket::shutdown_both, ec);
    stream_.close();
  }

  // Streaming: a chunked response, one NDJSON line per chunk, ending when the job is terminal.
  void start_events(const std::string& id) {
    std::weak_ptr<Session> weak = weak_from_this();
    std::uint64_t handle = 0;
    auto err = service_.watch(
        id, peer_,
        [weak](const std::string& line, bool last) {
          if (auto self = weak.lock()) self->queue_chunk(line, last);
        },
        handle);
    if (err) return send(std::move(*err));
    watch_id_ = id;
    watch_handle_ = handle;
    keep_alive_ = false;
    stream_.expires_never();
    auto res = std::make_shared<http::response<http::empty_body>>(http::status::ok, 11);
    res->set(http::field::content_type, "application/x-ndjson");
    res->chunked(true);
    auto sr = std::make_shared<http::response_serializer<http::empty_body>>(*res);
    header_sent_ = false;
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
    pending_.push_back(line);
    if (last) {
      ended_ = true;
      if (watch_handle_) watch_handle_ = 0;  // the service dropped us already
    }
    pump();
  }

  void pump() {
    if (!header_sent_ || writing_) return;
    if (pending_.empty()) {
      if (ended_ && !final_sent_) {
        final_sent_ = true;
        writing_ = true;
        return asio::async_write(stream_, http::make_chunk_last(),
                                 [self = shared_from_this()](beast::error_code, std::size_t) {
                                   self->writing_ = false;
                                   self->close();
                                 });
      }
      return;
    }
    writing_ = true;
    auto line = std::make_shared<std::string>(std::move(pending_.front()));
    pending_.erase(pending_.begin());
    asio::async_write(stream_, http::make_chunk(asio::buffer(*line)),
                      [self = shared_from_this(), line](beast::error_code ec, std::size_t) {
                        self->writing_ = false;
                        if (ec) return self->close();
                        self->pump();
                      });
  }

  Stream stream_;
  Service& service_;
  std::shared_ptr<std::size_t> connections_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  Peer peer_;
  bool keep_alive_ = false;
  std::uint64_t served_ = 0;  // responses written on this connection
  std::string watch_id_;
  std::uint64_t watch_handle_ = 0;
  std::vector<std::string> pending_;
  bool header_sent_ = false, writing_ = false, ended_ = false, final_sent_ = false;
  std::array<char, 256> scratch_{};
};

// Refuses a connection over max_connections with a 503 and closes it.
void refuse(local::socket socket) {
  auto s = std::make_shared<local::socket>(std::move(socket));
  auto msg = std::make_shared<std::string>(
      "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: "
      "close\r\nContent-Length: 88\r\n\r\n");
  std::string body =
      R"({"error":{"code":"api.too_many_connections","message":"connection limit reached"}})";
  body.resize(88, ' ');
  body.back() = '\n';
  *msg += body;
  asio::async_write(*s, asio::buffer(*msg), [s, msg](beast::error_code, std::size_t) {
    beast::error_code ec;
    s->close(ec);
  });
}

}  // namespace

HttpServer::HttpServer(asio::io_context& io, Service& service)
    : io_(io), service_(service), acceptor_(io) {
  const Config& config = service.config();
  if (config.socket.empty()) {
    int n = sd_listen_fds(1);
    if (n < 1)
      throw Error("config.invalid",
                  "no --socket given and systemd passed no socket (sd_listen_fds = " +
                      std::to_string(n) + ")");
    acceptor_.assign(local(), SD_LISTEN_FDS_START);
    spdlog::info("listening on the socket systemd passed (fd {})", SD_LISTEN_FDS_START);
    return;
  }
  const auto& path = config.socket;
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode))
      throw Error("config.invalid", "socket path " + path.string() + " exists and is not a socket");
    // A live daemon answers connect(); a stale socket file refuses it.
    local::socket probe(io);
    beast::error_code ec;
    probe.connect(local::endpoint(path.string()), ec);
    if (!ec) throw Error("config.invalid", "another daemon is listening on " + path.string());
    ::unlink(path.c_str());
  }
  std::filesystem::create_directories(path.parent_path());
  acceptor_.open(local());
  mode_t old = ::umask(0117);  // the socket is born 0660: no window where it is wider
  beast::error_code ec;
  acceptor_.bind(local::endpoint(path.string()), ec);
  ::umask(old);
  if (ec) throw Error("config.invalid", "cannot bind " + path.string() + ": " + ec.message());
  ::chmod(path.c_str(), 0660);
  if (!config.socket_group.empty()) {
    struct group* gr = ::getgrnam(config.socket_group.c_str());
    if (!gr)
      throw Error("config.invalid", "socket_group \"" + config.socket_group + "\" does not exist");
    if (::chown(path.c_str(), static_cast<uid_t>(-1), gr->gr_gid) != 0)
      common::throw_errno("config.invalid", "chown " + path.string(), errno);
  }
  acceptor_.listen(asio::socket_base::max_listen_connections);
  spdlog::info("listening on {}", path.string());
}

void HttpServer::start() {
  do_accept();
}

void HttpServer::stop() {
  stopped_ = true;
  beast::error_code ec;
  acceptor_.close(ec);
  if (!service_.config().socket.empty()) ::unlink(service_.config().socket.c_str());
}

void HttpServer::do_accept() {
  acceptor_.async_accept([this](beast::error_code ec, local::socket socket) {
    if (stopped_) return;
    if (ec) {
      spdlog::warn("accept: {}", ec.message());
    } else if (*connections_ >= service_.config().max_connections) {
      service_.count_connection_refused();
      refuse(std::move(socket));
    } else {
      std::make_shared<Session>(std::move(socket), service_, connections_)->start();
    }
    do_accept();
  });
}

}  // namespace assay::supervisor
