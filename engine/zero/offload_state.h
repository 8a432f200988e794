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

// offload_param.device nvme (stage 3): the shards of the units that are not persistent live in one
// swap file per rank, each part's shard in its own 4 KiB-aligned region, written once when the
// unit is built and after every optimizer step, read back when the unit is gathered (its prefetch
// included, so along the fetch coordinator's recorded order) and freed once its all-gather is done.
class ParamSwap {
 public:
  ParamSwap(std::shared_ptr<offload::SwapDir> dir, std::shared_ptr<offload::IoEngine> io);
  // A region of `bytes` (rounded up to 4 KiB) at the end of the file; returns its offset.
  int64_t reserve(int64_t bytes);
  // Writes t's bytes at `offset`: a contiguous tensor on a GPU, or on the CPU with mapped storage
  // (alloc_storage_mapped), which is written as it is, without a copy.
  void store(const at::Tensor& t, int64_t offset);
  // Gives t's storage its bytes again and reads them from `offset`.
  void load(const at::Tensor& t, int64_t offset);
  int64_t disk_bytes() const { return end_; }
  offload::SwapDir& dir() { return file_.dir(); }

 private:
  offload::SwapFile file_;
  int64_t end_ = 0;
};

}  // namespace zeal::zero
