// optim_bench: zeal's CPU Adam step beside its memory floor and its peers, interleaved round by round.
//
//   build/bin/optim_bench [--params N] [--rounds R] [--threads 1,2] [--json PATH] [--python EXE] [--no-peers]
//
// Bytes per parameter (fp32 gradient, no compute copy): reads master, grad, m, v (16 B) and writes
// master, m, v (12 B) = 28 B. The floor (floor.h) is the fastest of several kernels that move exactly
// those bytes, per round.
//
// Contenders, per thread count, each on its own buffers, one step each per round in a rotated order
// (rounds.h): the floor kernels; zeal's Adam; zeal's whole step (statistics pass, then the Adam pass
// with loss scale and clip factor folded in and the bf16 copy written: 34 B/param); LibTorch's
// torch::optim::AdamW (linked in); and, from one persistent Python process per thread count
// (benchmarks/optim_peers.py, run with --python, default $ZEAL_PEERS_PYTHON or python3), Python
// torch.optim.AdamW(fused=True), DeepSpeed's DeepSpeedCPUAdam and the sequence DeepSpeed's
// ZeRO-Offload runs around it for a whole step. Every ratio is taken round by round and reported as
// its median with the min–max over rounds.
#include <torch/optim/adamw.h>
#include <ATen/Parallel.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "benchmarks/floor.h"
#include "benchmarks/peer_process.h"
#include "benchmarks/rounds.h"
#include "kernels/cpu/adam.h"
#include "engine/output.h"

namespace {

using nlohmann::json;
using zeal_bench::Contender;
using zeal_bench::Ratio;
using zeal_bench::Series;

template <class T>
struct AlignedBuffer {
  T* p;
  // 64-byte aligned, as LibTorch's allocator (and so the engine's flat buffers) gives them.
  AlignedBuffer(int64_t n, T value) : p(static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64))) {
    std::fill(p, p + n, value);
  }
  ~AlignedBuffer() { std::free(p); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  T* data() { return p; }
};

// The Python peers this benchmark asks for, their row names and bytes per parameter.
struct PeerRow {
  const char* key;
  const char* name;
  double bytes;
};
constexpr PeerRow kPeerRows[] = {{"torch_fused_adamw", "Python torch.optim.AdamW(fused=True)", 28},
                                 {"deepspeed_cpu_adam", "DeepSpeed DeepSpeedCPUAdam", 28},
                                 {"deepspeed_whole_step", "DeepSpeed whole step (ZeRO-Offload sequence)", 34}};

struct Row {
  std::string name;
  double bytes_per_param;
  Series seconds;
};

