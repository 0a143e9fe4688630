// What a worker holds and can reach: never root unless allowed, no capabilities, no new
// privileges, the seccomp filter, its own PID namespace and /proc, /sys of its network
// namespace, only the descriptors it was given; and the hostile worker's probes all fail.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "common/identity.h"
#include "supervisor/contain/contain.h"
#include "supervisor/contain/seccomp.h"
#include "supervisor/contain/spawn.h"
#include "tests/contain/test_util.h"

namespace {

namespace fs = std::filesystem;
using assay::common::Json;
using namespace assay::contain;
using namespace assay::contain::test;

constexpr const char* kPython = ASSAY_PYTHON3;

// The /proc/self/status lines a worker sees of itself.
std::string status_lines(const std::string& status, std::initializer_list<const char*> keys) {
  std::string out;
  std::istringstream in(status);
  for (std::string line; std::getline(in, line);) {
    for (const char* k : keys) {
      if (line.starts_with(std::string(k) + ":")) out += line + "\n";
    }
  }
  return out;
}

}  // namespace

TEST_CASE(
    "assayd contain -- cat /proc/self/status: no capabilities, seccomp filter, no_new_privs") {
  TempDir dir;
  fs::path out = dir.path / "status";
  auto r = run_cli({"--stdout", out.string(), "--", "cat", "/proc/self/status"});
  REQUIRE(r.status == 0);
  CHECK(status_lines(slurp(out), {"CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs",
                                  "Seccomp", "Pid", "PPid"}) ==
        "Pid:\t2\nPPid:\t1\nCapInh:\t0000000000000000\nCapPrm:\t0000000000000000\n"
        "CapEff:\t0000000000000000\nCapBnd:\t0000000000000000\nCapAmb:\t0000000000000000\n"
        "NoNewPrivs:\t1\nSeccomp:\t2\n");
  WorkerIdentity who = default_worker_identity();
  std::string uid = std::to_string(who.uid), gid = std::to_string(who.gid);
  CHECK(status_lines(slurp(out), {"Uid", "Gid", "Groups"}) ==
        "Uid:\t" + uid + "\t" + uid + "\t" + uid + "\t" + uid + "\nGid:\t" + gid + "\t" + gid +
            "\t" + gid + "\t" + gid + "\nGroups:\t \n");
  Json doc = Json::parse(r.out);
  check_schema(doc, dir.path);
  Evidence e = Evidence::from_json(doc);
  REQUIRE(e.spawn);
  CHECK(e.spawn->uid == who.uid);
  CHECK(e.spawn->gid == who.gid);
  CHECK(e.spawn->capabilities == Capabilities{});
  CHECK(doc["spawn"]["capabilities"]["effective"] == "0000000000000000");
  CHECK(e.spawn->seccomp.policy_sha256 == detail::seccomp_policy().sha256);
  CHECK(e.spawn->seccomp.denied.size() == 30);
  CHECK(e.pid_namespace_private == true);
  CHECK(doc["mounts"]["proc"] == "pid-namespace");
}

