// The head-node channel of a Slurm worker pool (supervisor/executors/pool_channel.h) over real
// loopback TCP: frames pass under the right key and survive a rekey; a wrong key, an altered
// frame, a replayed frame and an oversized first frame each end the channel, naming why; the key
// file is refused when it is a link, readable by others or not hex. And the pool's config keys.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <optional>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/write.hpp>

#include "common/error.h"
#include "supervisor/config.h"
#include "supervisor/executors/pool_channel.h"

using assay::common::Json;
using namespace assay::supervisor;
namespace fs = std::filesystem;
using tcp = boost::asio::ip::tcp;

namespace {

struct Pair {
  boost::asio::io_context io;
  tcp::socket a{io}, b{io};
  Pair() {
    tcp::acceptor acceptor(io, tcp::endpoint(boost::asio::ip::make_address("127.0.0.1"), 0));
    a.connect(acceptor.local_endpoint());
    b = acceptor.accept();
  }
  void run_for(std::chrono::milliseconds d) {
    io.restart();
    io.run_for(d);
  }
};

const std::string kKey(32, 'k');

// One frame as the channel writes it: length, HMAC over (sender, sequence, payload), payload.
std::string frame(const std::string& key, char sender, std::uint64_t sequence,
                  const std::string& payload) {
  std::string out(4, '\0');
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((payload.size() >> (8 * (3 - i))) & 0xff);
  std::string data(1, sender);
  for (int i = 7; i >= 0; --i) data.push_back(static_cast<char>((sequence >> (8 * i)) & 0xff));
  return out + hmac_sha256(key, data + payload) + payload;
}

}  // namespace

TEST_CASE("pool channel: messages pass both ways under the key and after a rekey") {
  Pair p;
  auto head = std::make_shared<PoolChannel>(std::move(p.a), kKey, 'h');
  auto node = std::make_shared<PoolChannel>(std::move(p.b), kKey, 'n');
  std::vector<Json> at_head, at_node;
  head->start([&](Json m) { at_head.push_back(m); }, [](const std::string&) {});
  node->start([&](Json m) { at_node.push_back(m); }, [](const std::string&) {});
  node->send(Json{{"type", "hello"}, {"n", 1}});
  p.run_for(std::chrono::milliseconds(200));
  REQUIRE(at_head.size() == 1);
  CHECK(at_head[0]["n"] == 1);
  head->send(Json{{"type", "welcome"}});
  const std::string session = pool_session_key(kKey, "a", "b");
  head->rekey(session);
  p.run_for(std::chrono::milliseconds(200));
  REQUIRE(at_node.size() == 1);
  node->rekey(session);
  for (int i = 0; i < 3; ++i) node->send(Json{{"type", "phase"}, {"i", i}});
  head->send(Json{{"type", "run"}});
  p.run_for(std::chrono::milliseconds(200));
  CHECK(at_head.size() == 4);
  CHECK(at_head.back()["i"] == 2);
  CHECK(at_node.size() == 2);
  CHECK(head->open());
  CHECK(node->open());
}

TEST_CASE("pool channel: a wrong key, an altered frame, a replay and an oversized hello end it") {
  auto refused = [](const std::function<std::string(void)>& bytes) {
    Pair p;
    auto head = std::make_shared<PoolChannel>(std::move(p.a), kKey, 'h');
    std::optional<std::string> why;
    int messages = 0;
    head->start([&](Json) { ++messages; }, [&](const std::string& w) { why = w; });
    boost::asio::write(p.b, boost::asio::buffer(bytes()));
    p.run_for(std::chrono::milliseconds(300));
    CHECK(messages <= 1);
    REQUIRE(why);
    CHECK_FALSE(head->open());
    return *why;
  };
  const std::string hello = R"({"type":"hello"})";
  CHECK(refused([&] { return frame(std::string(32, 'x'), 'n', 0, hello); }).find("HMAC") !=
        std::string::npos);
  CHECK(refused([&] {
          std::string f = frame(kKey, 'n', 0, hello);
          f.back() = '!';  // the payload altered after its MAC
          return f;
        }).find("HMAC") != std::string::npos);
  // The same valid frame twice: the second's sequence number is wrong.
  CHECK(refused([&] {
          return frame(kKey, 'n', 0, hello) + frame(kKey, 'n', 0, hello);
        }).find("HMAC") != std::string::npos);
  // A frame the head's own letter signed, sent back to it (a reflection).
  CHECK(refused([&] { return frame(kKey, 'h', 0, hello); }).find("HMAC") != std::string::npos);
  // A stranger's first frame claims 1 GiB: refused before anything is allocated for it.
  CHECK(refused([] {
          return std::string("\x40\x00\x00\x00", 4) + std::string(32, '\0');
        }).find("above the 65536") != std::string::npos);
}

