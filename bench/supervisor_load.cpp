// Load generator for bench/supervisor.sh: N clients, each on one keep-alive unix-socket
// connection, each sending M GET requests and reading the replies. With --baseline it first
// serves the same reply bytes itself (a thread per connection, no parsing beyond the request
// end) so the run measures the transport's floor on the same machine.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

namespace {

int connect_unix(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool send_all(int fd, const std::string& s) {
  std::size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<std::size_t>(n);
  }
  return true;
}

// Reads one HTTP response (Content-Length framed); returns its status or 0; keeps extra bytes.
int read_response(int fd, std::string& buf, std::string* whole = nullptr) {
  char tmp[65536];
  while (true) {
    auto end = buf.find("\r\n\r\n");
    if (end != std::string::npos) {
      std::size_t len = 0;
      auto cl = buf.find("Content-Length: ");
      if (cl == std::string::npos) cl = buf.find("content-length: ");
      if (cl != std::string::npos && cl < end)
        len = std::strtoul(buf.c_str() + cl + 16, nullptr, 10);
      if (buf.size() >= end + 4 + len) {
        int status = std::atoi(buf.substr(9, 3).c_str());
        if (whole) *whole = buf.substr(0, end + 4 + len);
        buf.erase(0, end + 4 + len);
        return status;
      }
    }
    ssize_t n = ::read(fd, tmp, sizeof tmp);
    if (n <= 0) return 0;
    buf.append(tmp, static_cast<std::size_t>(n));
  }
}

void serve_fixed(int listener, std::string reply) {
  while (true) {
    int c = ::accept(listener, nullptr, nullptr);
    if (c < 0) return;
    std::thread([c, reply] {
      std::string buf;
      char tmp[65536];
      while (true) {
        ssize_t n = ::read(c, tmp, sizeof tmp);
        if (n <= 0) break;
        buf.append(tmp, static_cast<std::size_t>(n));
        std::size_t end;
        while ((end = buf.find("\r\n\r\n")) != std::string::npos) {
          buf.erase(0, end + 4);
          if (!send_all(c, reply)) break;
        }
      }
      ::close(c);
    }).detach();
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string socket, target = "/v1/health";
  int clients = 64, requests = 100;
  bool baseline = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--socket")
      socket = next();
    else if (a == "--target")
      target = next();
    else if (a == "--clients")
      clients = std::atoi(next().c_str());
    else if (a == "--requests")
      requests = std::atoi(next().c_str());
    else if (a == "--baseline")
      baseline = true;
    else {
      std::fprintf(stderr,
                   "usage: supervisor_load --socket PATH [--target /v1/...] [--clients 64] "
                   "[--requests 100] [--baseline]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  if (socket.empty()) {
    std::fprintf(stderr, "supervisor_load: --socket is required\n");
    return 2;
  }
  std::string req = "GET " + target + " HTTP/1.1\r\nHost: assayd\r\n\r\n";
  if (baseline) {
    // Learn the real reply once, then serve exactly those bytes from our own socket.
    int fd = connect_unix(socket);
    if (fd < 0) return std::perror("connect"), 1;
    std::string buf, reply;
    send_all(fd, req);
    if (read_response(fd, buf, &reply) != 200)
      return std::fprintf(stderr, "no 200 from assayd\n"), 1;
    ::close(fd);
    socket += ".baseline";
    ::unlink(socket.c_str());
    int l = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", socket.c_str());
    if (::bind(l, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(l, 1024) != 0)
      return std::perror("bind"), 1;
    std::thread(serve_fixed, l, reply).detach();
  }
  std::atomic<long> ok{0}, bad{0};
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c)
    threads.emplace_back([&] {
      int fd = connect_unix(socket);
      if (fd < 0) {
        bad += requests;
        return;
      }
      std::string buf;
      for (int i = 0; i < requests; ++i) {
        if (!send_all(fd, req) || read_response(fd, buf) != 200) {
          bad += requests - i;
          break;
        }
        ++ok;
      }
      ::close(fd);
    });
  for (auto& t : threads) t.join();
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf(
      "{\"mode\":\"%s\",\"clients\":%d,\"requests\":%ld,\"errors\":%ld,\"seconds\":%.4f,"
      "\"rps\":%.1f}\n",
      baseline ? "baseline" : "assayd", clients, ok.load(), bad.load(), secs, ok / secs);
  if (baseline) ::unlink(socket.c_str());
  return bad ? 1 : 0;
}