TEST_CASE("the seccomp policy's hash is the sha256 of its BPF program, which fits short jumps") {
  const auto& policy = detail::seccomp_policy();
  CHECK(policy.program.size() < 256);
  CHECK(policy.fprog.len == policy.program.size());
  CHECK(policy.fprog.filter == policy.program.data());
  CHECK(policy.sha256 == assay::common::sha256_id(policy.program.data(),
                                                  policy.program.size() * sizeof(sock_filter)));
  CHECK(detail::sha256_id("abc", 3) ==
        "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  std::string two_blocks(119, 'x');  // padding spills into a second block
  CHECK(detail::sha256_id(two_blocks.data(), two_blocks.size()) ==
        assay::common::sha256_id(two_blocks));
  for (const char* name : {"ptrace",
                           "process_vm_readv",
                           "process_vm_writev",
                           "mount",
                           "umount2",
                           "pivot_root",
                           "unshare",
                           "setns",
                           "bpf",
                           "perf_event_open",
                           "keyctl",
                           "add_key",
                           "request_key",
                           "kexec_load",
                           "kexec_file_load",
                           "io_uring_setup",
                           "io_uring_enter",
                           "io_uring_register",
                           "open_by_handle_at",
                           "userfaultfd",
                           "init_module",
                           "finit_module",
                           "delete_module"}) {
    CHECK_MESSAGE(std::count(policy.denied.begin(), policy.denied.end(), name) == 1, name);
  }
  for (const char* allowed : {"memfd_create", "ioctl", "socket", "clone"}) {
    CHECK(std::count(policy.denied.begin(), policy.denied.end(), allowed) == 0);
  }
}

TEST_CASE("inside, /proc shows only the worker and its init, /sys/class/net only lo") {
  TempDir dir;
  auto rt = runtime();
  auto spec =
      make_spec("procview",
                {"/bin/sh", "-c",
                 "ls /proc | grep -E '^[0-9]+$' | sort -n | tr '\\n' ' '; echo; ls /sys/class/net; "
                 "test -e /proc/" +
                     std::to_string(::getpid()) +
                     "/root && echo supervisor-visible; "
                     "cat /proc/1/environ 2>/dev/null || echo init-environ-denied; "
                     "ls /proc/1/root/ 2>/dev/null || echo init-root-denied"},
                dir.path);
  Evidence e = rt->run(spec);
  CHECK(e.succeeded());
  // sh is pid 2, ls pid 3 (grep, sort and tr run beside it)
  std::string seen = slurp(spec.stdout_path);
  CHECK(seen.starts_with("1 2 "));
  CHECK(seen.find("\nlo\ninit-environ-denied\ninit-root-denied\n") != std::string::npos);
  CHECK(seen.find("supervisor-visible") == std::string::npos);
  CHECK(e.pid_namespace_private == true);
}

// The probes issue 14 reproduced as a hostile model would run them: each line names one and
// how it ended.
TEST_CASE("a hostile worker's probes fail: key, socket, model dir, ptrace, mount, namespaces") {
  TempDir dir;
  fs::path state = dir.path / "state";
  fs::create_directories(state / "keys");
  std::ofstream(state / "keys" / "host.key") << "PRIVATE";
  fs::path model = dir.path / "model";
  fs::create_directories(model);
  std::ofstream(model / "config.json") << "{}";
  fs::permissions(model, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                             fs::perms::others_read | fs::perms::others_exec);
  fs::path sock_path = dir.path / "assayd.sock";
  int listener = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(listener >= 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, sock_path.c_str(), sizeof addr.sun_path - 1);
  REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(::listen(listener, 8) == 0);
  ::chmod(sock_path.c_str(), 0777);  // reachable by anyone who can reach the path

  std::string script = R"(
import ctypes, errno, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
def probe(name, f):
    try:
        r = f()
        print(name, 'ok' if r is None or r >= 0 else errno.errorcode[ctypes.get_errno()])
    except OSError as e:
        print(name, errno.errorcode.get(e.errno, e.errno))
def sys_(nr, *a):
    return libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(x) for x in a])
