#include "supervisor/contain/seccomp.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstddef>
#include <cstring>

#include <linux/audit.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <sys/syscall.h>

namespace assay::contain::detail {

namespace {

struct Syscall {
  const char* name;
  long nr;
};

#define ASSAY_SYSCALL(n) \
  Syscall {              \
#n, SYS_##n          \
  }

// Debugging and reading other processes, mounts and namespaces, kernel objects a model never
// uses (BPF, perf, keyrings, modules, kexec), io_uring (its own path around this filter), and
// the calls that open files by handle or trap page faults.
constexpr std::array kDenied = {
    ASSAY_SYSCALL(add_key),
    ASSAY_SYSCALL(bpf),
    ASSAY_SYSCALL(delete_module),
    ASSAY_SYSCALL(finit_module),
    ASSAY_SYSCALL(fsconfig),
    ASSAY_SYSCALL(fsmount),
    ASSAY_SYSCALL(fsopen),
    ASSAY_SYSCALL(fspick),
    ASSAY_SYSCALL(init_module),
    ASSAY_SYSCALL(io_uring_enter),
    ASSAY_SYSCALL(io_uring_register),
    ASSAY_SYSCALL(io_uring_setup),
    ASSAY_SYSCALL(kexec_file_load),
    ASSAY_SYSCALL(kexec_load),
    ASSAY_SYSCALL(keyctl),
    ASSAY_SYSCALL(mount),
    ASSAY_SYSCALL(mount_setattr),
    ASSAY_SYSCALL(move_mount),
    ASSAY_SYSCALL(open_by_handle_at),
    ASSAY_SYSCALL(open_tree),
    ASSAY_SYSCALL(perf_event_open),
    ASSAY_SYSCALL(pivot_root),
    ASSAY_SYSCALL(process_vm_readv),
    ASSAY_SYSCALL(process_vm_writev),
    ASSAY_SYSCALL(ptrace),
    ASSAY_SYSCALL(request_key),
    ASSAY_SYSCALL(setns),
    ASSAY_SYSCALL(umount2),
    ASSAY_SYSCALL(unshare),
    ASSAY_SYSCALL(userfaultfd),
};
#undef ASSAY_SYSCALL

#if defined(__x86_64__)
constexpr std::uint32_t kArch = AUDIT_ARCH_X86_64;
constexpr const char* kArchName = "x86_64";
constexpr std::uint32_t kX32Bit = 0x40000000;  // __X32_SYSCALL_BIT
#elif defined(__aarch64__)
constexpr std::uint32_t kArch = AUDIT_ARCH_AARCH64;
constexpr const char* kArchName = "aarch64";
#else
#error "assay's seccomp policy knows x86_64 and aarch64"
#endif

constexpr std::uint32_t kNamespaceFlags = CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS |
                                          CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID |
                                          CLONE_NEWNET;

// A program with forward jumps to named labels, resolved once it is complete.
class Assembler {
 public:
  enum Label { kDeny, kEnosys, kCloneFlags, kLabels };

  void stmt(std::uint16_t code, std::uint32_t k) { prog_.push_back(BPF_STMT(code, k)); }
  // if (A <op> k) goto label; else fall through.
  void jump_if(std::uint16_t op, std::uint32_t k, Label label) { jump(op, k, label, true); }
  // if !(A <op> k) goto label; else fall through.
  void jump_unless(std::uint16_t op, std::uint32_t k, Label label) { jump(op, k, label, false); }
  void label(Label l) { at_[l] = prog_.size(); }
  std::vector<sock_filter> finish() {
    for (const Jump& j : jumps_) {
      std::size_t offset = at_[j.label] - j.index - 1;  // < 256 here: the test checks the length
      (j.when_true ? prog_[j.index].jt : prog_[j.index].jf) = static_cast<std::uint8_t>(offset);
    }
    return std::move(prog_);
  }

