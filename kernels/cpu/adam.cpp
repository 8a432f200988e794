// Dispatch, per-step constants, the scalar reference path and the reference conversions.
#include "kernels/cpu/adam.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/adam_kernel.h"

namespace zeal::cpu {
namespace {

uint32_t bits_of(float f) { return std::bit_cast<uint32_t>(f); }
float float_of(uint32_t u) { return std::bit_cast<float>(u); }

struct Scalar {
  float x;
  static Scalar splat(float f) { return {f}; }
  static Scalar sub(Scalar a, Scalar b) { return {a.x - b.x}; }
  static Scalar mul(Scalar a, Scalar b) { return {a.x * b.x}; }
  static Scalar div(Scalar a, Scalar b) { return {a.x / b.x}; }
  static Scalar fma(Scalar a, Scalar b, Scalar c) { return {std::fma(a.x, b.x, c.x)}; }
  static Scalar sqrt(Scalar a) { return {std::sqrt(a.x)}; }
};

float load_grad(const AdamPartition& p, int64_t i) {
  switch (p.grad_type) {
    case DType::kBf16: return bf16_to_float(static_cast<const uint16_t*>(p.grad)[i]);
    case DType::kFp16: return half_to_float(static_cast<const uint16_t*>(p.grad)[i]);
    default: return static_cast<const float*>(p.grad)[i];
  }
}

}  // namespace

uint16_t float_to_bf16(float f) {
  const uint32_t u = bits_of(f);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);  // keep the sign, stay a quiet NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float bf16_to_float(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

uint16_t float_to_half(float f) {
  uint32_t x = bits_of(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return static_cast<uint16_t>(sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to ≥ 65520: infinity
  if (x < 0x38800000u) {
    // Below 2^-14 the half is subnormal: adding 0.5 lines the half's last bit up with the float's
    // last bit, and the float addition rounds to nearest even.
    const float t = float_of(x) + 0.5f;
    return static_cast<uint16_t>(sign | (bits_of(t) - 0x3f000000u));
  }
  const uint32_t odd = (x >> 13) & 1u;
  x += 0xc8000fffu + odd;  // re-bias the exponent (127 → 15) and round to nearest even
  return static_cast<uint16_t>(sign | (x >> 13));
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant · 2^-24, exact
    return float_of(sign | bits_of(mag));
  }
  if (exp == 31) return float_of(sign | 0x7f800000u | (mant << 13));
  return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
}

namespace detail {

AdamConstants adam_constants(const AdamHyper& h) {
  const double bc1 = 1.0 - std::pow(static_cast<double>(h.beta1), static_cast<double>(h.step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(h.beta2), static_cast<double>(h.step));
  AdamConstants c{};
  c.beta1 = h.beta1;
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = h.beta2;
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.eps = h.eps;
  c.step_size = static_cast<float>(h.lr / bc1);
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.decay = h.decoupled ? static_cast<float>(1.0 - static_cast<double>(h.lr) * h.weight_decay) : 1.0f;
  c.l2 = h.decoupled ? 0.0f : h.weight_decay;
  c.grad_scale = h.grad_scale;
  return c;
}

void adam_scalar(const AdamConstants& c, const AdamPartition& p, int64_t begin) {
  for (int64_t i = begin; i < p.n; ++i) {
    Scalar w{p.master[i]}, m{p.m[i]}, v{p.v[i]};
    adam_lanes(c, w, m, v, Scalar{load_grad(p, i)});
    p.master[i] = w.x;
    p.m[i] = m.x;
    p.v[i] = v.x;
    if (p.copy) {
      static_cast<uint16_t*>(p.copy)[i] = p.copy_type == DType::kFp16 ? float_to_half(w.x) : float_to_bf16(w.x);
    }
  }
}

}  // namespace detail

bool simd_supported(Simd s) {
  __builtin_cpu_init();
  switch (s) {
    case Simd::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
    case Simd::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    default: return true;
  }
}

Simd best_simd() {
  static const Simd best = simd_supported(Simd::kAvx512) ? Simd::kAvx512
                            : simd_supported(Simd::kAvx2) ? Simd::kAvx2
                                                          : Simd::kScalar;
  return best;
}

const char* simd_name(Simd s) {
  switch (s) {
    case Simd::kAvx512: return "avx512";
    case Simd::kAvx2: return "avx2";
    default: return "scalar";
  }
}

AdamPartition slice(const AdamPartition& p, int64_t begin, int64_t end) {
  AdamPartition s = p;
  const size_t grad_bytes = p.grad_type == DType::kFp32 ? 4 : 2;
  s.master = p.master + begin, s.m = p.m + begin, s.v = p.v + begin;
  s.grad = static_cast<const char*>(p.grad) + begin * grad_bytes;
  if (p.copy) s.copy = static_cast<uint16_t*>(p.copy) + begin;
  s.n = end - begin;
  return s;
}

void adam_step(const AdamHyper& h, const AdamPartition& p, Simd simd, int threads) {
  if (!simd_supported(simd)) throw std::invalid_argument(std::string("this CPU lacks ") + simd_name(simd));
  if (p.copy && p.copy_type == DType::kFp32)
    throw std::invalid_argument("the compute copy must be bf16 or fp16 (the master is already fp32)");
  const detail::AdamConstants c = detail::adam_constants(h);
  auto run = [&c, simd](const AdamPartition& part) {
    switch (simd) {
      case Simd::kAvx512: detail::adam_avx512(c, part); break;
      case Simd::kAvx2: detail::adam_avx2(c, part); break;
      default: detail::adam_scalar(c, part, 0);
    }
  };
  // Chunks are multiples of 64 elements (a cache line of every buffer), so threads never share one.
  constexpr int64_t kAlign = 64;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(threads, (p.n + kAlign - 1) / kAlign));
  if (chunks == 1) return run(p);
  // Each chunk holds ⌈n / chunks⌉ elements rounded up to kAlign, so the chunks cover all n.
  const int64_t per = ((p.n + chunks - 1) / chunks + kAlign - 1) / kAlign * kAlign;
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < chunks; ++t) {
    const int64_t begin = std::min(p.n, t * per), end = std::min(p.n, (t + 1) * per);
    if (begin < end) workers.emplace_back(run, slice(p, begin, end));
  }
  run(slice(p, 0, std::min(p.n, per)));
  for (auto& w : workers) w.join();
}

}  // namespace zeal::cpu
