// The per-element Adam arithmetic shared by every path, written once over a lane type V: the CPU's
// scalar, AVX2 and AVX-512 lanes and the CUDA kernel's (kernels/cuda/adam.cu) evaluate the same
// expression with the same roundings. V provides: splat(float), sub, mul, div, fma(a,b,c) = a·b + c
// with one rounding, sqrt.
#pragma once

#include "kernels/cpu/adam.h"

#ifdef __CUDACC__
#define ZEAL_HOST_DEVICE __host__ __device__
#else
#define ZEAL_HOST_DEVICE
#endif

namespace zeal::cpu::detail {

// Per-step constants, computed once in double and rounded to float once.
struct AdamConstants {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, inv_sqrt_bc2, decay, l2,
      grad_scale;
};
AdamConstants adam_constants(const AdamHyper& h);

// g ← g·scale (+ l2·p); m ← β1·m + (1−β1)·g; v ← β2·v + (1−β2)·g²;
// p ← p·decay − step_size · m / (sqrt(v)·inv_sqrt_bc2 + eps)
template <class V>
ZEAL_HOST_DEVICE inline void adam_lanes(const AdamConstants& c, V& p, V& m, V& v, V g) {
  g = V::mul(g, V::splat(c.grad_scale));
  g = V::fma(V::splat(c.l2), p, g);
  m = V::fma(V::splat(c.beta1), m, V::mul(V::splat(c.one_minus_beta1), g));
  v = V::fma(V::splat(c.beta2), v, V::mul(V::mul(V::splat(c.one_minus_beta2), g), g));
  const V denom = V::fma(V::sqrt(v), V::splat(c.inv_sqrt_bc2), V::splat(c.eps));
  p = V::mul(p, V::splat(c.decay));
  p = V::sub(p, V::mul(V::splat(c.step_size), V::div(m, denom)));
}

// Gradient statistics over [0, n) of each path.
GradStats stats_scalar(const void* grad, DType type, int64_t begin, int64_t n);
GradStats stats_avx2(const void* grad, DType type, int64_t n);
GradStats stats_avx512(const void* grad, DType type, int64_t n);

void adam_avx2(const AdamConstants& c, const AdamPartition& p);
void adam_avx512(const AdamConstants& c, const AdamPartition& p);
// Elements [begin, n) with the scalar path (the SIMD paths use it for their tails).
void adam_scalar(const AdamConstants& c, const AdamPartition& p, int64_t begin);

}  // namespace zeal::cpu::detail
