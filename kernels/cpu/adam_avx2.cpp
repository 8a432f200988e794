// The AVX2 + FMA + F16C path: 8 lanes. Compiled with -mavx2 -mfma -mf16c; called only when the
// CPU has them.
#include <immintrin.h>

#include "kernels/cpu/adam_loop.h"

namespace zeal::cpu::detail {
namespace {

struct V8 {
  __m256 x;
  static V8 splat(float f) { return {_mm256_set1_ps(f)}; }
  static V8 sub(V8 a, V8 b) { return {_mm256_sub_ps(a.x, b.x)}; }
  static V8 mul(V8 a, V8 b) { return {_mm256_mul_ps(a.x, b.x)}; }
  static V8 div(V8 a, V8 b) { return {_mm256_div_ps(a.x, b.x)}; }
  static V8 fma(V8 a, V8 b, V8 c) { return {_mm256_fmadd_ps(a.x, b.x, c.x)}; }
  static V8 sqrt(V8 a) { return {_mm256_sqrt_ps(a.x)}; }
};

inline __m256 load(const void* g, DType type, int64_t i) {
  switch (type) {
    case DType::kBf16: {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case DType::kFp16:
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i)));
    default: return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  }
}

// Round to nearest even into bf16; NaN becomes a quiet NaN with its sign.
inline __m128i to_bf16(__m256 w) {
  const __m256i u = _mm256_castps_si256(w);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(w, w, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, nan, is_nan);
  const __m256i packed = _mm256_packus_epi32(r, r);  // 16-bit values in each 128-bit half
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

// The loop's traits (adam_loop.h).
struct Avx2 {
  using V = V8;
  static constexpr int64_t kWidth = 8;
  static __m256 load(const float* p, int64_t i) { return _mm256_loadu_ps(p + i); }
  static void store(float* p, int64_t i, V8 x) { _mm256_storeu_ps(p + i, x.x); }
  template <DType G>
  static __m256 load_grad(const void* g, int64_t i) { return detail::load(g, G, i); }
  template <CopyKind C>
  static void store_copy(void* out, int64_t i, V8 w) {
    if constexpr (C == CopyKind::kFp32) {
      _mm256_storeu_ps(static_cast<float*>(out) + i, w.x);
    } else {
      __m128i* half = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i);
      _mm_storeu_si128(half, C == CopyKind::kFp16 ? _mm256_cvtps_ph(w.x, _MM_FROUND_TO_NEAREST_INT) : to_bf16(w.x));
    }
  }
};

}  // namespace

void adam_avx2(const AdamConstants& c, const AdamPartition& p) { adam_simd<Avx2>(c, p); }

GradStats stats_avx2(const void* grad, DType type, int64_t n) {
  // Four vectors per iteration, each with its own accumulators, so the adds do not wait on one chain.
  constexpr int U = 4;
  const int64_t vec_end = n - n % 8;
  __m256d lo[U], hi[U];
  __m256 amax[U];
  for (int u = 0; u < U; ++u) lo[u] = hi[u] = _mm256_setzero_pd(), amax[u] = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  auto add = [&](int u, int64_t i) {
    const __m256 g = load(grad, type, i);
    const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(g)), b = _mm256_cvtps_pd(_mm256_extractf128_ps(g, 1));
    lo[u] = _mm256_fmadd_pd(a, a, lo[u]);
    hi[u] = _mm256_fmadd_pd(b, b, hi[u]);
    amax[u] = _mm256_max_ps(amax[u], _mm256_and_ps(g, abs_mask));
  };
  int64_t i = 0;
  for (; i + U * 8 <= vec_end; i += U * 8) {
    for (int u = 0; u < U; ++u) add(u, i + u * 8);
  }
  for (; i < vec_end; i += 8) add(0, i);
  for (int u = 1; u < U; ++u) {
    lo[0] = _mm256_add_pd(lo[0], lo[u]), hi[0] = _mm256_add_pd(hi[0], hi[u]);
    amax[0] = _mm256_max_ps(amax[0], amax[u]);
  }
  alignas(32) double s[4];
  _mm256_store_pd(s, _mm256_add_pd(lo[0], hi[0]));
  alignas(32) float m[8];
  _mm256_store_ps(m, amax[0]);
  GradStats out{(s[0] + s[1]) + (s[2] + s[3]), 0.0f};
  for (float x : m) out.amax = x > out.amax ? x : out.amax;
  return combine(out, stats_scalar(grad, type, vec_end, n));
}

}  // namespace zeal::cpu::detail
