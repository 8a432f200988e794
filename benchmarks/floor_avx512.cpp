// The floor kernels with 16-lane AVX-512 vectors (compiled with -mavx512f; called only where cpuid
// has it).
#include "benchmarks/floor_lanes.h"

namespace zeal_bench::detail {
namespace {
struct V16 {
  static constexpr int64_t kWidth = 16;
  static __m512 load(const float* p) { return _mm512_load_ps(p); }
  static void store(float* p, __m512 x) { _mm512_store_ps(p, x); }
  static void stream(float* p, __m512 x) { _mm512_stream_ps(p, x); }
  static __m512 add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
};
}  // namespace

void floor_avx512(FloorKind k, float* w, const float* g, float* m, float* v, int64_t n) {
  floor_range<V16>(k, w, g, m, v, n);
}

}  // namespace zeal_bench::detail
