#include "supervisor/api/server.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include <grp.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>
#include <boost/asio/write.hpp>

#include "common/error.h"
#include "supervisor/api/answer.h"
#include "supervisor/api/session.h"

namespace assay::supervisor::api {

namespace asio = boost::asio;
using local = asio::local::stream_protocol;
using common::Error;

namespace {

// Admins may go past max_connections by this many, so that an operator can still look in.
constexpr std::size_t kAdminReserve = 16;

bool in_group(pid_t pid, gid_t primary, gid_t wanted) {
  if (primary == wanted) return true;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/status", static_cast<int>(pid));
  std::FILE* f = std::fopen(path, "re");
  if (!f) return false;
  char line[4096];
  bool found = false;
  while (!found && std::fgets(line, sizeof line, f)) {
    if (std::strncmp(line, "Groups:", 7) != 0) continue;
    char* p = line + 7;
    char* end = nullptr;
    for (long g = std::strtol(p, &end, 10); end != p; g = std::strtol(p, &end, 10)) {
      if (static_cast<gid_t>(g) == wanted) found = true;
      p = end;
    }
  }
  std::fclose(f);
  return found;
}

// Answers 503 with `code` and closes, without reading the request.
void refuse(local::socket socket, const std::string& code, const std::string& message) {
  Answer a = error_answer(503, code, message);
  auto s = std::make_shared<local::socket>(std::move(socket));
  auto msg = std::make_shared<std::string>(
      "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: "
      "close\r\nContent-Length: " +
      std::to_string(a.body.size()) + "\r\n\r\n" + a.body);
  asio::async_write(*s, asio::buffer(*msg), [s, msg](boost::system::error_code, std::size_t) {
    boost::system::error_code ec;
    s->close(ec);
  });
}

}  // namespace

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
  if (!p.admin && !config.admin_group.empty())
    if (struct group* gr = ::getgrnam(config.admin_group.c_str()))
      p.admin = in_group(cred.pid, cred.gid, gr->gr_gid);
  return p;
}

Server::Server(asio::io_context& io, Service& service)
    : io_(io), service_(service), acceptor_(io), backoff_(io) {
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
    boost::system::error_code ec;
    probe.connect(local::endpoint(path.string()), ec);
    if (!ec) throw Error("config.invalid", "another daemon is listening on " + path.string());
    ::unlink(path.c_str());
  }
  acceptor_.open(local());
  // Workers must never inherit the listening socket.
  ::fcntl(acceptor_.native_handle(), F_SETFD, FD_CLOEXEC);
  mode_t old = ::umask(0117);  // the socket is born 0660: no window where it is wider
  boost::system::error_code ec;
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

void Server::start() {
  do_accept();
}

void Server::stop() {
  stopped_ = true;
  boost::system::error_code ec;
  acceptor_.close(ec);
  backoff_.cancel();
  if (!service_.config().socket.empty()) ::unlink(service_.config().socket.c_str());
}

void Server::do_accept() {
  acceptor_.async_accept([this](boost::system::error_code ec, local::socket socket) {
    if (stopped_) return;
    if (ec == asio::error::no_descriptors || ec == asio::error::no_buffer_space ||
        ec.value() == ENFILE || ec.value() == ENOMEM) {
      // Out of descriptors: the connections we have keep being served; try again shortly
      // instead of spinning on a connection we cannot take.
      spdlog::warn("accept: {}; retrying in 100 ms", ec.message());
      backoff_.expires_after(std::chrono::milliseconds(100));
      backoff_.async_wait([this](boost::system::error_code e) {
        if (!e && !stopped_) do_accept();
      });
      return;
    }
    if (ec)
      spdlog::warn("accept: {}", ec.message());
    else
      admit(std::move(socket));
    do_accept();
  });
}

void Server::admit(local::socket socket) {
  const Config& c = service_.config();
  ::fcntl(socket.native_handle(), F_SETFD, FD_CLOEXEC);
  Peer peer;
  try {
    peer = peer_of(socket.native_handle(), c);
  } catch (const Error& e) {
    spdlog::warn("dropping a connection: {}", e.what());
    return;
  }
  std::size_t mine = budget_->per_user.count(peer.uid) ? budget_->per_user[peer.uid] : 0;
  std::size_t cap = c.max_connections + (peer.admin ? kAdminReserve : 0);
  if (budget_->connections >= cap) {
    ++service_.metrics().connections_refused;
    return refuse(
        std::move(socket), "api.too_many_connections",
        "connection limit reached (max_connections = " + std::to_string(c.max_connections) + ")");
  }
  if (!peer.admin && mine >= c.max_connections_per_user) {
    ++service_.metrics().connections_refused;
    return refuse(std::move(socket), "api.too_many_connections",
                  "uid " + std::to_string(peer.uid) + " holds " + std::to_string(mine) +
                      " connections, the limit (max_connections_per_user)");
  }
  start_session(std::move(socket), service_, peer, budget_);
}

}  // namespace assay::supervisor::api
