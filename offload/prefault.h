// Faulting fresh host memory in ahead of its use, on a thread of its own: a buffer the disk is
// about to fill (or a copy about to write) costs a page fault and a cleared page every 4 KiB when
// first touched — on virtual machines several times the cost of the copy itself. A Prefaulter
// walks its buffers in order while the caller's I/O runs on the buffers before them. No LibTorch.
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
