// A TCP listener for Prometheus (config.metrics_listen, off by default): on a loopback address
// only, it answers GET and HEAD /metrics with the same text as the unix socket's /metrics and
// nothing else (every other path 404, another method 405), one request per connection, no body
// read, at most kMaxConnections open at once, each closed after kTimeout. The job API stays on
// the unix socket, where peer credentials decide what a caller may see and do.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

#include "supervisor/config.h"
#include "supervisor/service.h"

namespace assay::supervisor::api {

class MetricsListener {
 public:
  static constexpr std::size_t kMaxConnections = 32;
  static constexpr std::chrono::seconds kTimeout{5};

  // Binds `address` (Error("config.invalid") naming it when the bind fails: in use, say).
  MetricsListener(boost::asio::io_context& io, Service& service, const ListenAddress& address);
  void start();
  void stop();

 private:
  void do_accept();

  Service& service_;
  boost::asio::ip::tcp::acceptor acceptor_;
  std::shared_ptr<std::size_t> open_ = std::make_shared<std::size_t>(0);
  bool stopped_ = false;
};

}  // namespace assay::supervisor::api
