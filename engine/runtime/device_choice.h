// Which GPU a rank trains on, and which communicator carries its CUDA tensors.
//
// Local rank r takes the r-th GPU of the ones it may use: those `gpu_ids` lists (Accelerate's key,
// indices as this process sees them, after CUDA_VISIBLE_DEVICES), or every visible one. NCCL needs
// one GPU per rank: more local ranks than usable GPUs is an error naming both numbers. With
// ZEAL_COMM_BACKEND=gloo several ranks share a GPU (local rank r takes usable GPU r mod their count)
// and the Gloo communicator stages their CUDA tensors through pinned host memory.
//
// A process that sees exactly one GPU because CUDA_VISIBLE_DEVICES lists one may have been given
// a GPU of its own (a scheduler's per-rank binding) or share it with every other rank (one value
// exported for all): the choice accepts it, and the NCCL communicator then compares the ranks'
// hosts and PCI bus ids (describe_shared_gpu) and names two ranks that share one GPU.
#pragma once

#include <string>
#include <vector>

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
// process sees one GPU because CUDA_VISIBLE_DEVICES lists one, so a count of 1 may be its own;
// gpu_ids: the config's key (parse_gpu_ids, engine/config/config.h). Throws zeal::Error with the
// numbers when they do not fit.
DeviceChoice choose_cuda_device(int local_rank, int local_world_size, int device_count, const std::string& backend,
                                bool have_nccl, bool per_rank_visible = false, const std::string& gpu_ids = "all");

// The same with ZEAL_COMM_BACKEND and CUDA_VISIBLE_DEVICES read from the environment.
DeviceChoice choose_cuda_device(int local_rank, int local_world_size, int device_count, bool have_nccl,
                                const std::string& gpu_ids = "all");

// One rank's GPU as the NCCL communicator's check sees it.
struct GpuOfRank {
  std::string host;     // gethostname
  std::string host_id;  // what tells machines apart: NCCL_HOSTID, else the kernel's boot id
  std::string bus_id;   // the GPU's PCI bus id ("0000:1A:00.0")
  int device = 0;       // the CUDA device index in that rank's process
  std::string visible;  // its CUDA_VISIBLE_DEVICES, or "(unset)"
  std::string encode() const;
  static GpuOfRank decode(const std::string& s);
};

// This machine's host_id: $NCCL_HOSTID if set (as NCCL does), else /proc/sys/kernel/random/boot_id,
// else the host name (two containers with one host name on different machines are told apart).
std::string this_host_id();

// "" when no two ranks (vector index = rank) run on one GPU of one machine; else an error message
// naming the first two that do, the host, the GPU and each rank's CUDA_VISIBLE_DEVICES.
std::string describe_shared_gpu(const std::vector<GpuOfRank>& ranks);

}  // namespace zeal
