// The HTTP/1.1 front of assayd over a unix socket (Boost.Beast): one Session object per
// connection, async read -> route -> async write, with body/header limits, a read deadline
// that cuts off a client trickling bytes, and a connection cap.
#pragma once

#include <cstddef>
#include <filesystem>
#include <memory>

#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>

#include "supervisor/service.h"

namespace assay::supervisor {

class HttpServer {
 public:
  // Listens on `socket_path` (created 0660, group `group` when set; a stale socket file is
  // replaced, a live one is an error), or on the socket systemd passed when the path is empty.
  HttpServer(boost::asio::io_context& io, Service& service);
  void start();
  void stop();
  std::size_t connections() const { return *connections_; }

 private:
  void do_accept();
  boost::asio::io_context& io_;
  Service& service_;
  boost::asio::local::stream_protocol::acceptor acceptor_;
  std::shared_ptr<std::size_t> connections_ = std::make_shared<std::size_t>(0);
  bool stopped_ = false;
};

}  // namespace assay::supervisor
