#include "offload/prefault.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "engine/error.h"

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

namespace {

// ZEAL_HUGE_PAGES=0 (or off) keeps fresh buffers on the system's small pages.
bool huge_pages_wanted() {
  static const bool wanted = [] {
    const char* v = std::getenv("ZEAL_HUGE_PAGES");
    return !v || (std::strcmp(v, "0") != 0 && std::strcmp(v, "off") != 0);
  }();
  return wanted;
}

}  // namespace

FreshBuffer::FreshBuffer(int64_t bytes) {
  constexpr int64_t kHuge = int64_t{2} << 20;
  static const int64_t page = ::sysconf(_SC_PAGESIZE);
  size_ = std::max<int64_t>(bytes, 0);
  mapped_ = (std::max<int64_t>(size_, 1) + page - 1) / page * page;
  // Map 2 MiB more and keep the aligned part, so that every whole 2 MiB inside can be a huge page.
  const int64_t over = mapped_ >= kHuge && huge_pages_wanted() ? kHuge : 0;
  void* p = ::mmap(nullptr, static_cast<size_t>(mapped_ + over), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
  if (p == MAP_FAILED) {
    throw Error(fmt::format("cannot map {} bytes of host memory: {}", size_, std::strerror(errno)));
  }
  char* base = static_cast<char*>(p);
  char* aligned = base;
  if (over > 0) {
    aligned = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + kHuge - 1) & ~static_cast<uintptr_t>(kHuge - 1));
    if (aligned > base) ::munmap(base, static_cast<size_t>(aligned - base));
    const int64_t tail = (base + mapped_ + over) - (aligned + mapped_);
    if (tail > 0) ::munmap(aligned + mapped_, static_cast<size_t>(tail));
    (void)::madvise(aligned, static_cast<size_t>(mapped_), MADV_HUGEPAGE);  // no effect where THP is off
  } else if (mapped_ >= kHuge) {
    (void)::madvise(aligned, static_cast<size_t>(mapped_), MADV_NOHUGEPAGE);  // ZEAL_HUGE_PAGES=0, THP "always"
  }
  data_ = aligned;
}

FreshBuffer::~FreshBuffer() {
  if (data_) ::munmap(data_, static_cast<size_t>(mapped_));
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
