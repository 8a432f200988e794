// The CPU fused Adam: the scalar path against a float64 computation, every SIMD path against the
// scalar path bit for bit, and the bf16/fp16 conversions against independent nearest-value searches.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cpu/adam.h"
#include "tests/optim_error_bound.h"

using namespace zeal::cpu;

namespace {

float f32(uint32_t u) { return std::bit_cast<float>(u); }
uint32_t u32(float f) { return std::bit_cast<uint32_t>(f); }

// Independent decodings (by formula, not by bit tricks).
double half_value(uint16_t h) {
  const int sign = (h >> 15) ? -1 : 1, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (exp == 0) return sign * std::ldexp(mant, -24);
  if (exp == 31) return mant ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  return sign * std::ldexp(1024 + mant, exp - 25);
}
double bf16_value(uint16_t b) { return static_cast<double>(f32(static_cast<uint32_t>(b) << 16)); }

// The nearest representable value among finite candidates `lo` < `hi` (as bit patterns with their
// values), ties to the even pattern.
uint16_t nearest(double x, uint16_t lo, double vlo, uint16_t hi, double vhi) {
  const double dlo = x - vlo, dhi = vhi - x;
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1) ? hi : lo;
}

// Round-to-nearest-even into fp16, by search over the ordered positive half values.
uint16_t reference_half(float f) {
  if (std::isnan(f)) return 0x7e00;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7c00;  // halfway between 65504 and the next step rounds up
  uint16_t lo = 0;
  for (uint16_t step = 0x4000; step; step >>= 1)
    if (lo + step <= 0x7bff && half_value(lo + step) <= a) lo += step;
  if (half_value(lo) == a || lo == 0x7bff) return sign | lo;
  return sign | nearest(a, lo, half_value(lo), lo + 1, half_value(lo + 1));
}

uint16_t reference_bf16(float f) {
  if (std::isnan(f)) return static_cast<uint16_t>((u32(f) >> 16) | 0x40);
  const uint16_t lo = static_cast<uint16_t>(u32(f) >> 16);  // truncation: toward zero
  const double a = f, vlo = bf16_value(lo);
  if (a == vlo) return lo;
  const uint16_t hi = lo + 1;  // one step away from zero
  // Past the largest finite value the next step is infinity, whose distance counts from 2^128.
  const double vhi = (hi & 0x7fff) == 0x7f80 ? std::copysign(std::ldexp(1.0, 128), a) : bf16_value(hi);
  return std::fabs(a - vlo) < std::fabs(vhi - a) ? lo : std::fabs(vhi - a) < std::fabs(a - vlo) ? hi : ((lo & 1) ? hi : lo);
}

struct Data {
  std::vector<float> master, m, v, grad32;
  std::vector<uint16_t> grad16, copy;
};

Data adam_test_data(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::uniform_real_distribution<float> pos(0.0f, 1e-2f);
  Data x;
  x.master.resize(n), x.m.resize(n), x.v.resize(n), x.grad32.resize(n), x.grad16.resize(n), x.copy.assign(n, 0xdead);
  for (int64_t i = 0; i < n; ++i) {
    x.master[i] = d(rng);
    x.m[i] = 1e-2f * d(rng);
    x.v[i] = pos(rng) * pos(rng);
    x.grad32[i] = 1024.0f * d(rng);  // a loss-scaled gradient
  }
  return x;
}

AdamPartition partition(Data& x, DType grad_type, DType copy_type, bool with_copy) {
  AdamPartition p;
  p.master = x.master.data(), p.m = x.m.data(), p.v = x.v.data(), p.n = static_cast<int64_t>(x.master.size());
  p.grad_type = grad_type;
  if (grad_type == DType::kFp32) {
    p.grad = x.grad32.data();
  } else {
    for (size_t i = 0; i < x.grad32.size(); ++i)
      x.grad16[i] = grad_type == DType::kBf16 ? reference_bf16(x.grad32[i]) : reference_half(x.grad32[i] / 64.0f);
    p.grad = x.grad16.data();
  }
  p.copy = with_copy ? x.copy.data() : nullptr;
  p.copy_type = copy_type;
  return p;
}

