// The floor kernels over a vector type V (floor_avx2.cpp, floor_avx512.cpp): V provides kWidth,
// load, store, stream (non-temporal store), add. Internal to the floor.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "benchmarks/floor.h"

namespace zeal_bench::detail {

template <class V>
void floor_range(FloorKind k, float* w, const float* g, float* m, float* v, int64_t n) {
  constexpr int64_t W = V::kWidth;
  int64_t i = 0;
  switch (k) {
    case FloorKind::kPlain:
      for (; i + W <= n; i += W) {
        const auto x = V::load(g + i);
        V::store(m + i, V::add(V::load(m + i), x));
        V::store(v + i, V::add(V::load(v + i), x));
        V::store(w + i, V::add(V::load(w + i), x));
      }
      break;
    case FloorKind::kNonTemporal:
      for (; i + W <= n; i += W) {
        const auto x = V::load(g + i);
        V::stream(m + i, V::add(V::load(m + i), x));
        V::stream(v + i, V::add(V::load(v + i), x));
        V::stream(w + i, V::add(V::load(w + i), x));
      }
      _mm_sfence();
      break;
    case FloorKind::kUnrolled:
      for (; i + 4 * W <= n; i += 4 * W) {
        const auto x0 = V::load(g + i), x1 = V::load(g + i + W), x2 = V::load(g + i + 2 * W), x3 = V::load(g + i + 3 * W);
        for (float* s : {m, v, w}) {
          const auto a0 = V::load(s + i), a1 = V::load(s + i + W), a2 = V::load(s + i + 2 * W), a3 = V::load(s + i + 3 * W);
          V::store(s + i, V::add(a0, x0));
          V::store(s + i + W, V::add(a1, x1));
          V::store(s + i + 2 * W, V::add(a2, x2));
          V::store(s + i + 3 * W, V::add(a3, x3));
        }
      }
      break;
    case FloorKind::kPrefetched: {
      constexpr int64_t ahead = 1024;  // elements: 4 KiB ahead on each stream
      for (; i + W <= n; i += W) {
        if (i % 16 == 0 && i + ahead < n) {
          _mm_prefetch(reinterpret_cast<const char*>(g + i + ahead), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(m + i + ahead), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(v + i + ahead), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(w + i + ahead), _MM_HINT_T0);
        }
        const auto x = V::load(g + i);
        V::store(m + i, V::add(V::load(m + i), x));
        V::store(v + i, V::add(V::load(v + i), x));
        V::store(w + i, V::add(V::load(w + i), x));
      }
      break;
    }
  }
  for (; i < n; ++i) {
    m[i] += g[i];
    v[i] += g[i];
    w[i] += g[i];
  }
}

}  // namespace zeal_bench::detail
