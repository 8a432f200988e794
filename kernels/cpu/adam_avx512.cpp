// The AVX-512 path: 16 lanes. Compiled with -mavx512f -mavx512bw -mavx512vl; called only when
// the CPU has them.
#include <immintrin.h>

#include "kernels/cpu/adam_loop.h"

namespace zeal::cpu::detail {
namespace {

struct V16 {
  __m512 x;
  static V16 splat(float f) { return {_mm512_set1_ps(f)}; }
  static V16 sub(V16 a, V16 b) { return {_mm512_sub_ps(a.x, b.x)}; }
  static V16 mul(V16 a, V16 b) { return {_mm512_mul_ps(a.x, b.x)}; }
  static V16 div(V16 a, V16 b) { return {_mm512_div_ps(a.x, b.x)}; }
  static V16 fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.x, b.x, c.x)}; }
  static V16 sqrt(V16 a) { return {_mm512_sqrt_ps(a.x)}; }
};

inline __m512 load(const void* g, DType type, int64_t i) {
  const auto* half = reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i);
  switch (type) {
    case DType::kBf16:
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(half)), 16));
    case DType::kFp16: return _mm512_cvtph_ps(_mm256_loadu_si256(half));
    default: return _mm512_loadu_ps(static_cast<const float*>(g) + i);
  }
}

inline __m256i to_bf16(__m512 w) {
  const __m512i u = _mm512_castps_si512(w);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(w, w, _CMP_UNORD_Q), nan);
  return _mm512_cvtepi32_epi16(r);
}

// The loop's traits (adam_loop.h).
struct Avx512 {
  using V = V16;
  static constexpr int64_t kWidth = 16;
  static __m512 load(const float* p, int64_t i) { return _mm512_loadu_ps(p + i); }
  static void store(float* p, int64_t i, V16 x) { _mm512_storeu_ps(p + i, x.x); }
  template <DType G>
  static __m512 load_grad(const void* g, int64_t i) { return detail::load(g, G, i); }
  template <CopyKind C>
  static void store_copy(void* out, int64_t i, V16 w) {
    if constexpr (C == CopyKind::kFp32) {
      _mm512_storeu_ps(static_cast<float*>(out) + i, w.x);
    } else {
      __m256i* half = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i);
      _mm256_storeu_si256(half, C == CopyKind::kFp16
                                    ? _mm512_cvtps_ph(w.x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                                    : to_bf16(w.x));
    }
  }
};

}  // namespace

void adam_avx512(const AdamConstants& c, const AdamPartition& p) { adam_simd<Avx512>(c, p); }

GradStats stats_avx512(const void* grad, DType type, int64_t n) {
  // Four vectors per iteration, each with its own accumulators, so the adds do not wait on one chain.
  constexpr int U = 4;
  const int64_t vec_end = n - n % 16;
  __m512d lo[U], hi[U];
  __m512 amax[U];
  for (int u = 0; u < U; ++u) lo[u] = hi[u] = _mm512_setzero_pd(), amax[u] = _mm512_setzero_ps();
  auto add = [&](int u, int64_t i) {
    const __m512 g = load(grad, type, i);
    const __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(g));
    const __m512d b = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(g), 1)));
    lo[u] = _mm512_fmadd_pd(a, a, lo[u]);
    hi[u] = _mm512_fmadd_pd(b, b, hi[u]);
    amax[u] = _mm512_max_ps(amax[u], _mm512_abs_ps(g));
  };
  int64_t i = 0;
  for (; i + U * 16 <= vec_end; i += U * 16) {
    for (int u = 0; u < U; ++u) add(u, i + u * 16);
  }
  for (; i < vec_end; i += 16) add(0, i);
  for (int u = 1; u < U; ++u) {
    lo[0] = _mm512_add_pd(lo[0], lo[u]), hi[0] = _mm512_add_pd(hi[0], hi[u]);
    amax[0] = _mm512_max_ps(amax[0], amax[u]);
  }
  GradStats out{_mm512_reduce_add_pd(_mm512_add_pd(lo[0], hi[0])), _mm512_reduce_max_ps(amax[0])};
  return combine(out, stats_scalar(grad, type, vec_end, n));
}

}  // namespace zeal::cpu::detail