AdamHyper hyper(bool decoupled, int64_t step) {
  AdamHyper h;
  h.lr = 3e-3, h.beta1 = 0.9, h.beta2 = 0.95, h.eps = 1e-8, h.weight_decay = 0.1;
  h.decoupled = decoupled, h.step = step, h.grad_scale = 1.0 / 1024.0;
  return h;
}

const int64_t kLengths[] = {1, 7, 8, 15, 16, 17, 31, 33, 1000, 10007};

}  // namespace

TEST(CpuConversions, HalfToFloatDecodesEveryHalf) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const double want = half_value(static_cast<uint16_t>(h));
    const float got = half_to_float(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << h;
    } else {
      ASSERT_EQ(static_cast<double>(got), want) << h;
    }
  }
}

TEST(CpuConversions, FloatToHalfAndBf16RoundToNearestEven) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  std::vector<float> samples = {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, 1e-8f, 2.98023224e-8f, 6.1e-5f,
                                INFINITY, -INFINITY, 1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048};
  for (int i = 0; i < 200000; ++i) {
    float f = f32(bits(rng));
    if (i % 2) f = std::ldexp(static_cast<float>(bits(rng) % 100000) / 1000.0f, static_cast<int>(bits(rng) % 40) - 30);
    samples.push_back(f);
  }
  for (float f : samples) {
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_half(f), reference_half(f)) << f;
    ASSERT_EQ(float_to_bf16(f), reference_bf16(f)) << f;
  }
  EXPECT_TRUE(std::isnan(half_to_float(float_to_half(NAN))));
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(-NAN))));
}

// The scalar path (every other path is its bit-for-bit equal, below) against the float64 formula,
// element by element, within the float32 forward error bound of one step (optim_error_bound.h):
// master, m and v. The gradient's scale is 1/1024, exact in binary.
TEST(CpuAdam, ScalarPathMatchesFloat64) {
  for (bool decoupled : {true, false}) {
    for (DType g : {DType::kFp32, DType::kBf16, DType::kFp16}) {
      for (int64_t step : {1, 10}) {
        Data x = adam_test_data(10007, 11);
        const Data before = x;
        AdamPartition p = partition(x, g, DType::kBf16, false);
        const AdamHyper h = hyper(decoupled, step);
        adam_step(h, p, Simd::kScalar);
        const zeal_test::AdamFormula f{h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, decoupled};
        double worst = 0;
        for (int64_t i = 0; i < p.n; ++i) {
          const double grad = g == DType::kFp32 ? before.grad32[i]
                              : g == DType::kBf16 ? bf16_value(x.grad16[i]) : half_value(x.grad16[i]);
          zeal_test::AdamElement e{.w = before.master[i], .m = before.m[i], .v = before.v[i]};
          zeal_test::adam_step_bound(e, f, step, grad * h.grad_scale);
          const double got[3] = {x.master[i], x.m[i], x.v[i]}, ref[3] = {e.w, e.m, e.v},
                       bound[3] = {e.err_w, e.err_m, e.err_v};
          for (int k = 0; k < 3; ++k) {
            ASSERT_LE(std::fabs(got[k] - ref[k]), bound[k]) << "element " << i << " quantity " << k;
            worst = std::max(worst, std::fabs(got[k] - ref[k]) / bound[k]);
          }
        }
        std::printf("[ metric ] decoupled %d grad %d step %lld: largest error / bound %.3g\n", decoupled,
                    static_cast<int>(g), static_cast<long long>(step), worst);
      }
    }
  }
}

