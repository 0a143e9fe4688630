// The three sd-daemon calls assayd makes (sd_listen_fds, sd_notify, sd_watchdog_enabled),
// implemented on the documented environment and datagram protocols (sd_listen_fds(3),
// sd_notify(3), sd_watchdog_enabled(3)) instead of linking libsystemd. Linking it costs every
// assayd start ~2 ms of relocations (it pulls libgcrypt, lzma, zstd, lz4, gpg-error), which
// `assayd contain` pays per worker. systemd once shipped sd-daemon.c as a drop-in for this.
#include <systemd/sd-daemon.h>

#include <cerrno>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

namespace {

// True when `name` holds this process's pid; -errno when it is malformed, 0 when unset.
int env_is_own_pid(const char* name) {
  const char* text = std::getenv(name);
  if (!text) return 0;
  std::string_view s(text);
  pid_t pid = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), pid);
  if (ec != std::errc() || p != s.data() + s.size() || pid <= 0) return -EINVAL;
  return pid == ::getpid() ? 1 : 0;
}

bool parse_u64(const char* text, std::uint64_t& out) {
  std::string_view s(text);
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && p == s.data() + s.size() && !s.empty();
}

}  // namespace

extern "C" {

int sd_listen_fds(int unset_environment) {
  int r = env_is_own_pid("LISTEN_PID");
  int n = 0;
  if (r > 0) {
    std::uint64_t count = 0;
    const char* fds = std::getenv("LISTEN_FDS");
    if (!fds || !parse_u64(fds, count) || count > 4096) {
      r = -EINVAL;
    } else {
      n = static_cast<int>(count);
      for (int fd = SD_LISTEN_FDS_START; fd < SD_LISTEN_FDS_START + n; ++fd) {
        int flags = ::fcntl(fd, F_GETFD);
        if (flags < 0 || ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC) < 0) {
          r = -errno;
          break;
        }
      }
    }
  }
  if (unset_environment) {
    ::unsetenv("LISTEN_PID");
    ::unsetenv("LISTEN_FDS");
    ::unsetenv("LISTEN_FDNAMES");
  }
  return r > 0 ? n : r;
}

int sd_notify(int unset_environment, const char* state) {
  const char* path = std::getenv("NOTIFY_SOCKET");
  int r = 0;
  if (path && state && *state) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::size_t len = std::strlen(path);
    if ((path[0] != '/' && path[0] != '@') || len < 2 || len >= sizeof addr.sun_path) {
      r = -EAFNOSUPPORT;  // e.g. "vsock:": not used by assayd's units
    } else {
      std::memcpy(addr.sun_path, path, len);
      if (path[0] == '@') addr.sun_path[0] = '\0';  // abstract namespace
      int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
      if (fd < 0) {
        r = -errno;
      } else {
        auto addr_len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + len);
        ssize_t sent = ::sendto(fd, state, std::strlen(state), MSG_NOSIGNAL,
                                reinterpret_cast<const sockaddr*>(&addr), addr_len);
        r = sent < 0 ? -errno : 1;
        ::close(fd);
      }
    }
  }
  if (unset_environment) ::unsetenv("NOTIFY_SOCKET");
  return r;
}

int sd_watchdog_enabled(int unset_environment, std::uint64_t* usec) {
  int r = 0;
  const char* text = std::getenv("WATCHDOG_USEC");
  if (text) {
    std::uint64_t value = 0;
    if (!parse_u64(text, value) || value == 0) {
      r = -EINVAL;
    } else {
      int own = env_is_own_pid("WATCHDOG_PID");
      // No WATCHDOG_PID: meant for us. One for another process (our parent): not for us.
      r = own < 0 ? own : (own > 0 || !std::getenv("WATCHDOG_PID")) ? 1 : 0;
      if (r > 0 && usec) *usec = value;
    }
  }
  if (unset_environment) {
    ::unsetenv("WATCHDOG_USEC");
    ::unsetenv("WATCHDOG_PID");
  }
  return r;
}

}  // extern "C"
