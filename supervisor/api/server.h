// The HTTP/1.1 front of assayd over a unix socket (Boost.Beast): one Session per connection,
// async read -> route -> async write. Limits that keep one client from starving the others:
// connections per user (admins exempt), request bodies buffered across all connections, event
// streams; a request must arrive within read_timeout_ms. Accept backs off on EMFILE.
#pragma once

#include <cstddef>
#include <map>
#include <memory>

#include <sys/types.h>
#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/steady_timer.hpp>

#include "supervisor/service.h"

namespace assay::supervisor::api {

// What all sessions share: the counts the limits are checked against.
struct Budget {
  std::size_t connections = 0;
  std::map<uid_t, std::size_t> per_user;
  std::size_t buffered_bytes = 0;
};

class Server {
 public:
  // Listens on config.socket (created 0660, group socket_group when set; a stale socket file is
  // replaced, a live one is an error; its directory must exist), or on the socket systemd passed
  // when the path is empty.
  Server(boost::asio::io_context& io, Service& service);
  void start();
  void stop();

 private:
  void do_accept();
  void admit(boost::asio::local::stream_protocol::socket socket);

  boost::asio::io_context& io_;
  Service& service_;
  boost::asio::local::stream_protocol::acceptor acceptor_;
  boost::asio::steady_timer backoff_;
  std::shared_ptr<Budget> budget_ = std::make_shared<Budget>();
  bool stopped_ = false;
};

// Peer credentials of a connected unix socket (SO_PEERCRED), admin when root or in admin_group.
Peer peer_of(int fd, const Config& config);

}  // namespace assay::supervisor::api
