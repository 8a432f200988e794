// The CUDA multi-tensor kernels against the CPU scalar kernel (Adam: bit for bit, the same
// expression with the same roundings) and against float64 (sum of squares, unscale). Many
// tensors of awkward sizes, so launches split between tensors and inside one, and tensors that start
// 1 to 3 elements past an aligned address (segments of a flat buffer), so both the vector path and
// the one-element path run. Skips without a GPU (tests/test_device.h).
#include <gtest/gtest.h>

#include "tests/test_device.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cpu/adam.h"

#ifdef ZEAL_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/adam.h"
#include "kernels/cuda/loss_scale.h"
#endif

namespace {

#ifdef ZEAL_HAVE_CUDA
using zeal::cpu::DType;

// A device copy of `host`, starting `skew` elements past the allocation's (aligned) start.
template <class T>
struct Device {
  T* base = nullptr;
  T* p = nullptr;
  size_t n = 0;
  explicit Device(const std::vector<T>& host, size_t skew = 0) : n(host.size()) {
    EXPECT_EQ(cudaMalloc(&base, std::max<size_t>(1, n + skew) * sizeof(T)), cudaSuccess);
    p = base + skew;
    EXPECT_EQ(cudaMemcpy(p, host.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  Device(const Device&) = delete;
  ~Device() { cudaFree(base); }
  std::vector<T> get() const {
    std::vector<T> out(n);
    EXPECT_EQ(cudaMemcpy(out.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
};

// Sizes that cross the 32 Ki-element chunks and a launch's tensor limit (24 or 110); `big` adds one
// tensor of more chunks than a launch takes (320 or 2048), split between two launches.
std::vector<int64_t> test_sizes(bool big) {
  std::vector<int64_t> s = {1, 7, 255, 32768, 32769, 65537, 1000003};
  for (int i = 0; i < 120; ++i) s.push_back(97 * i + 3);
  if (big) s.push_back(2048 * 32768 + 5);
  return s;
}

// Buffer k of tensor t starts this many elements past an aligned address: most tensors aligned (the
// vector path throughout), some with every buffer 1 to 3 elements off alike (the vector path after a
// short head of each chunk), some with buffers off by different amounts (the one-element path).
size_t skew_of(size_t t, size_t k) {
  if (t % 5 == 4) return k % 3;
  return t % 3 == 2 ? 1 + t % 4 % 3 : 0;
}

struct Host {
  std::vector<float> master, m, v, g32, copy32;
  std::vector<uint16_t> g16, copy;
};

Host make(int64_t n, uint32_t seed, DType grad) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  Host h;
  h.master.resize(n), h.m.resize(n), h.v.resize(n), h.g32.resize(n), h.g16.resize(n), h.copy.assign(n, 0);
  h.copy32.assign(n, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    h.master[i] = d(rng), h.m[i] = 1e-2f * d(rng), h.v[i] = 1e-4f * std::fabs(d(rng));
    h.g32[i] = 1024.0f * d(rng);
    h.g16[i] = grad == DType::kBf16 ? zeal::cpu::float_to_bf16(h.g32[i]) : zeal::cpu::float_to_half(h.g32[i] / 64);
  }
  return h;
}
#endif

}  // namespace

// Every gradient type, Adam and AdamW, and every kind of compute copy (bf16, fp16, fp32, none).
TEST(CudaAdam, MultiTensorMatchesTheCpuKernelBitForBit) {
  ZEAL_NEED_CUDA();
#ifdef ZEAL_HAVE_CUDA
  zeal::cpu::AdamHyper hyper;
  hyper.lr = 3e-3, hyper.beta1 = 0.9, hyper.beta2 = 0.95, hyper.weight_decay = 0.1, hyper.step = 3;
  hyper.grad_scale = 1.0f / 1024.0f;
  struct Case {
    DType grad;
    bool decoupled;
    int copy;  // -1: none; else a DType
    bool big;
  };
  const int kNone = -1, kBf16 = static_cast<int>(DType::kBf16), kFp16 = static_cast<int>(DType::kFp16),
            kFp32 = static_cast<int>(DType::kFp32);
  for (const Case c : {Case{DType::kFp32, true, kBf16, true}, Case{DType::kFp32, false, kFp16, false},
                       Case{DType::kBf16, true, kBf16, false}, Case{DType::kBf16, false, kNone, false},
                       Case{DType::kFp16, true, kFp16, false}, Case{DType::kFp16, false, kFp32, false}}) {
    const DType grad = c.grad;
    const DType copy_type = c.copy == kNone ? DType::kBf16 : static_cast<DType>(c.copy);
    hyper.decoupled = c.decoupled;
    const auto sizes = test_sizes(c.big);
    std::vector<Host> host;
    std::vector<std::unique_ptr<Device<float>>> dev_f;
    std::vector<std::unique_ptr<Device<uint16_t>>> dev_h;
    std::vector<zeal::cuda::AdamTensor> tensors;
    for (size_t t = 0; t < sizes.size(); ++t) {
      host.push_back(make(sizes[t], static_cast<uint32_t>(t), grad));
      Host& h = host.back();
      size_t k = 0;
      for (auto* v : {&h.master, &h.m, &h.v, &h.g32, &h.copy32})
        dev_f.push_back(std::make_unique<Device<float>>(*v, skew_of(t, k++)));
      for (auto* v : {&h.g16, &h.copy}) dev_h.push_back(std::make_unique<Device<uint16_t>>(*v, skew_of(t, k++)));
      const size_t f = dev_f.size() - 5, q = dev_h.size() - 2;
      void* copy = c.copy == kNone ? nullptr
                   : c.copy == kFp32 ? static_cast<void*>(dev_f[f + 4]->p)
                                     : static_cast<void*>(dev_h[q + 1]->p);
      tensors.push_back({dev_f[f]->p, dev_f[f + 1]->p, dev_f[f + 2]->p,
                         grad == DType::kFp32 ? static_cast<const void*>(dev_f[f + 3]->p) : dev_h[q]->p, copy,
                         sizes[t]});
    }
    zeal::cuda::multi_tensor_adam(hyper, tensors, grad, copy_type, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (size_t t = 0; t < sizes.size(); ++t) {
      Host& h = host[t];
      zeal::cpu::AdamPartition p;
      p.master = h.master.data(), p.m = h.m.data(), p.v = h.v.data(), p.n = sizes[t];
      p.grad = grad == DType::kFp32 ? static_cast<const void*>(h.g32.data()) : h.g16.data();
      p.grad_type = grad, p.copy_type = copy_type;
      p.copy = c.copy == kNone ? nullptr : c.copy == kFp32 ? static_cast<void*>(h.copy32.data()) : h.copy.data();
      zeal::cpu::adam_step(hyper, p, zeal::cpu::Simd::kScalar);
      const size_t f = 5 * t, q = 2 * t;
      SCOPED_TRACE(testing::Message() << "tensor " << t << " of " << sizes[t] << " (skew " << skew_of(t, 0) << "), grad "
                                      << static_cast<int>(grad) << ", decoupled " << c.decoupled << ", copy " << c.copy);
      ASSERT_EQ(0, std::memcmp(dev_f[f]->get().data(), h.master.data(), sizes[t] * 4));
      ASSERT_EQ(0, std::memcmp(dev_f[f + 1]->get().data(), h.m.data(), sizes[t] * 4));
      ASSERT_EQ(0, std::memcmp(dev_f[f + 2]->get().data(), h.v.data(), sizes[t] * 4));
      ASSERT_EQ(0, std::memcmp(dev_f[f + 4]->get().data(), h.copy32.data(), sizes[t] * 4));
      ASSERT_EQ(0, std::memcmp(dev_h[q + 1]->get().data(), h.copy.data(), sizes[t] * 2));
    }
  }
#endif
}

TEST(CudaAdam, SumOfSquaresMatchesFloat64AndSeesInfAndNan) {
  ZEAL_NEED_CUDA();
#ifdef ZEAL_HAVE_CUDA
  const auto sizes = test_sizes(false);
  std::vector<std::vector<float>> host;
  std::vector<std::unique_ptr<Device<float>>> dev;
  std::vector<const void*> ptrs;
  long double ref = 0;
  for (size_t t = 0; t < sizes.size(); ++t) {
    host.push_back(make(sizes[t], 100 + static_cast<uint32_t>(t), DType::kBf16).g32);
    for (float x : host.back()) ref += static_cast<long double>(x) * x;
    dev.push_back(std::make_unique<Device<float>>(host.back()));
    ptrs.push_back(dev.back()->p);
  }
  Device<double> out(std::vector<double>(1, -1.0));
  Device<double> work(std::vector<double>(zeal::cuda::sumsq_workspace(sizes), 0.0));
  zeal::cuda::multi_tensor_sumsq(ptrs, sizes, DType::kFp32, out.p, work.p, nullptr);
  const double got = out.get()[0];
  // Squares of floats are exact in float64; n positive terms summed in any order land within
  // (n − 1)·2⁻⁵³ of the exact sum.
  double n = 0;
  for (auto s : sizes) n += static_cast<double>(s);
  EXPECT_LE(std::fabs(got - static_cast<double>(ref)), (n - 1) * std::ldexp(1.0, -53) * static_cast<double>(ref));
  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    const size_t t = sizes.size() / 2;
    std::vector<float> h = host[t];
    h.back() = bad;
    Device<float> d(h);
    std::vector<const void*> p = ptrs;
    p[t] = d.p;
    zeal::cuda::multi_tensor_sumsq(p, sizes, DType::kFp32, out.p, work.p, nullptr);
    EXPECT_FALSE(std::isfinite(out.get()[0])) << bad;
  }
#endif
}

TEST(CudaAdam, MultiTensorUnscaleMatchesFloat64) {
  ZEAL_NEED_CUDA();
#ifdef ZEAL_HAVE_CUDA
  const std::vector<int64_t> sizes = {3, 65537, 100, 1000};
  std::vector<std::vector<float>> host;
  std::vector<std::unique_ptr<Device<float>>> dev;
  std::vector<float*> ptrs;
  for (size_t t = 0; t < sizes.size(); ++t) {
    host.push_back(make(sizes[t], 7 + static_cast<uint32_t>(t), DType::kBf16).g32);
    dev.push_back(std::make_unique<Device<float>>(host.back()));
    ptrs.push_back(dev.back()->p);
  }
  Device<int> flag(std::vector<int>(1, 0));
  const float inv = 1.0f / 3000.0f;
  zeal::cuda::multi_tensor_unscale(ptrs, sizes, inv, flag.p, nullptr);
  EXPECT_EQ(flag.get()[0], 0);
  for (size_t t = 0; t < sizes.size(); ++t) {
    const auto out = dev[t]->get();
    for (int64_t i = 0; i < sizes[t]; ++i)
      ASSERT_EQ(out[i], static_cast<float>(static_cast<double>(host[t][i]) * inv)) << t << " " << i;
  }
  host[2][50] = std::numeric_limits<float>::quiet_NaN();
  Device<float> bad(host[2]);
  ptrs[2] = bad.p;
  zeal::cuda::multi_tensor_unscale(ptrs, sizes, inv, flag.p, nullptr);
  EXPECT_EQ(flag.get()[0], 1);
#endif
}
