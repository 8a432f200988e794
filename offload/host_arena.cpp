#include "offload/host_arena.h"

#include <hwloc.h>
#include <sys/mman.h>

#include <cstring>

#include <fmt/format.h>

#include "engine/error.h"
#include "engine/host_cache.h"

#ifdef ZEAL_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace zeal::offload {

HostArena::HostArena(bool pin) : pin_(pin) {
#ifndef ZEAL_HAVE_CUDA
  if (pin) throw Error("offload: pinned host memory needs CUDA, and this zeal was built without it");
#endif
  hwloc_topology_t topo = nullptr;
  if (hwloc_topology_init(&topo) == 0 && hwloc_topology_load(topo) == 0) {
    topology_ = topo;
    hwloc_bitmap_t set = hwloc_bitmap_alloc();
    cpuset_ = set;
    const auto* support = hwloc_topology_get_support(topo);
    const int nodes = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
    if (hwloc_get_cpubind(topo, set, HWLOC_CPUBIND_PROCESS) != 0) hwloc_bitmap_copy(set, hwloc_topology_get_topology_cpuset(topo));
    char* cpus = nullptr;
    hwloc_bitmap_list_asprintf(&cpus, set);
    hwloc_bitmap_t nodeset = hwloc_bitmap_alloc();
    hwloc_cpuset_to_nodeset(topo, set, nodeset);
    char* node_list = nullptr;
    hwloc_bitmap_list_asprintf(&node_list, nodeset);
    bind_ = nodes > 1 && support->membind->alloc_membind && support->membind->bind_membind;
    placement_ = nodes > 1 ? fmt::format("NUMA node{} {} (CPUs {}){}", hwloc_bitmap_weight(nodeset) > 1 ? "s" : "",
                                         node_list ? node_list : "?", cpus ? cpus : "?",
                                         bind_ ? "" : ", not bound: the system cannot bind memory")
                           : fmt::format("one NUMA node (CPUs {})", cpus ? cpus : "?");
    std::free(cpus);
    std::free(node_list);
    hwloc_bitmap_free(nodeset);
  } else {
    if (topo) hwloc_topology_destroy(topo);
    placement_ = "not bound: hwloc could not read the topology";
  }
}

HostArena::~HostArena() {
  if (cpuset_) hwloc_bitmap_free(static_cast<hwloc_bitmap_t>(cpuset_));
  if (topology_) hwloc_topology_destroy(static_cast<hwloc_topology_t>(topology_));
}

void* HostArena::allocate(size_t bytes) {
  if (bytes == 0) bytes = 1;
  host_cache_make_room(bytes);  // the offloaded state does not grow the resident set beside cached blocks
  void* p = nullptr;
  if (bind_) {
    // Memory of the node(s) this process's CPUs belong to (mmap + mbind: zero-filled pages).
    p = hwloc_alloc_membind(static_cast<hwloc_topology_t>(topology_), bytes, static_cast<hwloc_bitmap_t>(cpuset_),
                            HWLOC_MEMBIND_BIND, 0);
  } else {
    p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) p = nullptr;
  }
  if (!p) {
    throw Error(fmt::format("offload: cannot allocate {} bytes of host memory ({} held by the offload manager "
                            "already)",
                            bytes, bytes_.load()));
  }
#ifdef ZEAL_HAVE_CUDA
  if (pin_) {
    const cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterDefault);
    if (e != cudaSuccess) {
      munmap(p, bytes);
      throw Error(fmt::format("offload: cannot page-lock {} bytes of host memory for the GPU ({}); lower "
                              "pin_memory's use or the locked-memory limit (ulimit -l)",
                              bytes, cudaGetErrorString(e)));
    }
  }
#endif
  const int64_t now = bytes_.fetch_add(static_cast<int64_t>(bytes)) + static_cast<int64_t>(bytes);
  int64_t peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
  return p;
}

void HostArena::release(void* p, size_t bytes) noexcept {
  if (!p) return;
  if (bytes == 0) bytes = 1;
#ifdef ZEAL_HAVE_CUDA
  if (pin_) cudaHostUnregister(p);
#endif
  if (bind_) {
    hwloc_free(static_cast<hwloc_topology_t>(topology_), p, bytes);
  } else {
    munmap(p, bytes);
  }
  bytes_.fetch_sub(static_cast<int64_t>(bytes));
}

}  // namespace zeal::offload
