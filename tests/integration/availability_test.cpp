// Availability of assayd (issue 13): each hostile or unlucky reproduction that ended or hung the
// daemon, run against a real assayd through its unix socket. Every case ends by checking that the
// daemon still answers /v1/health within a second and that a restart on the same state directory
// comes up. Run alone with: integration_tests -ts=availability
#include <doctest/doctest.h>

#include <grp.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <cstring>
#include <functional>
#include <optional>
#include <set>
#include <sstream>

#include "tests/integration/harness.h"

using namespace assay::test;
namespace common = assay::common;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void sleep_s(double s) {
  std::this_thread::sleep_for(std::chrono::duration<double>(s));
}

// A hung daemon must not hang the test's cleanup: SIGTERM, then SIGKILL after a few seconds.
// Declared after the Daemon, so it runs before the Daemon's own (unbounded) stop().
struct StopOnExit {
  Daemon& d;
  ~StopOnExit() { d.stop_within(3); }
};

// Strict UTF-8 (RFC 3629): no overlong forms, no surrogates, nothing above U+10FFFF.
bool valid_utf8(const std::string& s) {
  std::size_t i = 0;
  while (i < s.size()) {
    auto c = static_cast<unsigned char>(s[i]);
    std::size_t n;
    std::uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n >= s.size()) return false;
    for (std::size_t k = 1; k <= n; ++k) {
      auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) ||
        cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += n + 1;
  }
  return true;
}

// GET /v1/health answered 200 within `seconds` (connect included).
bool health_within(const Daemon& d, double seconds = 1.0) {
  auto t0 = Clock::now();
  auto r = request_within(d.socket(), "GET", "/v1/health", seconds);
  return r.status == 200 && seconds_since(t0) < seconds;
}

// An error answer whose body is valid UTF-8 JSON naming an error code.
bool clear_error(const HttpReply& r) {
  if (!valid_utf8(r.body) || !valid_utf8(r.headers)) return false;
  try {
    Json j = r.json();
    return j["error"]["code"].is_string() && !j["error"]["code"].get<std::string>().empty() &&
           j["error"]["message"].is_string() && !j["error"]["message"].get<std::string>().empty();
  } catch (const std::exception&) {
    return false;
  }
}

fs::path make_config_only_model(const fs::path& dir) {
  fs::create_directories(dir);
  spit(dir / "config.json", R"({"model_type":"llama","vocab_size":260})");
  return dir;
}

HttpReply submit(const Daemon& d, const Json& request, double seconds = 5) {
  return request_within(d.socket(), "POST", "/v1/jobs", seconds, request.dump());
}

// Polls the job until `pred`, the deadline, or the daemon's exit; returns the last document.
template <typename Pred>
Json wait_job_alive(Daemon& d, const std::string& id, Pred pred, double seconds) {
  auto t0 = Clock::now();
  Json job;
  while (seconds_since(t0) < seconds && d.alive()) {
    auto r = request_within(d.socket(), "GET", "/v1/jobs/" + id, 2);
    if (r.status == 200) {
      job = r.json();
      if (pred(job)) return job;
    }
    sleep_s(0.05);
  }
  return job;
}

// A shell script standing in for a worker that blocks (a real process, never a stub of assayd).
fs::path blocking_worker(const fs::path& dir, int seconds) {
  fs::path p = dir / "blocking-worker";
  spit(p, "#!/bin/sh\nexec sleep " + std::to_string(seconds) + "\n");
  ::chmod(p.c_str(), 0755);
  return p;
}

// utime + stime of a process, in seconds.
double cpu_seconds(pid_t pid) {
  std::string stat = slurp("/proc/" + std::to_string(pid) + "/stat");
  auto close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream in(stat.substr(close + 2));
  std::string field;
  std::vector<std::string> f;
  while (in >> field) f.push_back(field);
  // After "pid (comm) ": state is field 3, utime 14, stime 15.
  if (f.size() < 13) return -1;
  return (std::stod(f[11]) + std::stod(f[12])) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

std::uint64_t rss_bytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  return 0;
}

std::uint64_t meminfo_bytes(const std::string& want) {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  std::uint64_t value = 0;
  while (in >> key >> value) {
    std::getline(in, unit);
    if (key == want + ":") return value * 1024;
  }
  return 0;
}
std::uint64_t mem_available_bytes() {
  return meminfo_bytes("MemAvailable");
}

// A daemon with `config` as its assayd.json, no containment, and `args` (by default a
// fingerprint worker that fails: for config-only models, where no worker should run).
std::unique_ptr<Daemon> config_daemon(const fs::path& dir, const Json& config,
                                      std::vector<std::string> args = {"--fingerprint-worker",
                                                                       "/bin/false"}) {
  spit(dir / "assayd.json", config.dump());
  std::vector<std::string> all{"--containment", "none", "--config", (dir / "assayd.json").string()};
  all.insert(all.end(), args.begin(), args.end());
  return std::make_unique<Daemon>(dir / "state", dir / "assayd.sock", all);
}

// What the preflight estimates a job needs, from a daemon whose reserve alone is the host's
// whole memory: it refuses the job at admission, naming the estimate ("needs N bytes").
std::uint64_t estimated_need(const fs::path& dir, const Json& request) {
  auto d = config_daemon(dir, Json{{"memory_reserve_bytes", meminfo_bytes("MemTotal")}});
  REQUIRE_MESSAGE(d->start_within(15), d->log());
  auto r = request_within(d->socket(), "POST", "/v1/jobs", 5, request.dump());
  REQUIRE_MESSAGE(r.status == 422, r.body);
  const std::string message = r.json()["error"]["message"];
  const auto at = message.find("needs ");
  REQUIRE_MESSAGE(at != std::string::npos, message);
  d->stop_within(5);
  fs::remove_all(dir / "state");
  return std::stoull(message.substr(at + 6));
}

// A reserve that makes a job estimated at `need` wait on this host and never be refused:
// MemTotal less 1 MiB, which MemAvailable never reaches (the kernel's own memory is not in it).
std::uint64_t reserve_to_wait(std::uint64_t need) {
  return meminfo_bytes("MemTotal") - need - (1u << 20);
}

