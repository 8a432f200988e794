#include "engine/runtime/device_choice.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <utility>

#include <fmt/format.h>
#include <unistd.h>

#include "engine/config/config.h"
#include "engine/error.h"

namespace zeal {

const char* to_string(CudaBackend b) { return b == CudaBackend::kNccl ? "nccl" : "gloo"; }

DeviceChoice choose_cuda_device(int local_rank, int local_world_size, int device_count, const std::string& backend,
                                bool have_nccl, bool per_rank_visible, const std::string& gpu_ids) {
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
  std::vector<int> usable = parse_gpu_ids(gpu_ids);
  for (int id : usable) {
    if (id >= device_count) {
      throw Error(fmt::format("gpu_ids lists GPU {}, but this process sees {} GPU{} (0 to {}{})", id, device_count,
                              device_count == 1 ? "" : "s", device_count - 1,
                              std::getenv("CUDA_VISIBLE_DEVICES") ? ", after CUDA_VISIBLE_DEVICES" : ""));
    }
  }
  const bool listed = !usable.empty();
  if (!listed) {
    for (int d = 0; d < device_count; ++d) usable.push_back(d);
  }
  const int count = static_cast<int>(usable.size());
  // One GPU visible to this process through CUDA_VISIBLE_DEVICES: possibly its own. The NCCL
  // communicator checks the ranks' bus ids, so a GPU two ranks really share is still named.
  const bool maybe_own = count == 1 && per_rank_visible && !listed;
  if (c.backend == CudaBackend::kNccl && local_world_size > count && !maybe_own) {
    throw Error(fmt::format(
        "{} ranks run on this machine but {} GPU{} {}: NCCL needs one GPU per rank. Launch at most {} process{} per "
        "machine (num_processes), {}or set ZEAL_COMM_BACKEND=gloo to let ranks share GPUs (collectives then go "
        "through host memory)",
        local_world_size, count, count == 1 ? "" : "s",
        listed ? fmt::format("{} listed in gpu_ids ({})", count == 1 ? "is" : "are", gpu_ids)
               : fmt::format("{} visible to this process", count == 1 ? "is" : "are"),
        count, count == 1 ? "" : "es", listed ? "list more GPUs in gpu_ids, " : ""));
  }
  c.device = usable[static_cast<size_t>(local_rank % count)];
  return c;
}

DeviceChoice choose_cuda_device(int local_rank, int local_world_size, int device_count, bool have_nccl,
                                const std::string& gpu_ids) {
  const char* b = std::getenv("ZEAL_COMM_BACKEND");
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const bool one_listed = visible && *visible && std::string(visible).find(',') == std::string::npos;
  return choose_cuda_device(local_rank, local_world_size, device_count, b ? b : "", have_nccl, one_listed, gpu_ids);
}

std::string this_host_id() {
  if (const char* v = std::getenv("NCCL_HOSTID"); v && *v) return v;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (f && std::getline(f, id) && !id.empty()) return id;
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  return host;
}

std::string GpuOfRank::encode() const {
  return fmt::format("{}\n{}\n{}\n{}\n{}", host, host_id, bus_id, device, visible);
}

GpuOfRank GpuOfRank::decode(const std::string& s) {
  std::stringstream in(s);
  GpuOfRank g;
  std::string device;
  std::getline(in, g.host);
  std::getline(in, g.host_id);
  std::getline(in, g.bus_id);
  std::getline(in, device);
  std::getline(in, g.visible);
  g.device = std::atoi(device.c_str());
  return g;
}

std::string describe_shared_gpu(const std::vector<GpuOfRank>& ranks) {
  std::map<std::pair<std::string, std::string>, int> first;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const auto [it, fresh] = first.emplace(std::pair{ranks[r].host_id, ranks[r].bus_id}, static_cast<int>(r));
    if (fresh) continue;
    const GpuOfRank& a = ranks[static_cast<size_t>(it->second)];
    const GpuOfRank& b = ranks[r];
    return fmt::format(
        "ranks {} and {} both run on GPU {} of {} (CUDA device {} with CUDA_VISIBLE_DEVICES={} in rank {}, device {} "
        "with CUDA_VISIBLE_DEVICES={} in rank {}): NCCL needs one GPU per rank. Give each rank its own GPU (do not "
        "export one CUDA_VISIBLE_DEVICES to every rank; list the GPUs in gpu_ids), launch fewer processes, or set "
        "ZEAL_COMM_BACKEND=gloo to let ranks share a GPU",
        it->second, r, a.bus_id, a.host, a.device, a.visible, it->second, b.device, b.visible, r);
  }
  return "";
}

}  // namespace zeal
