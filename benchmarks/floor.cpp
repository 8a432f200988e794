// Dispatch and threads of the floor kernels (floor.h).
#include "benchmarks/floor.h"

#include <algorithm>
#include <thread>

#include "kernels/cpu/adam.h"

namespace zeal_bench {
namespace detail {
void floor_avx2(FloorKind k, float* w, const float* g, float* m, float* v, int64_t n);
void floor_avx512(FloorKind k, float* w, const float* g, float* m, float* v, int64_t n);

void floor_scalar(float* w, const float* g, float* m, float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    m[i] += g[i];
    v[i] += g[i];
    w[i] += g[i];
  }
}
}  // namespace detail

std::vector<FloorKind> floor_kinds() {
  return {FloorKind::kPlain, FloorKind::kNonTemporal, FloorKind::kUnrolled, FloorKind::kPrefetched};
}

std::string floor_name(FloorKind k) {
  switch (k) {
    case FloorKind::kPlain: return "plain";
    case FloorKind::kNonTemporal: return "non-temporal stores";
    case FloorKind::kUnrolled: return "unrolled x4";
    case FloorKind::kPrefetched: return "prefetched";
  }
  return "?";
}

std::string floor_isa() {
  using zeal::cpu::Simd;
  if (zeal::cpu::simd_supported(Simd::kAvx512)) return "avx512";
  if (zeal::cpu::simd_supported(Simd::kAvx2)) return "avx2";
  return "scalar";
}

void floor_pass(FloorKind k, float* w, const float* g, float* m, float* v, int64_t n, int threads) {
  static const std::string isa = floor_isa();
  auto run = [&](int64_t b, int64_t e) {
    if (b >= e) return;
    if (isa == "avx512") detail::floor_avx512(k, w + b, g + b, m + b, v + b, e - b);
    else if (isa == "avx2") detail::floor_avx2(k, w + b, g + b, m + b, v + b, e - b);
    else detail::floor_scalar(w + b, g + b, m + b, v + b, e - b);
  };
  // Chunks of whole 64-element blocks (aligned loads stay aligned), as zeal's kernels split.
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(threads, (n + 63) / 64));
  const int64_t per = ((n + chunks - 1) / chunks + 63) / 64 * 64;
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < chunks; ++t) workers.emplace_back(run, std::min(n, t * per), std::min(n, (t + 1) * per));
  run(0, std::min(n, per));
  for (auto& x : workers) x.join();
}

}  // namespace zeal_bench