// This process's cgroup memory limit (v1 or v2), if it has one: the daemon inherits it.
std::optional<std::uint64_t> own_memory_limit() {
  std::ifstream cg("/proc/self/cgroup");
  std::string line;
  while (std::getline(cg, line)) {
    auto a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    std::string controllers = line.substr(a + 1, b - a - 1);
    fs::path rel = fs::path(line.substr(b + 1)).relative_path();
    std::string text;
    if (controllers.empty())
      text = slurp(fs::path("/sys/fs/cgroup") / rel / "memory.max");
    else if (("," + controllers + ",").find(",memory,") != std::string::npos)
      text = slurp(fs::path("/sys/fs/cgroup/memory") / rel / "memory.limit_in_bytes");
    if (text.empty() || text.rfind("max", 0) == 0) continue;
    std::uint64_t v = std::stoull(text);
    if (v < (1ull << 60)) return v;
  }
  return std::nullopt;
}

// The entries of a directory that may change while it is read (/proc): no throwing.
std::vector<fs::path> entries(const fs::path& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  fs::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) out.push_back(it->path());
  return out;
}

std::vector<pid_t> all_pids() {
  std::vector<pid_t> out;
  for (const auto& p : entries("/proc")) {
    std::string name = p.filename();
    if (!name.empty() && std::all_of(name.begin(), name.end(), ::isdigit))
      out.push_back(std::stoi(name));
  }
  return out;
}

// The parent of `pid` from /proc/PID/stat; -1 when it is gone.
pid_t parent_of(pid_t pid) {
  std::string stat = slurp("/proc/" + std::to_string(pid) + "/stat");
  auto close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream in(stat.substr(close + 2));
  std::string state;
  pid_t ppid = -1;
  in >> state >> ppid;
  return ppid;
}

// Pids (other than `except`) that hold a unix socket bound to `path`, from /proc/net/unix and
// every process's fd table.
std::vector<pid_t> socket_holders(const fs::path& path, pid_t except) {
  std::set<std::string> inodes;
  std::ifstream net("/proc/net/unix");
  std::string line;
  std::getline(net, line);
  while (std::getline(net, line)) {
    std::istringstream in(line);
    std::vector<std::string> f;
    std::string x;
    while (in >> x) f.push_back(x);
    if (f.size() >= 8 && f[7] == path.string()) inodes.insert("socket:[" + f[6] + "]");
  }
  std::vector<pid_t> holders;
  for (pid_t pid : all_pids()) {
    if (pid == except) continue;
    for (const auto& fd : entries("/proc/" + std::to_string(pid) + "/fd")) {
      std::error_code ec;
      auto target = fs::read_symlink(fd, ec);
      if (!ec && inodes.count(target.string())) {
        holders.push_back(pid);
        break;
      }
    }
  }
  return holders;
}

// A child process of `parent` that still runs the parent's image (cloned, not yet exec'd).
pid_t unexeced_child(pid_t parent) {
  std::error_code ec;
  fs::path image = fs::read_symlink("/proc/" + std::to_string(parent) + "/exe", ec);
  if (ec) return -1;
  for (pid_t pid : all_pids()) {
    if (parent_of(pid) != parent) continue;
    std::error_code lec;
    if (fs::read_symlink("/proc/" + std::to_string(pid) + "/exe", lec) == image) return pid;
  }
  return -1;
}

// Kills (SIGKILL) and, where they are our children, reaps the listed pids at scope exit.
struct KillOnExit {
  std::vector<pid_t> pids;
  ~KillOnExit() {
    for (pid_t p : pids)
      if (p > 0) {
        ::kill(p, SIGKILL);
        ::waitpid(p, nullptr, 0);
      }
  }
};

// Makes this process the reaper of orphans (workers of a killed assayd) while it lives, and at
// scope exit kills and reaps every child it still has: all are this test's.
struct AdoptOrphans {
  AdoptOrphans() { ::prctl(PR_SET_CHILD_SUBREAPER, 1); }
  ~AdoptOrphans() {
    for (pid_t pid : all_pids())
      if (parent_of(pid) == ::getpid()) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
      }
    ::prctl(PR_SET_CHILD_SUBREAPER, 0);
  }
};

// A small tmpfs, unmounted at scope exit (lazily if something still holds it).
struct TmpfsMount {
  fs::path dir;
  bool mounted = false;
  std::string error;
  TmpfsMount(fs::path d, const std::string& size) : dir(std::move(d)) {
    fs::create_directories(dir);
    mounted =
        ::mount("tmpfs", dir.c_str(), "tmpfs", 0, ("size=" + size + ",mode=0755").c_str()) == 0;
    if (!mounted) error = std::strerror(errno);
  }
  ~TmpfsMount() {
    if (mounted && ::umount(dir.c_str()) != 0) ::umount2(dir.c_str(), MNT_DETACH);
  }
};

// Writes to `path` until the file system is full (ENOSPC), leaving `leave` bytes (about) free.
std::uint64_t fill(const fs::path& path, std::uint64_t leave = 0) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  REQUIRE(fd >= 0);
  std::string chunk(64 * 1024, 'x');
  std::uint64_t written = 0;
  for (std::size_t size : {std::size_t{64 * 1024}, std::size_t{4096}, std::size_t{1}}) {
    while (true) {
      if (leave) {
        auto free = fs::space(path.parent_path()).available;
        if (free <= leave + size) break;
      }
      ssize_t n = ::write(fd, chunk.data(), size);
      if (n <= 0) break;
      written += static_cast<std::uint64_t>(n);
    }
  }
  ::close(fd);
  return written;
}

// ---------------------------------------------------------------------------------------------
// The unprivileged attacker of the connection-exhaustion cases: a forked child that drops to
// nobody:nogroup (65534). It reaches the daemon's socket because the daemon runs with
// socket_group "nogroup" (the socket is root:nogroup 0660) in a directory others may traverse.

