// The memory floor of an Adam step: kernels that move exactly Adam's bytes (read master, grad, m, v;
// write master, m, v: 28 bytes per fp32 parameter) with one add per stream, in several ways —
// plain vector loads and stores, non-temporal stores, 4× unrolled, software prefetch — with the
// widest vectors this CPU has, split over threads in 64-element-aligned chunks like zeal's kernels.
// The floor of a thread count is the fastest of them in each round: no program can do an Adam step
// in less time than its bytes take to move, so a contender faster than the floor means the floor
// is wrong, and the benchmark says so.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zeal_bench {

enum class FloorKind { kPlain, kNonTemporal, kUnrolled, kPrefetched };

std::vector<FloorKind> floor_kinds();
std::string floor_name(FloorKind k);
// The vector width the floor kernels use here ("avx512", "avx2" or "scalar").
std::string floor_isa();
// One pass: m += g, v += g, w += g over n elements. Buffers 64-byte aligned.
void floor_pass(FloorKind k, float* w, const float* g, float* m, float* v, int64_t n, int threads);

}  // namespace zeal_bench
