// The seccomp filter every worker runs under: a deny-list of what a model worker never needs,
// chosen so that CUDA and ROCm still start (memfd_create, AF_UNIX sockets and ioctl stay
// allowed). Raw classic BPF, no libseccomp (assayd is linked statically).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <linux/filter.h>

namespace assay::contain::detail {

struct SeccompPolicy {
  std::vector<sock_filter> program;
  sock_fprog fprog{};               // points into `program`, for seccomp(2)
  std::string arch;                 // "x86_64", "aarch64"
  std::vector<std::string> denied;  // EPERM, sorted
  std::vector<std::string> enosys;  // ENOSYS (clone3: libc then uses clone, whose flags we read)
  std::string sha256;               // "sha256:<hex>" of the program's bytes
};

// Built once. Besides `denied`: clone with any CLONE_NEW* flag, x32 system calls and calls of
// any other architecture (i386 through int 0x80) fail with EPERM.
const SeccompPolicy& seccomp_policy();

// "sha256:<64 hex>" of `size` bytes (assay_base has no crypto; this is the only digest assayd
// needs).
std::string sha256_id(const void* data, std::size_t size);

}  // namespace assay::contain::detail
