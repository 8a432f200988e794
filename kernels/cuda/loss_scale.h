// Loss-scale kernels on CUDA: multiply a gradient buffer by 1/scale and report whether any
// element is inf or nan, in one pass (DeepSpeed needs a separate unscale and a separate check).
#pragma once

#include <cstdint>

namespace zeal::cuda {

// Returns true when this build has CUDA kernels and the process sees at least one GPU.
bool device_available();

// grads[i] *= inv_scale for i < n, on `stream` (a cudaStream_t; nullptr for the default stream).
// *found_inf_device (an int in device memory) is set to 1 when any input or output element is
// not finite; it is never cleared, so one flag can collect several buffers. Errors throw
// zeal::Error naming the CUDA call.
void unscale_and_check(float* grads, int64_t n, float inv_scale, int* found_inf_device, void* stream);

}  // namespace zeal::cuda
