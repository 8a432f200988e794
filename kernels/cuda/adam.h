// Multi-tensor kernels for the optimizer step on CUDA: raw device pointers and a stream, no
// LibTorch headers. Many tensors go through one launch (chunks of every tensor share the grid),
// so a step over hundreds of parameters costs a handful of launches, not hundreds.
//
//   multi_tensor_adam      Adam/AdamW from fp32, bf16 or fp16 gradients (times grad_scale) into
//                          fp32 master, m, v, writing the bf16/fp16 compute copy in the same pass.
//                          The arithmetic is the CPU kernel's (kernels/cpu/adam.h), expression for
//                          expression with the same roundings, so the two agree bit for bit.
//   multi_tensor_sumsq     the sum of squares of many gradients in float64 (deterministic: fixed
//                          partial order, no atomics); non-finite when any element is inf or nan.
//   multi_tensor_unscale   g *= inv_scale over many fp32 buffers, raising a device flag on inf/nan.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/cpu/adam.h"

namespace zeal::cuda {

using cpu::AdamHyper;
using cpu::DType;

struct AdamTensor {
  float* master = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  const void* grad = nullptr;  // grad_type
  void* copy = nullptr;        // copy_type, or null for no copy
  int64_t n = 0;
};

// One Adam step over every tensor on `stream` (a cudaStream_t; nullptr for the default stream).
// Every tensor has the same gradient and copy types. Throws zeal::Error naming the CUDA call.
void multi_tensor_adam(const AdamHyper& h, const std::vector<AdamTensor>& tensors, DType grad_type,
                       DType copy_type, void* stream);

// Device scratch (doubles) multi_tensor_sumsq needs for these sizes.
int64_t sumsq_workspace(const std::vector<int64_t>& sizes);
// *out_device (a double in device memory) = Σ over tensors and elements of g², computed in
// float64. `workspace` holds at least sumsq_workspace(sizes) doubles.
void multi_tensor_sumsq(const std::vector<const void*>& grads, const std::vector<int64_t>& sizes, DType type,
                        double* out_device, double* workspace, void* stream);

// grads[t][i] *= inv_scale; *found_inf_device = 1 when any element is inf or nan (never cleared).
void multi_tensor_unscale(const std::vector<float*>& grads, const std::vector<int64_t>& sizes, float inv_scale,
                          int* found_inf_device, void* stream);

}  // namespace zeal::cuda