TEST(CpuAdam, SimdPathsMatchScalarBitForBit) {
  int tested = 0;
  for (Simd simd : {Simd::kAvx2, Simd::kAvx512}) {
    if (!simd_supported(simd)) {
      std::printf("[ SKIPPED  ] %s: this CPU lacks it\n", simd_name(simd));
      continue;
    }
    ++tested;
    for (int64_t n : kLengths) {
      for (DType g : {DType::kFp32, DType::kBf16, DType::kFp16}) {
        for (DType c : {DType::kBf16, DType::kFp16}) {
          for (bool decoupled : {true, false}) {
            SCOPED_TRACE(testing::Message() << simd_name(simd) << " n=" << n << " grad " << static_cast<int>(g)
                                            << " copy " << static_cast<int>(c) << " decoupled " << decoupled);
            Data a = adam_test_data(n, static_cast<uint32_t>(n) * 31 + static_cast<uint32_t>(g));
            Data b = a;
            adam_step(hyper(decoupled, 3), partition(a, g, c, true), Simd::kScalar);
            adam_step(hyper(decoupled, 3), partition(b, g, c, true), simd);
            ASSERT_EQ(0, std::memcmp(a.master.data(), b.master.data(), n * 4));
            ASSERT_EQ(0, std::memcmp(a.m.data(), b.m.data(), n * 4));
            ASSERT_EQ(0, std::memcmp(a.v.data(), b.v.data(), n * 4));
            ASSERT_EQ(0, std::memcmp(a.copy.data(), b.copy.data(), n * 2));
          }
        }
      }
    }
  }
  if (tested == 0) GTEST_SKIP() << "this CPU has neither AVX2+FMA+F16C nor AVX-512";
}

TEST(CpuAdam, CopyIsTheRoundedNewMasterOnEveryPath) {
  for (Simd simd : {Simd::kScalar, Simd::kAvx2, Simd::kAvx512}) {
    if (!simd_supported(simd)) continue;
    for (DType c : {DType::kBf16, DType::kFp16}) {
      Data x = adam_test_data(1003, 5);
      adam_step(hyper(true, 1), partition(x, DType::kFp32, c, true), simd);
      for (size_t i = 0; i < x.master.size(); ++i) {
        const uint16_t want = c == DType::kBf16 ? reference_bf16(x.master[i]) : reference_half(x.master[i]);
        ASSERT_EQ(x.copy[i], want) << simd_name(simd) << " element " << i;
      }
    }
  }
}

TEST(CpuAdam, NonFiniteGradientPropagatesInEveryPosition) {
  for (Simd simd : {Simd::kScalar, Simd::kAvx2, Simd::kAvx512}) {
    if (!simd_supported(simd)) continue;
    for (int64_t pos : {0, 8, 16, 1002}) {
      Data x = adam_test_data(1003, 9);
      x.grad32[pos] = NAN;
      adam_step(hyper(true, 1), partition(x, DType::kFp32, DType::kBf16, false), simd);
      EXPECT_TRUE(std::isnan(x.master[pos])) << simd_name(simd) << " " << pos;
      EXPECT_FALSE(std::isnan(x.master[(pos + 1) % 1003])) << simd_name(simd) << " " << pos;
    }
  }
}

TEST(CpuAdam, ThreadCountDoesNotChangeTheResult) {
  for (int threads : {2, 3, 8}) {
    for (int64_t n : {int64_t{100}, int64_t{193}, int64_t{10007}, int64_t{100003}}) {
      Data a = adam_test_data(n, 21), b = a;
      adam_step(hyper(true, 2), partition(a, DType::kBf16, DType::kBf16, true), best_simd(), 1);
      adam_step(hyper(true, 2), partition(b, DType::kBf16, DType::kBf16, true), best_simd(), threads);
      ASSERT_EQ(0, std::memcmp(a.master.data(), b.master.data(), n * 4)) << threads << " threads, n=" << n;
      ASSERT_EQ(0, std::memcmp(a.v.data(), b.v.data(), n * 4)) << threads << " threads, n=" << n;
      ASSERT_EQ(0, std::memcmp(a.copy.data(), b.copy.data(), n * 2)) << threads << " threads, n=" << n;
    }
  }
}