TEST_CASE("pool key file: 64 hex digits, a regular file of its owner only") {
  fs::path dir = fs::temp_directory_path() / ("pool-key-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& text, mode_t mode) {
    fs::path p = dir / name;
    std::ofstream(p) << text;
    ::chmod(p.c_str(), mode);
    return p.string();
  };
  const std::string hex(64, 'a');
  CHECK(read_pool_key(write("good", hex + "\n", 0600)) == std::string(32, '\xaa'));
  auto error_of = [](const std::string& path) {
    try {
      read_pool_key(path);
    } catch (const assay::common::Error& e) {
      CHECK(e.code() == "pool.key");
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  CHECK(error_of(write("open", hex, 0644)).find("mode 0644") != std::string::npos);
  CHECK(error_of(write("short", "abcd", 0600)).find("64 lowercase hex") != std::string::npos);
  CHECK(error_of(write("upper", std::string(64, 'A'), 0600)).find("hex") != std::string::npos);
  fs::create_symlink(dir / "good", dir / "link");
  CHECK(error_of((dir / "link").string()).find("open the pool key") != std::string::npos);
  CHECK(error_of((dir / "missing").string()).find("open the pool key") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("config: slurm.pool's keys are checked and name the bad value") {
  fs::path dir = fs::temp_directory_path() / ("pool-config-" + std::to_string(::getpid()));
  fs::create_directories(dir / "shared");
  fs::create_directories(dir / "state");
  auto error_of = [&](const Json& pool) {
    Json j{{"executor", "slurm"},
           {"state_dir", (dir / "state").string()},
           {"slurm", {{"shared_dir", (dir / "shared").string()}, {"pool", pool}}}};
    std::ofstream(dir / "config.json") << j.dump();
    try {
      Config c;
      c.load_file(dir / "config.json");
      c.finalize();
      CHECK(c.slurm.pool.nodes == pool.value("nodes", 0u));
      CHECK(c.resident_steps() == (c.slurm.pool.nodes > 0));
    } catch (const assay::common::Error& e) {
      CHECK((e.code() == "config.invalid" || e.code() == "json.unknown_field"));
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  CHECK(error_of(Json{{"nodes", 2}, {"listen", "10.0.0.1:0"}}) == "accepted");
  CHECK(error_of(Json{{"nodes", 0}}) == "accepted");
  CHECK(error_of(Json{{"nodes", 2}}).find("slurm.pool.listen must be") != std::string::npos);
  CHECK(error_of(Json{{"nodes", 2}, {"listen", "10.0.0.1"}}).find("\"10.0.0.1\"") !=
        std::string::npos);
  CHECK(error_of(Json{{"nodes", 2}, {"listen", "10.0.0.1:70000"}}).find("70000") !=
        std::string::npos);
  CHECK(error_of(Json{{"nodes", 1}, {"listen", "h:1"}, {"idle_seconds", 0}})
            .find("idle_seconds must be a number in [1, 604800], got 0") != std::string::npos);
  CHECK(error_of(Json{{"nodes", 1}, {"listen", "h:1"}, {"resident_models", 0}})
            .find("resident_models must be in 1..64, got 0") != std::string::npos);
  CHECK(error_of(Json{{"nodes", 1}, {"listen", "h:1"}, {"sbatch_args", {1}}})
            .find("holds a non-string: 1") != std::string::npos);
  CHECK(error_of(Json{{"nodes", 1}, {"listen", "h:1"}, {"gpus", 65}})
            .find("gpus must be in 0..64, got 65") != std::string::npos);
  CHECK(error_of(Json{{"nodes", 1}, {"listen", "h:1"}, {"gpus", 2}, {"partition", "gpu"}}) ==
        "accepted");
  CHECK(error_of(Json{{"nodes", 1}, {"listen", "h:1"}, {"bogus", 1}}).find("bogus") !=
        std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("pool channel: a frame sent and the channel closed at once (a release) is harmless") {
  // The write of the last frame completes after close(): its handler must not touch the
  // queue close() left (it popped an empty deque and crashed the head on a node's release).
  for (int i = 0; i < 50; ++i) {
    Pair p;
    auto head = std::make_shared<PoolChannel>(std::move(p.a), kKey, 'h');
    std::string why;
    head->start([](Json) {}, [&](const std::string& w) { why = w; });
    head->send(Json{{"type", "stop"}, {"pad", std::string(1 << 16, 'x')}});
    head->send(Json{{"type", "stop"}});
    head->close("released");
    p.run_for(std::chrono::milliseconds(20));
    CHECK(why == "released");
    CHECK_FALSE(head->open());
  }
}
