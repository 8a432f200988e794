// cuda_bench: zeal's CUDA Adam/AdamW step (kernels/cuda/adam.h) beside torch's fused AdamW
// (torch.optim.AdamW(fused=True), the same aten::_fused_adamw_ kernel, linked in) and beside the GPU's
// own device-to-device copy bandwidth, in one process, interleaved round by round.
//
//   build/bin/cuda_bench [--params N] [--rounds R] [--steps K] [--json PATH]
//
// The parameters are a GPT-2-medium-like list of tensors (attention, projections, MLP, biases and
// norms) summing to at least N elements (default 2e8), each contender on its own buffers. Bytes per
// parameter and step: fp32 master, grad, m, v read (16 B) and master, m, v written (12 B) = 28 B;
// zeal's mixed-precision step reads a bf16 gradient and writes a bf16 compute copy beside the fp32
// master, m and v: 14 + 14 = 28 B. torch does the same job (bf16 compute, fp32 master) in three
// passes: the bf16 gradient widened into fp32 (2 + 4 B), the fused AdamW on fp32 (28 B), the master
// copied into the bf16 parameters (4 + 2 B): 40 B. The floor of a step is its own bytes at the copy
// bandwidth, measured here as cudaMemcpy's (bytes read + bytes written) per second over a buffer far
// larger than the L2 cache; the mixed-precision job's floor is zeal's 28 B for both.
//
// Each contender runs K steps between two CUDA events on the default stream, once per round, the
// order rotated each round (rounds.h); times are the median of R rounds with the min–max, every
// ratio is taken round by round. Goal on an H100: zeal >= 1.0x torch fused and >= 0.9 of the floor.
#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/_fused_adamw.h>
#include <cuda_runtime.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "benchmarks/rounds.h"
#include "kernels/cuda/adam.h"
#include "engine/output.h"

namespace {

using nlohmann::json;
using zeal_bench::Contender;
using zeal_bench::Series;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(fmt::format("{}: {}", what, cudaGetErrorString(e)));
}

// Milliseconds of `steps` calls of `fn`, between two events on the default stream.
double event_ms(int steps, const std::function<void()>& fn) {
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "cudaEventCreate");
  check(cudaEventCreate(&b), "cudaEventCreate");
  check(cudaEventRecord(a, nullptr), "cudaEventRecord");
  for (int i = 0; i < steps; ++i) fn();
  check(cudaEventRecord(b, nullptr), "cudaEventRecord");
  check(cudaEventSynchronize(b), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  check(cudaGetLastError(), "a kernel");
  return ms / steps;
}

// GPT-2-medium's parameter shapes, block after block, until `total` elements.
std::vector<int64_t> parameter_sizes(int64_t total) {
  const int64_t d = 1024;
  const std::vector<int64_t> block = {d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d};
  std::vector<int64_t> sizes = {50257 * d, 1024 * d};
  int64_t sum = sizes[0] + sizes[1];
  while (sum < total) {
    for (int64_t n : block) {
      sizes.push_back(n);
      sum += n;
    }
  }
  return sizes;
}