TEST(CpuAdam, Fp32CopyIsTheNewMasterOnEveryPath) {
  for (Simd simd : {Simd::kScalar, Simd::kAvx2, Simd::kAvx512}) {
    if (!simd_supported(simd)) continue;
    Data x = adam_test_data(1003, 6);
    std::vector<float> copy(x.master.size(), -1.0f);
    AdamPartition p = partition(x, DType::kFp32, DType::kBf16, false);
    p.copy = copy.data();
    p.copy_type = DType::kFp32;
    adam_step(hyper(true, 1), p, simd, 3);
    ASSERT_EQ(0, std::memcmp(copy.data(), x.master.data(), copy.size() * 4)) << simd_name(simd);
  }
}

// Gradient statistics: the sum of squares against a float64 sum (long double accumulation of the
// decoded values), the maximum magnitude exactly, for every path, dtype and awkward length.
TEST(GradStats, EveryPathMatchesFloat64OnOddLengths) {
  for (Simd simd : {Simd::kScalar, Simd::kAvx2, Simd::kAvx512}) {
    if (!simd_supported(simd)) continue;
    for (int64_t n : kLengths) {
      for (DType g : {DType::kFp32, DType::kBf16, DType::kFp16}) {
        for (int threads : {1, 3}) {
          SCOPED_TRACE(testing::Message() << simd_name(simd) << " n=" << n << " dtype " << static_cast<int>(g)
                                          << " threads " << threads);
          Data x = adam_test_data(n, static_cast<uint32_t>(n) + 77);
          const void* ptr = partition(x, g, DType::kBf16, false).grad;
          long double sum = 0;
          double amax = 0;
          for (int64_t i = 0; i < n; ++i) {
            const double v = g == DType::kFp32 ? x.grad32[i] : g == DType::kBf16 ? bf16_value(x.grad16[i])
                                                                                   : half_value(x.grad16[i]);
            sum += static_cast<long double>(v) * v;
            amax = std::max(amax, std::fabs(v));
          }
          const GradStats s = grad_stats(ptr, g, n, simd, threads);
          EXPECT_TRUE(s.finite());
          // A float's square is exact in float64 (24 + 24 significant bits), so the only error is
          // the float64 sum of n positive terms, in any order: at most (n − 1)·2⁻⁵³ of it.
          EXPECT_LE(std::fabs(s.sumsq - static_cast<double>(sum)),
                    static_cast<double>(n - 1) * std::ldexp(1.0, -53) * static_cast<double>(sum));
          EXPECT_EQ(static_cast<double>(s.amax), amax);
        }
      }
    }
  }
}

TEST(GradStats, InfAndNanAreFoundInEveryPosition) {
  constexpr int64_t n = 67;  // a 16-lane body, an 8-lane body and a tail
  for (Simd simd : {Simd::kScalar, Simd::kAvx2, Simd::kAvx512}) {
    if (!simd_supported(simd)) continue;
    for (DType g : {DType::kFp32, DType::kBf16, DType::kFp16}) {
      for (float bad : {INFINITY, -INFINITY, NAN}) {
        for (int64_t pos = 0; pos < n; ++pos) {
          Data x = adam_test_data(n, 3);
          const void* ptr = partition(x, g, DType::kBf16, false).grad;
          if (g == DType::kFp32) x.grad32[pos] = bad;
          else x.grad16[pos] = g == DType::kBf16 ? reference_bf16(bad) : reference_half(bad);
          ASSERT_FALSE(grad_stats(ptr, g, n, simd, 1).finite())
              << simd_name(simd) << " dtype " << static_cast<int>(g) << " value " << bad << " at " << pos;
        }
      }
    }
  }
  // Large finite values are not an overflow: their squares fit in float64.
  std::vector<float> big(33, 3.0e38f);
  EXPECT_TRUE(grad_stats(big.data(), DType::kFp32, 33).finite());
}
