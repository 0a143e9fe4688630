// Who is on the other end of the socket: the peer credentials the API resolves once per
// connection (api/session.cpp), which admission and every step open the request's files as
// (pipelines/admission.h). A leaf: any layer may include it.
#pragma once

#include <sys/types.h>

namespace assay::supervisor {

struct Peer {
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;
  bool admin = false;  // root or a member of the admin group
};

}  // namespace assay::supervisor
