#include "engine/zero/host_memory.h"

#include <c10/core/DeviceGuard.h>

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>

#include <sys/mman.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include <fmt/format.h>

#include "engine/error.h"
#include "engine/host_cache.h"

namespace zeal::zero {
namespace {

constexpr size_t kMapBytes = size_t{1} << 20;
// glibc's thresholds while zeal runs: blocks from 128 KiB are mapped, a heap's free top beyond
// 128 KiB is returned (glibc's initial values, fixed so that frees no longer raise them).
constexpr int kMallocThreshold = 128 * 1024;

struct Mapping {
  void* p;
  size_t n;
  static void unmap(void* ctx) {
    auto* m = static_cast<Mapping*>(ctx);
    munmap(m->p, m->n);
    delete m;
  }
};

// With the host cache installed its blocks, reused; a buffer that must start zeroed (or be a whole
// page-aligned mapping, small ones included) is a fresh mapping after the cache made room for it.
c10::DataPtr map_bytes(size_t bytes, at::Device device, bool zeroed = false) {
  if (c10::Allocator* cache = host_cache_allocator(); cache && !zeroed && device.is_cpu()) {
    return cache->allocate(bytes);
  }
  host_cache_make_room(bytes);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw Error(fmt::format("cannot map {} bytes of host memory (a gathered unit, gradient staging or a shard read from disk)", bytes));
  return {p, new Mapping{p, bytes}, &Mapping::unmap, device};
}

}  // namespace

void alloc_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (s->nbytes() == bytes) return;
  c10::OptionalDeviceGuard on(t.device().is_cpu() ? std::nullopt : std::optional<c10::Device>(t.device()));
  s->set_data_ptr_noswap(t.device().is_cpu() && bytes >= kMapBytes ? map_bytes(bytes, t.device())
                                                                   : s->allocator()->allocate(bytes));
  s->set_nbytes(bytes);
}

void alloc_storage_mapped(const at::Tensor& t) {
  if (!t.device().is_cpu()) return alloc_storage(t);
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (s->nbytes() == bytes) return;
  // A fresh mapping: page-aligned, and the tail past the tensor's bytes zero (written to disk as it is).
  s->set_data_ptr_noswap(map_bytes(std::max<size_t>(bytes, 1), t.device(), /*zeroed=*/true));
  s->set_nbytes(bytes);
}

void free_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(c10::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}

at::Tensor storage_slice(const at::Tensor& t, int64_t offset, int64_t count) {
  ZEAL_CHECK(t.is_contiguous() && offset >= 0 && count >= 0 && offset + count <= t.numel())
      << "storage_slice [" << offset << ", " << offset + count << ") of " << t.numel() << " elements";
  at::Tensor v = at::empty({0}, t.options());
  c10::TensorImpl* impl = v.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(t.storage());  // the same StorageImpl: its bytes, when they come back
  impl->set_sizes_contiguous({count});
  impl->set_storage_offset(t.storage_offset() + offset);
  return v;
}

at::Tensor staging_zeros(int64_t n, const at::TensorOptions& o) {
  const size_t bytes = static_cast<size_t>(n) * o.dtype().itemsize();
  if (!o.device().is_cpu() || bytes < kMapBytes) return at::zeros({n}, o);
  c10::Storage st(c10::Storage::use_byte_size_t(), bytes, map_bytes(bytes, o.device(), /*zeroed=*/true), nullptr, false);
  return at::empty({0}, o).set_(st, 0, {n}, {1});
}

void keep_large_allocations_mapped() {
#if defined(__GLIBC__)
  static std::once_flag once;
  std::call_once(once, [] {
    const char* tunables = std::getenv("GLIBC_TUNABLES");
    auto chosen = [&](const char* env, const char* tunable) {
      return std::getenv(env) != nullptr || (tunables != nullptr && std::strstr(tunables, tunable) != nullptr);
    };
    if (!chosen("MALLOC_MMAP_THRESHOLD_", "mmap_threshold")) mallopt(M_MMAP_THRESHOLD, kMallocThreshold);
    if (!chosen("MALLOC_TRIM_THRESHOLD_", "trim_threshold")) mallopt(M_TRIM_THRESHOLD, kMallocThreshold);
  });
#endif
}

}  // namespace zeal::zero
