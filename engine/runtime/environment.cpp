#include "engine/runtime/environment.h"

#include <dlfcn.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cstring>
#include <fstream>

#include <fmt/format.h>
#include <hwloc.h>

#include "engine/launch/binding.h"
#include "kernels/cpu/adam.h"
#include <liburing.h>

#ifndef ZEAL_CUDA_VERSION
#define ZEAL_CUDA_VERSION "not compiled in"
#endif

namespace zeal {
namespace {

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

std::string simd_features() {
  std::string out;
  auto add = [&](bool has, const char* name) {
    if (has) out += (out.empty() ? "" : " ") + std::string(name);
  };
  __builtin_cpu_init();
  add(__builtin_cpu_supports("sse4.2"), "sse4.2");
  add(__builtin_cpu_supports("avx"), "avx");
  add(__builtin_cpu_supports("avx2"), "avx2");
  add(__builtin_cpu_supports("fma"), "fma");
  add(__builtin_cpu_supports("f16c"), "f16c");
  add(__builtin_cpu_supports("avx512f"), "avx512f");
  add(__builtin_cpu_supports("avx512bw"), "avx512bw");
  add(__builtin_cpu_supports("avx512vl"), "avx512vl");
  add(__builtin_cpu_supports("avx512bf16"), "avx512bf16");
  return out.empty() ? "none" : out;
}

std::string io_uring_probe() {
  io_uring ring;
  int rc = io_uring_queue_init(4, &ring, 0);
  if (rc < 0) return fmt::format("no ({}: io_uring_setup failed)", std::strerror(-rc));
  std::string result = "yes";
  io_uring_sqe* sqe = io_uring_get_sqe(&ring);
  io_uring_prep_nop(sqe);
  if ((rc = io_uring_submit(&ring)) < 0) {
    result = fmt::format("no ({}: submit failed)", std::strerror(-rc));
  } else {
    io_uring_cqe* cqe = nullptr;
    if ((rc = io_uring_wait_cqe(&ring, &cqe)) < 0) {
      result = fmt::format("no ({}: completion failed)", std::strerror(-rc));
    } else {
      io_uring_cqe_seen(&ring, cqe);
    }
  }
  io_uring_queue_exit(&ring);
  return result;
}

struct Topology {
  std::string cores, numa;
};

Topology hwloc_topology() {
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0 || hwloc_topology_load(topo) != 0) return {"unknown", "unknown"};
  const int cores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
  const int pus = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PU);
  const int numa = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
  const int packages = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PACKAGE);
  hwloc_topology_destroy(topo);
  return {fmt::format("{} cores, {} hardware threads, {} sockets", cores, pus, packages), std::to_string(numa)};
}

// The CUDA driver API through dlopen, so that `zeal env` works on machines without a driver.
std::vector<EnvironmentItem> gpu_items() {
  using Fn_i = int (*)(unsigned);
  using Fn_pi = int (*)(int*);
  using Fn_dev = int (*)(int*, int);
  using Fn_name = int (*)(char*, int, int);
  using Fn_mem = int (*)(size_t*, int);
  using Fn_attr = int (*)(int*, int, int);
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) return {{"CUDA driver", "not found (no libcuda.so.1)"}, {"GPUs", "0"}};
  std::vector<EnvironmentItem> items;
  auto init = reinterpret_cast<Fn_i>(dlsym(h, "cuInit"));
  auto version = reinterpret_cast<Fn_pi>(dlsym(h, "cuDriverGetVersion"));
  auto count = reinterpret_cast<Fn_pi>(dlsym(h, "cuDeviceGetCount"));
  auto get = reinterpret_cast<Fn_dev>(dlsym(h, "cuDeviceGet"));
  auto name = reinterpret_cast<Fn_name>(dlsym(h, "cuDeviceGetName"));
  auto mem = reinterpret_cast<Fn_mem>(dlsym(h, "cuDeviceTotalMem_v2"));
  auto attr = reinterpret_cast<Fn_attr>(dlsym(h, "cuDeviceGetAttribute"));
  int v = 0, n = 0;
  if (version && version(&v) == 0) items.push_back({"CUDA driver", fmt::format("{}.{}", v / 1000, (v % 1000) / 10)});
  if (!init || init(0) != 0 || !count || count(&n) != 0) {
    items.push_back({"GPUs", "0 (cuInit failed)"});
  } else {
    items.push_back({"GPUs", std::to_string(n)});
    for (int i = 0; i < n; ++i) {
      int dev = 0, major = 0, minor = 0;
      char buf[256] = {0};
      size_t bytes = 0;
      get(&dev, i);
      name(buf, sizeof buf, dev);
      mem(&bytes, dev);
      attr(&major, 75, dev);  // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
      attr(&minor, 76, dev);
      items.push_back({fmt::format("GPU {}", i), fmt::format("{}, {:.1f} GiB, sm_{}{}", buf,
                                                             static_cast<double>(bytes) / (1 << 30), major, minor)});
    }
  }
  dlclose(h);
  return items;
}

