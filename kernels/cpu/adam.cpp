// Dispatch, per-step constants, the scalar reference path and the reference conversions.
#include "kernels/cpu/adam.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
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
  const double bc1 = h.bias_correction ? 1.0 - std::pow(h.beta1, static_cast<double>(h.step)) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(h.beta2, static_cast<double>(h.step)) : 1.0;
  AdamConstants c{};
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.eps = static_cast<float>(h.eps);
  c.step_size = static_cast<float>(h.lr / bc1);
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.decay = h.decoupled ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  c.l2 = h.decoupled ? 0.0f : static_cast<float>(h.weight_decay);
  c.grad_scale = static_cast<float>(h.grad_scale);
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
      if (p.copy_type == DType::kFp32) static_cast<float*>(p.copy)[i] = w.x;
      else static_cast<uint16_t*>(p.copy)[i] = p.copy_type == DType::kFp16 ? float_to_half(w.x) : float_to_bf16(w.x);
    }
  }
}

GradStats stats_scalar(const void* grad, DType type, int64_t begin, int64_t n) {
  // Four accumulators, so the sum order matches no SIMD path but the loop pipelines.
  double acc[4] = {0, 0, 0, 0};
  float amax = 0.0f;
  int64_t i = begin;
  for (; i < n; ++i) {
    float g;
    switch (type) {
      case DType::kBf16: g = bf16_to_float(static_cast<const uint16_t*>(grad)[i]); break;
      case DType::kFp16: g = half_to_float(static_cast<const uint16_t*>(grad)[i]); break;
      default: g = static_cast<const float*>(grad)[i];
    }
    const double d = g;
    acc[i & 3] += d * d;
    const float a = std::fabs(g);
    amax = a > amax ? a : amax;
  }
  return {(acc[0] + acc[1]) + (acc[2] + acc[3]), amax};
}

}  // namespace detail

namespace {

// Splits [0, n) into at most `threads` chunks that are multiples of 64 elements (a cache line of
// every buffer, so threads never share one) and runs fn(begin, end) on each, the first on the
// calling thread.
template <class Fn>
void parallel_chunks(int64_t n, int threads, Fn&& fn) {
  constexpr int64_t kAlign = 64;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(threads, (n + kAlign - 1) / kAlign));
  if (chunks == 1) return fn(0, int64_t{0}, n);
  // Each chunk holds ⌈n / chunks⌉ elements rounded up to kAlign, so the chunks cover all n.
  const int64_t per = ((n + chunks - 1) / chunks + kAlign - 1) / kAlign * kAlign;
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < chunks; ++t) {
    const int64_t begin = std::min(n, t * per), end = std::min(n, (t + 1) * per);
    if (begin < end) workers.emplace_back(fn, static_cast<int>(t), begin, end);
  }
  fn(0, int64_t{0}, std::min(n, per));
  for (auto& w : workers) w.join();
}

}  // namespace

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

namespace {

// ZEAL_CPU_ISA, checked: the path it names, or best_simd() when it is unset or empty.
Simd simd_from_environment() {
  const char* v = std::getenv("ZEAL_CPU_ISA");
  if (!v || !*v) return best_simd();
  const std::string word(v);
  for (Simd s : {Simd::kScalar, Simd::kAvx2, Simd::kAvx512}) {
    if (word != simd_name(s)) continue;
    if (!simd_supported(s)) {
      throw std::invalid_argument("ZEAL_CPU_ISA=" + word + ": this CPU lacks it (its widest path is " +
                                  simd_name(best_simd()) + "; choose scalar, avx2 or avx512 up to that)");
    }
    return s;
  }
  throw std::invalid_argument("ZEAL_CPU_ISA=" + word + ": expected scalar, avx2 or avx512");
}

}  // namespace

Simd active_simd() { return simd_from_environment(); }

std::string describe_active_simd() {
  const char* v = std::getenv("ZEAL_CPU_ISA");
  try {
    const Simd s = active_simd();
    if (!v || !*v) return std::string(simd_name(s)) + " (the widest this CPU supports; ZEAL_CPU_ISA unset)";
    return std::string(simd_name(s)) + " (ZEAL_CPU_ISA; this CPU supports up to " + simd_name(best_simd()) + ")";
  } catch (const std::invalid_argument& e) {
    return std::string("invalid: ") + e.what();
  }
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
  if (p.copy) s.copy = static_cast<char*>(p.copy) + begin * (p.copy_type == DType::kFp32 ? 4 : 2);
  s.n = end - begin;
  return s;
}

void adam_step(const AdamHyper& h, const AdamPartition& p, Simd simd, int threads) {
  if (!simd_supported(simd)) throw std::invalid_argument(std::string("this CPU lacks ") + simd_name(simd));
  const detail::AdamConstants c = detail::adam_constants(h);
  auto run = [&c, simd](const AdamPartition& part) {
    switch (simd) {
      case Simd::kAvx512: detail::adam_avx512(c, part); break;
      case Simd::kAvx2: detail::adam_avx2(c, part); break;
      default: detail::adam_scalar(c, part, 0);
    }
  };
  parallel_chunks(p.n, threads, [&](int, int64_t begin, int64_t end) { run(slice(p, begin, end)); });
}

GradStats grad_stats(const void* grad, DType type, int64_t n, Simd simd, int threads) {
  if (!simd_supported(simd)) throw std::invalid_argument(std::string("this CPU lacks ") + simd_name(simd));
  if (n <= 0) return {};
  const size_t bytes = type == DType::kFp32 ? 4 : 2;
  std::vector<GradStats> parts(static_cast<size_t>(std::max(1, threads)));
  parallel_chunks(n, threads, [&](int t, int64_t begin, int64_t end) {
    const void* g = static_cast<const char*>(grad) + begin * bytes;
    switch (simd) {
      case Simd::kAvx512: parts[t] = detail::stats_avx512(g, type, end - begin); break;
      case Simd::kAvx2: parts[t] = detail::stats_avx2(g, type, end - begin); break;
      default: parts[t] = detail::stats_scalar(g, type, 0, end - begin);
    }
  });
  GradStats out;
  for (const auto& p : parts) out = combine(out, p);
  return out;
}

}  // namespace zeal::cpu
