// The SIMD Adam loop shared by the AVX2 and AVX-512 paths, over an ISA's traits I:
//   I::V                        the lane type adam_lanes() takes (splat, sub, mul, div, fma, sqrt)
//   I::kWidth                   lanes per vector
//   I::load(ptr, i)             kWidth floats at ptr + i
//   I::store(ptr, i, V)         kWidth floats to ptr + i
//   I::load_grad<G>(ptr, i)     kWidth gradients of dtype G at ptr + i, widened to float
//   I::store_copy<C>(ptr, i, V) kWidth values to the compute copy of dtype C at ptr + i
//
// The loop is instantiated per gradient dtype and copy dtype, with the constants and pointers held
// in locals the compiler knows no store can alias: the constants are broadcast once, not reloaded and
// re-broadcast per vector, and no dtype is tested inside the loop. Each iteration reads 256 bytes
// (four cache lines) of each stream, one stream after the other, before it computes and stores them:
// a single thread then keeps enough line fills in flight to run at the memory's speed (measured with
// optim_bench, docs/benchmarks.md). Per element the arithmetic is adam_lanes(), so every path stays
// bit-identical to the scalar reference.
#pragma once

#include <cstdint>

#include "kernels/cpu/adam_kernel.h"

namespace zeal::cpu::detail {

enum class CopyKind { kNone, kFp32, kFp16, kBf16 };

template <class I, DType G, CopyKind C>
void adam_loop(const AdamConstants& constants, const AdamPartition& p, int64_t vec_end) {
  using V = typename I::V;
  constexpr int64_t W = I::kWidth;
  const AdamConstants c = constants;
  float* __restrict master = p.master;
  float* __restrict m = p.m;
  float* __restrict v = p.v;
  const void* __restrict grad = p.grad;
  void* __restrict copy = p.copy;
  auto one = [&](int64_t i) {
    V w{I::load(master, i)}, mi{I::load(m, i)}, vi{I::load(v, i)};
    adam_lanes(c, w, mi, vi, V{I::template load_grad<G>(grad, i)});
    I::store(master, i, w);
    I::store(m, i, mi);
    I::store(v, i, vi);
    if constexpr (C != CopyKind::kNone) I::template store_copy<C>(copy, i, w);
  };
  constexpr int U = static_cast<int>(64 / W);  // 256 bytes of each stream per iteration
  int64_t i = 0;
  for (; i + U * W <= vec_end; i += U * W) {
    V g[U], w[U], mi[U], vi[U];
    for (int u = 0; u < U; ++u) g[u] = V{I::template load_grad<G>(grad, i + u * W)};
    for (int u = 0; u < U; ++u) w[u] = V{I::load(master, i + u * W)};
    for (int u = 0; u < U; ++u) mi[u] = V{I::load(m, i + u * W)};
    for (int u = 0; u < U; ++u) vi[u] = V{I::load(v, i + u * W)};
    for (int u = 0; u < U; ++u) adam_lanes(c, w[u], mi[u], vi[u], g[u]);
    for (int u = 0; u < U; ++u) I::store(m, i + u * W, mi[u]);
    for (int u = 0; u < U; ++u) I::store(v, i + u * W, vi[u]);
    for (int u = 0; u < U; ++u) I::store(master, i + u * W, w[u]);
    if constexpr (C != CopyKind::kNone) {
      for (int u = 0; u < U; ++u) I::template store_copy<C>(copy, i + u * W, w[u]);
    }
  }
  for (; i < vec_end; i += W) one(i);
}

template <class I, DType G>
void adam_dispatch_copy(const AdamConstants& c, const AdamPartition& p, int64_t vec_end) {
  if (!p.copy) return adam_loop<I, G, CopyKind::kNone>(c, p, vec_end);
  switch (p.copy_type) {
    case DType::kFp32: return adam_loop<I, G, CopyKind::kFp32>(c, p, vec_end);
    case DType::kFp16: return adam_loop<I, G, CopyKind::kFp16>(c, p, vec_end);
    default: return adam_loop<I, G, CopyKind::kBf16>(c, p, vec_end);
  }
}

// Elements [0, n − n mod kWidth) with the ISA's lanes, the tail with the scalar path.
template <class I>
void adam_simd(const AdamConstants& c, const AdamPartition& p) {
  const int64_t vec_end = p.n - p.n % I::kWidth;
  switch (p.grad_type) {
    case DType::kBf16: adam_dispatch_copy<I, DType::kBf16>(c, p, vec_end); break;
    case DType::kFp16: adam_dispatch_copy<I, DType::kFp16>(c, p, vec_end); break;
    default: adam_dispatch_copy<I, DType::kFp32>(c, p, vec_end);
  }
  adam_scalar(c, p, vec_end);
}

}  // namespace zeal::cpu::detail
