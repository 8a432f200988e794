// Fused Adam/AdamW over one flat fp32 partition on the CPU: one pass reads the fp32 master
// weights, m, v and the gradient (fp32, bf16 or fp16), applies the loss scale's inverse, weight
// decay and bias correction, and writes master, m, v and, in the same pass, an optional bf16/fp16
// compute copy of the new weights. No LibTorch headers: raw pointers and sizes.
//
// Memory traffic per element: 12 bytes read + 12 written for master/m/v, plus the gradient read
// (4 or 2 bytes) and the copy written (2 bytes) when present.
//
// Paths: scalar (the reference, always present), AVX2+FMA+F16C and AVX-512, chosen at run time.
// All paths evaluate the same expression with the same roundings (fused multiply-adds in the
// same places, correctly rounded sqrt and division), so they agree bit for bit.
#pragma once

#include <cstdint>
#include <string>

namespace zeal::cpu {

enum class DType { kFp32, kBf16, kFp16 };
enum class Simd { kScalar, kAvx2, kAvx512 };

// Hyperparameters as the user gives them (double, like torch::optim's options). The kernel works
// in float: every constant it needs (β, 1 − β, lr / (1 − β1ᵗ), 1 − lr·wd, …) is computed here in
// double and rounded to float once, so a β2 of 0.999 gives 1 − β2 = 0.001 to float precision, not
// the 1.3e-5-off 1 − 0.999f.
struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled = true;    // AdamW: p -= lr·wd·p; Adam: g += wd·p
  bool bias_correction = true;  // divide the moments by 1 − βᵗ
  int64_t step = 1;         // 1 for the first step (bias correction)
  double grad_scale = 1.0;  // gradients are multiplied by this (1 / loss scale × clip factor)
};

struct AdamPartition {
  float* master = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  const void* grad = nullptr;
  DType grad_type = DType::kFp32;
  void* copy = nullptr;  // optional compute copy of the updated master (fp32, bf16 or fp16), or null
  DType copy_type = DType::kBf16;
  int64_t n = 0;
};

// The widest path this CPU supports (AVX-512 needs avx512f+bw+vl; AVX2 needs avx2+fma+f16c).
Simd best_simd();
bool simd_supported(Simd s);
const char* simd_name(Simd s);
// The path the engine's kernels take: ZEAL_CPU_ISA (scalar, avx2 or avx512) when it is set, else
// best_simd(). Read at every dispatch (a getenv and a compare, nothing next to a kernel's pass);
// throws std::invalid_argument naming the variable when it holds another word or a path this CPU
// lacks. Every path gives the same bits (see above), so
// forcing one changes speed only; it exists to run a narrower path on a wider CPU.
Simd active_simd();
// The text of the choice for reports: "avx512 (widest this CPU supports)" or
// "avx2 (ZEAL_CPU_ISA; this CPU supports avx512)". Never throws: an invalid ZEAL_CPU_ISA is
// described instead.
std::string describe_active_simd();

// One Adam step over the partition with the given path (which must be supported), split over
// `threads` threads in contiguous chunks (results do not depend on the thread count).
void adam_step(const AdamHyper& h, const AdamPartition& p, Simd simd, int threads = 1);
inline void adam_step(const AdamHyper& h, const AdamPartition& p) { adam_step(h, p, active_simd()); }

// Elements [begin, end) of a partition, as a partition of its own.
AdamPartition slice(const AdamPartition& p, int64_t begin, int64_t end);

// The gradient statistics the step needs before it can run: the sum of squares (accumulated in
// float64: every float's square is exact there) and the largest magnitude. Any inf or nan makes
// sumsq non-finite, so `finite()` is the overflow check. One read pass, no write.
struct GradStats {
  double sumsq = 0.0;
  float amax = 0.0f;
  bool finite() const { return sumsq - sumsq == 0.0; }  // false for inf and nan
};  // amax means nothing when !finite()
inline GradStats combine(GradStats a, const GradStats& b) {
  a.sumsq += b.sumsq;
  a.amax = b.amax > a.amax ? b.amax : a.amax;
  return a;
}
// Over n elements of type `type` at `grad`, split over `threads` threads (partial sums combined
// in chunk order, so a given thread count always gives the same bits).
GradStats grad_stats(const void* grad, DType type, int64_t n, Simd simd, int threads = 1);
inline GradStats grad_stats(const void* grad, DType type, int64_t n) { return grad_stats(grad, type, n, active_simd()); }

// Conversions with round-to-nearest-even, the scalar reference for the SIMD paths.
uint16_t float_to_bf16(float f);
float bf16_to_float(uint16_t b);
uint16_t float_to_half(float f);
float half_to_float(uint16_t h);

}  // namespace zeal::cpu