state, model, sock = sys.argv[1:4]
probe('read-key', lambda: len(open(state + '/keys/host.key').read()) and None)
probe('connect-socket', lambda: socket.socket(socket.AF_UNIX).connect(sock))
probe('connect-via-init-root', lambda: socket.socket(socket.AF_UNIX).connect('/proc/1/root' + sock))
probe('write-model', lambda: open(model + '/x', 'w') and None)
probe('ptrace-init', lambda: libc.ptrace(16, 1, 0, 0))
probe('ptrace-traceme', lambda: libc.ptrace(0, 0, 0, 0))
probe('mount-tmpfs', lambda: libc.mount(b'x', b'/tmp', b'tmpfs', 0, None))
probe('unshare-user', lambda: libc.unshare(0x10000000))
probe('unshare-net', lambda: libc.unshare(0x40000000))
probe('clone-newuser', lambda: sys_(56, 0x10000000 | 17, 0, 0, 0, 0))
probe('clone3', lambda: sys_(435, 0, 0))
probe('setns', lambda: sys_(308, 0, 0))
probe('io_uring_setup', lambda: sys_(425, 1, 0))
probe('bpf', lambda: sys_(321, 0, 0, 0))
probe('process_vm_readv', lambda: sys_(310, 1, 0, 0, 0, 0, 0))
probe('userfaultfd', lambda: sys_(323, 0))
probe('memfd_create', lambda: libc.memfd_create(b'cuda', 0))
probe('unix-socketpair', lambda: socket.socketpair(socket.AF_UNIX) and None)
probe('ioctl-FIONREAD', lambda: libc.ioctl(0, 0x541B, ctypes.byref(ctypes.c_int())))
)";
  auto rt = runtime();
  auto spec = make_spec("hostile",
                        {kPython, "-c", script, state.string(), model.string(), sock_path.string()},
                        dir.path);
  spec.hidden_paths = {state, sock_path};
  Evidence e = rt->run(spec);
  ::close(listener);
  CHECK(e.succeeded());
  CHECK(slurp(spec.stdout_path) ==
        "read-key ENOENT\n"
        "connect-socket ECONNREFUSED\n"
        "connect-via-init-root EACCES\n"
        "write-model EACCES\n"
        "ptrace-init EPERM\n"
        "ptrace-traceme EPERM\n"
        "mount-tmpfs EPERM\n"
        "unshare-user EPERM\n"
        "unshare-net EPERM\n"
        "clone-newuser EPERM\n"
        "clone3 ENOSYS\n"
        "setns EPERM\n"
        "io_uring_setup EPERM\n"
        "bpf EPERM\n"
        "process_vm_readv EPERM\n"
        "userfaultfd EPERM\n"
        "memfd_create ok\n"
        "unix-socketpair ok\n"
        "ioctl-FIONREAD ENOTTY\n");
  CHECK(slurp(spec.stderr_path) == "");
  CHECK(slurp(state / "keys" / "host.key") == "PRIVATE");
  CHECK_FALSE(fs::exists(model / "x"));
}

TEST_CASE("the contained mount and unshare tools fail with EPERM, and util-linux says so") {
  TempDir dir;
  fs::create_directories(dir.path / "x");
  auto rt = runtime();
  auto spec = make_spec("tools",
                        {"/bin/sh", "-c",
                         "unshare -n true; echo unshare=$?; "
                         "mount -t tmpfs x x 2>/dev/null; echo mount=$?"},
                        dir.path);
  Evidence e = rt->run(spec);
  CHECK(e.succeeded());
  std::string out = slurp(spec.stdout_path);
  CHECK(out.find("unshare=1\n") != std::string::npos);
  CHECK(out.find("mount=0") == std::string::npos);
  CHECK(slurp(spec.stderr_path).find("Operation not permitted") != std::string::npos);
}

TEST_CASE(
    "the worker runs batch-class at nice 10; its init, which only reaps, keeps its priority") {
  // Fields 19 (nice) and 41 (policy) of /proc/PID/stat, counted after the command's ")".
  auto nice_and_policy = [](const std::string& stat) {
    std::istringstream in(stat.substr(stat.rfind(')') + 2));
    std::vector<std::string> fields(2);  // fields 1 and 2 are before the ")"
    for (std::string f; in >> f;) fields.push_back(f);
    REQUIRE(fields.size() > 41);
    return std::make_pair(fields[19 - 1], fields[41 - 1]);
  };
  TempDir dir;
  auto rt = runtime();
  auto spec =
      make_spec("priority", {"/bin/sh", "-c", "cat /proc/self/stat; cat /proc/1/stat"}, dir.path);
  Evidence e = rt->run(spec);
  REQUIRE(e.succeeded());
  std::istringstream lines(slurp(spec.stdout_path));
  std::string worker, init;
  std::getline(lines, worker);
  std::getline(lines, init);
  CHECK(nice_and_policy(worker) == std::make_pair(std::string("10"), std::string("3")));
  CHECK(nice_and_policy(init).second == "0");  // SCHED_OTHER
}

