// Prefaulter: faults in a fresh private image a step ahead of the thread that reads into it
// (worker/model_files.cpp). Header-only, standard library and Linux only, so that
// bench/private_copy.cpp times this very code.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <stop_token>
#include <thread>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels refuse it and the reads fault instead
#endif

namespace assay::oracle {

// Faults in (the kernel zeroes) the fresh pages of a large image one step ahead of its reader, on
// a thread of its own: the reader's pread then only copies, and the zeroing runs beside it.
// Which page size to fault with is measured, not assumed. On a host that keeps its memory, huge
// pages win (fewer faults; bench/private_copy.md, two runs: 0.40-0.56 s against 1.23-1.43 s for
// 2.6 GB). In a VM whose host took back the guest's free 2 MiB blocks (free page reporting),
// every huge page must first be backed again by the host, and 4 KiB pages from the guest's own
// free lists win by 2-5x (1.57-3.64 s against 6.97-8.45 s); a step in huge pages soon after
// another process freed its pages can take 90-145 ms against 12-22. So each step's page size
// follows the last measurements (run()). Destroyed before the mapping it fills: it stops at the
// next step and is joined.
class Prefaulter {
 public:
  static constexpr std::size_t kStep = 32u << 20;
  // Images smaller than this are read without a second thread, in huge pages.
  static constexpr std::size_t kMinSize = 4 * kStep;

  Prefaulter(std::byte* data, std::size_t size) : size_(size) {
    if (!data || size < kMinSize) {
      ready_ = size;
      return;
    }
    thread_ = std::jthread([this, data](std::stop_token stop) { run(data, stop); });
  }

  // Waits until the bytes below `end` are faulted in (or the faulting thread gave up).
  void wait_for(std::size_t end) {
    std::size_t now = ready_.load(std::memory_order_acquire);
    while (now < end) {
      ready_.wait(now, std::memory_order_acquire);
      now = ready_.load(std::memory_order_acquire);
    }
  }

 private:
  // Faults in [at, at + kStep) and publishes it; false when the kernel refused (an old kernel,
  // no memory for now): the reader's own faults then do the rest, in whatever page size the
  // mapping has there.
  bool populate(std::byte* data, std::size_t at) {
    std::size_t n = std::min(kStep, size_ - at);
    if (::madvise(data + at, n, MADV_POPULATE_WRITE) != 0) return false;
    ready_.store(at + n, std::memory_order_release);
    ready_.notify_one();
    return true;
  }

  // Step 0 in huge pages, step 1 in 4 KiB pages; then the faster, each later step in huge pages
  // compared with the last in 4 KiB pages. After a switch to 4 KiB pages, one step in huge pages
  // is tried again 8 steps later, then after twice as many each time it is still slower, so a
  // host that took the memory back costs a few slow steps, not one in eight.
  void run(std::byte* data, const std::stop_token& stop) {
    using Clock = std::chrono::steady_clock;
    Clock::duration first{}, small{};  // step 0 (huge pages); the last step in 4 KiB pages
    bool huge = true;
    std::size_t interval = 8, next_try = 0;
    for (std::size_t i = 0, at = 0; at < size_ && !stop.stop_requested(); ++i, at += kStep) {
      const bool in_huge = i != 1 && (huge || i == next_try);
      const std::size_t n = std::min(kStep, size_ - at);
      if (::madvise(data + at, n, in_huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE) != 0) break;
      auto t0 = Clock::now();
      if (!populate(data, at)) break;
      const auto took = Clock::now() - t0;
      if (i == 0) {
        first = took;
      } else if (!in_huge) {
        small = took;
        if (i == 1 && first > small) {
          huge = false;
          next_try = i + interval;
        }
      } else if (took <= small) {
        huge = true;
        interval = 8;
      } else {
        if (!huge) interval *= 2;
        huge = false;
        next_try = i + interval;
      }
    }
    ready_.store(size_, std::memory_order_release);
    ready_.notify_one();
  }

  std::size_t size_;
  std::atomic<std::size_t> ready_{0};
  std::jthread thread_;
};

}  // namespace assay::oracle