pid_t as_nobody(const std::function<void()>& attack) {
  pid_t pid = ::fork();
  if (pid == 0) {
    rlimit rl{4096, 4096};
    ::setrlimit(RLIMIT_NOFILE, &rl);
    if (::setgroups(0, nullptr) != 0 || ::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(3);
    attack();
    ::_exit(0);
  }
  return pid;
}

int connect_nonblocking(const fs::path& socket) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", socket.c_str());
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Holds `n` connections for `seconds`: each sends `head` (and then up to `body_bytes` of body,
// as far as the daemon reads it) and never finishes its request. A connection the daemon closes
// or answers is re-opened. Non-blocking throughout, so the attack ends on time.
struct AttackStats {
  int connects = 0;         // connections the daemon's socket accepted
  int peak_open = 0;        // most held open at once
  std::uint64_t bytes = 0;  // request bytes sent
};

AttackStats hold_connections(const fs::path& socket, int n, const std::string& head,
                             std::uint64_t body_bytes, double seconds) {
  AttackStats stats;
  struct Conn {
    int fd = -1;
    std::uint64_t sent = 0;
  };
  std::vector<Conn> conns(static_cast<std::size_t>(n));
  static const std::string chunk(1 << 20, ' ');
  const std::uint64_t total = head.size() + body_bytes;
  auto t0 = Clock::now();
  while (seconds_since(t0) < seconds) {
    std::vector<pollfd> pfds;
    for (auto& c : conns) {
      if (c.fd < 0) {
        c.fd = connect_nonblocking(socket);
        c.sent = 0;
        stats.connects += c.fd >= 0;
      }
      if (c.fd >= 0 && c.sent < head.size()) {
        ssize_t k = ::send(c.fd, head.data() + c.sent, head.size() - c.sent, MSG_NOSIGNAL);
        if (k > 0)
          c.sent += static_cast<std::uint64_t>(k), stats.bytes += static_cast<std::uint64_t>(k);
      }
      pfds.push_back(
          {c.fd, static_cast<short>(c.fd >= 0 ? (POLLIN | (c.sent < total ? POLLOUT : 0)) : 0), 0});
    }
    if (::poll(pfds.data(), pfds.size(), 50) < 0) break;
    for (std::size_t i = 0; i < conns.size(); ++i) {
      auto& c = conns[i];
      if (c.fd < 0) continue;
      if (pfds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
        char buf[4096];
        ssize_t k = ::recv(c.fd, buf, sizeof buf, MSG_DONTWAIT);
        if (k == 0 || (k < 0 && errno != EAGAIN) || (pfds[i].revents & (POLLHUP | POLLERR))) {
          ::close(c.fd);
          c.fd = -1;
          continue;
        }
      }
      if ((pfds[i].revents & POLLOUT) && c.sent >= head.size() && c.sent < total) {
        std::uint64_t left = total - c.sent;
        ssize_t k = ::send(c.fd, chunk.data(), std::min<std::uint64_t>(left, chunk.size()),
                           MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0)
          c.sent += static_cast<std::uint64_t>(k), stats.bytes += static_cast<std::uint64_t>(k);
      }
    }
    int open = 0;
    for (auto& c : conns) open += c.fd >= 0;
    stats.peak_open = std::max(stats.peak_open, open);
  }
  for (auto& c : conns)
    if (c.fd >= 0) ::close(c.fd);
  return stats;
}

// Runs `attack` as nobody while root probes /v1/health ten times; each probe must be answered
// 200 within a second. Returns what the attacker managed; `max_rss` gets the daemon's peak VmRSS.
AttackStats probe_during(Daemon& d, const std::function<AttackStats()>& attack,
                         std::uint64_t& max_rss) {
  int fds[2];
  REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
  pid_t pid = as_nobody([&] {
    AttackStats st = attack();
    ssize_t ignored = ::write(fds[1], &st, sizeof st);
    (void)ignored;
  });
  ::close(fds[1]);
  KillOnExit attacker{{pid}};
  sleep_s(1.5);  // the attacker's connections are in place
  max_rss = rss_bytes(d.pid());
  for (int i = 0; i < 10; ++i) {
    auto t0 = Clock::now();
    auto r = request_within(d.socket(), "GET", "/v1/health", 1.0);
    double took = seconds_since(t0);
    max_rss = std::max(max_rss, rss_bytes(d.pid()));
    INFO("probe " << i << ": status " << r.status << " after " << took << " s " << r.body);
    CHECK((r.status == 200 && took < 1.0));
    sleep_s(std::max(0.0, 0.5 - took));
  }
  // The attack ends on its own (its duration); a stuck attacker is killed.
  auto t0 = Clock::now();
  while (::waitpid(pid, nullptr, WNOHANG) != pid && seconds_since(t0) < 5) sleep_s(0.05);
  AttackStats st;
  if (::read(fds[0], &st, sizeof st) != sizeof st) st = AttackStats{};
  ::close(fds[0]);
  attacker.pids.clear();
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, WNOHANG);
  MESSAGE("attacker: " << st.connects << " connections, " << st.peak_open << " open at once, "
                       << st.bytes << " bytes sent");
  // The attack must really have reached the daemon, or the probes prove nothing.
  CHECK(st.connects > 0);
  CHECK(st.bytes > 0);
  return st;
}

}  // namespace