std::string nccl_version() {
  void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (!h) return "not found (no libnccl.so.2)";
  using Fn = int (*)(int*);
  auto get = reinterpret_cast<Fn>(dlsym(h, "ncclGetVersion"));
  int v = 0;
  std::string out = "unknown";
  if (get && get(&v) == 0) out = fmt::format("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100);
  dlclose(h);
  return out;
}

}  // namespace

const char* build_source_id();  // generated at build time (cmake/build_id.cmake)

std::vector<EnvironmentItem> describe_environment() {
  std::vector<EnvironmentItem> items;
  utsname u{};
  uname(&u);
  const Topology topo = hwloc_topology();
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  items.push_back({"zeal", fmt::format("{} ({} build, {})", ZEAL_VERSION, ZEAL_BUILD_TYPE, build_source_id())});
  const char* cuda = !libtorch_cuda_linked() ? "CPU half only (scripts/setup --cuda adds the CUDA half)"
                     : libtorch_has_cuda()    ? "CUDA half linked, GPUs usable"
                                              : "CUDA half linked, no GPU usable";
  items.push_back({"LibTorch", fmt::format("{} ({}; {})", libtorch_version(), cuda, libtorch_parallel_info())});
  items.push_back({"CUDA toolkit (build)", ZEAL_CUDA_VERSION});
  for (auto& g : gpu_items()) items.push_back(std::move(g));
  items.push_back({"NCCL", nccl_version()});
  items.push_back({"liburing", ZEAL_LIBURING_VERSION});
  items.push_back({"io_uring usable", io_uring_probe()});
  const unsigned hv = hwloc_get_api_version();
  items.push_back({"hwloc", fmt::format("{} (API {}.{}.{})", ZEAL_HWLOC_VERSION, hv >> 16, (hv >> 8) & 0xff, hv & 0xff)});
  items.push_back({"OS", fmt::format("{} {} {}", u.sysname, u.release, u.machine)});
  items.push_back({"CPU", cpu_model()});
  items.push_back({"CPU SIMD", simd_features()});
  items.push_back({"zeal CPU kernels", cpu::describe_active_simd()});
  const char* aten = std::getenv("ATEN_CPU_CAPABILITY");
  items.push_back({"LibTorch CPU kernels", libtorch_cpu_capability() + (aten && *aten ? " (ATEN_CPU_CAPABILITY)" : "")});
  items.push_back({"cores", topo.cores});
  items.push_back({"NUMA nodes", topo.numa});
  items.push_back({"CPU binding (this process)", current_cpu_binding()});
  const char* planned = std::getenv("ZEAL_CPU_BIND");
  if (planned) items.push_back({"CPU binding (from zeal launch)", planned});
  for (int ranks : {2, 4}) {
    std::string plan;
    for (const auto& b : plan_cpu_binding(ranks)) plan += fmt::format("{}{}: {}", plan.empty() ? "" : "; ", b.local_rank, b.describe());
    items.push_back({fmt::format("zeal launch binding, {} local ranks", ranks), plan.empty() ? "unavailable" : plan});
  }
  items.push_back({"memory", fmt::format("{:.1f} GiB", static_cast<double>(pages) * page / (1ULL << 30))});
  items.push_back({"compiler", __VERSION__});
  return items;
}

}  // namespace zeal
