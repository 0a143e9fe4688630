// bench/private_copy.sh's probe: the ways the oracle could make its private copy of a weight
// file, timed on one file in the page cache. Prints one JSON line:
// {"method", "bytes", "copy_s", "touch_s", "free_s"}.
//   anon-hugepage: anonymous memory with MADV_HUGEPAGE, pread in 256 KiB chunks, then read-only
//                  (worker/model_files.cpp until 2026-12-07).
//   anon-4k:       the same without MADV_HUGEPAGE.
//   anon-prefault: anonymous memory, a second thread faulting the pages in (MADV_POPULATE_WRITE)
//                  a 32 MiB step ahead of the reader, each step in the page size the steps
//                  before it measured faster (worker/model_files.cpp now).
//   anon-huge-prefault, anon-4k-prefault: the same, always in huge pages, always in 4 KiB pages.
//   memfd:         sendfile into a memfd (shared-memory pages written whole are never zeroed
//                  first), sealed against writes, mapped read-only.
// copy_s: until the read-only image exists; touch_s: one byte of every 4 KiB page read
// afterwards (faults the memfd mapping pays late); free_s: munmap (and the memfd's last close).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "worker/prefault.h"

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "private_copy: %s: %s\n", what.c_str(), std::strerror(errno));
  std::exit(1);
}

unsigned char* anonymous_copy(int fd, std::size_t size, bool huge) {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) die("mmap");
  if (huge) ::madvise(p, size, MADV_HUGEPAGE);
  auto* data = static_cast<unsigned char*>(p);
  for (std::size_t got = 0; got < size;) {
    ssize_t n = ::pread(fd, data + got, std::min<std::size_t>(256 << 10, size - got),
                        static_cast<off_t>(got));
    if (n <= 0) die("pread");
    got += static_cast<std::size_t>(n);
  }
  ::mprotect(p, size, PROT_READ);
  return data;
}

enum class Pages { kHuge, k4k, kMeasured };

// The reader waits (std::atomic::wait, a futex) until the faulting thread has populated the step
// it is about to read into. kMeasured is the oracle's own Prefaulter (worker/prefault.h).
unsigned char* prefaulted_copy(int fd, std::size_t size, Pages pages) {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) die("mmap");
  if (pages != Pages::k4k) ::madvise(p, size, MADV_HUGEPAGE);
  auto* data = static_cast<unsigned char*>(p);
  auto read_all = [&](auto&& wait_for) {
    for (std::size_t got = 0; got < size;) {
      std::size_t n = std::min<std::size_t>(256 << 10, size - got);
      wait_for(got + n);
      ssize_t r = ::pread(fd, data + got, n, static_cast<off_t>(got));
      if (r <= 0) die("pread");
      got += static_cast<std::size_t>(r);
    }
  };
  if (pages == Pages::kMeasured) {
    assay::oracle::Prefaulter prefault(reinterpret_cast<std::byte*>(data), size);
    read_all([&](std::size_t end) { prefault.wait_for(end); });
  } else {
    constexpr std::size_t kStep = assay::oracle::Prefaulter::kStep;
    std::atomic<std::size_t> ready{0};
    std::thread faulter([&] {
      for (std::size_t at = 0; at < size; at += kStep) {
        std::size_t n = std::min(kStep, size - at);
        ::madvise(data + at, n, MADV_POPULATE_WRITE);  // a failure leaves the fault to the read
        ready.store(at + n, std::memory_order_release);
        ready.notify_one();
      }
    });
    read_all([&](std::size_t end) {
      for (std::size_t r = ready.load(); r < end; r = ready.load()) ready.wait(r);
    });
    faulter.join();
  }
  ::mprotect(p, size, PROT_READ);
  return data;
}

unsigned char* memfd_copy(int fd, std::size_t size) {
  int memory = ::memfd_create("private-copy", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (memory < 0) die("memfd_create");
  off_t at = 0;
  while (static_cast<std::size_t>(at) < size)
    if (::sendfile(memory, fd, &at, size - static_cast<std::size_t>(at)) <= 0) die("sendfile");
  if (::fcntl(memory, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK) != 0) die("seal");
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, memory, 0);
  if (p == MAP_FAILED) die("mmap memfd");
  ::close(memory);
  return static_cast<unsigned char*>(p);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 || std::string(argv[1]) == "--help") {
    std::fprintf(
        stderr,
        "usage: %s anon-hugepage|anon-4k|anon-prefault|anon-huge-prefault|anon-4k-prefault|memfd "
        "FILE\n",
        argv[0]);
    return argc == 2 ? 0 : 2;
  }
  const std::string method = argv[1];
  int fd = ::open(argv[2], O_RDONLY | O_CLOEXEC);
  if (fd < 0) die(std::string("open ") + argv[2]);
  struct stat st {};
  if (::fstat(fd, &st) != 0) die("fstat");
  const auto size = static_cast<std::size_t>(st.st_size);
  double t0 = now();
  unsigned char* image = nullptr;
  if (method == "anon-hugepage" || method == "anon-4k")
    image = anonymous_copy(fd, size, method == "anon-hugepage");
  else if (method == "anon-prefault")
    image = prefaulted_copy(fd, size, Pages::kMeasured);
  else if (method == "anon-huge-prefault")
    image = prefaulted_copy(fd, size, Pages::kHuge);
  else if (method == "anon-4k-prefault")
    image = prefaulted_copy(fd, size, Pages::k4k);
  else if (method == "memfd")
    image = memfd_copy(fd, size);
  else {
    std::fprintf(stderr, "private_copy: unknown method \"%s\"\n", method.c_str());
    return 2;
  }
  double t1 = now();
  unsigned long sum = 0;
  for (std::size_t i = 0; i < size; i += 4096) sum += image[i];
  double t2 = now();
  ::munmap(image, size);
  double t3 = now();
  std::printf(
      "{\"method\": \"%s\", \"bytes\": %zu, \"copy_s\": %.3f, \"touch_s\": %.3f, \"free_s\": %.3f, "
      "\"checksum\": %lu}\n",
      method.c_str(), size, t1 - t0, t2 - t1, t3 - t2, sum);
  return 0;
}