TEST_CASE("pass_fds become fds 3, 4 in order, close-on-exec cleared; no other fd survives") {
  TempDir dir;
  std::ofstream(dir.path / "a") << "first\n";
  std::ofstream(dir.path / "b") << "second\n";
  int a = ::open((dir.path / "a").c_str(), O_RDONLY | O_CLOEXEC);
  int b = ::open((dir.path / "b").c_str(), O_RDONLY);      // not close-on-exec: passed as is
  int stray = ::open((dir.path / "a").c_str(), O_RDONLY);  // inheritable, but not passed
  REQUIRE((a >= 0 && b >= 0 && stray >= 0));
  auto rt = runtime();
  auto spec = make_spec("fds",
                        {"/bin/sh", "-c",
                         "cat <&3; cat <&4; for n in 5 6 7 8 9 " + std::to_string(stray) +
                             "; do test -e /proc/self/fd/$n && echo open $n; done; echo end"},
                        dir.path);
  spec.pass_fds = {b, a};
  Evidence e = rt->run(spec);
  ::close(a);
  ::close(b);
  ::close(stray);
  CHECK(e.succeeded());
  CHECK(slurp(spec.stdout_path) == "second\nfirst\nend\n");
  REQUIRE(e.spawn);
  CHECK(e.spawn->pass_fds == 2);
  CHECK(e.to_json()["spawn"]["pass_fds"] == 2);
  spec.pass_fds = {1000};
  spec.name += "-bad";
  CHECK_THROWS_WITH(rt->run(spec), doctest::Contains("descriptor 1000 is not open"));
}

TEST_CASE("a worker is never root unless allowed; allowed, it is root without capabilities") {
  TempDir dir;
  auto rt = runtime();
  auto spec = make_spec(
      "root", {"/bin/sh", "-c", "id -u; grep -E '^Cap(Eff|Bnd)' /proc/self/status"}, dir.path);
  spec.uid.reset();
  spec.gid.reset();
  if (::geteuid() != 0) return;  // the rule is about a root assayd
  try {
    rt->run(spec);
    FAIL("expected contain.root_worker");
  } catch (const assay::common::Error& e) {
    CHECK(e.code() == "contain.root_worker");
    CHECK(std::string(e.what()).find(spec.name) != std::string::npos);
  }
  CHECK(my_cgroups(*rt).empty());
  spec.gid = 1234;  // a uid of 0 is refused whatever the group
  CHECK_THROWS_WITH(rt->run(spec), doctest::Contains("uid 0 gid 1234"));
  spec.gid.reset();
  spec.uid = 1234;  // and so is root's group
  CHECK_THROWS_WITH(rt->run(spec), doctest::Contains("uid 1234 gid 0"));
  CHECK_THROWS_AS(EarlyChild::start(spec), assay::common::Error);
  spec.uid.reset();
  spec.allow_root = true;
  Evidence e = rt->run(spec);
  CHECK(e.succeeded());
  CHECK(slurp(spec.stdout_path) == "0\nCapEff:\t0000000000000000\nCapBnd:\t0000000000000000\n");
  REQUIRE(e.spawn);
  CHECK(e.spawn->uid == 0u);
  CHECK(e.spawn->capabilities == Capabilities{});

  auto cli = run_cli({"--stdout", (dir.path / "cli").string(), "--allow-root", "--", "id", "-u"});
  CHECK(cli.status == 0);
  CHECK(slurp(dir.path / "cli") == "0\n");
  auto named = run_cli({"--stdout", (dir.path / "named").string(), "--user", "nobody", "--", "id"});
  CHECK(named.status == 0);
  CHECK(slurp(dir.path / "named").starts_with("uid=65534(nobody) gid=65534(nogroup)"));
  auto unknown = run_cli({"--user", "no-such-user-xyz", "--", "id"});
  CHECK(unknown.status == 2);
  CHECK(unknown.err.find("no-such-user-xyz") != std::string::npos);
}

