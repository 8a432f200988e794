// The CUDA unscale-and-check kernel against a float64 reference computed here. Skips without a GPU.
#include <gtest/gtest.h>

#include "tests/test_device.h"

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#ifdef ZEAL_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/loss_scale.h"
#endif

namespace {

#ifdef ZEAL_HAVE_CUDA
void check(cudaError_t e) { ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e); }

// Runs the kernel over `host` and returns the result and the flag.
std::pair<std::vector<float>, int> run(const std::vector<float>& host, float inv_scale) {
  float* d = nullptr;
  int* flag = nullptr;
  std::vector<float> out(host.size());
  int found = -1;
  check(cudaMalloc(&d, host.size() * sizeof(float)));
  check(cudaMalloc(&flag, sizeof(int)));
  check(cudaMemset(flag, 0, sizeof(int)));
  check(cudaMemcpy(d, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  zeal::cuda::unscale_and_check(d, static_cast<int64_t>(host.size()), inv_scale, flag, nullptr);
  check(cudaDeviceSynchronize());
  check(cudaMemcpy(out.data(), d, host.size() * sizeof(float), cudaMemcpyDeviceToHost));
  check(cudaMemcpy(&found, flag, sizeof(int), cudaMemcpyDeviceToHost));
  cudaFree(d);
  cudaFree(flag);
  return {out, found};
}
#endif

}  // namespace

TEST(CudaLossScale, UnscaleMatchesFloat64AndFindsInfAndNanAnywhere) {
  ZEAL_NEED_CUDA();
#ifdef ZEAL_HAVE_CUDA
  std::mt19937 rng(1234);
  std::normal_distribution<float> dist(0.0f, 1000.0f);
  for (size_t n : {1u, 255u, 1000003u}) {
    std::vector<float> g(n);
    for (auto& x : g) x = dist(rng);
    const float inv = 1.0f / 65536.0f;
    auto [out, found] = run(g, inv);
    EXPECT_EQ(found, 0) << n;
    for (size_t i = 0; i < n; ++i) {
      const double ref = static_cast<double>(g[i]) * static_cast<double>(inv);
      ASSERT_EQ(out[i], static_cast<float>(ref)) << "element " << i << " of " << n;  // one rounding: exact
    }
    for (size_t pos : {size_t{0}, n / 2, n - 1}) {
      for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
        std::vector<float> h = g;
        h[pos] = bad;
        EXPECT_EQ(run(h, inv).second, 1) << "bad value at " << pos << " of " << n;
      }
    }
  }
#endif
}
