#include "engine/runtime/device_choice.h"

#include <cstdlib>

#include <fmt/format.h>

#include "engine/error.h"

namespace zeal {

const char* to_string(CudaBackend b) { return b == CudaBackend::kNccl ? "nccl" : "gloo"; }

DeviceChoice choose_cuda_device(int local_rank, int local_world_size, int device_count, const std::string& backend,
                                bool have_nccl, bool per_rank_visible) {
  if (device_count <= 0) throw Error("no CUDA device is visible to this process");
  if (local_world_size < 1 || local_rank < 0 || local_rank >= local_world_size) {
    throw Error(fmt::format("LOCAL_RANK {} does not fit LOCAL_WORLD_SIZE {}", local_rank, local_world_size));
  }
  DeviceChoice c;
  if (backend.empty()) {
    c.backend = have_nccl ? CudaBackend::kNccl : CudaBackend::kGloo;
  } else if (backend == "nccl") {
    if (!have_nccl) {
      throw Error("ZEAL_COMM_BACKEND=nccl, but this zeal was built without NCCL (no CUDA toolkit with NCCL at build "
                  "time); unset it to use Gloo");
    }
    c.backend = CudaBackend::kNccl;
  } else if (backend == "gloo") {
    c.backend = CudaBackend::kGloo;
  } else {
    throw Error(fmt::format("ZEAL_COMM_BACKEND is '{}'; expected nccl or gloo", backend));
  }
  // One GPU visible per process (a scheduler's per-rank CUDA_VISIBLE_DEVICES): each rank's GPU 0 is
  // its own, and NCCL names a GPU two ranks really share.
  if (device_count == 1 && per_rank_visible) return c;
  if (c.backend == CudaBackend::kNccl && local_world_size > device_count) {
    throw Error(fmt::format(
        "{} ranks run on this machine but this process sees {} GPU{}: NCCL needs one GPU per rank. Launch at most {} "
        "process{} per machine (num_processes), or set ZEAL_COMM_BACKEND=gloo to let ranks share GPUs (collectives "
        "then go through host memory)",
        local_world_size, device_count, device_count == 1 ? "" : "s", device_count, device_count == 1 ? "" : "es"));
  }
  c.device = local_rank % device_count;
  return c;
}

DeviceChoice choose_cuda_device(int local_rank, int local_world_size, int device_count, bool have_nccl) {
  const char* b = std::getenv("ZEAL_COMM_BACKEND");
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const bool one_listed = visible && *visible && std::string(visible).find(',') == std::string::npos;
  return choose_cuda_device(local_rank, local_world_size, device_count, b ? b : "", have_nccl, one_listed);
}

}  // namespace zeal
