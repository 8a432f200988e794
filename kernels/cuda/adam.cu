#include "kernels/cuda/adam.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <array>
#include <string>

#include "engine/error.h"
#include "kernels/cpu/adam_kernel.h"

namespace zeal::cuda {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Work is cut into chunks of kChunk elements; one block per chunk. A launch carries the pointers
// of up to kMaxTensors tensors and the (tensor, chunk) of up to kMaxBlocks blocks in its
// parameters (under the 4 KiB every CUDA version accepts).
constexpr int kChunk = 1 << 16;
constexpr int kMaxTensors = 24;
constexpr int kMaxBlocks = 320;
constexpr int kThreads = 256;

template <int kPtrs>
struct Batch {
  void* ptr[kPtrs][kMaxTensors];
  int64_t n[kMaxTensors];
  unsigned char tensor[kMaxBlocks];
  int chunk[kMaxBlocks];
  int blocks;
};

// Packs the tensors into batches and calls launch(batch, first_block) for each, where
// first_block counts the blocks of earlier batches.
template <int kPtrs, class Launch>
void for_each_batch(const std::vector<std::array<void*, kPtrs>>& ptrs, const std::vector<int64_t>& sizes,
                    Launch&& launch) {
  Batch<kPtrs> b{};
  int tensors = 0;
  int64_t first_block = 0;
  auto add_tensor = [&](size_t t) {
    for (int k = 0; k < kPtrs; ++k) b.ptr[k][tensors] = ptrs[t][k];
    b.n[tensors] = sizes[t];
    return tensors++;
  };
  auto flush = [&] {
    if (b.blocks > 0) launch(b, first_block);
    first_block += b.blocks;
    b = Batch<kPtrs>{};
    tensors = 0;
  };
  for (size_t t = 0; t < sizes.size(); ++t) {
    if (sizes[t] <= 0) continue;
    if (tensors == kMaxTensors) flush();
    int slot = add_tensor(t);
    const int64_t chunks = (sizes[t] + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      if (b.blocks == kMaxBlocks) {
        flush();
        slot = add_tensor(t);
      }
      b.tensor[b.blocks] = static_cast<unsigned char>(slot);
      b.chunk[b.blocks] = static_cast<int>(c);
      ++b.blocks;
    }
  }
  flush();
}

__device__ __forceinline__ float load(const void* p, DType type, int64_t i) {
  switch (type) {
    case DType::kBf16: return __uint_as_float(static_cast<unsigned>(static_cast<const unsigned short*>(p)[i]) << 16);
    case DType::kFp16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// Round to nearest even into bf16 (the CPU kernel's rule, NaN kept quiet with its sign).
__device__ __forceinline__ unsigned short to_bf16(float f) {
  const unsigned u = __float_as_uint(f);
  if (f != f) return static_cast<unsigned short>((u >> 16) | 0x40);
  return static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ void store(void* p, DType type, int64_t i, float w) {
  switch (type) {
    case DType::kBf16: static_cast<unsigned short*>(p)[i] = to_bf16(w); break;
    case DType::kFp16: static_cast<__half*>(p)[i] = __float2half_rn(w); break;
    default: static_cast<float*>(p)[i] = w;
  }
}

// The CPU kernel's expression (kernels/cpu/adam_kernel.h) with explicit roundings: nvcc would
// otherwise contract multiply-adds the CPU path keeps separate.
__global__ void adam_kernel(Batch<5> b, cpu::detail::AdamConstants c, DType grad_type, DType copy_type) {
  const int t = b.tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(b.chunk[blockIdx.x]) * kChunk;
  const int64_t end = min(b.n[t], begin + kChunk);
  float* master = static_cast<float*>(b.ptr[0][t]);
  float* m_ = static_cast<float*>(b.ptr[1][t]);
  float* v_ = static_cast<float*>(b.ptr[2][t]);
  const void* grad = b.ptr[3][t];
  void* copy = b.ptr[4][t];
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float g = __fmul_rn(load(grad, grad_type, i), c.grad_scale);
    float p = master[i];
    g = __fmaf_rn(c.l2, p, g);
    const float m = __fmaf_rn(c.beta1, m_[i], __fmul_rn(c.one_minus_beta1, g));
    const float v = __fmaf_rn(c.beta2, v_[i], __fmul_rn(__fmul_rn(c.one_minus_beta2, g), g));
    const float denom = __fmaf_rn(__fsqrt_rn(v), c.inv_sqrt_bc2, c.eps);
    p = __fmul_rn(p, c.decay);
    p = __fsub_rn(p, __fmul_rn(c.step_size, __fdiv_rn(m, denom)));
    master[i] = p;
    m_[i] = m;
    v_[i] = v;
    if (copy) store(copy, copy_type, i, p);
  }
}

__global__ void sumsq_kernel(Batch<1> b, DType type, double* partials) {
  const int t = b.tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(b.chunk[blockIdx.x]) * kChunk;
  const int64_t end = min(b.n[t], begin + kChunk);
  double acc = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const double g = load(b.ptr[0][t], type, i);
    acc = fma(g, g, acc);
  }
  __shared__ double s[kThreads];
  s[threadIdx.x] = acc;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) s[threadIdx.x] += s[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = s[0];
}

// One block sums the partials in a fixed order.
__global__ void sum_partials_kernel(const double* partials, int64_t n, double* out) {
  __shared__ double s[kThreads];
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += partials[i];
  s[threadIdx.x] = acc;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) s[threadIdx.x] += s[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = s[0];
}

__global__ void unscale_kernel(Batch<1> b, float inv_scale, int* found_inf) {
  const int t = b.tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(b.chunk[blockIdx.x]) * kChunk;
  const int64_t end = min(b.n[t], begin + kChunk);
  float* g = static_cast<float*>(b.ptr[0][t]);
  bool bad = false;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float x = g[i];
    bad |= !isfinite(x);
    g[i] = x * inv_scale;
  }
  if (bad) *found_inf = 1;
}

}  // namespace

