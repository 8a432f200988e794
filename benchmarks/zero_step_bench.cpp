// zero_step_bench: one training step of a GPT (examples/models/gpt.h, default gpt2-small, 124 M
// parameters) on CPU ranks, fp32, AdamW, gradient clipping at 1.0: zeal stages 0-3 and, in the
// same run, PyTorch FSDP2 (fully_shard on every block, then the root; gloo) and DDP through
// benchmarks/fsdp2_peer.py, on the same tokens.
//
//   build/bin/zero_step_bench [--model PRESET] [--world N] [--threads T] [--steps S] [--seq_len L]
//       [--micro_batch B] [--stages 0,1,2,3] [--json PATH] [--python EXE] [--no-peers]
//
// Per configuration: the median step time (forward, backward, clip, step; the slowest rank per
// step; one untimed warm-up step first) and the per-rank peak memory: the peak resident set
// (VmHWM, reset through /proc/self/clear_refs) above the resident set just before the model is
// built, the most over ranks. The same method runs inside the Python peer. zeal stage 3 builds
// the model with engine.init (zero3_init_flag). Prints the table and zeal ÷ FSDP2 ratios.
#include <torch/optim/adamw.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>

#include "benchmarks/peer_json.h"
#include "engine/engine.h"
#include "engine/memory.h"
#include "engine/runtime/runtime.h"
#include "engine/runtime/spawn.h"
#include "examples/models/gpt.h"

using nlohmann::json;

namespace {

int64_t status_bytes(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(field, 0) == 0) return std::stoll(line.substr(std::string(field).size() + 1)) * 1024;
  }
  return 0;
}

void reset_peak_rss() { std::ofstream("/proc/self/clear_refs") << "5"; }

struct Options {
  std::string model = "gpt2-small";
  int world = 2, threads = 1, steps = 3;
  int64_t seq_len = 128, micro_batch = 2;
  std::vector<int> stages{0, 1, 2, 3};
  std::string json_path, python;
  bool peers = true;
};

struct Row {
  std::string name;
  bool ok = false;
  std::string why;
  std::vector<double> step_s;
  double peak_bytes = 0, model_state_bytes = 0;
  double median() const {
    std::vector<double> v = step_s;
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : v[v.size() / 2];
  }
};

// One zeal configuration on `world` ranks; each rank writes its times and peak to `dir`.
Row run_zeal(const Options& o, int stage, const at::Tensor& tokens, const std::string& dir) {
  Row row;
  row.name = fmt::format("zeal stage {}", stage);
  const auto cfg = zeal::models::gpt_preset(o.model);
  zeal::SpawnOptions so;
  so.comm_timeout = 1800;
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        at::set_num_threads(o.threads);
        zeal::Config c = zeal::Config::defaults(false);
        c.zero.stage = stage;
        c.zero.zero3_init_flag = true;
        c.gradient_clipping = {1.0, false};
        zeal::Engine engine(c, rt);
        reset_peak_rss();
        const int64_t base = status_bytes("VmRSS:");
        at::manual_seed(1234);
        auto model = engine.init<zeal::models::Gpt>(cfg);
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-4).weight_decay(0.1));
        auto [m, po] = engine.prepare(model, opt);
        std::vector<double> times;
        for (int step = 0; step <= o.steps; ++step) {
          at::Tensor batch = tokens[step][engine.process_index()];
          const auto t0 = std::chrono::steady_clock::now();
          engine.backward(m->loss(batch));
          po.step();
          po.zero_grad();
          times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        times.erase(times.begin());  // the warm-up step
        times.push_back(double(status_bytes("VmHWM:") - base));
        times.push_back(double(engine.memory().model_states()));
        std::ofstream(dir + "/rank" + std::to_string(engine.process_index())) << json(times).dump();
      },
      o.world, so);
  const std::string failure = zeal::describe_failures(results);
  if (!failure.empty()) {
    row.why = failure;
    return row;
  }
  row.step_s.assign(o.steps, 0);
  for (int r = 0; r < o.world; ++r) {
    json v = json::parse(std::ifstream(dir + "/rank" + std::to_string(r)));
    for (int s = 0; s < o.steps; ++s) row.step_s[s] = std::max(row.step_s[s], v[s].get<double>());
    row.peak_bytes = std::max(row.peak_bytes, v[o.steps].get<double>());
    row.model_state_bytes = std::max(row.model_state_bytes, v[o.steps + 1].get<double>());
  }
  row.ok = true;
  return row;
}