std::string ms_range(const Series& s) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f (%.1f–%.1f)", s.median() * 1e3, s.min() * 1e3, s.max() * 1e3);
  return buf;
}

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) out.push_back(std::stoi(x));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t n = 100'000'000;
  int rounds = 9;
  std::string json_path;
  std::string python = std::getenv("ZEAL_PEERS_PYTHON") ? std::getenv("ZEAL_PEERS_PYTHON") : "python3";
  bool peers = true;
  const int all = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<int> thread_counts = {1};
  if (all > 1) thread_counts.push_back(all);
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto next = [&]() -> std::string {
        if (i + 1 >= argc) throw std::invalid_argument(a + " expects a value");
        return argv[++i];
      };
      if (a == "--params") n = std::stoll(next());
      else if (a == "--rounds") rounds = std::stoi(next());
      else if (a == "--threads") thread_counts = parse_list(next());
      else if (a == "--json") json_path = next();
      else if (a == "--python") python = next();
      else if (a == "--no-peers") peers = false;
      else if (a == "--help") throw std::invalid_argument("");
      else throw std::invalid_argument("unknown flag " + a);
    }
    if (n < 1024 || rounds < 1 || thread_counts.empty()) throw std::invalid_argument("--params ≥ 1024, --rounds ≥ 1");
    for (int t : thread_counts)
      if (t < 1) throw std::invalid_argument("--threads takes positive counts");
  } catch (const std::exception& e) {
    if (*e.what()) std::fprintf(stderr, "optim_bench: %s\n", e.what());
    std::fprintf(stderr, "usage: optim_bench [--params N] [--rounds R] [--threads 1,2] [--json PATH] [--python EXE] "
                         "[--no-peers]\n");
    return std::string(e.what()).empty() ? 0 : 2;
  }
  const zeal::cpu::Simd simd = zeal::cpu::active_simd();
  std::printf("optim_bench: %lld parameters, fp32 gradients, %d interleaved rounds; zeal path %s, floor path %s\n",
              static_cast<long long>(n), rounds, zeal::cpu::simd_name(simd), zeal_bench::floor_isa().c_str());
  std::fflush(stdout);

  zeal_bench::Environment env;
  env.begin();
  // Each contender on its own buffers (the floor's adds would otherwise feed Adam's state).
  AlignedBuffer<float> master(n, 0.5f), m(n, 0.0f), v(n, 0.0f), grad(n, 1e-3f * 1024.0f);
  AlignedBuffer<uint16_t> copy(n, 0);
  AlignedBuffer<float> fw(n, 0.5f), fm(n, 0.0f), fv(n, 0.0f), fg(n, 1e-6f);
  torch::Tensor param = torch::full({n}, 0.5f);
  param.mutable_grad() = torch::full({n}, 1e-3f);
  torch::optim::AdamW libtorch_adamw({param}, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));

  std::vector<std::string> notes;
  json peer_info = json::object(), by_threads = json::array();
  std::map<int, std::vector<Row>> rows_by_threads;
  std::map<int, std::map<std::string, Ratio>> ratios_by_threads;
  for (int t : thread_counts) {
    zeal::cpu::AdamHyper h;
    h.weight_decay = 0.01;
    zeal::cpu::AdamPartition p;
    p.master = master.data(), p.m = m.data(), p.v = v.data(), p.grad = grad.data(), p.n = n;
    zeal::cpu::AdamPartition whole = p;
    whole.copy = copy.data();
    whole.copy_type = zeal::cpu::DType::kBf16;

    std::vector<Row> rows;
    std::vector<Contender> contenders;
    auto add = [&](std::string name, double bytes, std::function<double()> fn) {
      rows.push_back({name, bytes, {}});
      contenders.push_back({std::move(name), std::move(fn)});
    };
    for (auto k : zeal_bench::floor_kinds()) {
      add("floor: " + zeal_bench::floor_name(k), 28, [&, k, t] {
        return zeal_bench::seconds_of([&] { zeal_bench::floor_pass(k, fw.data(), fg.data(), fm.data(), fv.data(), n, t); });
      });
    }
    add(std::string("zeal cpu adam (") + zeal::cpu::simd_name(simd) + ")", 28, [&, t] {
      return zeal_bench::seconds_of([&] {
        zeal::cpu::adam_step(h, p, simd, t);
        ++h.step;
      });
    });
    // The whole step: loss scale 1024, clip at norm 1 (DeepSpeed's unscale_and_clip_grads rule).
    add("zeal whole step (stats + adam + bf16 copy)", 34, [&, t] {
      return zeal_bench::seconds_of([&] {
        const zeal::cpu::GradStats st = zeal::cpu::grad_stats(grad.data(), zeal::cpu::DType::kFp32, n, simd, t);
        if (!st.finite()) return;
        const double loss_scale = 1024.0, norm = std::sqrt(st.sumsq) / loss_scale;
        h.grad_scale = 1.0 / (loss_scale * std::max(1.0, norm / 1.0));
        zeal::cpu::adam_step(h, whole, simd, t);
        h.grad_scale = 1.0;
        ++h.step;
      });
    });
    add("LibTorch torch::optim::AdamW", 28, [&, t] {
      at::set_num_threads(t);
      return zeal_bench::seconds_of([&] { libtorch_adamw.step(); });
    });

    std::unique_ptr<zeal_bench::PeerProcess> peer;
    if (peers) {
      std::fprintf(stderr, "optim_bench: starting the Python peers at %d thread(s) with %s\n", t, python.c_str());
      peer = std::make_unique<zeal_bench::PeerProcess>(
          std::vector<std::string>{python, std::string(ZEAL_BENCH_DIR) + "/optim_peers.py", "--params",
                                   std::to_string(n), "--threads", std::to_string(t)},
          std::vector<std::string>{"OMP_NUM_THREADS=" + std::to_string(t)});
      // DeepSpeed compiles its CPU Adam on first use: allow minutes for the hello.
      const json hello = peer->read(900);
      for (const char* k : {"torch", "deepspeed"})
        if (hello.contains(k)) peer_info[k] = hello[k];
      for (const auto& pr : kPeerRows) {
        std::string why;
        if (hello.contains("error")) why = hello["error"].get<std::string>();
        else if (!hello.contains("peers") || !hello["peers"].contains(pr.key)) why = "the peer did not offer it";
        else if (!hello["peers"][pr.key].is_null()) why = hello["peers"][pr.key].get<std::string>();
        if (!why.empty()) {
          notes.push_back(std::string(pr.name) + " at " + std::to_string(t) + " thread(s) did not run: " + why);
          continue;
        }
        const std::string key = pr.key;
        zeal_bench::PeerProcess* pp = peer.get();
        add(pr.name, pr.bytes, [pp, key] {
          const json r = pp->request(key, 600);
          if (!r.contains("seconds")) {
            throw std::runtime_error(key + ": " + r.value("error", std::string("no answer")));
          }
          return r["seconds"].get<double>();
        });
      }
    } else if (t == thread_counts.front()) {
      notes.push_back("Python peers skipped (--no-peers)");
    }

    std::printf("\n%d thread(s): %zu contenders, %d rounds\n", t, contenders.size(), rounds);
    std::fflush(stdout);
    std::vector<Series> series;
    try {
      series = zeal_bench::interleave(contenders, rounds, 1, [&](int r) {
        std::fprintf(stderr, "\r  round %d of %d", r, rounds);
        if (r == rounds) std::fprintf(stderr, "\n");
      });
    } catch (const std::exception& e) {
      std::fprintf(stderr, "optim_bench: %s\n", e.what());
      return 1;
    }
    if (peer) peer->close_peer();
    for (size_t i = 0; i < rows.size(); ++i) rows[i].seconds = series[i];

    // The floor of each round: the fastest floor kernel in that round.
    Series floor;
    for (int r = 0; r < rounds; ++r) {
      double best = std::numeric_limits<double>::infinity();
      for (const auto& row : rows)
        if (row.name.rfind("floor: ", 0) == 0) best = std::min(best, row.seconds.values[r]);
      floor.values.push_back(best);
    }
    auto find = [&](const std::string& prefix) -> const Series* {
      for (const auto& row : rows)
        if (row.name.rfind(prefix, 0) == 0) return &row.seconds;
      return nullptr;
    };
    auto ratio_of = [&](const Series* num, const Series* den, double scale = 1.0) {
      if (!num || !den) return Ratio{};
      Ratio r = zeal_bench::ratio(*num, *den);
      r.median *= scale, r.lo *= scale, r.hi *= scale;
      return r;
    };
    const Series* zeal_adam = find("zeal cpu adam");
    const Series* zeal_whole = find("zeal whole step");
    std::map<std::string, Ratio> ratios;
    ratios["fraction_of_floor_bandwidth"] = ratio_of(&floor, zeal_adam);
    ratios["speedup_vs_libtorch_adamw"] = ratio_of(find("LibTorch"), zeal_adam);
    ratios["speedup_vs_torch_fused_adamw"] = ratio_of(find("Python torch"), zeal_adam);
    ratios["speedup_vs_deepspeed_cpu_adam"] = ratio_of(find("DeepSpeed DeepSpeedCPUAdam"), zeal_adam);
    ratios["whole_step_speedup_vs_deepspeed"] = ratio_of(find("DeepSpeed whole step"), zeal_whole);
    // Bandwidth of the whole step (34 B/param) over the floor's (28 B/param).
    ratios["whole_step_fraction_of_floor_bandwidth"] = ratio_of(&floor, zeal_whole, 34.0 / 28.0);
    // A contender faster than the floor by more than the spread: the floor is not a floor.
    for (const auto& row : rows) {
      if (row.name.rfind("floor: ", 0) == 0) continue;
      const Ratio r = ratio_of(&floor, &row.seconds, row.bytes_per_param / 28.0);
      if (r.valid && r.median > 1.0 + (r.hi - r.lo)) {
        const std::string msg = "WARNING: " + row.name + " moved its bytes " + r.text() + "x as fast as the floor at " +
                                std::to_string(t) + " thread(s), beyond the spread: the floor is wrong";
        std::printf("%s\n", msg.c_str());
        notes.push_back(msg);
      }
    }
    rows_by_threads[t] = rows;
    ratios_by_threads[t] = ratios;

    json e;
    e["threads"] = t;
    for (const auto& [k, r] : ratios) zeal_bench::put_ratio(e, k, r);
    e["floor_ns_per_param"] = floor.median() * 1e9 / static_cast<double>(n);
    for (const auto& row : rows) {
      e["ns_per_param"][row.name] = row.seconds.median() * 1e9 / static_cast<double>(n);
      e["ns_per_param_spread"][row.name] = {row.seconds.min() * 1e9 / static_cast<double>(n),
                                            row.seconds.max() * 1e9 / static_cast<double>(n)};
    }
    by_threads.push_back(e);
  }
  env.end();

  std::printf("\n| kernel | threads | ms/step, median (min–max) | ns/param | B/param | GB/s |\n|---|---|---|---|---|---|\n");
  for (const auto& [t, rows] : rows_by_threads) {
    for (const auto& r : rows) {
      const double s = r.seconds.median();
      std::printf("| %s | %d | %s | %.3f | %.0f | %.1f |\n", r.name.c_str(), t, ms_range(r.seconds).c_str(),
                  s * 1e9 / static_cast<double>(n), r.bytes_per_param, r.bytes_per_param * static_cast<double>(n) / s / 1e9);
    }
  }
  std::printf("\nRatios, median over rounds (min–max of the per-round ratios):\n\n"
              "| threads | zeal / floor bandwidth | vs LibTorch AdamW | vs torch fused AdamW | vs DeepSpeedCPUAdam | "
              "whole step vs DeepSpeed | whole step / floor bandwidth |\n|---|---|---|---|---|---|---|\n");
  for (const auto& [t, r] : ratios_by_threads) {
    std::printf("| %d | %s | %s | %s | %s | %s | %s |\n", t, r.at("fraction_of_floor_bandwidth").text().c_str(),
                r.at("speedup_vs_libtorch_adamw").text().c_str(), r.at("speedup_vs_torch_fused_adamw").text().c_str(),
                r.at("speedup_vs_deepspeed_cpu_adam").text().c_str(), r.at("whole_step_speedup_vs_deepspeed").text().c_str(),
                r.at("whole_step_fraction_of_floor_bandwidth").text().c_str());
  }
  std::printf("\n");
  env.print();
  for (const auto& note : notes) std::printf("Note: %s\n", note.c_str());
  if (!json_path.empty()) {
    json out;
    out["params"] = n;
    out["simd"] = zeal::cpu::simd_name(simd);
    out["floor_isa"] = zeal_bench::floor_isa();
    out["rounds"] = rounds;
    out["bytes_per_param"] = {{"adam", 28}, {"whole_step", 34}};
    out["peers"] = peer_info;
    // The headline figures are at the largest thread count.
    const json& top = by_threads.back();
    for (const char* k : {"speedup_vs_libtorch_adamw", "speedup_vs_deepspeed_cpu_adam", "speedup_vs_torch_fused_adamw",
                          "whole_step_speedup_vs_deepspeed", "fraction_of_floor_bandwidth",
                          "whole_step_fraction_of_floor_bandwidth"}) {
      out[k] = top[k];
      out[std::string(k) + "_spread"] = top[std::string(k) + "_spread"];
    }
    out["threads"] = top["threads"];
    out["by_threads"] = by_threads;
    out["environment"] = env.json();
    out["notes"] = notes;
    zeal::write_file_whole(json_path, out.dump(2).append("\n"), "--json");
    std::printf("wrote %s\n", json_path.c_str());
  }
  return 0;
}
