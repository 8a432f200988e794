// zeal::CpuMemoryCounter: what LibTorch really allocates on the CPU, measured at the allocator.
//
// While a counter lives, every CPU allocation LibTorch makes goes through a wrapper of its
// allocator that counts the bytes handed out and not yet freed, and the most at once. Memory the
// process gets by other means (malloc outside LibTorch, mmap of gathered units and staging buffers
// above a MiB, thread stacks) is not counted: for the resident set use /proc/self/status. Counters
// nest; the counting stops when the last one goes. Not thread-safe to construct concurrently.
#pragma once

#include <cstdint>

namespace zeal {

class CpuMemoryCounter {
 public:
  CpuMemoryCounter();
  ~CpuMemoryCounter();
  CpuMemoryCounter(const CpuMemoryCounter&) = delete;
  CpuMemoryCounter& operator=(const CpuMemoryCounter&) = delete;

  // Bytes allocated through LibTorch's CPU allocator since this counter started and not freed
  // (negative when more was freed than allocated), and the most since start or reset_peak().
  int64_t live() const;
  int64_t peak() const;
  void reset_peak();

 private:
  int64_t start_ = 0;
};

}  // namespace zeal
