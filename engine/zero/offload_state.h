// Tensors over the offload manager's host memory (offload/host_arena.h), and the optimizer step of
// a partition whose master weights and optimizer state live there (ZeRO-Offload): the gradients
// stream from the partition's device into a host buffer, the CPU kernels update the host master and
// state, and the updated compute-precision values stream back. The same on a CPU-only run (the
// copies are then host to host), so the path a GPU takes is the one the CPU tests run.
#pragma once

#include <ATen/Tensor.h>

#include <memory>

#include "offload/host_arena.h"
#include "offload/swap_dir.h"

namespace zeal::zero {

// A zero-filled tensor of n elements of `dtype` in the arena's memory, given back to the arena when
// the last reference goes (the arena is kept alive until then).
at::Tensor arena_tensor(const std::shared_ptr<offload::HostArena>& arena, int64_t n, at::ScalarType dtype);

// offload_optimizer.device nvme: where the optimizer's swap files go and how they are read.
struct NvmeOffload {
  std::shared_ptr<offload::SwapDir> dir;
  std::shared_ptr<offload::IoEngine> io;
  int64_t sub_group_elems = 1'000'000'000;  // sub_group_size: elements updated per window
};

}  // namespace zeal::zero
