// The channel between the head and a pool node (executors/pool.h): one TCP connection, the node
// dialling the head. Every frame is [u32 length, big-endian][32-byte HMAC-SHA256][payload: one
// JSON object], the MAC over (the sender's letter, the frame's sequence number in its direction,
// the payload): a frame altered, dropped, replayed or reordered ends the channel. The first two
// frames (the node's hello, the head's welcome) are keyed with the pool's key, which the head
// wrote to the pool's directory in the shared file system for the pool's Slurm jobs to read;
// every later frame with a session key derived from it and both frames' random nonces, so that
// a recorded session cannot be replayed into a new one. Once keyed, both sides send a ping
// every kPoolPing; a channel silent for kPoolSilence ends (a node lost without a FIN, or a
// stranger that connects and says nothing).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

#include "common/json.h"

namespace assay::supervisor {

inline constexpr auto kPoolPing = std::chrono::seconds(2);
inline constexpr auto kPoolSilence = std::chrono::seconds(10);
inline constexpr std::size_t kPoolKeyBytes = 32;
inline constexpr std::size_t kPoolMaxFrame = 256u << 20;
inline constexpr std::size_t kPoolMaxHello = 64u << 10;

// n random bytes from the kernel, raw, or as lowercase hex (2 * n characters).
std::string random_bytes(std::size_t n);
std::string random_hex(std::size_t n);
// "ADDRESS:PORT" (an IPv6 address in brackets) as an endpoint; throws
// common::Error("pool.address") naming `what` and the text.
boost::asio::ip::tcp::endpoint parse_endpoint(const std::string& text, const std::string& what);
// HMAC-SHA256 of `data` under `key`: 32 raw bytes.
std::string hmac_sha256(const std::string& key, const std::string& data);
// The session key of a channel: HMAC(pool key, "assay-pool-session" + node nonce + head nonce).
std::string pool_session_key(const std::string& pool_key, const std::string& node_nonce,
                             const std::string& head_nonce);
// Reads a pool key file (64 hex characters, a regular file, not a link, not readable by others).
// Throws common::Error("pool.key") naming what is wrong.
std::string read_pool_key(const std::string& path);

class PoolChannel : public std::enable_shared_from_this<PoolChannel> {
 public:
  using Message = std::function<void(common::Json)>;
  using Closed = std::function<void(const std::string& why)>;
  // `self`: 'h' (head) or 'n' (node); `key`: the pool key (kPoolKeyBytes raw bytes).
  PoolChannel(boost::asio::ip::tcp::socket socket, std::string key, char self);
  // Starts reading and pinging. `on_message` runs for each authenticated frame but pings;
  // `on_closed` runs once, when the channel ends for any reason (close() included).
  void start(Message on_message, Closed on_closed);
  // Replaces the handlers (the head's, once a hello made the peer a node) without a second
  // reader.
  void handle(Message on_message, Closed on_closed);
  void send(const common::Json& message);
  // Both directions use `key` from the next frame on (after the hello and welcome).
  void rekey(std::string key);
  void close(const std::string& why);
  bool open() const { return open_; }
  std::string peer() const { return peer_; }

 private:
  void read_header();
  void read_payload(std::uint32_t length);
  void write_next();
  void ping();
  std::string mac(char sender, std::uint64_t sequence, const std::string& payload) const;

  boost::asio::ip::tcp::socket socket_;
  std::string key_;
  char self_, other_;
  std::uint64_t sent_ = 0, received_ = 0;
  std::array<unsigned char, 36> header_{};
  std::string payload_;
  std::deque<std::string> outbox_;
  boost::asio::steady_timer ping_;
  std::chrono::steady_clock::time_point heard_;
  Message on_message_;
  Closed on_closed_;
  bool open_ = true;
  bool keyed_ = false;  // rekey()ed: the handshake is done
  std::string peer_;
};

}  // namespace assay::supervisor
