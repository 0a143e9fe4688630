// Who a worker runs as when assayd is root: never root itself. The daemon and `assayd contain`
// pick it by the same rule.
#pragma once

#include <filesystem>
#include <string>

#include <sys/types.h>

namespace assay::contain {

struct WorkerIdentity {
  uid_t uid = 0;
  gid_t gid = 0;
  std::string user;        // the passwd name ("assay-worker"); empty for a transient id
  bool transient = false;  // a uid/gid that no passwd or group entry names
  bool operator==(const WorkerIdentity&) const = default;
};

// The `assay-worker` user and its primary group when /etc/passwd has it. Otherwise a transient
// id: the lowest N in systemd's dynamic range 61184-65519 that /etc/passwd names as no uid,
// /etc/group as no gid, and /run/systemd/dynamic-uid/ has not handed out, used as uid and gid.
// Reads the files directly, no NSS (assayd is linked statically): a user that only NSS knows
// (LDAP) is not seen. `root` prefixes every path (tests). Throws
// common::Error("contain.no_worker_identity") when the range is full.
WorkerIdentity default_worker_identity(const std::filesystem::path& root = "/");

// `--user`: a name from /etc/passwd (with its primary group), or a numeric uid (gid: its passwd
// entry's, else the same number). Throws common::Error("contain.unknown_user") naming it.
WorkerIdentity worker_identity(const std::string& user_or_uid,
                               const std::filesystem::path& root = "/");

}  // namespace assay::contain
