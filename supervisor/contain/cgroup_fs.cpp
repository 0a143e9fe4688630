// cgroupfs helpers shared by both backends: /proc parsing, reading and writing control files.
#include <cerrno>
#include <charconv>
#include <cstring>
#include <sstream>
#include <thread>

#include <fcntl.h>
#include <unistd.h>

#include "common/error.h"
#include "common/fs.h"
#include "supervisor/contain/cgroup.h"

namespace assay::contain::detail {

namespace {

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> out;
  std::string::size_type start = 0;
  while (true) {
    auto pos = text.find(sep, start);
    out.push_back(text.substr(start, pos - start));
    if (pos == std::string::npos) break;
    start = pos + 1;
  }
  return out;
}

// The lines of `text`, without their newlines.
std::vector<std::string_view> lines_of(std::string_view text) {
  std::vector<std::string_view> out;
  while (!text.empty()) {
    auto nl = text.find('\n');
    out.push_back(text.substr(0, nl));
    if (nl == std::string_view::npos) break;
    text.remove_prefix(nl + 1);
  }
  return out;
}

// Space-separated fields of one line.
std::vector<std::string_view> fields_of(std::string_view line) {
  std::vector<std::string_view> out;
  while (true) {
    auto start = line.find_first_not_of(' ');
    if (start == std::string_view::npos) break;
    line.remove_prefix(start);
    auto end = line.find(' ');
    out.push_back(line.substr(0, end));
    if (end == std::string_view::npos) break;
    line.remove_prefix(end);
  }
  return out;
}

std::optional<std::uint64_t> parse_u64(std::string_view s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.remove_suffix(1);
  std::uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || s.empty()) return std::nullopt;
  return v;
}

// Unescapes mountinfo's octal escapes (\040 for a space).
std::string unescape_mountinfo(const std::string& s) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size()) {
      int v = 0;
      bool ok = true;
      for (int k = 1; k <= 3; ++k) {
        char c = s[i + k];
        if (c < '0' || c > '7') ok = false;
        v = v * 8 + (c - '0');
      }
      if (ok) {
        out.push_back(static_cast<char>(v));
        i += 3;
        continue;
      }
    }
    out.push_back(s[i]);
  }
  return out;
}

// Field 22 of /proc/<pid>/stat: start time in clock ticks since boot.
std::optional<std::string> process_start_time(pid_t pid) {
  std::optional<std::string> line;
  try {
    line = read_cgroup_file("/proc/" + std::to_string(pid) + "/stat");
  } catch (const common::Error&) {
    return std::nullopt;  // e.g. ESRCH: the process is exiting
  }
  if (!line) return std::nullopt;
  auto close = line->rfind(')');  // comm may contain spaces and parentheses
  if (close == std::string::npos) return std::nullopt;
  auto fields = fields_of(std::string_view(*line).substr(close + 1));  // from field 3, state
  if (fields.size() < 20) return std::nullopt;
  return std::string(fields[19]);  // field 22
}

}  // namespace

std::vector<CgroupMembership> parse_proc_cgroup(const std::string& text) {
  std::vector<CgroupMembership> out;
  for (std::string_view line : lines_of(text)) {
    if (line.empty()) continue;
    auto malformed = [&] {
      return common::Error("contain.unavailable",
                           "malformed /proc/self/cgroup line \"" + std::string(line) + "\"");
    };
    auto first = line.find(':');
    if (first == std::string_view::npos) throw malformed();
    auto second = line.find(':', first + 1);
    int id = 0;
    auto [end, ec] = std::from_chars(line.data(), line.data() + first, id);
    if (second == std::string_view::npos || ec != std::errc() || end != line.data() + first) {
      throw malformed();
    }
    CgroupMembership m;
    m.id = id;
    std::string ctrls(line.substr(first + 1, second - first - 1));
    if (!ctrls.empty()) m.controllers = split(ctrls, ',');
    m.path = line.substr(second + 1);
    out.push_back(std::move(m));
  }
  return out;
}

std::vector<CgroupMount> parse_mountinfo_cgroups(const std::string& text) {
  std::vector<CgroupMount> out;
  for (std::string_view line : lines_of(text)) {
    auto dash = line.find(" - ");
    if (dash == std::string_view::npos) continue;
    auto pre = fields_of(line.substr(0, dash));    // id parent major:minor root mountpoint ...
    auto post = fields_of(line.substr(dash + 3));  // fstype source superoptions
    if (pre.size() < 5 || post.size() < 3) continue;
    if (post[0] != "cgroup" && post[0] != "cgroup2") continue;
    CgroupMount m;
    m.root = unescape_mountinfo(std::string(pre[3]));
    m.mountpoint = unescape_mountinfo(std::string(pre[4]));
    m.v2 = post[0] == "cgroup2";
    if (!m.v2) {
      for (const auto& opt : split(std::string(post[2]), ',')) {
        if (opt == "rw" || opt == "ro" || opt.find('=') != std::string::npos) continue;
        m.controllers.push_back(opt);
      }
    }
    out.push_back(std::move(m));
  }
  return out;
}

