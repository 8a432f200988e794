// The floor kernels with 8-lane AVX2 vectors (compiled with -mavx2; called only where cpuid has it).
#include "benchmarks/floor_lanes.h"

namespace zeal_bench::detail {
namespace {
struct V8 {
  static constexpr int64_t kWidth = 8;
  static __m256 load(const float* p) { return _mm256_load_ps(p); }
  static void store(float* p, __m256 x) { _mm256_store_ps(p, x); }
  static void stream(float* p, __m256 x) { _mm256_stream_ps(p, x); }
  static __m256 add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
};
}  // namespace

void floor_avx2(FloorKind k, float* w, const float* g, float* m, float* v, int64_t n) {
  floor_range<V8>(k, w, g, m, v, n);
}

}  // namespace zeal_bench::detail