 private:
  struct Jump {
    std::size_t index;
    Label label;
    bool when_true;
  };
  void jump(std::uint16_t op, std::uint32_t k, Label label, bool when_true) {
    jumps_.push_back({prog_.size(), label, when_true});
    prog_.push_back(BPF_JUMP(BPF_JMP | op | BPF_K, k, 0, 0));
  }
  std::vector<sock_filter> prog_;
  std::vector<Jump> jumps_;
  std::array<std::size_t, kLabels> at_{};
};

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "clone's flags are read as the low word");

SeccompPolicy build() {
  SeccompPolicy p;
  p.arch = kArchName;
  Assembler a;
  a.stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch));
  a.jump_unless(BPF_JEQ, kArch, Assembler::kDeny);
  a.stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr));
#if defined(__x86_64__)
  a.jump_if(BPF_JGE, kX32Bit, Assembler::kDeny);
#endif
  for (const Syscall& s : kDenied) {
    a.jump_if(BPF_JEQ, static_cast<std::uint32_t>(s.nr), Assembler::kDeny);
    p.denied.emplace_back(s.name);
  }
  a.jump_if(BPF_JEQ, SYS_clone3, Assembler::kEnosys);
  p.enosys.emplace_back("clone3");
  a.jump_if(BPF_JEQ, SYS_clone, Assembler::kCloneFlags);
  a.stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
  a.label(Assembler::kCloneFlags);
  a.stmt(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, args));  // flags, low 32 bits
  a.jump_if(BPF_JSET, kNamespaceFlags, Assembler::kDeny);
  a.stmt(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
  a.label(Assembler::kDeny);
  a.stmt(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA));
  a.label(Assembler::kEnosys);
  a.stmt(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (ENOSYS & SECCOMP_RET_DATA));
  p.program = a.finish();
  std::sort(p.denied.begin(), p.denied.end());
  p.sha256 = sha256_id(p.program.data(), p.program.size() * sizeof(sock_filter));
  p.fprog.len = static_cast<unsigned short>(p.program.size());
  p.fprog.filter = p.program.data();
  return p;
}

// FIPS 180-4 SHA-256.
constexpr std::array<std::uint32_t, 64> kRound = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

std::uint32_t rotr(std::uint32_t x, int n) {
  return (x >> n) | (x << (32 - n));
}

void compress(std::array<std::uint32_t, 8>& h, const unsigned char* block) {
  std::uint32_t w[64];
  for (int i = 0; i < 16; ++i) {
    w[i] = std::uint32_t(block[4 * i]) << 24 | std::uint32_t(block[4 * i + 1]) << 16 |
           std::uint32_t(block[4 * i + 2]) << 8 | std::uint32_t(block[4 * i + 3]);
  }
  for (int i = 16; i < 64; ++i) {
    std::uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    std::uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  auto [a, b, c, d, e, f, g, hh] = h;
  for (int i = 0; i < 64; ++i) {
    std::uint32_t t1 =
        hh + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kRound[i] + w[i];
    std::uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    hh = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  std::array<std::uint32_t, 8> add = {a, b, c, d, e, f, g, hh};
  for (int i = 0; i < 8; ++i) h[i] += add[i];
}

}  // namespace

std::string sha256_id(const void* data, std::size_t size) {
  std::array<std::uint32_t, 8> h = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                    0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  const auto* bytes = static_cast<const unsigned char*>(data);
  std::size_t full = size / 64 * 64;
  for (std::size_t at = 0; at < full; at += 64) compress(h, bytes + at);
  unsigned char tail[128] = {};
  std::size_t rest = size - full;
  std::memcpy(tail, bytes + full, rest);
  tail[rest] = 0x80;
  std::size_t tail_len = rest + 9 <= 64 ? 64 : 128;
  std::uint64_t bits = static_cast<std::uint64_t>(size) * 8;
  for (int i = 0; i < 8; ++i) tail[tail_len - 1 - i] = static_cast<unsigned char>(bits >> (8 * i));
  for (std::size_t at = 0; at < tail_len; at += 64) compress(h, tail + at);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "sha256:";
  for (std::uint32_t word : h) {
    for (int shift = 28; shift >= 0; shift -= 4) out.push_back(kHex[(word >> shift) & 0xf]);
  }
  return out;
}

const SeccompPolicy& seccomp_policy() {
  static const SeccompPolicy policy = build();  // a move keeps the program's buffer
  return policy;
}

}  // namespace assay::contain::detail