// One flat buffer of `dtype` split into views of `sizes`.
struct Flat {
  at::Tensor flat;
  std::vector<at::Tensor> views;
  Flat(const std::vector<int64_t>& sizes, at::ScalarType dtype, double scale) {
    int64_t n = 0;
    for (int64_t s : sizes) n += s;
    // Random values, drawn on the GPU: zeros would hide unwritten outputs and can run faster.
    flat = at::empty({n}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, 0)).uniform_(0.1, 1.0).mul_(scale);
    flat = flat.to(dtype);
    int64_t off = 0;
    for (int64_t s : sizes) {
      views.push_back(flat.narrow(0, off, s));
      off += s;
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  int64_t params = 200'000'000;
  int rounds = 20, steps = 5;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " expects a value");
      return argv[++i];
    };
    try {
      if (a == "--params") params = static_cast<int64_t>(std::stod(next()));
      else if (a == "--rounds") rounds = std::stoi(next());
      else if (a == "--steps") steps = std::stoi(next());
      else if (a == "--json") json_path = next();
      else throw std::invalid_argument("unknown flag " + a);
      if (params < 1 || rounds < 1 || steps < 1) throw std::invalid_argument("counts must be positive");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "cuda_bench: %s\nusage: cuda_bench [--params N] [--rounds R] [--steps K] [--json PATH]\n",
                   e.what());
      return 2;
    }
  }
  if (!at::detail::getCUDAHooks().hasCUDA() || at::detail::getCUDAHooks().deviceCount() < 1) {
    std::fprintf(stderr, "cuda_bench: no GPU visible to LibTorch (or this build has no CUDA half): nothing to run\n");
    return 2;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  at::manual_seed(1234);
  const std::vector<int64_t> sizes = parameter_sizes(params);
  int64_t n = 0;
  for (int64_t s : sizes) n += s;
  std::printf("cuda_bench: %s (%d SMs, L2 %d MiB); %zu tensors, %.1f M parameters; %d steps a measurement, %d rounds\n",
              prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, sizes.size(), n / 1e6, steps, rounds);
  std::fflush(stdout);

  const double lr = 1e-4, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, wd = 0.01;
  zeal::cpu::AdamHyper hyper;
  hyper.lr = lr, hyper.beta1 = beta1, hyper.beta2 = beta2, hyper.eps = eps, hyper.weight_decay = wd;
  hyper.step = 10;

  // zeal fp32: master (the parameters), m, v, fp32 gradient.
  Flat z_p(sizes, at::kFloat, 1.0), z_m(sizes, at::kFloat, 1e-2), z_v(sizes, at::kFloat, 1e-4),
      z_g(sizes, at::kFloat, 1.0);
  // zeal mixed precision: the same fp32 state, a bf16 gradient and a bf16 copy.
  Flat b_p(sizes, at::kFloat, 1.0), b_m(sizes, at::kFloat, 1e-2), b_v(sizes, at::kFloat, 1e-4),
      b_g(sizes, at::kBFloat16, 1.0), b_c(sizes, at::kBFloat16, 1.0);
  // torch fused fp32, and torch's mixed-precision job: bf16 gradient widened into an fp32 one, the
  // fused step on the fp32 master, the master copied into the bf16 parameters.
  Flat t_p(sizes, at::kFloat, 1.0), t_m(sizes, at::kFloat, 1e-2), t_v(sizes, at::kFloat, 1e-4),
      t_g(sizes, at::kFloat, 1.0);
  Flat h_p(sizes, at::kFloat, 1.0), h_m(sizes, at::kFloat, 1e-2), h_v(sizes, at::kFloat, 1e-4),
      h_g(sizes, at::kBFloat16, 1.0), h_g32(sizes, at::kFloat, 1.0), h_c(sizes, at::kBFloat16, 1.0);
  std::vector<at::Tensor> steps32, steps16;
  for (size_t i = 0; i < sizes.size(); ++i) {
    steps32.push_back(at::full({}, 10.0, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, 0)));
    steps16.push_back(at::full({}, 10.0, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, 0)));
  }
  // The copy: 14 B a parameter each way (28 B moved), as Adam's fp32 step.
  at::Tensor src = at::empty({n * 14}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, 0)).random_(0, 255);
  at::Tensor dst = at::empty_like(src);

  std::vector<zeal::cuda::AdamTensor> z32, z16;
  for (size_t i = 0; i < sizes.size(); ++i) {
    z32.push_back({z_p.views[i].data_ptr<float>(), z_m.views[i].data_ptr<float>(), z_v.views[i].data_ptr<float>(),
                   z_g.views[i].data_ptr(), nullptr, sizes[i]});
    z16.push_back({b_p.views[i].data_ptr<float>(), b_m.views[i].data_ptr<float>(), b_v.views[i].data_ptr<float>(),
                   b_g.views[i].data_ptr(), b_c.views[i].data_ptr(), sizes[i]});
  }
  const double adam_bytes = 28.0 * static_cast<double>(n), torch16_bytes = 40.0 * static_cast<double>(n);
  const std::vector<Contender> contenders = {
      {"copy", [&] { return event_ms(steps, [&] { dst.copy_(src); }); }},
      {"zeal fp32", [&] {
         return event_ms(steps, [&] { zeal::cuda::multi_tensor_adam(hyper, z32, zeal::cpu::DType::kFp32,
                                                                    zeal::cpu::DType::kFp32, nullptr); });
       }},
      {"torch fused fp32", [&] {
         return event_ms(steps, [&] {
           at::_fused_adamw_(t_p.views, t_g.views, t_m.views, t_v.views, {}, steps32, lr, beta1, beta2, wd, eps, false,
                             false);
         });
       }},
      {"zeal bf16 grad + copy", [&] {
         return event_ms(steps, [&] { zeal::cuda::multi_tensor_adam(hyper, z16, zeal::cpu::DType::kBf16,
                                                                    zeal::cpu::DType::kBf16, nullptr); });
       }},
      {"torch bf16 grad + copy (3 passes)", [&] {
         return event_ms(steps, [&] {
           h_g32.flat.copy_(h_g.flat);
           at::_fused_adamw_(h_p.views, h_g32.views, h_m.views, h_v.views, {}, steps16, lr, beta1, beta2, wd, eps,
                             false, false);
           h_c.flat.copy_(h_p.flat);
         });
       }},
  };
  const std::vector<Series> ms = zeal_bench::interleave(contenders, rounds, 2, [&](int r) {
    std::printf("  round %d/%d\r", r, rounds);
    std::fflush(stdout);
  });
  std::printf("\n");
  // Per round: the copy bandwidth (read + written), each contender's fraction of its floor.
  Series bandwidth;
  for (double t : ms[0].values) bandwidth.values.push_back(2.0 * static_cast<double>(src.nbytes()) / (t * 1e-3));
  auto floor_fraction = [&](const Series& t, double bytes) {
    Series f;
    for (size_t r = 0; r < t.values.size(); ++r) f.values.push_back(bytes / bandwidth.values[r] / (t.values[r] * 1e-3));
    return f;
  };
  // Each contender's bytes, and the bytes of its job's floor (the least any implementation must move).
  const double bytes_of[] = {2.0 * static_cast<double>(src.nbytes()), adam_bytes, adam_bytes, adam_bytes, torch16_bytes};
  const double floor_of[] = {bytes_of[0], adam_bytes, adam_bytes, adam_bytes, adam_bytes};
  std::printf("| contender | ms per step, median (min–max) | bytes per parameter | GB/s | fraction of the job's floor |\n"
              "|---|---|---|---|---|\n");
  json rows = json::array();
  for (size_t i = 0; i < contenders.size(); ++i) {
    const Series f = floor_fraction(ms[i], floor_of[i]);
    const double gbs = bytes_of[i] / (ms[i].median() * 1e-3) / 1e9;
    std::printf("| %s | %.3f (%.3f–%.3f) | %.0f | %.0f | %.3f |\n", contenders[i].name.c_str(), ms[i].median(),
                ms[i].min(), ms[i].max(), bytes_of[i] / static_cast<double>(n), gbs, f.median());
    rows.push_back({{"name", contenders[i].name}, {"ms_per_step", ms[i].values}, {"median_ms", ms[i].median()},
                    {"bytes_per_parameter", bytes_of[i] / static_cast<double>(n)}, {"gb_per_s", gbs},
                    {"floor_fraction", f.median()}, {"floor_fraction_spread", {f.min(), f.max()}}});
  }
  json out = {{"device", prop.name}, {"sms", prop.multiProcessorCount}, {"parameters", n},
              {"tensors", sizes.size()}, {"steps_per_measurement", steps}, {"rounds", rounds},
              {"copy_bandwidth_gb_per_s", bandwidth.median() / 1e9}, {"rows", rows}};
  const auto r32 = zeal_bench::ratio(ms[2], ms[1]), r16 = zeal_bench::ratio(ms[4], ms[3]);
  zeal_bench::put_ratio(out, "torch_fp32_time_over_zeal_fp32", r32);
  zeal_bench::put_ratio(out, "torch_bf16_time_over_zeal_bf16", r16);
  const Series f32 = floor_fraction(ms[1], adam_bytes), f16 = floor_fraction(ms[3], adam_bytes);
  out["zeal_fp32_floor_fraction"] = f32.median();
  out["zeal_bf16_floor_fraction"] = f16.median();
  std::printf("\ncopy bandwidth %.0f GB/s (read + written)\n", bandwidth.median() / 1e9);
  std::printf("speed-up over torch fused AdamW: fp32 %s, bf16 %s (goal >= 1.0)\n", r32.text(3).c_str(),
              r16.text(3).c_str());
  std::printf("zeal's fraction of the copy floor: fp32 %.3f, bf16 grad + copy %.3f (goal >= 0.9)\n", f32.median(),
              f16.median());
  if (!json_path.empty()) {
    zeal::write_file_whole(json_path, out.dump(2).append("\n"), "--json");
    std::printf("wrote %s\n", json_path.c_str());
  }
  return 0;
}