TEST_SUITE("availability") {
  TEST_CASE("the tests' UTF-8 check accepts U+20AC and refuses C3 28, C0 AF, ED A0 80 and a cut") {
    CHECK(valid_utf8("plain ASCII"));
    CHECK(valid_utf8("\xE2\x82\xAC and \xF0\x9F\x98\x80"));
    CHECK_FALSE(valid_utf8("x\xC3\x28"));
    CHECK_FALSE(valid_utf8("\xC0\xAF"));
    CHECK_FALSE(valid_utf8("\xED\xA0\x80"));
    CHECK_FALSE(valid_utf8("\xFF"));
    CHECK_FALSE(valid_utf8("\x82\xAC"));          // a tail cut off its lead byte
    CHECK_FALSE(valid_utf8("ends in \xE2\x82"));  // a lead cut off its tail
  }

  TEST_CASE(
      "invalid UTF-8 in a target, query or body is a 400 in valid UTF-8, and assayd keeps "
      "serving") {
    TempDir tmp;
    fs::path model = make_config_only_model(tmp.path / "model");
    Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
             {"--containment", "none", "--fingerprint-worker", "/bin/false"});
    StopOnExit stop{d};
    REQUIRE_MESSAGE(d.start_within(15), d.log());
    auto accepted = submit(d, next_token_request("utf8-before", model));
    REQUIRE(accepted.status == 201);
    std::string accepted_id = accepted.json()["id"];

    std::string good = next_token_request("utf8", model).dump();
    auto body_with = [&](const std::string& bytes) {
      return R"({"schema":"assay.next-token-request.v1","id":"x)" + bytes + R"(","model_dir":")" +
             model.string() +
             R"(","input_token_ids":[72,101],"candidates":[{"engine":"kiln","token_id":65,"text":"A"},{"engine":"vllm","token_id":66,"text":"B"}]})";
    };
    struct Case {
      std::string name, method, target, body;
    };
    std::vector<Case> cases{
        {"percent-encoded FF as a query key", "GET", "/v1/jobs?%FF=1", ""},
        {"raw FF byte in a job path", "GET", "/v1/jobs/\xff", ""},
        {"raw FF byte in an unknown route", "GET", "/v1/\xff", ""},
        {"percent-encoded FF as a state filter", "GET", "/v1/jobs?state=%FF", ""},
        {"truncated sequence as a model_dir query", "POST", "/v1/jobs?model_dir=/%C3", good},
        {"C3 28 in a body string", "POST", "/v1/jobs", body_with("\xC3\x28")},
        {"overlong C0 AF in a body string", "POST", "/v1/jobs", body_with("\xC0\xAF")},
        {"surrogate ED A0 80 in a body string", "POST", "/v1/jobs", body_with("\xED\xA0\x80")},
    };
    for (const auto& c : cases) {
      CAPTURE(c.name);
      auto r = request_within(d.socket(), c.method, c.target, 5, c.body);
      CHECK(r.status == 400);
      CHECK_MESSAGE(clear_error(r), "body: " << r.body);
      bool up = d.alive() && health_within(d);
      CHECK_MESSAGE(up, "assayd stopped serving: " << d.log());
      if (!up) {  // try the remaining cases on a fresh daemon
        d.stop_within(1);
        REQUIRE_MESSAGE(d.start_within(15), d.log());
      }
    }
    CHECK(d.stop_within(5) == 0);
    REQUIRE_MESSAGE(d.start_within(15), d.log());
    CHECK(health_within(d));
    CHECK(request_within(d.socket(), "GET", "/v1/jobs/" + accepted_id, 2).status == 200);
  }

  TEST_CASE(
      "a worker error cut inside a multi-byte character fails the job in valid UTF-8, and a "
      "restart stays up") {
    if (!have(kFingerprint) || !have(kOracle)) {
      MESSAGE("skipped: assay-fingerprint or assay-oracle was not built");
      return;
    }
    TempDir tmp;
    fs::path model = fixture_model(tmp.path / "llama-tiny");
    Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
             {"--containment", containment(), "--fingerprint-worker", kFingerprint,
              "--oracle-worker", kOracle});
    StopOnExit stop{d};
    REQUIRE_MESSAGE(d.start_within(15), d.log());
    Json doc = next_token_request("euro", model);
    std::string euros;
    for (int i = 0; i < 700; ++i) euros += "\xE2\x82\xAC";  // U+20AC, 3 bytes each
    doc["candidates"][0]["text"] = euros;
    auto sub = submit(d, doc);
    REQUIRE_MESSAGE(sub.status == 201, sub.body);
    std::string id = sub.json()["id"];
    Json job = wait_job_alive(d, id, terminal, 180);
    CHECK_MESSAGE(d.alive(), "assayd exited while the job ran: " << d.log());
    CHECK(job["state"] == "failed");
    std::string message =
        job["error"]["message"].is_string() ? job["error"]["message"].get<std::string>() : "";
    CHECK_FALSE(message.empty());
    CHECK(valid_utf8(message));
    CHECK(health_within(d));
    auto raw = request_within(d.socket(), "GET", "/v1/jobs/" + id, 2);
    CHECK(raw.status == 200);
    CHECK(valid_utf8(raw.body));

    d.stop_within(5);
    Json on_disk;
    CHECK_NOTHROW(on_disk = common::parse_strict(slurp(d.state() / "jobs" / id / "job.json")));
    CHECK(on_disk.value("state", "") == "failed");
    REQUIRE_MESSAGE(d.start_within(15), d.log());
    auto again = request_within(d.socket(), "GET", "/v1/jobs/" + id, 2);
    REQUIRE(again.status == 200);
    CHECK(again.json()["state"] == "failed");
    sleep_s(3);  // long enough for a re-run of the job to reach its oracle
    CHECK_MESSAGE(d.alive(), "assayd exited after the restart: " << d.log());
    CHECK(health_within(d));
  }

  TEST_CASE(
      "a job waiting for memory does not spin: health answers, job.json stays small, cancel "
      "works") {
    std::uint64_t available = mem_available_bytes();
    if (auto limit = own_memory_limit()) {
      MESSAGE("skipped: under this cgroup's memory limit (" << *limit
                                                            << " bytes) the preflight refuses");
      return;
    }
    TempDir tmp;
    fs::path model = make_config_only_model(tmp.path / "model");
    // A reserve that leaves the job more than MemAvailable and less than MemTotal: it must wait.
    INFO("MemAvailable " << available);
    const Json request = next_token_request("waits", model);
    const std::uint64_t need = estimated_need(tmp.path, request);
    auto daemon = config_daemon(tmp.path, Json{{"memory_reserve_bytes", reserve_to_wait(need)}});
    Daemon& d = *daemon;
    StopOnExit stop{d};
    REQUIRE_MESSAGE(d.start_within(15), d.log());
    auto sub = submit(d, request);
    CHECK_MESSAGE(sub.status == 201, "the submission went unanswered or was refused: " << sub.body);
    // Go on with the stored job either way, to see what else breaks.
    std::string id;
    if (sub.status == 201) id = sub.json()["id"];
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(d.state() / "jobs", ec))
      if (id.empty()) id = e.path().filename();
    REQUIRE_FALSE(id.empty());
    fs::path job_json = d.state() / "jobs" / id / "job.json";

    sleep_s(0.5);
    double cpu0 = cpu_seconds(d.pid());
    auto t0 = Clock::now();
    auto r = request_within(d.socket(), "GET", "/v1/jobs/" + id, 1);
    CHECK_MESSAGE(r.status == 200, "the job's status went unanswered for a second");
    if (r.status == 200) {
      CHECK(r.json()["state"] == "queued");
      CHECK_FALSE(r.json().value("waiting_reason", std::string()).empty());
    }
    for (int i = 0; i < 5; ++i) {
      auto p0 = Clock::now();
      CHECK_MESSAGE(health_within(d), "health probe " << i);
      sleep_s(std::max(0.0, 1.0 - seconds_since(p0)));
    }
    double cpu = cpu_seconds(d.pid()) - cpu0;
    INFO("assayd used " << cpu << " s of CPU in " << seconds_since(t0) << " s");
    CHECK(cpu < 1.0);
    auto bytes = fs::file_size(job_json, ec);
    INFO("job.json: " << bytes << " bytes");
    CHECK(bytes < 64 * 1024);

    // A restart while the job waits comes up, and the job still waits.
    int st = d.stop_within(5);
    CHECK_MESSAGE((WIFEXITED(st) && WEXITSTATUS(st) == 0), "SIGTERM did not stop assayd: " << st);
    REQUIRE_MESSAGE(d.start_within(15), d.log());
    sleep_s(0.5);
    CHECK(health_within(d));
    r = request_within(d.socket(), "GET", "/v1/jobs/" + id, 1);
    CHECK(r.status == 200);
    if (r.status == 200) CHECK(r.json()["state"] == "queued");

    auto cancel = request_within(d.socket(), "DELETE", "/v1/jobs/" + id, 2);
    CHECK((cancel.status == 200 || cancel.status == 202));
    Json job = wait_job_alive(d, id, terminal, 5);
    CHECK(job.value("state", "") == "cancelled");
    CHECK(health_within(d));
  }

  TEST_CASE(
      "a model whose config.json or shards ask for more memory than the host has is refused at "
      "admission with preflight.refused naming the figure, and nothing is queued") {
    if (auto limit = own_memory_limit()) MESSAGE("under a cgroup memory limit of " << *limit);
    TempDir tmp;
    auto d = config_daemon(tmp.path, Json::object());
    StopOnExit stop{*d};
    // num_attention_heads and vocab_size make the sequence's estimate hundreds of GiB; a sparse
    // shard of 1 TiB the weights'.
    REQUIRE_MESSAGE(d->start_within(15), d->log());
    struct Case {
      std::string name, config;
      std::uint64_t sparse_shard = 0;
    };
    for (const Case& c : std::vector<Case>{
             {"heads",
              R"({"model_type":"llama","vocab_size":260,"num_attention_heads":1000000000})"},
             {"vocab", R"({"model_type":"llama","vocab_size":1000000000000})"},
             {"shard", R"({"model_type":"llama","vocab_size":260})", 1ull << 40}}) {
      CAPTURE(c.name);
      fs::path model = tmp.path / c.name;
      fs::create_directories(model);
      spit(model / "config.json", c.config);
      if (c.sparse_shard) {
        int fd =
            ::open((model / "model.safetensors").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
        REQUIRE(fd >= 0);
        REQUIRE(::ftruncate(fd, static_cast<off_t>(c.sparse_shard)) == 0);
        ::close(fd);
      }
      Json request = next_token_request("too-big-" + c.name, model);
      if (c.name == "vocab") request["candidates"][0]["token_id"] = 5;
      auto r = submit(*d, request);
      CHECK_MESSAGE(r.status == 422, r.body);
      if (r.status != 422) continue;
      CHECK(r.json()["error"]["code"] == "preflight.refused");
      const std::string message = r.json()["error"]["message"];
      CHECK_MESSAGE(message.find("more than this host can ever give") != std::string::npos,
                    message);
      CHECK_MESSAGE((message.find("MemTotal") != std::string::npos ||
                     message.find("cgroup limit") != std::string::npos),
                    message);
      CHECK_MESSAGE(message.find(model.string() + "/config.json") != std::string::npos, message);
    }
    auto list = request_within(d->socket(), "GET", "/v1/jobs", 2);
    REQUIRE(list.status == 200);
    CHECK_MESSAGE(list.json()["jobs"].empty(), list.body);
    CHECK(fs::is_empty(d->state() / "admission"));
  }

  TEST_CASE(
      "a tokenizer or config file over the size bound is refused at admission naming the file "
      "(issue 36, defect 4)") {
    // A 200 MB tokenizer.json got the libtorch oracle OOM-killed with no file named. Sparse
    // files: st_size is what admission looks at.
    TempDir tmp;
    auto d = config_daemon(tmp.path, Json::object());
    StopOnExit stop{*d};
    REQUIRE_MESSAGE(d->start_within(15), d->log());
    for (std::string name : {"tokenizer.json", "chat_template.jinja", "config.json"}) {
      CAPTURE(name);
      fs::path model = tmp.path / ("big-" + std::string(name));
      fs::create_directories(model);
      spit(model / "config.json", R"({"model_type":"llama","vocab_size":260})");
      int fd = ::open((model / name).c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
      REQUIRE(fd >= 0);
      REQUIRE(::ftruncate(fd, 200 << 20) == 0);
      ::close(fd);
      auto r = submit(*d, next_token_request("big-" + name, model));
      CHECK_MESSAGE(r.status == 422, r.body);
      if (r.status != 422) continue;
      CHECK(r.json()["error"]["code"] == "request.bad_model");
      const std::string message = r.json()["error"]["message"];
      CHECK_MESSAGE(message.find((model / name).string()) != std::string::npos, message);
      CHECK_MESSAGE(message.find("209715200 bytes") != std::string::npos, message);
    }
    auto list = request_within(d->socket(), "GET", "/v1/jobs", 2);
    REQUIRE(list.status == 200);
    CHECK_MESSAGE(list.json()["jobs"].empty(), list.body);
  }

  TEST_CASE(
      "a config whose sizes contradict its weights is refused at admission by name, for both "
      "backends, before a worker builds anything (issue 36, defect 3)") {
    // num_hidden_layers 1e6 got the transformers worker OOM-killed and hidden_size 1e9 a 520 GB
    // allocation attempt: it builds the model from config.json before comparing a weight.
    TempDir tmp;
    fs::path good = fixture_model(tmp.path / "llama-tiny");
    auto d = config_daemon(tmp.path, Json::object());
    StopOnExit stop{*d};
    REQUIRE_MESSAGE(d->start_within(15), d->log());
    const Json config = Json::parse(slurp(good / "config.json"));
    for (const auto& [key, value] :
         std::vector<std::pair<std::string, Json>>{{"num_hidden_layers", 1000000},
                                                   {"hidden_size", 1e9},
                                                   {"vocab_size", 1e12},
                                                   {"num_attention_heads", 1e9},
                                                   {"intermediate_size", 1e9}}) {
      for (const std::string backend : {"libtorch", "transformers"}) {
        CAPTURE(key);
        CAPTURE(backend);
        fs::path model = tmp.path / (key + "-" + backend);
        fs::copy(good, model, fs::copy_options::recursive);
        Json bad = config;
        bad[key] = value;
        spit(model / "config.json", bad.dump());
        Json request = next_token_request(key + "-" + backend, model);
        request["oracle"] = {{"backend", backend}};
        auto r = submit(*d, request);
        CHECK_MESSAGE(r.status == 422, r.body);
        if (r.status != 422) continue;
        CHECK(r.json()["error"]["code"] == "request.bad_model");
        const std::string message = r.json()["error"]["message"];
        CHECK_MESSAGE(message.find(key + " = " + value.dump()) != std::string::npos, message);
        CHECK_MESSAGE(message.find((model / "config.json").string()) != std::string::npos, message);
      }
    }
    auto list = request_within(d->socket(), "GET", "/v1/jobs", 2);
    REQUIRE(list.status == 200);
    CHECK_MESSAGE(list.json()["jobs"].empty(), list.body);
    // Every architecture's fixture, as it was made, is admitted (Qwen3.5's gated q_proj and
    // Gated DeltaNet blocks, Spark2.5's fused q_k_v_proj and "embedding").
    auto r = submit(*d, next_token_request("consistent-llama", good));
    CHECK_MESSAGE(r.status == 201, r.body);
    for (std::string arch : {"qwen2", "qwen3", "qwen3_5", "spark2_5"}) {
      CAPTURE(arch);
      fs::path dir = tmp.path / (arch + "-tiny");
      std::string cmd = std::string(ASSAY_PYTHON3) + " " + ASSAY_SOURCE_DIR +
                        "/tests/fixtures/make_fixture.py --arch " + arch + " --size tiny --out " +
                        dir.string() + " > " + dir.string() + ".log 2>&1";
      REQUIRE_MESSAGE(std::system(cmd.c_str()) == 0, slurp(dir.string() + ".log"));
      r = submit(*d, next_token_request("consistent-" + arch, dir));
      CHECK_MESSAGE(r.status == 201, r.body);
    }
  }

  TEST_CASE(
      "a job that could fit only later holds back no job behind it that fits now, and keeps its "
      "place") {
    if (own_memory_limit() || !have(kFingerprint) || !have(kOracle)) {
      MESSAGE("skipped: under a cgroup memory limit, or the workers were not built");
      return;
    }
    TempDir tmp;
    // The waiting job's model is a config with a sparse shard of half the host's memory; the
    // reserve makes its need MemTotal - 1 MiB. The tiny fixture's jobs need over half less.
    fs::path big = make_config_only_model(tmp.path / "big");
    {
      int fd = ::open((big / "model.safetensors").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
      REQUIRE(fd >= 0);
      REQUIRE(::ftruncate(fd, static_cast<off_t>(meminfo_bytes("MemTotal") / 2)) == 0);
      ::close(fd);
    }
    fs::path small = fixture_model(tmp.path / "llama-tiny");
    const Json waits = next_token_request("waits", big);
    const std::uint64_t need = estimated_need(tmp.path, waits);
    auto daemon = config_daemon(tmp.path, Json{{"memory_reserve_bytes", reserve_to_wait(need)}},
                                {"--fingerprint-worker", kFingerprint, "--oracle-worker", kOracle});
    Daemon& d = *daemon;
    StopOnExit stop{d};
    REQUIRE_MESSAGE(d.start_within(15), d.log());
    auto a = submit(d, waits);
    REQUIRE_MESSAGE(a.status == 201, a.body);
    const std::string waiting = a.json()["id"];
    Json first = wait_job_alive(
        d, waiting, [](const Json& j) { return !j.value("waiting_reason", "").empty(); }, 10);
    REQUIRE_MESSAGE(first.value("state", "") == "queued", first.dump(2));
    // Jobs behind it, on a model that fits now: each runs to its end while it waits.
    for (const char* name : {"fits-1", "fits-2"}) {
      auto b = submit(d, next_token_request(name, small));
      REQUIRE_MESSAGE(b.status == 201, b.body);
      Json done = wait_job_alive(d, b.json()["id"], terminal, 180);
      CHECK_MESSAGE(done.value("state", "") == "succeeded", done.dump(2) << d.log());
    }
    auto still = request_within(d.socket(), "GET", "/v1/jobs/" + waiting, 2);
    REQUIRE(still.status == 200);
    CHECK(still.json()["state"] == "queued");
    CHECK_FALSE(still.json().value("waiting_reason", std::string()).empty());
    auto cancel = request_within(d.socket(), "DELETE", "/v1/jobs/" + waiting, 2);
    CHECK((cancel.status == 200 || cancel.status == 202));
    CHECK(wait_job_alive(d, waiting, terminal, 5).value("state", "") == "cancelled");
  }

  TEST_CASE(
      "after kill -9 of assayd mid-spawn, no worker keeps the listening socket and a restart comes "
      "up") {
    if (std::system("strace -V > /dev/null 2>&1") != 0) {
      MESSAGE("skipped: strace is not installed (scripts/install-deps installs it)");
      return;
    }
    TempDir tmp;
    AdoptOrphans adopt;  // the worker stuck at its gate outlives assayd
    fs::path model = make_config_only_model(tmp.path / "model");
    fs::path worker = blocking_worker(tmp.path, 20);
    Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
             {"--containment", "none", "--fingerprint-worker", worker.string()});
    StopOnExit stop{d};
    REQUIRE_MESSAGE(d.start_within(15), d.log());
    pid_t daemon_pid = d.pid();

    // strace's fault injection holds every clone/clone3 of assayd for 1.5 s on its way back to the
    // caller: the cloned worker runs on to its gate while assayd is killed. (Threads assayd
    // starts are held too, so the worker's clone may come a few seconds after the submission.)
    KillOnExit cleanup;
    pid_t tracer = ::fork();
    if (tracer == 0) {
      int log = ::open((tmp.path / "strace.log").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(log, 1);
      ::dup2(log, 2);
      std::string p = std::to_string(daemon_pid);
      ::execlp("strace", "strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=clone3,clone", "-e",
               "inject=clone,clone3:delay_exit=1500000", "-p", p.c_str(), nullptr);
      ::_exit(127);
    }
    cleanup.pids.push_back(tracer);
    auto traced = [&] {
      std::string status = slurp("/proc/" + std::to_string(daemon_pid) + "/status");
      return status.find("TracerPid:\t" + std::to_string(tracer) + "\n") != std::string::npos;
    };
    auto t0 = Clock::now();
    while (!traced() && seconds_since(t0) < 5) sleep_s(0.02);
    REQUIRE_MESSAGE(traced(), "strace did not attach: " << slurp(tmp.path / "strace.log"));

    // The submission is answered only after the (held) clone, so look for the child meanwhile.
    HttpReply sub;
    std::thread submitter([&] { sub = submit(d, next_token_request("gate", model), 6); });
    struct Join {
      std::thread& t;
      ~Join() {
        if (t.joinable()) t.join();
      }
    } join{submitter};
    pid_t child = -1;
    t0 = Clock::now();
    while ((child = unexeced_child(daemon_pid)) < 0 && seconds_since(t0) < 12) sleep_s(0.005);
    REQUIRE_MESSAGE(child > 0, "no worker was cloned within 12 s");
    d.kill9();
    submitter.join();  // unanswered: assayd was killed before it wrote the answer
    std::string id;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(d.state() / "jobs", ec)) id = e.path().filename();
    ::kill(tracer, SIGTERM);  // detaches from the remaining tracees
    ::waitpid(tracer, nullptr, 0);
    cleanup.pids.clear();
    sleep_s(0.2);

    t0 = Clock::now();
    bool up = d.start_within(2);
    INFO("restart took " << seconds_since(t0) << " s");
    CHECK_MESSAGE(up, "restart failed: " << d.log());
    CHECK(d.log().find("another daemon is listening") == std::string::npos);
    auto holders = socket_holders(d.socket(), d.pid());
    std::string who;
    for (pid_t p : holders)
      who += std::to_string(p) + " (" + slurp("/proc/" + std::to_string(p) + "/cmdline") + ") ";
    CHECK_MESSAGE(holders.empty(),
                  "other processes hold a socket bound to " << d.socket() << ": " << who);
    if (up) {
      CHECK(health_within(d));
      if (!id.empty()) CHECK(request_within(d.socket(), "GET", "/v1/jobs/" + id, 2).status == 200);
    }
  }

  TEST_CASE("a FIFO in place of a model's config.json is refused quickly without blocking health") {
    TempDir tmp;
    fs::path model = tmp.path / "fifo-model";
    fs::create_directories(model);
    REQUIRE(::mkfifo((model / "config.json").c_str(), 0644) == 0);
    Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
             {"--containment", "none", "--fingerprint-worker", "/bin/false"});
    StopOnExit stop{d};
    REQUIRE_MESSAGE(d.start_within(15), d.log());
    auto accepted =
        submit(d, next_token_request("before-fifo", make_config_only_model(tmp.path / "m")));
    REQUIRE(accepted.status == 201);
    std::string accepted_id = accepted.json()["id"];

    HttpReply refused;
    double took = 0;
    std::thread submitter([&] {
      auto t0 = Clock::now();
      refused = submit(d, next_token_request("fifo", model), 5);
      took = seconds_since(t0);
    });
    sleep_s(0.3);
    bool health = health_within(d);
    submitter.join();
    CHECK_MESSAGE(health, "health went unanswered while the submission was handled");
    INFO("the submission took " << took << " s, status " << refused.status << ": " << refused.body);
    CHECK((refused.status == 422 || refused.status == 400));
    CHECK(took < 2.0);
    CHECK(clear_error(refused));
    CHECK(health_within(d));
    CHECK(d.stop_within(5) == 0);
    REQUIRE_MESSAGE(d.start_within(15), d.log());
    CHECK(health_within(d));
    CHECK(request_within(d.socket(), "GET", "/v1/jobs/" + accepted_id, 2).status == 200);
  }

  TEST_CASE(
      "a full state directory answers 507, keeps every accepted job, and assayd starts while it is "
      "full") {
    TempDir tmp;
    TmpfsMount disk(tmp.path / "state", "4m");
    if (!disk.mounted) {
      MESSAGE("skipped: cannot mount a tmpfs here (" << disk.error << "); needs root");
      return;
    }
    fs::path model = make_config_only_model(tmp.path / "model");
    Daemon d(disk.dir, tmp.path / "assayd.sock",
             {"--containment", "none", "--fingerprint-worker", "/bin/false"});
    StopOnExit stop{d};
    REQUIRE_MESSAGE(d.start_within(15), d.log());

    // Leave a little room, then submit until a submission cannot be written.
    fill(disk.dir / "filler", 192 * 1024);
    std::vector<std::string> accepted;
    HttpReply refused;
    int tried = 0;
    for (; tried < 200; ++tried) {
      auto r = submit(d, next_token_request("full-" + std::to_string(tried), model));
      if (r.status != 201) {
        refused = r;
        break;
      }
      accepted.push_back(r.json()["id"]);
    }
    INFO(accepted.size() << " jobs accepted, then status " << refused.status << ": "
                         << refused.body);
    CHECK(refused.status == 507);
    CHECK(clear_error(refused));
    if (refused.status != 0) CHECK(refused.body.find("space") != std::string::npos);
    sleep_s(0.5);  // the accepted jobs' workers fail meanwhile, on a full disk
    bool up = d.alive() && health_within(d);
    CHECK_MESSAGE(up, "assayd stopped serving on a full disk: " << d.log());
    if (up) {
      for (const auto& id : accepted) {
        CAPTURE(id);
        auto r = request_within(d.socket(), "GET", "/v1/jobs/" + id, 2);
        CHECK(r.status == 200);
        if (r.status == 200) CHECK(r.json()["id"] == id);
      }
    }
    for (const auto& id : accepted) {
      CAPTURE(id);
      CHECK_NOTHROW(common::parse_strict(slurp(disk.dir / "jobs" / id / "job.json")));
    }

    // Room again: the refused submission was not stored, so it is new now.
    fs::remove(disk.dir / "filler");
    if (!up) {
      d.stop_within(1);
      REQUIRE_MESSAGE(d.start_within(15), d.log());
    }
    auto again = submit(d, next_token_request("full-" + std::to_string(tried), model));
    CHECK(again.status == 201);
    if (again.status == 201) accepted.push_back(again.json()["id"]);
    auto settle = Clock::now();
    for (const auto& id : accepted)
      wait_job_alive(d, id, terminal, std::max(0.1, 10 - seconds_since(settle)));

    // Start-up on a full disk writes nothing that exists already.
    CHECK(d.stop_within(5) == 0);
    fill(disk.dir / "filler");
    REQUIRE(fs::space(disk.dir).available < 4096);
    CHECK_MESSAGE(d.start_within(15), "assayd cannot start on a full state directory: " << d.log());
    if (d.alive()) {
      CHECK(health_within(d));
      for (const auto& id : accepted) {
        CAPTURE(id);
        CHECK(request_within(d.socket(), "GET", "/v1/jobs/" + id, 2).status == 200);
      }
    }
    d.stop_within(5);
  }

  TEST_CASE("an unprivileged user exhausting connections cannot starve health probes") {
    TempDir tmp;
    ::chmod(tmp.path.c_str(), 0755);  // nobody traverses to the socket
    fs::path model = make_config_only_model(tmp.path / "model");
    fs::path worker = blocking_worker(tmp.path, 20);
    spit(tmp.path / "config.json", R"({"socket_group":"nogroup"})");
    REQUIRE_MESSAGE(::getgrnam("nogroup") != nullptr, "the group nogroup (65534) must exist");
    Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
             {"--containment", "none", "--fingerprint-worker", worker.string(), "--config",
              (tmp.path / "config.json").string()});
    StopOnExit stop{d};
    REQUIRE_MESSAGE(d.start_within(15), d.log());
    fs::path socket = d.socket();
    std::uint64_t max_rss = 0;
    std::string kept_job;  // the attacker's job, where a case made one

    SUBCASE("600 half-sent requests, re-opened as the daemon closes them") {
      const std::string head = "GET /v1/health HTTP/1.1\r\nHost: x\r\n";
      probe_during(
          d, [&] { return hold_connections(socket, 600, head, 0, 8); }, max_rss);
    }
    SUBCASE("520 open event streams of a running job") {
      // The attacker's own job (a blocking worker keeps it running): its events are its to watch.
      // Queued would do as well: the stream stays open until the job ends.
      fs::path drop = tmp.path / "drop";
      fs::create_directory(drop);
      ::chmod(drop.c_str(), 0777);  // nobody writes its job's id here
      pid_t submitter = as_nobody([&] {
        auto r = request_within(socket, "POST", "/v1/jobs", 5,
                                next_token_request("streams", model).dump());
        if (r.status == 201) spit(drop / "id", r.json()["id"].get<std::string>());
      });
      ::waitpid(submitter, nullptr, 0);
      std::string id = slurp(drop / "id");
      REQUIRE_MESSAGE(!id.empty(), "nobody could not submit a job: " << d.log());
      kept_job = id;
      Json job = wait_job_alive(
          d, id, [](const Json& j) { return j["state"] == "running"; }, 10);
      REQUIRE(job["state"] == "running");
      const std::string head = "GET /v1/jobs/" + id + "/events HTTP/1.1\r\nHost: x\r\n\r\n";
      probe_during(
          d, [&] { return hold_connections(socket, 520, head, 0, 8); }, max_rss);
    }
    SUBCASE("100 connections each one byte short of a 17 MiB body") {
      const std::uint64_t limit = 17ull << 20;
      const std::string head =
          "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: "
          "application/json\r\nContent-Length: " +
          std::to_string(limit) + "\r\n\r\n";
      probe_during(
          d, [&] { return hold_connections(socket, 100, head, limit - 1, 8); }, max_rss);
      INFO("peak VmRSS " << max_rss / 1048576.0 << " MiB");
      CHECK(max_rss < (512ull << 20));
    }
    sleep_s(0.5);
    CHECK_MESSAGE(d.alive(), d.log());
    CHECK(health_within(d));
    CHECK(d.stop_within(5) == 0);
    REQUIRE_MESSAGE(d.start_within(15), d.log());
    CHECK(health_within(d));
    if (!kept_job.empty())
      CHECK(request_within(d.socket(), "GET", "/v1/jobs/" + kept_job, 2).status == 200);
  }

  TEST_CASE(
      "405 answers carry Allow, HEAD /v1/health works, and a missing socket directory is an "
      "error") {
    TempDir tmp;
    Daemon d(tmp.path / "state", tmp.path / "assayd.sock",
             {"--containment", "none", "--fingerprint-worker", "/bin/false"});
    StopOnExit stop{d};
    REQUIRE_MESSAGE(d.start_within(15), d.log());

    for (std::string method : {"PUT", "PATCH"}) {
      CAPTURE(method);
      auto r = request_within(d.socket(), method, "/v1/jobs", 2, "{}");
      CHECK(r.status == 405);
      std::string headers = r.headers;
      std::transform(headers.begin(), headers.end(), headers.begin(), ::tolower);
      auto allow = headers.find("\r\nallow:");
      CHECK_MESSAGE(allow != std::string::npos, "no Allow header in\n" << r.headers);
      if (allow != std::string::npos) {
        std::string value =
            r.headers.substr(allow + 8, r.headers.find("\r\n", allow + 2) - allow - 8);
        CHECK(value.find("GET") != std::string::npos);
        CHECK(value.find("POST") != std::string::npos);
      }
    }

    auto head = request_within(d.socket(), "HEAD", "/v1/health", 2);
    CHECK(head.status == 200);
    CHECK(head.body.empty());
    CHECK(health_within(d));

    // --socket in a directory that does not exist: a clear error, and no directory made.
    fs::path missing = tmp.path / "no-such-dir";
    std::string out = run_capture("timeout 5 " + std::string(ASSAYD_PATH) + " serve --socket " +
                                  (missing / "assayd.sock").string() + " --state-dir " +
                                  (tmp.path / "state2").string() +
                                  " --containment none --fingerprint-worker /bin/false");
    INFO(out);
    CHECK(out.rfind("0:", 0) != 0);
    CHECK(out.rfind("124:", 0) != 0);  // it did not serve until the timeout
    CHECK(out.find(missing.string()) != std::string::npos);
    CHECK_FALSE(fs::exists(missing));
  }

}  // TEST_SUITE("availability")
