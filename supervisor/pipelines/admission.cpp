#include "supervisor/pipelines/admission.h"

#include <algorithm>
#include <filesystem>
#include <vector>

#include <grp.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/error.h"
#include "common/text.h"

namespace assay::supervisor {

using common::Error;
namespace fs = std::filesystem;

namespace {

std::vector<gid_t> groups_of(const Peer& peer) {
  std::vector<gid_t> groups(64);
  if (struct passwd* pw = ::getpwuid(peer.uid)) {
    int n = static_cast<int>(groups.size());
    if (::getgrouplist(pw->pw_name, pw->pw_gid, groups.data(), &n) < 0) {
      groups.resize(static_cast<std::size_t>(n));
      ::getgrouplist(pw->pw_name, pw->pw_gid, groups.data(), &n);
    }
    groups.resize(static_cast<std::size_t>(std::max(n, 0)));
  } else {
    groups.clear();
  }
  groups.push_back(peer.gid);
  return groups;
}

bool allowed(const struct stat& st, const Peer& peer, const std::vector<gid_t>& groups,
             mode_t user_bit, mode_t group_bit, mode_t other_bit) {
  if (peer.admin) return true;
  if (st.st_uid == peer.uid) return (st.st_mode & user_bit) != 0;
  if (std::find(groups.begin(), groups.end(), st.st_gid) != groups.end())
    return (st.st_mode & group_bit) != 0;
  return (st.st_mode & other_bit) != 0;
}

std::string quote_path(const std::string& path) {
  return "\"" + common::printable(path, 300) + "\"";
}

// Walks `path` from the root as the peer would: each directory above it must be searchable by
// the peer. Until the walk passed a directory the peer may search, nothing is said of what lies
// below it, so a refusal never tells whether a path exists.
struct stat walk(const std::string& path, const Peer& peer, const std::string& code,
                 const std::string& what) {
  auto groups = groups_of(peer);
  auto forbidden = [&] {
    return Error("request.forbidden", what + " " + quote_path(path) + " is not readable by uid " +
                                          std::to_string(peer.uid) + ", who submitted it");
  };
  fs::path p(path);
  fs::path prefix = "/";
  struct stat st {};
  for (auto it = std::next(p.begin()); it != p.end(); ++it) {
    if (::lstat(prefix.c_str(), &st) != 0)
      throw Error(code, what + " " + quote_path(path) + " does not exist");
    if (!allowed(st, peer, groups, S_IXUSR, S_IXGRP, S_IXOTH)) throw forbidden();
    prefix /= *it;
  }
  if (::lstat(path.c_str(), &st) != 0)
    throw Error(code, what + " " + quote_path(path) + " does not exist");
  if (S_ISLNK(st.st_mode)) throw Error(code, what + " " + quote_path(path) + " is a symlink");
  mode_t need_user = S_IRUSR, need_group = S_IRGRP, need_other = S_IROTH;
  if (S_ISDIR(st.st_mode)) need_user |= S_IXUSR, need_group |= S_IXGRP, need_other |= S_IXOTH;
  auto ok = [&](mode_t u, mode_t g, mode_t o) {
    if (peer.admin) return true;
    if (st.st_uid == peer.uid) return (st.st_mode & u) == u;
    if (std::find(groups.begin(), groups.end(), st.st_gid) != groups.end())
      return (st.st_mode & g) == g;
    return (st.st_mode & o) == o;
  };
  if (!ok(need_user, need_group, need_other)) throw forbidden();
  return st;
}

std::string normalised(const std::string& dir, const std::string& code, const std::string& what) {
  if (dir.empty() || dir.front() != '/')
    throw Error(code, what + " " + quote_path(dir) + " is not absolute");
  for (const auto& part : fs::path(dir))
    if (part == "..") throw Error(code, what + " " + quote_path(dir) + " has .. in its path");
  std::string n = fs::path(dir).lexically_normal().string();
  while (n.size() > 1 && n.back() == '/') n.pop_back();
  return n;
}

}  // namespace

std::string check_model_dir(const std::string& raw, const Peer& peer) {
  const std::string what = "model directory";
  std::string dir = normalised(raw, "request.bad_model", what);
  struct stat st = walk(dir, peer, "request.bad_model", what);
  if (!S_ISDIR(st.st_mode))
    throw Error("request.bad_model", what + " " + quote_path(dir) + " is not a directory");
  std::error_code ec;
  auto real = fs::canonical(dir, ec);
  if (ec || real.string() != dir)
    throw Error("request.bad_model", what + " " + quote_path(dir) +
                                         " has a symlink in its path (resolves to " +
                                         quote_path(real.string()) + ")");
  // Workers read every regular file at the top of the directory (engine.cpp hands them the
  // descriptors): each must be readable by the submitter, a symlinked one at its target.
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::error_code fec;
    if (!e.is_regular_file(fec)) continue;
    fs::path target = e.is_symlink(fec) ? fs::canonical(e.path(), fec) : e.path();
    if (fec) continue;
    walk(target.string(), peer, "request.bad_model", "model file");
  }
  if (ec)
    common::throw_errno("request.bad_model", "cannot list model directory " + quote_path(dir),
                        ec.value());
  return dir;
}

void check_readable_file(const std::string& raw, const Peer& peer, const std::string& code,
                         const std::string& what) {
  std::string path = normalised(raw, code, what);
  if (path != raw) throw Error(code, what + " " + quote_path(raw) + " is not a normalised path");
  struct stat st = walk(path, peer, code, what);
  if (!S_ISREG(st.st_mode))
    throw Error(code, what + " " + quote_path(path) + " is not a regular file");
}

void check_request_limits(const common::RequestLimits& asked, const Config& config) {
  if (asked.timeout_seconds && *asked.timeout_seconds > config.worker_timeout_seconds)
    throw Error("request.limit_above_max", "request.limits.timeout_seconds " +
                                               std::to_string(*asked.timeout_seconds) +
                                               " is above the configured worker_timeout_seconds " +
                                               std::to_string(config.worker_timeout_seconds));
  if (asked.memory_bytes && config.worker_memory_max &&
      *asked.memory_bytes > *config.worker_memory_max)
    throw Error("request.limit_above_max", "request.limits.memory_bytes " +
                                               std::to_string(*asked.memory_bytes) +
                                               " is above the configured worker_memory_max " +
                                               std::to_string(*config.worker_memory_max));
}

}  // namespace assay::supervisor
