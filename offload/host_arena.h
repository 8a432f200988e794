// Host memory for offloaded state (ZeRO-Offload's CPU side): exact-size allocations bound to the
// NUMA node of the CPUs this process runs on (hwloc), page-locked with CUDA when the engine trains
// on a GPU so copies to and from the device run asynchronously. Not LibTorch's pinned allocator,
// which rounds every request up to a power of two (1.78x the bytes asked, on average).
//
// No LibTorch headers: engine/zero/offload_state.h makes tensors over this memory.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

namespace zeal::offload {

class HostArena {
 public:
  // pin: register every allocation with the CUDA driver (cudaHostRegister); refused with a
  // zeal::Error when zeal was built without CUDA.
  explicit HostArena(bool pin = false);
  ~HostArena();
  HostArena(const HostArena&) = delete;
  HostArena& operator=(const HostArena&) = delete;

  // `bytes` of zero-filled memory, page-aligned; throws zeal::Error naming the size and what the
  // arena holds already when the system refuses.
  void* allocate(size_t bytes);
  // Gives back what allocate returned (`bytes` as asked).
  void release(void* p, size_t bytes) noexcept;

  int64_t bytes() const { return bytes_.load(); }  // held now
  int64_t peak() const { return peak_.load(); }
  bool pinned() const { return pin_; }
  // Where allocations go: "NUMA node 0 (CPUs 0-1)", or why they are not bound.
  const std::string& placement() const { return placement_; }

 private:
  bool pin_;
  void* topology_ = nullptr;  // hwloc_topology_t
  void* cpuset_ = nullptr;    // hwloc_bitmap_t: the CPUs this process may run on
  bool bind_ = false;
  std::string placement_;
  std::atomic<int64_t> bytes_{0}, peak_{0};
};

}  // namespace zeal::offload
