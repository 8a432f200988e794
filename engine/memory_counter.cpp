#include "engine/memory_counter.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <mutex>

namespace zeal {
namespace {

// Counts the bytes of CPU memory allocated through it (and not yet freed) and the most at once. It
// allocates itself, as LibTorch's default CPU allocator does (64-byte aligned), and keeps each
// block's size in a header just before it: the DataPtr stays "simple" (its context is its data),
// which LibTorch's raw_allocate (Gloo uses it) requires. Memory it handed out may be freed long
// after the counters went, so it lives as long as the process.
class CountingAllocator final : public at::Allocator {
 public:
  static constexpr size_t kHeader = 64;  // keeps the data 64-byte aligned

  at::DataPtr allocate(size_t n) override {
    void* base = nullptr;
    if (posix_memalign(&base, 64, n + kHeader) != 0) throw std::bad_alloc();
    const int64_t bytes = static_cast<int64_t>(n);
    std::memcpy(base, &bytes, sizeof bytes);
    void* data = static_cast<char*>(base) + kHeader;
    const int64_t now = live_.fetch_add(bytes) + bytes;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return {data, data, &free_block, at::Device(at::kCPU)};
  }
  at::DeleterFnPtr raw_deleter() const override { return &free_block; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

  int64_t install() {
    std::lock_guard<std::mutex> lock(mu_);
    if (installs_++ == 0) {
      base_ = c10::GetCPUAllocator();
      c10::SetCPUAllocator(this, /*priority=*/255);
    }
    return live_.load();
  }
  void uninstall() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--installs_ == 0) c10::SetCPUAllocator(base_, 255);
  }
  int64_t live() const { return live_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_ = live_.load(); }

 private:
  static void free_block(void* data);
  std::mutex mu_;
  int installs_ = 0;
  at::Allocator* base_ = nullptr;
  std::atomic<int64_t> live_{0}, peak_{0};
};

CountingAllocator& counting_allocator() {
  static auto* a = new CountingAllocator();  // never destroyed: storages may outlive everything
  return *a;
}

void CountingAllocator::free_block(void* data) {
  if (!data) return;
  char* base = static_cast<char*>(data) - kHeader;
  int64_t bytes = 0;
  std::memcpy(&bytes, base, sizeof bytes);
  counting_allocator().live_.fetch_sub(bytes);
  std::free(base);
}

}  // namespace

CpuMemoryCounter::CpuMemoryCounter() {
  start_ = counting_allocator().install();
  counting_allocator().reset_peak();
}

CpuMemoryCounter::~CpuMemoryCounter() { counting_allocator().uninstall(); }

int64_t CpuMemoryCounter::live() const { return counting_allocator().live() - start_; }
int64_t CpuMemoryCounter::peak() const { return counting_allocator().peak() - start_; }
void CpuMemoryCounter::reset_peak() { counting_allocator().reset_peak(); }

}  // namespace zeal
