#include "engine/launch/binding.h"

#include <hwloc.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <cerrno>
#include <cstring>
#include <map>

#include <fmt/format.h>

namespace zeal {
namespace fs = std::filesystem;

namespace {

// NUMA node of each NVIDIA GPU in PCI bus order, from the driver's /proc entries and sysfs.
std::vector<int> gpu_numa_nodes() {
  std::vector<std::string> buses;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc/driver/nvidia/gpus", ec)) buses.push_back(e.path().filename());
  std::sort(buses.begin(), buses.end());
  std::vector<int> nodes;
  for (auto bus : buses) {
    std::transform(bus.begin(), bus.end(), bus.begin(), [](unsigned char c) { return std::tolower(c); });
    std::ifstream f("/sys/bus/pci/devices/" + bus + "/numa_node");
    int node = -1;
    if (!(f >> node)) node = -1;
    nodes.push_back(node);
  }
  return nodes;
}

struct Topology {
  hwloc_topology_t t = nullptr;
  Topology() {
    if (hwloc_topology_init(&t) != 0 || hwloc_topology_load(t) != 0) t = nullptr;
  }
  ~Topology() {
    if (t) hwloc_topology_destroy(t);
  }
};

// First PU of each core inside `set` (one thread per physical core), in order.
std::vector<int> cores_in(hwloc_topology_t t, hwloc_const_cpuset_t set) {
  std::vector<int> out;
  const int n = hwloc_get_nbobjs_inside_cpuset_by_type(t, set, HWLOC_OBJ_CORE);
  for (int i = 0; i < n; ++i) {
    hwloc_obj_t core = hwloc_get_obj_inside_cpuset_by_type(t, set, HWLOC_OBJ_CORE, i);
    const int pu = hwloc_bitmap_first(core->cpuset);
    if (pu >= 0) out.push_back(pu);
  }
  return out;
}

}  // namespace

std::string format_cpu_list(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += j == i ? std::to_string(cpus[i]) : fmt::format("{}-{}", cpus[i], cpus[j]);
    i = j + 1;
  }
  return out.empty() ? "none" : out;
}

std::string CpuBinding::describe() const {
  std::string s = fmt::format("{} {}", cpus.size() == 1 ? "core" : "cores", format_cpu_list(cpus));
  if (numa_node >= 0) s += fmt::format(" (NUMA node {} of its GPU)", numa_node);
  if (shared) s += " (shared: fewer cores than ranks)";
  return s;
}

std::vector<CpuBinding> plan_cpu_binding(int local_world_size) {
  std::vector<CpuBinding> plan(local_world_size);
  Topology topo;
  if (!topo.t || local_world_size <= 0) return {};
  hwloc_const_cpuset_t all = hwloc_topology_get_allowed_cpuset(topo.t);
  const std::vector<int> gpu_nodes = gpu_numa_nodes();

  // Group ranks by the NUMA node they should live on (-1: anywhere).
  std::map<int, std::vector<int>> ranks_by_node;
  for (int r = 0; r < local_world_size; ++r) {
    int node = gpu_nodes.empty() ? -1 : gpu_nodes[r % gpu_nodes.size()];
    if (node >= 0 && !hwloc_get_numanode_obj_by_os_index(topo.t, node)) node = -1;
    plan[r].local_rank = r;
    plan[r].numa_node = node;
    ranks_by_node[node].push_back(r);
  }
  for (const auto& [node, ranks] : ranks_by_node) {
    std::vector<int> cores;
    if (node >= 0) {
      hwloc_obj_t numa = hwloc_get_numanode_obj_by_os_index(topo.t, node);
      hwloc_bitmap_t set = hwloc_bitmap_dup(numa->cpuset);
      hwloc_bitmap_and(set, set, all);
      cores = cores_in(topo.t, set);
      hwloc_bitmap_free(set);
    }
    if (cores.empty()) cores = cores_in(topo.t, all);
    const size_t n = ranks.size();
    if (cores.size() >= n) {
      // Contiguous blocks; the first `extra` ranks get one core more.
      const size_t per = cores.size() / n, extra = cores.size() % n;
      size_t at = 0;
      for (size_t i = 0; i < n; ++i) {
        const size_t take = per + (i < extra ? 1 : 0);
        plan[ranks[i]].cpus.assign(cores.begin() + at, cores.begin() + at + take);
        at += take;
      }
    } else {
      for (size_t i = 0; i < n; ++i) {
        plan[ranks[i]].cpus = {cores[i % cores.size()]};
        plan[ranks[i]].shared = true;
      }
    }
  }
  return plan;
}

bool apply_cpu_binding(const CpuBinding& b, std::string* why) {
  Topology topo;
  if (!topo.t) {
    if (why) *why = "hwloc could not load the topology";
    return false;
  }
  hwloc_bitmap_t set = hwloc_bitmap_alloc();
  for (int c : b.cpus) hwloc_bitmap_set(set, c);
  const int rc = hwloc_set_cpubind(topo.t, set, HWLOC_CPUBIND_PROCESS);
  hwloc_bitmap_free(set);
  if (rc != 0 && why) *why = fmt::format("binding to {} failed: {}", format_cpu_list(b.cpus), std::strerror(errno));
  return rc == 0;
}

std::string current_cpu_binding() {
  Topology topo;
  if (!topo.t) return "unknown";
  hwloc_bitmap_t set = hwloc_bitmap_alloc();
  std::vector<int> cpus;
  if (hwloc_get_cpubind(topo.t, set, HWLOC_CPUBIND_PROCESS) == 0) {
    for (int i = hwloc_bitmap_first(set); i >= 0; i = hwloc_bitmap_next(set, i)) cpus.push_back(i);
  }
  hwloc_bitmap_free(set);
  return format_cpu_list(cpus);
}

}  // namespace zeal
