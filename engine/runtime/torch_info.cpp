// The only translation unit of the runtime that includes LibTorch headers.
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include "engine/runtime/environment.h"

namespace zeal {

std::string libtorch_version() { return TORCH_VERSION; }

std::string libtorch_parallel_info() {
  return std::to_string(at::get_num_threads()) + " intra-op threads, " +
         std::to_string(at::get_num_interop_threads()) + " inter-op threads";
}

bool libtorch_has_cuda() { return torch::cuda::is_available(); }

bool libtorch_cuda_linked() { return at::detail::getCUDAHooks().hasCUDART(); }

std::string libtorch_cpu_capability() { return at::get_cpu_capability(); }

}  // namespace zeal
