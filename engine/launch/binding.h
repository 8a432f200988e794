// CPU binding for local ranks: each rank gets a disjoint set of cores (on the NUMA node of its
// GPU when the machine has NVIDIA GPUs), and its intra-op thread count matches that set.
#pragma once

#include <string>
#include <vector>

namespace zeal {

struct CpuBinding {
  int local_rank = 0;
  std::vector<int> cpus;  // OS processor indices
  int numa_node = -1;     // the node of this rank's GPU, -1 when none is known
  bool shared = false;    // fewer cores than ranks: cores are shared round-robin
  std::string describe() const;  // "cores 0-3 (NUMA node 0)"
};

// One binding per local rank; NVIDIA GPUs found under /proc/driver/nvidia are assigned to local
// ranks round-robin and each rank's cores come from its GPU's NUMA node. Empty when hwloc fails.
std::vector<CpuBinding> plan_cpu_binding(int local_world_size);

// Binds the calling process (and the threads it will create) to `b.cpus`. Returns false and
// sets `why` when the system refuses.
bool apply_cpu_binding(const CpuBinding& b, std::string* why);

// The calling process's current CPU affinity as a list like "0-3,8".
std::string current_cpu_binding();

// "0-3,8" from {0,1,2,3,8}.
std::string format_cpu_list(const std::vector<int>& cpus);

}  // namespace zeal
