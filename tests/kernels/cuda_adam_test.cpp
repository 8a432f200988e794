// The CUDA multi-tensor kernels against the CPU scalar kernel (Adam: bit for bit, the same
// expression with the same roundings) and against float64 (sum of squares, unscale). Many
// tensors of awkward sizes, so launches split between tensors and inside one. Skips without a GPU.
#include <gtest/gtest.h>

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

template <class T>
struct Device {
  T* p = nullptr;
  size_t n = 0;
  explicit Device(const std::vector<T>& host) : n(host.size()) {
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, host.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  Device(const Device&) = delete;
  ~Device() { cudaFree(p); }
  std::vector<T> get() const {
    std::vector<T> out(n);
    EXPECT_EQ(cudaMemcpy(out.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
};

// Sizes that cross the 64 Ki-element chunks, the 24-tensor and the 320-block batch limits.
std::vector<int64_t> test_sizes() {
  std::vector<int64_t> s = {1, 7, 255, 65536, 65537, 1000003};
  for (int i = 0; i < 30; ++i) s.push_back(97 * i + 3);
  s.push_back(320 * 65536 + 5);  // one tensor split between two launches
  return s;
}

struct Host {
  std::vector<float> master, m, v, g32;
  std::vector<uint16_t> g16, copy;
};

Host make(int64_t n, uint32_t seed, DType grad) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  Host h;
  h.master.resize(n), h.m.resize(n), h.v.resize(n), h.g32.resize(n), h.g16.resize(n), h.copy.assign(n, 0);
  for (int64_t i = 0; i < n; ++i) {
    h.master[i] = d(rng), h.m[i] = 1e-2f * d(rng), h.v[i] = 1e-4f * std::fabs(d(rng));
    h.g32[i] = 1024.0f * d(rng);
    h.g16[i] = grad == DType::kBf16 ? zeal::cpu::float_to_bf16(h.g32[i]) : zeal::cpu::float_to_half(h.g32[i] / 64);
  }
  return h;
}
#endif

}  // namespace

TEST(CudaAdam, MultiTensorMatchesTheCpuKernelBitForBit) {
#ifndef ZEAL_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA (no nvcc, or -DZEAL_CUDA=OFF)";
#else
  if (!zeal::cuda::device_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  zeal::cpu::AdamHyper hyper;
  hyper.lr = 3e-3, hyper.beta1 = 0.9, hyper.beta2 = 0.95, hyper.weight_decay = 0.1, hyper.step = 3;
  hyper.grad_scale = 1.0f / 1024.0f;
  for (DType grad : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    for (bool decoupled : {true, false}) {
      hyper.decoupled = decoupled;
      const auto sizes = test_sizes();
      std::vector<Host> host;
      std::vector<std::unique_ptr<Device<float>>> dev_f;
      std::vector<std::unique_ptr<Device<uint16_t>>> dev_h;
      std::vector<zeal::cuda::AdamTensor> tensors;
      for (size_t t = 0; t < sizes.size(); ++t) {
        host.push_back(make(sizes[t], static_cast<uint32_t>(t), grad));
        Host& h = host.back();
        for (auto* v : {&h.master, &h.m, &h.v, &h.g32}) dev_f.push_back(std::make_unique<Device<float>>(*v));
        for (auto* v : {&h.g16, &h.copy}) dev_h.push_back(std::make_unique<Device<uint16_t>>(*v));
        const size_t f = dev_f.size() - 4, q = dev_h.size() - 2;
        tensors.push_back({dev_f[f]->p, dev_f[f + 1]->p, dev_f[f + 2]->p,
                           grad == DType::kFp32 ? static_cast<const void*>(dev_f[f + 3]->p) : dev_h[q]->p,
                           dev_h[q + 1]->p, sizes[t]});
      }
      zeal::cuda::multi_tensor_adam(hyper, tensors, grad, DType::kBf16, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      for (size_t t = 0; t < sizes.size(); ++t) {
        Host& h = host[t];
        zeal::cpu::AdamPartition p;
        p.master = h.master.data(), p.m = h.m.data(), p.v = h.v.data(), p.n = sizes[t];
        p.grad = grad == DType::kFp32 ? static_cast<const void*>(h.g32.data()) : h.g16.data();
        p.grad_type = grad, p.copy = h.copy.data(), p.copy_type = DType::kBf16;
        zeal::cpu::adam_step(hyper, p, zeal::cpu::Simd::kScalar);
        const size_t f = 4 * t, q = 2 * t;
        SCOPED_TRACE(testing::Message() << "tensor " << t << " of " << sizes[t] << ", grad " << static_cast<int>(grad)
                                        << ", decoupled " << decoupled);
        ASSERT_EQ(0, std::memcmp(dev_f[f]->get().data(), h.master.data(), sizes[t] * 4));
        ASSERT_EQ(0, std::memcmp(dev_f[f + 1]->get().data(), h.m.data(), sizes[t] * 4));
        ASSERT_EQ(0, std::memcmp(dev_f[f + 2]->get().data(), h.v.data(), sizes[t] * 4));
        ASSERT_EQ(0, std::memcmp(dev_h[q + 1]->get().data(), h.copy.data(), sizes[t] * 2));
      }
    }
  }
#endif
}

TEST(CudaAdam, SumOfSquaresMatchesFloat64AndSeesInfAndNan) {
#ifndef ZEAL_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA (no nvcc, or -DZEAL_CUDA=OFF)";
#else
  if (!zeal::cuda::device_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  const auto sizes = test_sizes();
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
#ifndef ZEAL_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA (no nvcc, or -DZEAL_CUDA=OFF)";
#else
  if (!zeal::cuda::device_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
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
