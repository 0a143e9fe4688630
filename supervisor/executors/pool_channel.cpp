// The head-node channel of a Slurm pool (pool_channel.h).
#include "supervisor/executors/pool_channel.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>

#include <openssl/crypto.h>
#include <openssl/hmac.h>

#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>

#include "common/error.h"
#include "common/fs.h"
#include "common/identity.h"

namespace assay::supervisor {

using common::Error;
using common::Json;

namespace {

std::string from_hex(const std::string& hex) {
  auto value = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  std::string out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2) {
    int hi = value(hex[i]), lo = value(hex[i + 1]);
    if (hi < 0 || lo < 0) return {};
    out.push_back(static_cast<char>(hi * 16 + lo));
  }
  return out;
}

std::string fmt_octal(unsigned mode) {
  char out[8];
  std::snprintf(out, sizeof out, "%04o", mode);
  return out;
}

}  // namespace

std::string random_bytes(std::size_t n) {
  std::string raw(n, '\0');
  std::size_t got = 0;
  while (got < n) {
    ssize_t r = ::getrandom(raw.data() + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) common::throw_errno("pool.random", "getrandom", errno);
    got += static_cast<std::size_t>(r);
  }
  return raw;
}

std::string random_hex(std::size_t n) {
  const std::string raw = random_bytes(n);
  return common::hex({reinterpret_cast<const std::uint8_t*>(raw.data()), raw.size()});
}

boost::asio::ip::tcp::endpoint parse_endpoint(const std::string& text, const std::string& what) {
  const auto colon = text.rfind(':');
  const std::string port = colon == std::string::npos ? std::string() : text.substr(colon + 1);
  std::string host = colon == std::string::npos ? text : text.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  boost::system::error_code ec;
  auto address = boost::asio::ip::make_address(host, ec);
  if (ec || port.empty() || port.size() > 5 ||
      port.find_first_not_of("0123456789") != std::string::npos || std::stoul(port) > 65535)
    throw Error("pool.address",
                what + " \"" + text + "\" is not ADDRESS:PORT with an IP address and a port");
  return {address, static_cast<unsigned short>(std::stoul(port))};
}

std::string hmac_sha256(const std::string& key, const std::string& data) {
  unsigned char out[32];
  unsigned int length = sizeof out;
  if (!HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
            reinterpret_cast<const unsigned char*>(data.data()), data.size(), out, &length))
    throw Error("pool.crypto", "HMAC-SHA256 failed");
  return std::string(reinterpret_cast<char*>(out), length);
}

std::string pool_session_key(const std::string& pool_key, const std::string& node_nonce,
                             const std::string& head_nonce) {
  return hmac_sha256(pool_key, "assay-pool-session\n" + node_nonce + "\n" + head_nonce);
}

std::string read_pool_key(const std::string& path) {
  common::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (!fd) common::throw_errno("pool.key", "open the pool key " + path, errno);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) common::throw_errno("pool.key", "stat " + path, errno);
  if (!S_ISREG(st.st_mode)) throw Error("pool.key", "the pool key " + path + " is not a file");
  if (st.st_mode & 0077)
    throw Error("pool.key", "the pool key " + path +
                                " may be read by others than its owner (mode " +
                                fmt_octal(st.st_mode & 0777) + ")");
  char buffer[2 * kPoolKeyBytes + 2];
  ssize_t n = ::read(fd.get(), buffer, sizeof buffer);
  if (n < 0) common::throw_errno("pool.key", "read " + path, errno);
  std::string hex(buffer, static_cast<std::size_t>(n));
  while (!hex.empty() && hex.back() == '\n') hex.pop_back();
  std::string raw = from_hex(hex);
  if (hex.size() != 2 * kPoolKeyBytes || raw.size() != kPoolKeyBytes)
    throw Error("pool.key", "the pool key " + path + " is not " +
                                std::to_string(2 * kPoolKeyBytes) + " lowercase hex digits");
  return raw;
}

PoolChannel::PoolChannel(boost::asio::ip::tcp::socket socket, std::string key, char self)
    : socket_(std::move(socket)),
      key_(std::move(key)),
      self_(self),
      other_(self == 'h' ? 'n' : 'h'),
      ping_(socket_.get_executor()) {
  boost::system::error_code ec;
  auto remote = socket_.remote_endpoint(ec);
  peer_ =
      ec ? std::string("?") : remote.address().to_string() + ":" + std::to_string(remote.port());
  socket_.set_option(boost::asio::ip::tcp::no_delay(true), ec);
}

std::string PoolChannel::mac(char sender, std::uint64_t sequence,
                             const std::string& payload) const {
  std::string data(1, sender);
  for (int i = 7; i >= 0; --i) data.push_back(static_cast<char>((sequence >> (8 * i)) & 0xff));
  data += payload;
  return hmac_sha256(key_, data);
}

void PoolChannel::start(Message on_message, Closed on_closed) {
  on_message_ = std::move(on_message);
  on_closed_ = std::move(on_closed);
  heard_ = std::chrono::steady_clock::now();
  read_header();
  ping();
}