std::filesystem::path cgroup_dir(const CgroupMount& mount, const std::string& path) {
  std::string rel;
  if (mount.root == "/") {
    rel = path;
  } else if (path == mount.root || path.starts_with(mount.root + "/")) {
    rel = path.substr(mount.root.size());
  } else {
    throw common::Error("contain.unavailable", "cgroup \"" + path +
                                                   "\" is outside the hierarchy \"" + mount.root +
                                                   "\" mounted at " + mount.mountpoint.string());
  }
  while (!rel.empty() && rel.front() == '/') rel.erase(0, 1);
  return rel.empty() ? mount.mountpoint : mount.mountpoint / rel;
}

std::optional<std::string> read_cgroup_file(const std::filesystem::path& file) {
  int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return std::nullopt;
    common::throw_errno("contain.cgroup_io", "open " + file.string(), errno);
  }
  common::UniqueFd guard(fd);
  std::string out;
  char buf[4096];
  while (true) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      // A counter the kernel does not implement for this cgroup reads as an error: absent.
      if (errno == EOPNOTSUPP || errno == ENODEV) return std::nullopt;
      common::throw_errno("contain.cgroup_io", "read " + file.string(), errno);
    }
    if (n == 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  return out;
}

void write_cgroup_file(const std::filesystem::path& file, const std::string& value) {
  int fd = ::open(file.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) common::throw_errno("contain.cgroup_io", "open " + file.string(), errno);
  common::UniqueFd guard(fd);
  ssize_t n;
  do {
    n = ::write(fd, value.data(), value.size());
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    common::throw_errno("contain.cgroup_io", "write \"" + value + "\" to " + file.string(), errno);
  }
}

std::optional<std::uint64_t> read_u64(const std::filesystem::path& file) {
  auto text = read_cgroup_file(file);
  if (!text) return std::nullopt;
  auto v = parse_u64(*text);
  if (!v) {
    auto trimmed = text->substr(0, text->find('\n'));
    if (trimmed == "max") return std::nullopt;
    throw common::Error("contain.cgroup_io",
                        "unexpected content \"" + trimmed + "\" in " + file.string());
  }
  return v;
}

std::vector<pid_t> read_pids(const std::filesystem::path& procs_file) {
  std::vector<pid_t> out;
  auto text = read_cgroup_file(procs_file);
  if (!text) return out;
  std::istringstream in(*text);
  long pid;
  while (in >> pid) out.push_back(static_cast<pid_t>(pid));
  return out;
}

std::map<std::string, std::optional<std::uint64_t>> parse_flat_keyed(
    std::string_view text, const std::vector<std::string>& keys) {
  std::map<std::string, std::optional<std::uint64_t>> out;
  for (const auto& k : keys) out[k] = std::nullopt;
  for (std::string_view line : lines_of(text)) {
    auto f = fields_of(line);
    if (f.size() != 2) continue;
    auto it = out.find(std::string(f[0]));
    if (it != out.end()) it->second = parse_u64(f[1]);
  }
  return out;
}

Counter read_flat_keyed(const std::filesystem::path& file, const std::vector<std::string>& keys) {
  Counter c;
  if (auto text = read_cgroup_file(file)) c.keys = parse_flat_keyed(*text, keys);
  return c;
}

Counter read_counter(const std::filesystem::path& file) {
  return Counter{read_u64(file), {}};
}

std::string owner_dir_name() {
  pid_t self = ::getpid();
  auto start = process_start_time(self);
  if (!start) throw common::Error("contain.unavailable", "cannot read /proc/self/stat");
  return "assayd-" + std::to_string(self) + "-" + *start;
}

bool owner_is_gone(const std::string& owner) {
  if (!owner.starts_with("assayd-")) return false;
  auto parts = split(owner.substr(7), '-');
  auto digits = [](const std::string& t) {
    return !t.empty() && t.find_first_not_of("0123456789") == std::string::npos;
  };
  if (parts.size() != 2 || !digits(parts[0]) || !digits(parts[1])) return false;
  pid_t pid = 0;
  auto [p, ec] = std::from_chars(parts[0].data(), parts[0].data() + parts[0].size(), pid);
  if (ec != std::errc() || pid <= 0) return false;
  auto start = process_start_time(pid);
  return !start || *start != parts[1];
}

void rmdir_retrying(const std::filesystem::path& dir) {
  for (int attempt = 0;; ++attempt) {
    if (::rmdir(dir.c_str()) == 0 || errno == ENOENT) return;
    if (errno != EBUSY || attempt >= 200) {
      common::throw_errno("contain.cgroup_io", "rmdir " + dir.string(), errno);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace assay::contain::detail