TEST_CASE("the default worker identity: assay-worker if passwd has it, else a free dynamic id") {
  TempDir root;
  fs::create_directories(root.path / "etc");
  fs::create_directories(root.path / "run/systemd/dynamic-uid");
  std::ofstream(root.path / "etc/passwd") << "root:x:0:0::/root:/bin/sh\n"
                                             "dyn:x:61184:61184::/:/bin/false\n"
                                             "broken line\n";
  std::ofstream(root.path / "etc/group") << "root:x:0:\nother:x:61185:\n";
  std::ofstream(root.path / "run/systemd/dynamic-uid/61186") << "";
  CHECK(default_worker_identity(root.path) == WorkerIdentity{61187, 61187, "", true});
  std::ofstream(root.path / "etc/passwd", std::ios::app)
      << "assay-worker:x:999:998:assay contained worker:/nonexistent:/usr/sbin/nologin\n";
  CHECK(default_worker_identity(root.path) == WorkerIdentity{999, 998, "assay-worker", false});
  CHECK(worker_identity("assay-worker", root.path) ==
        WorkerIdentity{999, 998, "assay-worker", false});
  CHECK(worker_identity("999", root.path) == WorkerIdentity{999, 998, "assay-worker", false});
  CHECK(worker_identity("4242", root.path) == WorkerIdentity{4242, 4242, "", true});
  CHECK_THROWS_WITH(worker_identity("nobody-here", root.path), doctest::Contains("nobody-here"));
  WorkerIdentity here = default_worker_identity();
  CHECK(here.uid != 0);
  CHECK(here.gid != 0);
}

// Issue 13, availability 4: a child cloned but not past its gate when assayd is killed must
// not keep assayd's listening socket (nor anything else) open.
TEST_CASE("a child whose parent dies before the gate opens exits and holds no parent fd") {
  TempDir dir;
  fs::permissions(dir.path, fs::perms::all);
  fs::path sock_path = dir.path / "listen.sock";
  int report[2];
  REQUIRE(::pipe(report) == 0);
  std::fflush(nullptr);
  pid_t parent = ::fork();
  REQUIRE(parent >= 0);
  if (parent == 0) {
    // The "assayd": listens, starts a worker that waits at its gate, and is killed.
    int l = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, sock_path.c_str(), sizeof addr.sun_path - 1);
    if (l < 0 || ::bind(l, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::listen(l, 8) != 0) {
      ::_exit(1);
    }
    auto early = EarlyChild::start(make_spec("orphaned", {"/bin/sleep", "60"}, dir.path));
    pid_t child = dynamic_cast<detail::Prespawned&>(*early).pid();
    (void)!::write(report[1], &child, sizeof child);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the child reaches its gate
    ::kill(::getpid(), SIGKILL);
  }
  ::close(report[1]);
  pid_t child = -1;
  REQUIRE(::read(report[0], &child, sizeof child) == sizeof child);
  ::close(report[0]);
  int status = 0;
  ::waitpid(parent, &status, 0);
  CHECK(WIFSIGNALED(status));
  bool gone = false;
  for (int i = 0; i < 200 && !gone; ++i) {
    gone = process_gone(child);
    if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(gone);
  int c = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, sock_path.c_str(), sizeof addr.sun_path - 1);
  errno = 0;
  CHECK(::connect(c, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == -1);
  CHECK(errno == ECONNREFUSED);  // nobody holds the listener any more
  ::close(c);
}

TEST_CASE("a worker name must start as the schema's pattern says: not with '-' or '.'") {
  TempDir dir;
  auto rt = runtime();
  for (const char* bad : {"-x", ".x"}) {
    auto spec = make_spec("x", {"/bin/true"}, dir.path);
    spec.name = bad;
    std::string quoted = std::string("\"") + bad + "\"";
    CHECK_THROWS_WITH(rt->run(spec), doctest::Contains(quoted.c_str()));
  }
  auto ok = make_spec("x", {"/bin/true"}, dir.path);
  ok.name = "_x-1";
  CHECK(rt->run(ok).succeeded());
  CHECK(my_cgroups(*rt).empty());
}