Row run_peer(const Options& o, const std::string& mode, const std::string& tokens_path) {
  Row row;
  row.name = mode == "fsdp2" ? "PyTorch FSDP2" : "PyTorch DDP";
  const auto cfg = zeal::models::gpt_preset(o.model);
  const std::string cmd = fmt::format(
      "OMP_NUM_THREADS={} '{}' '{}/fsdp2_peer.py' --mode {} --tokens '{}' --world {} --threads {} --steps {} "
      "--micro_batch {} --seq_len {} --vocab {} --context {} --layers {} --dim {} --heads {} 2>/dev/null",
      o.threads, o.python, ZEAL_BENCH_DIR, mode, tokens_path, o.world, o.threads, o.steps, o.micro_batch, o.seq_len,
      cfg.vocab, cfg.context, cfg.layers, cfg.dim, cfg.heads);
  const json r = zeal_bench::run_peer_json(cmd, o.python);
  if (r.contains("error")) {
    row.why = r["error"].get<std::string>();
  } else if (!r.value("ok", false)) {
    row.why = r.value("why", std::string("no reason given"));
  } else {
    row.step_s = r["step_s"].get<std::vector<double>>();
    row.peak_bytes = r["peak_bytes"].get<double>();
    row.ok = true;
  }
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  o.python = std::getenv("ZEAL_PEERS_PYTHON") ? std::getenv("ZEAL_PEERS_PYTHON") : "python3";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " expects a value");
      return argv[++i];
    };
    try {
      if (a == "--model") o.model = next();
      else if (a == "--world") o.world = std::stoi(next());
      else if (a == "--threads") o.threads = std::stoi(next());
      else if (a == "--steps") o.steps = std::stoi(next());
      else if (a == "--seq_len") o.seq_len = std::stoll(next());
      else if (a == "--micro_batch") o.micro_batch = std::stoll(next());
      else if (a == "--json") o.json_path = next();
      else if (a == "--python") o.python = next();
      else if (a == "--no-peers") o.peers = false;
      else if (a == "--stages") {
        o.stages.clear();
        std::stringstream ss(next());
        std::string s;
        while (std::getline(ss, s, ',')) o.stages.push_back(std::stoi(s));
      } else {
        throw std::invalid_argument("unknown flag " + a);
      }
      (void)zeal::models::gpt_preset(o.model);
    } catch (const std::exception& e) {
      std::fprintf(stderr,
                   "zero_step_bench: %s\nusage: zero_step_bench [--model PRESET] [--world N] [--threads T] [--steps S] "
                   "[--seq_len L] [--micro_batch B] [--stages 0,1,2,3] [--json PATH] [--python EXE] [--no-peers]\n",
                   e.what());
      return 2;
    }
  }
  const auto cfg = zeal::models::gpt_preset(o.model);
  // The tokens, for zeal and the peer alike: [steps + 1, world, micro_batch, seq_len + 1].
  auto gen = at::make_generator<at::CPUGeneratorImpl>(42);
  const at::Tensor tokens = at::randint(0, cfg.vocab, {o.steps + 1, o.world, o.micro_batch, o.seq_len + 1}, gen);
  char dir_template[] = "/tmp/zero_step_bench.XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  const std::string tokens_path = dir + "/tokens.bin";
  std::ofstream(tokens_path, std::ios::binary)
      .write(static_cast<const char*>(tokens.data_ptr()), static_cast<std::streamsize>(tokens.nbytes()));

  std::printf("zero_step_bench: %s (%.1f M parameters), %d ranks x %d threads (%u cores), %lld x %lld tokens per rank, "
              "fp32, AdamW, clip 1.0, %d timed steps\n",
              cfg.name.c_str(), cfg.num_parameters() / 1e6, o.world, o.threads, std::thread::hardware_concurrency(),
              (long long)o.micro_batch, (long long)o.seq_len, o.steps);
  std::fflush(stdout);
  std::vector<Row> rows;
  for (int stage : o.stages) {
    rows.push_back(run_zeal(o, stage, tokens, dir));
    std::printf("  %-16s %s\n", rows.back().name.c_str(),
                rows.back().ok ? fmt::format("{:.3f} s/step, peak {}", rows.back().median(),
                                             zeal::format_bytes(rows.back().peak_bytes)).c_str()
                               : rows.back().why.c_str());
    std::fflush(stdout);
  }
  std::optional<Row> fsdp2, ddp;
  if (o.peers) {
    for (const char* mode : {"fsdp2", "ddp"}) {
      Row r = run_peer(o, mode, tokens_path);
      std::printf("  %-16s %s\n", r.name.c_str(),
                  r.ok ? fmt::format("{:.3f} s/step, peak {}", r.median(), zeal::format_bytes(r.peak_bytes)).c_str()
                       : ("cannot run: " + r.why).c_str());
      std::fflush(stdout);
      (std::string(mode) == "fsdp2" ? fsdp2 : ddp) = r;
    }
  }
  std::remove(tokens_path.c_str());

  std::printf("\n| configuration | step (s, median) | peak memory per rank | model states per rank |\n|---|---|---|---|\n");
  json out_rows = json::array();
  auto add = [&](const Row& r) {
    if (r.ok) {
      std::printf("| %s | %.3f | %s | %s |\n", r.name.c_str(), r.median(), zeal::format_bytes(r.peak_bytes).c_str(),
                  r.model_state_bytes > 0 ? zeal::format_bytes(r.model_state_bytes).c_str() : "-");
    } else {
      std::printf("| %s | - | - | cannot run: %s |\n", r.name.c_str(), r.why.c_str());
    }
    out_rows.push_back({{"name", r.name}, {"ok", r.ok}, {"why", r.why}, {"step_s", r.step_s},
                        {"median_step_s", r.ok ? json(r.median()) : json(nullptr)},
                        {"peak_bytes", r.ok ? json(r.peak_bytes) : json(nullptr)},
                        {"model_state_bytes", r.model_state_bytes > 0 ? json(r.model_state_bytes) : json(nullptr)}});
  };
  for (const auto& r : rows) add(r);
  if (fsdp2) add(*fsdp2);
  if (ddp) add(*ddp);

  json result = {{"model", cfg.name}, {"parameters", cfg.num_parameters()}, {"world", o.world},
                 {"threads_per_rank", o.threads}, {"cores", std::thread::hardware_concurrency()},
                 {"micro_batch", o.micro_batch}, {"seq_len", o.seq_len}, {"steps", o.steps}, {"precision", "fp32"},
                 {"rows", out_rows}};
  const Row* s3 = nullptr;
  const Row* s0 = nullptr;
  for (const auto& r : rows) {
    if (r.ok && r.name == "zeal stage 3") s3 = &r;
    if (r.ok && r.name == "zeal stage 0") s0 = &r;
  }
  if (s3 && fsdp2 && fsdp2->ok) {
    result["time_ratio_vs_fsdp2"] = s3->median() / fsdp2->median();
    result["memory_ratio_vs_fsdp2"] = s3->peak_bytes / fsdp2->peak_bytes;
    std::printf("\nzeal stage 3 / FSDP2: time %.3f, peak memory %.3f (goal: <= 1.0 for both)\n",
                s3->median() / fsdp2->median(), s3->peak_bytes / fsdp2->peak_bytes);
  } else {
    result["time_ratio_vs_fsdp2"] = nullptr;
    result["memory_ratio_vs_fsdp2"] = nullptr;
  }
  if (s0 && ddp && ddp->ok) {
    result["stage0_time_ratio_vs_ddp"] = s0->median() / ddp->median();
    result["stage0_memory_ratio_vs_ddp"] = s0->peak_bytes / ddp->peak_bytes;
    std::printf("zeal stage 0 / DDP: time %.3f, peak memory %.3f\n", s0->median() / ddp->median(),
                s0->peak_bytes / ddp->peak_bytes);
  }
  std::remove(dir.c_str());
  if (!o.json_path.empty()) {
    std::ofstream(o.json_path) << result.dump(2) << "\n";
    std::printf("wrote %s\n", o.json_path.c_str());
  }
  return 0;
}
