#include "engine/zero/offload_state.h"

#include <ATen/ATen.h>

namespace zeal::zero {

at::Tensor arena_tensor(const std::shared_ptr<offload::HostArena>& arena, int64_t n, at::ScalarType dtype) {
  const size_t bytes = static_cast<size_t>(n) * c10::elementSize(dtype);
  void* p = arena->allocate(bytes);
  return at::from_blob(
      p, {n}, [arena, bytes](void* q) { arena->release(q, bytes); }, at::TensorOptions().dtype(dtype).device(at::kCPU));
}

}  // namespace zeal::zero
