// What a bug report needs to know about this machine and this build: versions of zeal and its
// libraries, whether io_uring works here, the CPU's SIMD features, cores, NUMA nodes and GPUs.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace zeal {

struct EnvironmentItem {
  std::string name;
  std::string value;
};

// Probes the machine (loads libcuda and libnccl if present, opens an io_uring) and returns the
// items in display order. Never throws: a probe that fails says why in its value.
std::vector<EnvironmentItem> describe_environment();

// LibTorch's version and its intra-op thread setup (kept in its own translation unit).
std::string libtorch_version();
std::string libtorch_parallel_info();
bool libtorch_has_cuda();     // the CUDA half is linked and a GPU is usable
bool libtorch_cuda_linked();  // LibTorch's CUDA half is linked (GPU or not)
// The vector path LibTorch's own CPU kernels take ("AVX512", "AVX2", "DEFAULT"; ATEN_CPU_CAPABILITY
// chooses another).
std::string libtorch_cpu_capability();

}  // namespace zeal
