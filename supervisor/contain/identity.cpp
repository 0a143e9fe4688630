#include "supervisor/contain/identity.h"

#include <charconv>
#include <optional>
#include <set>
#include <string_view>
#include <vector>

#include <sys/stat.h>

#include "common/error.h"
#include "supervisor/contain/cgroup.h"

namespace assay::contain {

namespace {

namespace fs = std::filesystem;

constexpr std::uint32_t kDynamicFirst = 61184;  // systemd's DYNAMIC_UID_MIN
constexpr std::uint32_t kDynamicLast = 65519;   // DYNAMIC_UID_MAX

struct Entry {
  std::string name;
  std::uint32_t id = 0;     // uid (passwd) or gid (group)
  std::uint32_t group = 0;  // passwd: the primary gid
};

std::optional<std::uint32_t> number(std::string_view s) {
  std::uint32_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || p != s.data() + s.size()) return std::nullopt;
  return v;
}

// name:password:id[:gid...] lines; malformed lines are skipped as libc's parser skips them.
std::vector<Entry> read_db(const fs::path& file, bool passwd) {
  std::vector<Entry> out;
  auto text = detail::read_cgroup_file(file.c_str());
  if (!text) return out;
  std::string_view all(*text);
  while (!all.empty()) {
    auto nl = all.find('\n');
    std::string_view line = all.substr(0, nl);
    all = nl == std::string_view::npos ? std::string_view() : all.substr(nl + 1);
    std::vector<std::string_view> f;
    while (f.size() < 4) {
      auto colon = line.find(':');
      f.push_back(line.substr(0, colon));
      if (colon == std::string_view::npos) break;
      line.remove_prefix(colon + 1);
    }
    if (f.size() < (passwd ? 4u : 3u) || f[0].empty()) continue;
    auto id = number(f[2]);
    auto group = passwd ? number(f[3]) : id;
    if (!id || !group) continue;
    out.push_back({std::string(f[0]), *id, *group});
  }
  return out;
}

fs::path under(const fs::path& root, const char* path) {
  return root / fs::path(path).relative_path();
}

}  // namespace

WorkerIdentity default_worker_identity(const fs::path& root) {
  auto users = read_db(under(root, "/etc/passwd"), true);
  for (const auto& u : users) {
    if (u.name == "assay-worker") return {u.id, u.group, u.name, false};
  }
  std::set<std::uint32_t> taken;
  for (const auto& u : users) taken.insert(u.id);
  for (const auto& g : read_db(under(root, "/etc/group"), false)) taken.insert(g.id);
  fs::path dynamic = under(root, "/run/systemd/dynamic-uid");
  for (std::uint32_t id = kDynamicFirst; id <= kDynamicLast; ++id) {
    if (taken.count(id)) continue;
    struct stat st;
    if (::lstat((dynamic / std::to_string(id)).c_str(), &st) == 0) continue;
    return {id, id, "", true};
  }
  throw common::Error("contain.no_worker_identity", "no assay-worker user in " +
                                                        under(root, "/etc/passwd").string() +
                                                        " and every id in 61184-65519 is taken");
}

WorkerIdentity worker_identity(const std::string& user_or_uid, const fs::path& root) {
  auto users = read_db(under(root, "/etc/passwd"), true);
  if (auto uid = number(user_or_uid)) {
    for (const auto& u : users) {
      if (u.id == *uid) return {u.id, u.group, u.name, false};
    }
    return {*uid, *uid, "", true};
  }
  for (const auto& u : users) {
    if (u.name == user_or_uid) return {u.id, u.group, u.name, false};
  }
  throw common::Error("contain.unknown_user", "user \"" + user_or_uid + "\" is not in " +
                                                  under(root, "/etc/passwd").string());
}

}  // namespace assay::contain