void multi_tensor_adam(const AdamHyper& h, const std::vector<AdamTensor>& tensors, DType grad_type,
                       DType copy_type, void* stream) {
  const cpu::detail::AdamConstants c = cpu::detail::adam_constants(h);
  std::vector<std::array<void*, 5>> ptrs;
  std::vector<int64_t> sizes;
  for (const AdamTensor& t : tensors) {
    ptrs.push_back({t.master, t.m, t.v, const_cast<void*>(t.grad), t.copy});
    sizes.push_back(t.n);
  }
  for_each_batch<5>(ptrs, sizes, [&](const Batch<5>& b, int64_t) {
    adam_kernel<<<b.blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(b, c, grad_type, copy_type);
    check(cudaGetLastError(), "multi_tensor_adam launch");
  });
}

int64_t sumsq_workspace(const std::vector<int64_t>& sizes) {
  int64_t chunks = 0;
  for (int64_t n : sizes) chunks += n > 0 ? (n + kChunk - 1) / kChunk : 0;
  return chunks;
}

void multi_tensor_sumsq(const std::vector<const void*>& grads, const std::vector<int64_t>& sizes, DType type,
                        double* out_device, double* workspace, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  std::vector<std::array<void*, 1>> ptrs;
  for (const void* g : grads) ptrs.push_back({const_cast<void*>(g)});
  for_each_batch<1>(ptrs, sizes, [&](const Batch<1>& b, int64_t first) {
    sumsq_kernel<<<b.blocks, kThreads, 0, s>>>(b, type, workspace + first);
    check(cudaGetLastError(), "multi_tensor_sumsq launch");
  });
  sum_partials_kernel<<<1, kThreads, 0, s>>>(workspace, sumsq_workspace(sizes), out_device);
  check(cudaGetLastError(), "multi_tensor_sumsq final launch");
}

void multi_tensor_unscale(const std::vector<float*>& grads, const std::vector<int64_t>& sizes, float inv_scale,
                          int* found_inf_device, void* stream) {
  std::vector<std::array<void*, 1>> ptrs;
  for (float* g : grads) ptrs.push_back({g});
  for_each_batch<1>(ptrs, sizes, [&](const Batch<1>& b, int64_t) {
    unscale_kernel<<<b.blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(b, inv_scale, found_inf_device);
    check(cudaGetLastError(), "multi_tensor_unscale launch");
  });
}

}  // namespace zeal::cuda
