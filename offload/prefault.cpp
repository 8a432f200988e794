#include "offload/prefault.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace zeal::offload {

void fault_in(char* p, int64_t n) {
  if (n <= 0) return;
  static const int64_t page = ::sysconf(_SC_PAGESIZE);
  // The whole pages inside, in one call that faults them as a batch and never changes a byte: the
  // caller's reads may be filling them already. The partial pages at either end, and every page on
  // a kernel without the call, are left to fault when they are first written.
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~static_cast<uintptr_t>(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(n)) & ~static_cast<uintptr_t>(page - 1);
  if (end > begin) (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE);
}

Prefaulter::Prefaulter(std::vector<std::pair<char*, int64_t>> buffers) : buffers_(std::move(buffers)) {
  thread_ = std::thread([this] {
    constexpr int64_t kStep = int64_t{8} << 20;  // checks for stop between steps
    for (const auto& [p, n] : buffers_) {
      for (int64_t at = 0; at < n; at += kStep) {
        if (stop_.load(std::memory_order_relaxed)) return;
        fault_in(p + at, std::min(kStep, n - at));
      }
      done_.fetch_add(1, std::memory_order_release);
    }
  });
}

Prefaulter::~Prefaulter() {
  stop_.store(true, std::memory_order_relaxed);
  if (thread_.joinable()) thread_.join();
}

}  // namespace zeal::offload
