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
// parameters: CUDA 12.1 and later take up to 32 KiB of them (Volta and newer), so one launch covers
// 2048 chunks (67 M elements); older toolkits keep under the 4 KiB every version accepts. Chunks of
// 32 Ki elements keep a launch's last wave of blocks a small part of it.
constexpr int kChunk = 1 << 15;
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
constexpr int kMaxTensors = 110;
constexpr int kMaxBlocks = 2048;
#else
constexpr int kMaxTensors = 24;
constexpr int kMaxBlocks = 320;
#endif
constexpr int kThreads = 256;      // the reductions
constexpr int kAdamThreads = 512;  // the Adam step: 4 elements a thread per pass, 2048 a block

template <int kPtrs>
struct Batch {
  void* ptr[kPtrs][kMaxTensors];
  int64_t n[kMaxTensors];
  // Elements before the tensor's pointers all allow 4-element vector accesses (0 to 3), or
  // kNoVector when they never do together.
  unsigned char head[kMaxTensors];
  unsigned char tensor[kMaxBlocks];
  int chunk[kMaxBlocks];
  int blocks;
};
static_assert(kMaxTensors < 256, "Batch::tensor holds a tensor's slot in a byte");
constexpr unsigned char kNoVector = 255;

// Packs the tensors into batches and calls launch(batch, first_block) for each, where
// first_block counts the blocks of earlier batches. head[t]: Batch::head of tensor t (0 when unset).
template <int kPtrs, class Launch>
void for_each_batch(const std::vector<std::array<void*, kPtrs>>& ptrs, const std::vector<int64_t>& sizes,
                    Launch&& launch, const std::vector<unsigned char>& head = {}) {
  Batch<kPtrs> b{};
  int tensors = 0;
  int64_t first_block = 0;
  auto add_tensor = [&](size_t t) {
    for (int k = 0; k < kPtrs; ++k) b.ptr[k][tensors] = ptrs[t][k];
    b.n[tensors] = sizes[t];
    b.head[tensors] = head.empty() ? 0 : head[t];
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

__device__ __forceinline__ unsigned short to_16(float f, DType type) {
  return type == DType::kBf16 ? to_bf16(f) : __half_as_ushort(__float2half_rn(f));
}

__device__ __forceinline__ float from_16(unsigned short h, DType type) {
  return type == DType::kBf16 ? __uint_as_float(static_cast<unsigned>(h) << 16) : __half2float(__ushort_as_half(h));
}

// One lane of the shared Adam expression (kernels/cpu/adam_kernel.h) with explicit roundings: nvcc
// would otherwise contract the multiply-adds the CPU path keeps separate.
struct Lane {
  float x;
  __device__ static Lane splat(float f) { return {f}; }
  __device__ static Lane sub(Lane a, Lane b) { return {__fsub_rn(a.x, b.x)}; }
  __device__ static Lane mul(Lane a, Lane b) { return {__fmul_rn(a.x, b.x)}; }
  __device__ static Lane div(Lane a, Lane b) { return {__fdiv_rn(a.x, b.x)}; }
  __device__ static Lane fma(Lane a, Lane b, Lane c) { return {__fmaf_rn(a.x, b.x, c.x)}; }
  __device__ static Lane sqrt(Lane a) { return {__fsqrt_rn(a.x)}; }
};

// The compute copy written beside the master: none, fp32, or a 16-bit type.
enum class Copy { kNone, kFp32, kBf16, kFp16 };

template <DType G, Copy C>
__device__ __forceinline__ void adam_element(const cpu::detail::AdamConstants& c, float* master, float* m_, float* v_,
                                             const void* grad, void* copy, int64_t i) {
  Lane p{master[i]}, m{m_[i]}, v{v_[i]};
  cpu::detail::adam_lanes(c, p, m, v, Lane{load(grad, G, i)});
  master[i] = p.x;
  m_[i] = m.x;
  v_[i] = v.x;
  if constexpr (C == Copy::kFp32) static_cast<float*>(copy)[i] = p.x;
  if constexpr (C == Copy::kBf16) static_cast<unsigned short*>(copy)[i] = to_bf16(p.x);
  if constexpr (C == Copy::kFp16) static_cast<__half*>(copy)[i] = __float2half_rn(p.x);
}

// Each thread updates 4 consecutive elements a pass with 16-byte loads of master, m and v (8 bytes
// of a 16-bit gradient or copy). A tensor that starts 1 to 3 elements past an aligned address (a
// segment at any offset of a flat buffer) has those first elements of each chunk and a chunk's last
// n mod 4 take the one-element path; a tensor whose pointers are never aligned together takes it
// throughout. Memory traffic per element: 12 bytes read (master, m, v) + the gradient, 12 written +
// the copy: the kernel is bound by memory bandwidth, not arithmetic.
template <DType G, Copy C>
__global__ void __launch_bounds__(kAdamThreads) adam_kernel(const Batch<5> b, const cpu::detail::AdamConstants c) {
  const int t = b.tensor[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(b.chunk[blockIdx.x]) * kChunk;
  const int64_t end = min(b.n[t], begin + kChunk);
  float* __restrict__ master = static_cast<float*>(b.ptr[0][t]);
  float* __restrict__ m_ = static_cast<float*>(b.ptr[1][t]);
  float* __restrict__ v_ = static_cast<float*>(b.ptr[2][t]);
  const void* __restrict__ grad = b.ptr[3][t];
  void* __restrict__ copy = b.ptr[4][t];
  int64_t first = begin, tail = begin;  // the vector path covers [first, tail)
  if (b.head[t] != kNoVector) {
    // Chunks start at multiples of 4 elements, so every chunk's first aligned element is `head` in.
    first = min(end, begin + b.head[t]);
    tail = first + ((end - first) & ~int64_t{3});
    for (int64_t i = begin + threadIdx.x; i < first; i += kAdamThreads) {
      adam_element<G, C>(c, master, m_, v_, grad, copy, i);
    }
    for (int64_t i = first + 4 * static_cast<int64_t>(threadIdx.x); i < tail; i += 4 * kAdamThreads) {
      const float4 p4 = *reinterpret_cast<const float4*>(master + i);
      const float4 m4 = *reinterpret_cast<const float4*>(m_ + i);
      const float4 v4 = *reinterpret_cast<const float4*>(v_ + i);
      float g[4];
      if constexpr (G == DType::kFp32) {
        const float4 g4 = __ldcs(reinterpret_cast<const float4*>(static_cast<const float*>(grad) + i));
        g[0] = g4.x, g[1] = g4.y, g[2] = g4.z, g[3] = g4.w;
      } else {
        const uint2 h = __ldcs(reinterpret_cast<const uint2*>(static_cast<const unsigned short*>(grad) + i));
        g[0] = from_16(h.x & 0xffffu, G), g[1] = from_16(h.x >> 16, G);
        g[2] = from_16(h.y & 0xffffu, G), g[3] = from_16(h.y >> 16, G);
      }
      Lane p[4] = {{p4.x}, {p4.y}, {p4.z}, {p4.w}};
      Lane m[4] = {{m4.x}, {m4.y}, {m4.z}, {m4.w}};
      Lane v[4] = {{v4.x}, {v4.y}, {v4.z}, {v4.w}};
#pragma unroll
      for (int k = 0; k < 4; ++k) cpu::detail::adam_lanes(c, p[k], m[k], v[k], Lane{g[k]});
      *reinterpret_cast<float4*>(master + i) = make_float4(p[0].x, p[1].x, p[2].x, p[3].x);
      *reinterpret_cast<float4*>(m_ + i) = make_float4(m[0].x, m[1].x, m[2].x, m[3].x);
      *reinterpret_cast<float4*>(v_ + i) = make_float4(v[0].x, v[1].x, v[2].x, v[3].x);
      if constexpr (C == Copy::kFp32) {
        *reinterpret_cast<float4*>(static_cast<float*>(copy) + i) = make_float4(p[0].x, p[1].x, p[2].x, p[3].x);
      } else if constexpr (C != Copy::kNone) {
        constexpr DType T = C == Copy::kBf16 ? DType::kBf16 : DType::kFp16;
        const uint2 h = make_uint2(to_16(p[0].x, T) | (static_cast<unsigned>(to_16(p[1].x, T)) << 16),
                                   to_16(p[2].x, T) | (static_cast<unsigned>(to_16(p[3].x, T)) << 16));
        *reinterpret_cast<uint2*>(static_cast<unsigned short*>(copy) + i) = h;
      }
    }
  }
  for (int64_t i = tail + threadIdx.x; i < end; i += kAdamThreads) {
    adam_element<G, C>(c, master, m_, v_, grad, copy, i);
  }
}

template <DType G, Copy C>
void launch_adam(const Batch<5>& b, const cpu::detail::AdamConstants& c, cudaStream_t s) {
  adam_kernel<G, C><<<b.blocks, kAdamThreads, 0, s>>>(b, c);
}

template <DType G>
void launch_adam(Copy copy, const Batch<5>& b, const cpu::detail::AdamConstants& c, cudaStream_t s) {
  switch (copy) {
    case Copy::kNone: return launch_adam<G, Copy::kNone>(b, c, s);
    case Copy::kFp32: return launch_adam<G, Copy::kFp32>(b, c, s);
    case Copy::kBf16: return launch_adam<G, Copy::kBf16>(b, c, s);
    case Copy::kFp16: return launch_adam<G, Copy::kFp16>(b, c, s);
  }
}

bool aligned(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0; }

// Batch::head of a tensor: the elements before master, m, v, the gradient and the copy are all
// aligned for 4-element accesses (16 bytes of fp32, 8 of a 16-bit type), or kNoVector.
unsigned char head_of(const AdamTensor& t, size_t grad_elem, size_t copy_elem) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(t.master);
  if (a % 4 != 0) return kNoVector;
  const size_t h = ((16 - a % 16) % 16) / 4;
  auto at = [h](const void* p, size_t elem) { return static_cast<const char*>(p) + h * elem; };
  const bool ok = aligned(at(t.m, 4), 16) && aligned(at(t.v, 4), 16) && aligned(at(t.grad, grad_elem), 4 * grad_elem) &&
                  (!t.copy || aligned(at(t.copy, copy_elem), 4 * copy_elem));
  return ok ? static_cast<unsigned char>(h) : kNoVector;
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
  const size_t grad_elem = grad_type == DType::kFp32 ? 4 : 2;
  const size_t copy_elem = copy_type == DType::kFp32 ? 4 : 2;
  std::vector<std::array<void*, 5>> ptrs;
  std::vector<int64_t> sizes;
  std::vector<unsigned char> head;
  bool any_copy = false;
  for (const AdamTensor& t : tensors) {
    ptrs.push_back({t.master, t.m, t.v, const_cast<void*>(t.grad), t.copy});
    sizes.push_back(t.n);
    head.push_back(head_of(t, grad_elem, copy_elem));
    any_copy = any_copy || t.copy;
  }
  for (const AdamTensor& t : tensors) {
    if (t.n > 0 && any_copy && !t.copy) throw Error("multi_tensor_adam: every tensor of one call has a copy, or none");
  }
  const Copy copy = !any_copy                       ? Copy::kNone
                    : copy_type == DType::kFp32     ? Copy::kFp32
                    : copy_type == DType::kBf16     ? Copy::kBf16
                                                    : Copy::kFp16;
  const auto s = static_cast<cudaStream_t>(stream);
  for_each_batch<5>(
      ptrs, sizes,
      [&](const Batch<5>& b, int64_t) {
        switch (grad_type) {
          case DType::kFp32: launch_adam<DType::kFp32>(copy, b, c, s); break;
          case DType::kBf16: launch_adam<DType::kBf16>(copy, b, c, s); break;
          case DType::kFp16: launch_adam<DType::kFp16>(copy, b, c, s); break;
        }
        check(cudaGetLastError(), "multi_tensor_adam launch");
      },
      head);
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
