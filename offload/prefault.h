// Faulting fresh host memory in ahead of its use, on a thread of its own: a buffer the disk is
// about to fill (or a copy about to write) costs a page fault and a cleared page every 4 KiB when
// first touched — on virtual machines several times the cost of the copy itself. A Prefaulter
// walks its buffers in order while the caller's I/O runs on the buffers before them. A FreshBuffer
// asks for transparent huge pages (MADV_HUGEPAGE): one fault per 2 MiB instead of 512. No LibTorch.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

namespace zeal::offload {

// Faults in the whole pages inside [p, p + n) (MADV_POPULATE_WRITE, Linux 5.14; older kernels: no
// effect). Never stores: another thread may be writing the buffer meanwhile.
void fault_in(char* p, int64_t n);

// `bytes` of fresh host memory (the kernel's cleared pages), page-aligned; from 2 MiB up aligned to
// 2 MiB and, where the kernel offers transparent huge pages to those who ask (enabled: always or
// madvise), backed by them: a first touch then costs one fault and one cleared 2 MiB page instead of
// 512 faults (5.1-6.0 GB/s against 2.1 GB/s for a copy into fresh memory on a 2-core virtual
// machine, once the host backs the blocks). For large buffers used once (an asynchronous save's
// staging); zeal::Error naming the size when the system refuses. ZEAL_HUGE_PAGES=0 (or off) keeps
// them on small pages (MADV_NOHUGEPAGE, also where THP is "always").
class FreshBuffer {
 public:
  explicit FreshBuffer(int64_t bytes);
  ~FreshBuffer();
  FreshBuffer(const FreshBuffer&) = delete;
  FreshBuffer& operator=(const FreshBuffer&) = delete;
  char* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  char* data_ = nullptr;
  int64_t size_ = 0, mapped_ = 0;
};

class Prefaulter {
 public:
  // Starts faulting in `buffers` (pointer, bytes) in order.
  explicit Prefaulter(std::vector<std::pair<char*, int64_t>> buffers);
  // Stops (a buffer being faulted in is finished first) and joins.
  ~Prefaulter();
  Prefaulter(const Prefaulter&) = delete;
  Prefaulter& operator=(const Prefaulter&) = delete;
  // Buffers faulted in so far.
  int64_t done() const { return done_.load(std::memory_order_acquire); }

 private:
  std::vector<std::pair<char*, int64_t>> buffers_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> done_{0};
  std::thread thread_;
};

}  // namespace zeal::offload
