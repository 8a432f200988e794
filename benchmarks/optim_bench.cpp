// optim_bench: zeal's CPU Adam step beside its physical floor and its peers, in one run.
//
//   build/bin/optim_bench [--params N] [--repeats R] [--json PATH] [--python EXE] [--no-peers]
//
// Bytes per parameter (fp32 gradient, no compute copy): reads master, grad, m, v (16 B) and writes
// master, m, v (12 B) = 28 B. The floor is a kernel with exactly that traffic and trivial
// arithmetic; its bandwidth is what this machine's memory allows for an Adam step.
//
// Peers in the same run: LibTorch's torch::optim::AdamW (linked in), and through
// benchmarks/optim_peers.py (run with --python, default $ZEAL_PEERS_PYTHON or python3) Python
// torch.optim.AdamW(fused=True) and DeepSpeed's DeepSpeedCPUAdam, each at the same thread count.
// The whole step (inf/nan check, norm, unscale, clip, Adam, bf16 copy) is timed for zeal (a
// statistics pass, then the Adam pass with the scale and clip factor folded in and the bf16 copy
// written in it: 34 B/param) and for the same sequence as DeepSpeed's ZeRO-Offload runs it.
#include <torch/optim/adamw.h>
#include <ATen/Parallel.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "benchmarks/peer_json.h"
#include "kernels/cpu/adam.h"

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

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

template <class T>
struct AlignedBuffer {
  T* p;
  AlignedBuffer(int64_t n, T value) : p(static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64))) {
    std::fill(p, p + n, value);
  }
  ~AlignedBuffer() { std::free(p); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  T* data() { return p; }
};

struct Row {
  std::string name;
  int threads;
  double seconds;
  double bytes_per_param;
};

