// optim_bench: zeal's CPU Adam step beside its physical floor and LibTorch's AdamW, in one run.
//
//   build/bin/optim_bench [--params N] [--repeats R] [--json PATH]
//
// Bytes per parameter (fp32 gradient, no compute copy): reads master, grad, m, v (16 B) and writes
// master, m, v (12 B) = 28 B. The floor is a kernel with exactly that traffic and trivial
// arithmetic; its bandwidth is what this machine's memory allows for an Adam step.
#include <torch/optim/adamw.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/adam.h"

namespace {

using Clock = std::chrono::steady_clock;

double median_seconds(int repeats, const std::function<void()>& fn) {
  fn();  // warm-up: page faults and caches out of the numbers
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    const auto start = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// The floor: Adam's memory traffic with one add per stream.
void floor_pass(float* master, const float* grad, float* m, float* v, int64_t n, int threads) {
  auto run = [=](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float g = grad[i];
      m[i] += g;
      v[i] += g;
      master[i] += g;
    }
  };
  std::vector<std::thread> w;
  const int64_t per = ((n + threads - 1) / threads + 63) / 64 * 64;  // chunks cover all n
  for (int t = 1; t < threads; ++t) w.emplace_back(run, std::min(n, t * per), std::min(n, (t + 1) * per));
  run(0, std::min(n, per));
  for (auto& x : w) x.join();
}

struct Row {
  std::string name;
  int threads;
  double seconds;
};

}  // namespace

int main(int argc, char** argv) {
  int64_t n = 100'000'000;
  int repeats = 5;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--params" && i + 1 < argc) n = std::stoll(argv[++i]);
    else if (a == "--repeats" && i + 1 < argc) repeats = std::stoi(argv[++i]);
    else if (a == "--json" && i + 1 < argc) json = argv[++i];
    else {
      std::fprintf(stderr, "usage: optim_bench [--params N] [--repeats R] [--json PATH]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  const int all = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<int> thread_counts = {1};
  if (all > 1) thread_counts.push_back(all);
  const double bytes = 28.0 * static_cast<double>(n);
  const zeal::cpu::Simd simd = zeal::cpu::best_simd();
  std::printf("optim_bench: %lld parameters, fp32 gradients, %d repeats (median), zeal path %s\n",
              static_cast<long long>(n), repeats, zeal::cpu::simd_name(simd));

  std::vector<Row> rows;
  {
    std::vector<float> master(n, 0.5f), m(n, 0.0f), v(n, 0.0f), grad(n, 1e-3f);
    zeal::cpu::AdamPartition p;
    p.master = master.data(), p.m = m.data(), p.v = v.data(), p.grad = grad.data(), p.n = n;
    for (int t : thread_counts) {
      rows.push_back({"floor (Adam's traffic)", t, median_seconds(repeats, [&] {
                        floor_pass(master.data(), grad.data(), m.data(), v.data(), n, t);
                      })});
      zeal::cpu::AdamHyper h;
      h.weight_decay = 0.01f;
      rows.push_back({std::string("zeal cpu adam (") + zeal::cpu::simd_name(simd) + ")", t,
                      median_seconds(repeats, [&] { zeal::cpu::adam_step(h, p, simd, t); ++h.step; })});
    }
  }
  {
    torch::Tensor param = torch::full({n}, 0.5f);
    param.mutable_grad() = torch::full({n}, 1e-3f);
    torch::optim::AdamW opt({param}, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
    for (int t : thread_counts) {
      at::set_num_threads(t);
      rows.push_back({"LibTorch torch::optim::AdamW", t, median_seconds(repeats, [&] { opt.step(); })});
    }
  }

  auto find = [&](const std::string& prefix, int t) {
    for (const auto& r : rows)
      if (r.name.rfind(prefix, 0) == 0 && r.threads == t) return r.seconds;
    return 0.0;
  };
  std::printf("\n| kernel | threads | ms/step | ns/param | GB/s |\n|---|---|---|---|---|\n");
  for (const auto& r : rows)
    std::printf("| %s | %d | %.1f | %.3f | %.1f |\n", r.name.c_str(), r.threads, r.seconds * 1e3,
                r.seconds * 1e9 / static_cast<double>(n), bytes / r.seconds / 1e9);
  std::printf("\n| threads | zeal / floor bandwidth | speed-up vs LibTorch AdamW |\n|---|---|---|\n");
  std::string per_thread_json;
  for (int t : thread_counts) {
    const double floor_s = find("floor", t), zeal_s = find("zeal", t), torch_s = find("LibTorch", t);
    std::printf("| %d | %.2f | %.2fx |\n", t, floor_s / zeal_s, torch_s / zeal_s);
    per_thread_json += (per_thread_json.empty() ? "" : ",\n") + std::string("    {\"threads\": ") +
                       std::to_string(t) + ", \"fraction_of_floor_bandwidth\": " + std::to_string(floor_s / zeal_s) +
                       ", \"speedup_vs_libtorch_adamw\": " + std::to_string(torch_s / zeal_s) +
                       ", \"zeal_ns_per_param\": " + std::to_string(zeal_s * 1e9 / n) +
                       ", \"floor_ns_per_param\": " + std::to_string(floor_s * 1e9 / n) +
                       ", \"libtorch_adamw_ns_per_param\": " + std::to_string(torch_s * 1e9 / n) + "}";
  }
  std::printf("\nNot measured by this program: Python torch.optim.AdamW(fused=True) and DeepSpeed's "
              "DeepSpeedCPUAdam (they need the Python packages; see the README).\n");
  if (!json.empty()) {
    std::ofstream out(json);
    out << "{\n  \"params\": " << n << ",\n  \"simd\": \"" << zeal::cpu::simd_name(simd)
        << "\",\n  \"bytes_per_param\": 28,\n  \"speedup_vs_deepspeed_cpu_adam\": null,\n"
        << "  \"deepspeed_cpu_adam\": \"not measured by this program\",\n  \"by_threads\": [\n"
        << per_thread_json << "\n  ]\n}\n";
  }
  return 0;
}