void PoolChannel::handle(Message on_message, Closed on_closed) {
  on_message_ = std::move(on_message);
  on_closed_ = std::move(on_closed);
}

void PoolChannel::rekey(std::string key) {
  key_ = std::move(key);
  keyed_ = true;
}

void PoolChannel::send(const Json& message) {
  if (!open_) return;
  std::string payload = message.dump();
  std::string frame(4, '\0');
  const auto length = static_cast<std::uint32_t>(payload.size());
  for (int i = 0; i < 4; ++i) frame[i] = static_cast<char>((length >> (8 * (3 - i))) & 0xff);
  frame += mac(self_, sent_++, payload);
  frame += payload;
  outbox_.push_back(std::move(frame));
  if (outbox_.size() == 1) write_next();
}

void PoolChannel::write_next() {
  if (!open_ || outbox_.empty()) return;
  boost::asio::async_write(socket_, boost::asio::buffer(outbox_.front()),
                           [self = shared_from_this()](boost::system::error_code ec, std::size_t) {
                             // Closed meanwhile (a release sends "stop" and closes at once):
                             // the frame's bytes stay in outbox_ until the channel goes.
                             if (!self->open_) return;
                             if (ec) return self->close("write: " + ec.message());
                             self->outbox_.pop_front();
                             self->write_next();
                           });
}

void PoolChannel::read_header() {
  boost::asio::async_read(
      socket_, boost::asio::buffer(header_),
      [self = shared_from_this()](boost::system::error_code ec, std::size_t) {
        if (!self->open_) return;
        if (ec)
          return self->close(ec == boost::asio::error::eof ? "the peer closed the connection"
                                                           : "read: " + ec.message());
        std::uint32_t length = 0;
        for (int i = 0; i < 4; ++i) length = (length << 8) | self->header_[i];
        // Before the first frame is authenticated, a stranger may be talking: the hello and
        // welcome are small.
        const std::size_t most = self->received_ == 0 ? kPoolMaxHello : kPoolMaxFrame;
        if (length > most)
          return self->close("a frame of " + std::to_string(length) + " bytes, above the " +
                             std::to_string(most) + " this frame may have");
        self->read_payload(length);
      });
}

void PoolChannel::read_payload(std::uint32_t length) {
  payload_.assign(length, '\0');
  boost::asio::async_read(
      socket_, boost::asio::buffer(payload_),
      [self = shared_from_this()](boost::system::error_code ec, std::size_t) {
        if (!self->open_) return;
        if (ec) return self->close("read: " + ec.message());
        const std::string want = self->mac(self->other_, self->received_, self->payload_);
        if (CRYPTO_memcmp(want.data(), self->header_.data() + 4, want.size()) != 0)
          return self->close("frame " + std::to_string(self->received_) +
                             " failed its HMAC (wrong key, altered, replayed or reordered)");
        ++self->received_;
        self->heard_ = std::chrono::steady_clock::now();
        Json message;
        try {
          message = common::parse_strict(self->payload_,
                                         {.max_bytes = kPoolMaxFrame, .exact_integers = false});
        } catch (const std::exception& e) {
          return self->close(std::string("an authenticated frame that is not JSON: ") + e.what());
        }
        if (!message.is_object() || !message.value("type", Json()).is_string())
          return self->close("an authenticated frame without a \"type\"");
        if (message["type"] != "ping" && self->on_message_) {
          Message handler = self->on_message_;  // it may replace itself
          // A peer that holds the key may still send what its reader cannot use (a field of
          // the wrong type): the channel ends, the process goes on.
          try {
            handler(std::move(message));
          } catch (const std::exception& e) {
            return self->close(std::string("an unusable message: ") + e.what());
          }
        }
        if (self->open_) self->read_header();
      });
}

void PoolChannel::ping() {
  ping_.expires_after(kPoolPing);
  ping_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
    if (ec || !self->open_) return;
    if (std::chrono::steady_clock::now() - self->heard_ > kPoolSilence)
      return self->close(
          "nothing heard for " +
          std::to_string(std::chrono::duration_cast<std::chrono::seconds>(kPoolSilence).count()) +
          " s");
    // Only once the handshake is done: a ping under the pool key crossing the welcome would
    // fail the peer's session key. Silence before it ends a stranger's connection all the same.
    if (self->keyed_) self->send(Json{{"type", "ping"}});
    self->ping();
  });
}

void PoolChannel::close(const std::string& why) {
  if (!open_) return;
  open_ = false;
  boost::system::error_code ignored;
  ping_.cancel();
  socket_.shutdown(boost::asio::ip::tcp::socket::shutdown_both, ignored);
  socket_.close(ignored);
  if (on_closed_) {
    Closed closed = std::move(on_closed_);
    on_closed_ = nullptr;
    on_message_ = nullptr;
    closed(why);
  }
}

}  // namespace assay::supervisor