// Runs optim_peers.py at `threads` threads; returns its JSON, or an object with "error".
json run_peers(const std::string& python, int64_t n, int threads, int repeats) {
  const std::string cmd = "OMP_NUM_THREADS=" + std::to_string(threads) + " '" + python + "' '" +
                          ZEAL_BENCH_DIR + "/optim_peers.py' --params " + std::to_string(n) + " --threads " +
                          std::to_string(threads) + " --repeats " + std::to_string(repeats) + " 2>/dev/null";
  return zeal_bench::run_peer_json(cmd, python);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t n = 100'000'000;
  int repeats = 5;
  std::string json_path;
  std::string python = std::getenv("ZEAL_PEERS_PYTHON") ? std::getenv("ZEAL_PEERS_PYTHON") : "python3";
  bool peers = true;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--params" && i + 1 < argc) n = std::stoll(argv[++i]);
    else if (a == "--repeats" && i + 1 < argc) repeats = std::stoi(argv[++i]);
    else if (a == "--json" && i + 1 < argc) json_path = argv[++i];
    else if (a == "--python" && i + 1 < argc) python = argv[++i];
    else if (a == "--no-peers") peers = false;
    else {
      std::fprintf(stderr, "usage: optim_bench [--params N] [--repeats R] [--json PATH] [--python EXE] [--no-peers]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  const int all = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<int> thread_counts = {1};
  if (all > 1) thread_counts.push_back(all);
  const zeal::cpu::Simd simd = zeal::cpu::active_simd();
  std::printf("optim_bench: %lld parameters, fp32 gradients, %d repeats (median), zeal path %s\n",
              static_cast<long long>(n), repeats, zeal::cpu::simd_name(simd));

  std::vector<Row> rows;
  {
    // 64-byte aligned, as LibTorch's allocator (and so the engine's flat buffers) gives them.
    AlignedBuffer<float> master(n, 0.5f), m(n, 0.0f), v(n, 0.0f), grad(n, 1e-3f * 1024.0f);
    AlignedBuffer<uint16_t> copy(n, 0);
    zeal::cpu::AdamPartition p;
    p.master = master.data(), p.m = m.data(), p.v = v.data(), p.grad = grad.data(), p.n = n;
    for (int t : thread_counts) {
      rows.push_back({"floor (Adam's traffic)", t, median_seconds(repeats, [&] {
                        floor_pass(master.data(), grad.data(), m.data(), v.data(), n, t);
                      }), 28});
      zeal::cpu::AdamHyper h;
      h.weight_decay = 0.01f;
      rows.push_back({std::string("zeal cpu adam (") + zeal::cpu::simd_name(simd) + ")", t,
                      median_seconds(repeats, [&] { zeal::cpu::adam_step(h, p, simd, t); ++h.step; }), 28});
      // The whole step: loss scale 1024, clip at norm 1 (DeepSpeed's unscale_and_clip_grads rule).
      zeal::cpu::AdamPartition whole = p;
      whole.copy = copy.data();
      whole.copy_type = zeal::cpu::DType::kBf16;
      rows.push_back({"zeal whole step (stats + adam + bf16 copy)", t, median_seconds(repeats, [&] {
                        const zeal::cpu::GradStats st = zeal::cpu::grad_stats(grad.data(), zeal::cpu::DType::kFp32, n, simd, t);
                        if (!st.finite()) return;
                        const double loss_scale = 1024.0, norm = std::sqrt(st.sumsq) / loss_scale;
                        const double combined = loss_scale * std::max(1.0, norm / 1.0);
                        h.grad_scale = static_cast<float>(1.0 / combined);
                        zeal::cpu::adam_step(h, whole, simd, t);
                        ++h.step;
                      }), 34});
    }
  }
  {
    torch::Tensor param = torch::full({n}, 0.5f);
    param.mutable_grad() = torch::full({n}, 1e-3f);
    torch::optim::AdamW opt({param}, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
    for (int t : thread_counts) {
      at::set_num_threads(t);
      rows.push_back({"LibTorch torch::optim::AdamW", t, median_seconds(repeats, [&] { opt.step(); }), 28});
    }
  }
  std::vector<std::string> notes;
  json peer_info = json::object();
  if (peers) {
    for (int t : thread_counts) {
      std::fprintf(stderr, "optim_bench: running the Python peers at %d thread(s) with %s\n", t, python.c_str());
      const json r = run_peers(python, n, t, repeats);
      const std::pair<const char*, const char*> peer_rows[] = {
          {"torch_fused_adamw", "Python torch.optim.AdamW(fused=True)"},
          {"deepspeed_cpu_adam", "DeepSpeed DeepSpeedCPUAdam"},
          {"deepspeed_whole_step", "DeepSpeed whole step (ZeRO-Offload sequence)"}};
      for (const auto& [key, name] : peer_rows) {
        const json entry = r.contains(key) ? r[key] : (r.contains("error") ? r : json{{"error", "no result"}});
        if (entry.contains("seconds")) {
          rows.push_back({name, t, entry["seconds"].get<double>(), std::string(key) == "deepspeed_whole_step" ? 34.0 : 28.0});
        } else {
          notes.push_back(std::string(name) + " at " + std::to_string(t) + " thread(s) did not run: " +
                          entry.value("error", std::string("unknown")));
        }
      }
      for (const char* k : {"torch", "deepspeed"})
        if (r.contains(k)) peer_info[k] = r[k];
    }
  } else {
    notes.push_back("Python peers skipped (--no-peers)");
  }

  auto find = [&](const std::string& prefix, int t) -> std::optional<double> {
    for (const auto& r : rows)
      if (r.name.rfind(prefix, 0) == 0 && r.threads == t) return r.seconds;
    return std::nullopt;
  };
  std::printf("\n| kernel | threads | ms/step | ns/param | B/param | GB/s |\n|---|---|---|---|---|---|\n");
  for (const auto& r : rows)
    std::printf("| %s | %d | %.1f | %.3f | %.0f | %.1f |\n", r.name.c_str(), r.threads, r.seconds * 1e3,
                r.seconds * 1e9 / static_cast<double>(n), r.bytes_per_param,
                r.bytes_per_param * static_cast<double>(n) / r.seconds / 1e9);
  auto ratio = [](std::optional<double> a, std::optional<double> b) -> json {
    if (!a || !b) return nullptr;
    return *a / *b;
  };
  auto show = [](const json& x) {
    char buf[32];
    if (x.is_null()) return std::string("n/a");
    std::snprintf(buf, sizeof buf, "%.2f", x.get<double>());
    return std::string(buf);
  };
  std::printf("\n| threads | zeal / floor bandwidth | vs LibTorch AdamW | vs torch fused AdamW | "
              "vs DeepSpeedCPUAdam | whole step vs DeepSpeed | whole step / floor bandwidth |\n"
              "|---|---|---|---|---|---|---|\n");
  json by_threads = json::array();
  for (int t : thread_counts) {
    const auto floor_s = find("floor", t), zeal_s = find("zeal cpu adam", t), whole_s = find("zeal whole step", t);
    json e;
    e["threads"] = t;
    e["fraction_of_floor_bandwidth"] = ratio(floor_s, zeal_s);
    e["speedup_vs_libtorch_adamw"] = ratio(find("LibTorch", t), zeal_s);
    e["speedup_vs_torch_fused_adamw"] = ratio(find("Python torch", t), zeal_s);
    e["speedup_vs_deepspeed_cpu_adam"] = ratio(find("DeepSpeed DeepSpeedCPUAdam", t), zeal_s);
    e["whole_step_speedup_vs_deepspeed"] = ratio(find("DeepSpeed whole step", t), whole_s);
    // Bandwidth of the whole step (34 B/param) over the floor's (28 B/param).
    e["whole_step_fraction_of_floor_bandwidth"] =
        floor_s && whole_s ? json((34.0 / *whole_s) / (28.0 / *floor_s)) : json(nullptr);
    for (const auto& r : rows)
      if (r.threads == t) e["ns_per_param"][r.name] = r.seconds * 1e9 / static_cast<double>(n);
    std::printf("| %d | %s | %sx | %sx | %sx | %sx | %s |\n", t, show(e["fraction_of_floor_bandwidth"]).c_str(),
                show(e["speedup_vs_libtorch_adamw"]).c_str(), show(e["speedup_vs_torch_fused_adamw"]).c_str(),
                show(e["speedup_vs_deepspeed_cpu_adam"]).c_str(), show(e["whole_step_speedup_vs_deepspeed"]).c_str(),
                show(e["whole_step_fraction_of_floor_bandwidth"]).c_str());
    by_threads.push_back(e);
  }
  for (const auto& note : notes) std::printf("\nNote: %s\n", note.c_str());
  if (!json_path.empty()) {
    json out;
    out["params"] = n;
    out["simd"] = zeal::cpu::simd_name(simd);
    out["repeats"] = repeats;
    out["bytes_per_param"] = {{"adam", 28}, {"whole_step", 34}};
    out["peers"] = peer_info;
    // The headline figures are at the largest thread count.
    const json& top = by_threads.back();
    for (const char* k : {"speedup_vs_libtorch_adamw", "speedup_vs_deepspeed_cpu_adam", "speedup_vs_torch_fused_adamw",
                          "whole_step_speedup_vs_deepspeed", "fraction_of_floor_bandwidth",
                          "whole_step_fraction_of_floor_bandwidth"})
      out[k] = top[k];
    out["threads"] = top["threads"];
    out["by_threads"] = by_threads;
    out["notes"] = notes;
    std::ofstream(json_path) << out.dump(2) << "\n";
  }
  return 0;
}
