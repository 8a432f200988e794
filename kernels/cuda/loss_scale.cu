#include "kernels/cuda/loss_scale.h"

#include <cuda_runtime.h>

#include <string>

#include "engine/error.h"

namespace zeal::cuda {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Grid-stride loop; each element is read once and written once (8 bytes of traffic per element).
// The flag is written only by threads that saw a non-finite value, so the common case costs no
// atomic traffic at all.
__global__ void unscale_and_check_kernel(float* __restrict__ g, int64_t n, float inv_scale,
                                         int* __restrict__ found_inf) {
  bool bad = false;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = g[i];
    bad |= !isfinite(v);
    g[i] = v * inv_scale;
  }
  if (bad) *found_inf = 1;
}

}  // namespace

bool device_available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

void unscale_and_check(float* grads, int64_t n, float inv_scale, int* found_inf_device, void* stream) {
  if (n <= 0) return;
  constexpr int kThreads = 256;
  int device = 0, sms = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  const int64_t needed = (n + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(needed < sms * 8LL ? needed : sms * 8LL);
  unscale_and_check_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(grads, n, inv_scale,
                                                                                      found_inf_device);
  check(cudaGetLastError(), "unscale_and_check launch");
}

}  // namespace zeal::cuda
