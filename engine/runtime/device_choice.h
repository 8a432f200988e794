// Which GPU a rank trains on, and which communicator carries its CUDA tensors.
//
// NCCL needs one GPU per rank: local rank r takes GPU r, and more local ranks than GPUs is an
// error naming both numbers. With ZEAL_COMM_BACKEND=gloo several ranks share a GPU (local rank r
// takes GPU r mod the count) and the Gloo communicator stages their CUDA tensors through pinned
// host memory.
#pragma once

#include <string>

namespace zeal {

enum class CudaBackend { kNccl, kGloo };
const char* to_string(CudaBackend b);

struct DeviceChoice {
  int device = 0;
  CudaBackend backend = CudaBackend::kNccl;
};

// local_rank / local_world_size: this rank and the ranks on this machine; device_count: the GPUs
// this process sees; backend: ZEAL_COMM_BACKEND's value ("" for the default: NCCL where zeal was
// built with it, else Gloo); have_nccl: whether zeal was built with NCCL; per_rank_visible: the
// process was given one GPU of its own (CUDA_VISIBLE_DEVICES lists one), so a count of 1 is no
// shortage. Throws zeal::Error with the numbers when they do not fit.
DeviceChoice choose_cuda_device(int local_rank, int local_world_size, int device_count, const std::string& backend,
                                bool have_nccl, bool per_rank_visible = false);

// The same with ZEAL_COMM_BACKEND and CUDA_VISIBLE_DEVICES read from the environment.
DeviceChoice choose_cuda_device(int local_rank, int local_world_size, int device_count, bool have_nccl);

}  // namespace zeal
