// zero_step_bench: one training step of a GPT (examples/models/gpt.h, default gpt2-small, 124 M
// parameters) on CPU ranks, fp32, AdamW, gradient clipping at 1.0: zeal stages 0-3 and, in the
// same run, PyTorch FSDP2 (fully_shard on every block, then the root; gloo) and DDP through
// benchmarks/fsdp2_peer.py, on the same tokens.
//
//   build/bin/zero_step_bench [--model PRESET] [--world N] [--threads T] [--steps S] [--rounds R]
//       [--seq_len L] [--micro_batch B] [--stages 0,1,2,3] [--device cpu|cuda] [--json PATH]
//       [--python EXE] [--no-peers]
//
// --device cuda: one GPU per rank (NCCL; FSDP2 and DDP over NCCL too); each step is timed after the
// device has finished it, and the peak is the caching allocator's peak of allocated bytes above
// what was allocated before the model was built.
//
// Per configuration run: the median step time (forward, backward, clip, step; the slowest rank per
// step; one untimed warm-up step first) and the per-rank peak memory: the peak resident set
// (VmHWM, reset through /proc/self/clear_refs) above the resident set just before the model is
// built, the most over ranks. The same method runs inside the Python peer. zeal stage 3 builds
// the model with engine.init (zero3_init_flag) and runs twice: with DeepSpeed's defaults (units stay
// gathered within stage3_max_live_parameters) and FSDP-style (every unit released after its forward
// and its backward, one block gathered ahead). FSDP2 runs twice too: as it comes, and with glibc's
// mmap threshold held at a MiB (MALLOC_MMAP_THRESHOLD_), the setting zeal's engine makes.
//
// Each zeal row's peak is printed against its floor: the stage table's model states + the unit
// parameters the settings let be gathered + the activations (stage 0's peak minus its model states).
//
// Each configuration is its own group of processes holding its own model, too large to keep them
// all alive and interleave them step by step; so every configuration runs once per round, R rounds,
// in an order rotated each round (rounds.h), and each ratio (zeal ÷ FSDP2, stage 0 ÷ DDP) is taken
// round by round and reported as its median with the min–max over rounds.
#include <torch/optim/adamw.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <ATen/DeviceAccelerator.h>
#include <ATen/Parallel.h>

#include "benchmarks/peer_json.h"
#include "benchmarks/rank_results.h"
#include "benchmarks/rounds.h"
#include "engine/engine.h"
#include "engine/memory.h"
#include "engine/memory_tracker.h"
#include "engine/runtime/runtime.h"
#include "engine/runtime/spawn.h"
#include "examples/models/gpt.h"
#include "engine/output.h"

using nlohmann::json;

namespace {

struct Options {
  std::string model = "gpt2-small";
  int world = 2, threads = 1, steps = 3, rounds = 3;
  int64_t seq_len = 128, micro_batch = 2;
  std::vector<int> stages{0, 1, 2, 3};
  std::string json_path, python;
  std::string device = "cpu";
  bool peers = true;
};

// One run of one configuration.
struct Run {
  std::string name;
  bool ok = false;
  std::string why;
  std::vector<double> step_s;
  double peak_bytes = 0, model_state_bytes = 0;
  double median() const {
    zeal_bench::Series s;
    s.values = step_s;
    return s.median();
  }
};

// One configuration over the rounds: each round's median step and peak.
struct Row {
  std::string name;
  int stage = -1;  // zeal's rows
  bool fsdp_style = false;
  bool ok = true;
  std::string why;
  zeal_bench::Series step_s, peak_bytes;
  double model_state_bytes = 0;
  void add(const Run& r) {
    if (!r.ok) {
      ok = false;
      why = r.why;
      return;
    }
    step_s.values.push_back(r.median());
    peak_bytes.values.push_back(r.peak_bytes);
    model_state_bytes = r.model_state_bytes;
  }
};

// The caching allocator's peak of allocated bytes on a GPU, above what was allocated when made.
class DevicePeak {
 public:
  explicit DevicePeak(const at::Device& d) : index_(d.index() < 0 ? 0 : d.index()), on_(d.is_cuda()) {
    if (!on_) return;
    at::globalContext().lazyInitDevice(d.type());  // the caching allocator exists from here on
    at::accelerator::resetPeakStats(index_);
    start_ = static_cast<double>(at::accelerator::getDeviceStats(index_).allocated_bytes[0].current);
  }
  double above_start() const {
    return on_ ? static_cast<double>(at::accelerator::getDeviceStats(index_).allocated_bytes[0].peak) - start_ : 0.0;
  }

 private:
  c10::DeviceIndex index_;
  bool on_;
  double start_ = 0;
};

std::string zeal_row_name(int stage, bool fsdp_style) {
  return fsdp_style ? "zeal stage 3, FSDP-style" : fmt::format("zeal stage {}", stage);
}

// FSDP2's release policy in stage 3's keys: every unit released after its forward and after its
// backward (no reuse distance, nothing persistent), at most one more block gathered ahead.
void apply_fsdp_style(zeal::Config& c, const zeal::models::GptConfig& m) {
  c.zero.stage3_param_persistence_threshold = {0, false};
  c.zero.stage3_max_reuse_distance = 0;
  c.zero.stage3_max_live_parameters = 12 * m.dim * m.dim + 13 * m.dim;
}

std::string peer_row_name(const std::string& mode, bool mapped) {
  if (mode == "ddp") return "PyTorch DDP";
  return mapped ? "PyTorch FSDP2, 1 MiB mmap threshold" : "PyTorch FSDP2";
}

// One zeal configuration on `world` ranks; each rank writes its times and peak to `dir`.
Run run_zeal(const Options& o, int stage, bool fsdp_style, const at::Tensor& tokens, const std::string& dir) {
  Run row;
  row.name = zeal_row_name(stage, fsdp_style);
  const auto cfg = zeal::models::gpt_preset(o.model);
  zeal::SpawnOptions so;
  so.comm_timeout = 1800;
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        at::set_num_threads(o.threads);
        zeal::Config c = zeal::Config::defaults(false);
        c.launch.use_cpu = o.device != "cuda";
        c.zero.stage = stage;
        c.zero.zero3_init_flag = true;
        if (fsdp_style) apply_fsdp_style(c, cfg);
        c.gradient_clipping = {1.0, false};
        zeal::Engine engine(c, rt);
        if (o.device == "cuda" && !engine.device().is_cuda()) throw zeal::Error("--device cuda: the engine found no GPU");
        DevicePeak device_peak(engine.device());
        zeal::detail::reset_resident_peak();
        const int64_t base = zeal::detail::resident_bytes();
        at::manual_seed(1234);
        auto model = engine.init<zeal::models::Gpt>(cfg);
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-4).weight_decay(0.1));
        auto [m, po] = engine.prepare(model, opt);
        std::vector<double> times;
        for (int step = 0; step <= o.steps; ++step) {
          at::Tensor batch = tokens[step][engine.process_index()].to(engine.device());
          engine.synchronize();
          const auto t0 = std::chrono::steady_clock::now();
          engine.backward(m->loss(batch));
          po.step();
          po.zero_grad();
          engine.synchronize();  // the step's device work is done before the clock is read
          times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        times.erase(times.begin());  // the warm-up step
        const double peak = engine.device().is_cuda() ? device_peak.above_start()
                                                      : double(zeal::detail::resident_peak_bytes() - base);
        zeal_bench::write_rank_result(dir, engine.process_index(), times, peak, {double(engine.memory().model_states())});
      },
      o.world, so);
  const std::string failure = zeal::describe_failures(results);
  if (!failure.empty()) {
    row.why = failure;
    return row;
  }
  const auto res = zeal_bench::read_rank_results(dir, o.world, o.steps, 1);
  row.step_s = res.step_s;
  row.peak_bytes = res.peak_bytes;
  row.model_state_bytes = res.extras[0];
  row.ok = true;
  return row;
}

Run run_peer(const Options& o, const std::string& mode, const std::string& tokens_path, bool mapped = false) {
  Run row;
  row.name = peer_row_name(mode, mapped);
  const auto cfg = zeal::models::gpt_preset(o.model);
  const std::string cmd = fmt::format(
      "{}OMP_NUM_THREADS={} '{}' '{}/fsdp2_peer.py' --mode {} --tokens '{}' --world {} --threads {} --steps {} "
      "--micro_batch {} --seq_len {} --vocab {} --context {} --layers {} --dim {} --heads {} --device {} 2>/dev/null",
      mapped ? "MALLOC_MMAP_THRESHOLD_=1048576 " : "", o.threads, o.python, ZEAL_BENCH_DIR, mode, tokens_path, o.world, o.threads, o.steps, o.micro_batch, o.seq_len,
      cfg.vocab, cfg.context, cfg.layers, cfg.dim, cfg.heads, o.device);
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
      else if (a == "--rounds") o.rounds = std::stoi(next());
      else if (a == "--seq_len") o.seq_len = std::stoll(next());
      else if (a == "--micro_batch") o.micro_batch = std::stoll(next());
      else if (a == "--json") o.json_path = next();
      else if (a == "--python") o.python = next();
      else if (a == "--no-peers") o.peers = false;
      else if (a == "--device") {
        o.device = next();
        if (o.device != "cpu" && o.device != "cuda") throw std::invalid_argument("--device takes cpu or cuda");
      }
      else if (a == "--stages") {
        o.stages.clear();
        std::stringstream ss(next());
        std::string s;
        while (std::getline(ss, s, ',')) o.stages.push_back(std::stoi(s));
      } else {
        throw std::invalid_argument("unknown flag " + a);
      }
      (void)zeal::models::gpt_preset(o.model);
      if (o.rounds < 1 || o.steps < 1 || o.world < 1 || o.threads < 1) {
        throw std::invalid_argument("--rounds, --steps, --world and --threads take positive counts");
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr,
                   "zero_step_bench: %s\nusage: zero_step_bench [--model PRESET] [--world N] [--threads T] [--steps S] "
                   "[--rounds R] [--seq_len L] [--micro_batch B] [--stages 0,1,2,3] [--device cpu|cuda] [--json PATH] "
                   "[--python EXE] [--no-peers]\n",
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

  std::printf("zero_step_bench: %s (%.1f M parameters), %d ranks x %d threads (%u cores)%s, %lld x %lld tokens per "
              "rank, fp32, AdamW, clip 1.0, %d timed steps, %d rounds in rotated order\n",
              cfg.name.c_str(), cfg.num_parameters() / 1e6, o.world, o.threads, std::thread::hardware_concurrency(),
              o.device == "cuda" ? ", one GPU per rank, peaks from the caching allocator" : "",
              (long long)o.micro_batch, (long long)o.seq_len, o.steps, o.rounds);
  std::fflush(stdout);
  zeal_bench::Environment env;
  env.begin();
  // The configurations: zeal's stages, then the peers.
  struct Config {
    std::string name;
    std::function<Run()> run;
    int stage = -1;
    bool fsdp_style = false;
  };
  std::vector<Config> configs;
  for (int stage : o.stages) {
    configs.push_back(
        {zeal_row_name(stage, false), [&, stage] { return run_zeal(o, stage, false, tokens, dir); }, stage, false});
    if (stage == 3) configs.push_back({zeal_row_name(3, true), [&] { return run_zeal(o, 3, true, tokens, dir); }, 3, true});
  }
  if (o.peers) {
    configs.push_back({"PyTorch FSDP2", [&] { return run_peer(o, "fsdp2", tokens_path); }});
    // FSDP2 again with glibc's mmap threshold held at a MiB, as zeal's engine holds it: how much of
    // the difference in peak memory is that setting alone.
    if (o.device == "cpu") {
      configs.push_back({peer_row_name("fsdp2", true), [&] { return run_peer(o, "fsdp2", tokens_path, true); }});
    }
    configs.push_back({"PyTorch DDP", [&] { return run_peer(o, "ddp", tokens_path); }});
  }
  std::vector<Row> rows(configs.size());
  for (size_t i = 0; i < configs.size(); ++i) {
    rows[i].name = configs[i].name;
    rows[i].stage = configs[i].stage;
    rows[i].fsdp_style = configs[i].fsdp_style;
  }
  for (int r = 0; r < o.rounds; ++r) {
    for (size_t k = 0; k < configs.size(); ++k) {
      const size_t i = (k + static_cast<size_t>(r)) % configs.size();
      if (!rows[i].ok) continue;  // it could not run: no use retrying every round
      const Run run = configs[i].run();
      rows[i].add(run);
      std::printf("  round %d  %-16s %s\n", r + 1, run.name.c_str(),
                  run.ok ? fmt::format("{:.3f} s/step, peak {}", run.median(), zeal::format_bytes(run.peak_bytes)).c_str()
                         : ("cannot run: " + run.why).c_str());
      std::fflush(stdout);
    }
  }
  env.end();
  std::remove(tokens_path.c_str());

  std::printf("\n| configuration | step (s), median (min–max) over rounds | peak memory per rank | model states per rank |\n"
              "|---|---|---|---|\n");
  json out_rows = json::array();
  for (const auto& r : rows) {
    if (r.ok) {
      std::printf("| %s | %.3f (%.3f–%.3f) | %s (%s–%s) | %s |\n", r.name.c_str(), r.step_s.median(), r.step_s.min(),
                  r.step_s.max(), zeal::format_bytes(r.peak_bytes.median()).c_str(),
                  zeal::format_bytes(r.peak_bytes.min()).c_str(), zeal::format_bytes(r.peak_bytes.max()).c_str(),
                  r.model_state_bytes > 0 ? zeal::format_bytes(r.model_state_bytes).c_str() : "-");
    } else {
      std::printf("| %s | - | - | cannot run: %s |\n", r.name.c_str(), r.why.c_str());
    }
    out_rows.push_back({{"name", r.name}, {"ok", r.ok}, {"why", r.why}, {"step_s_per_round", r.step_s.values},
                        {"median_step_s", r.ok ? json(r.step_s.median()) : json(nullptr)},
                        {"median_step_s_spread", r.ok ? json({r.step_s.min(), r.step_s.max()}) : json(nullptr)},
                        {"peak_bytes", r.ok ? json(r.peak_bytes.median()) : json(nullptr)},
                        {"peak_bytes_spread", r.ok ? json({r.peak_bytes.min(), r.peak_bytes.max()}) : json(nullptr)},
                        {"model_state_bytes", r.model_state_bytes > 0 ? json(r.model_state_bytes) : json(nullptr)}});
  }

  json result = {{"model", cfg.name}, {"parameters", cfg.num_parameters()}, {"world", o.world},
                 {"threads_per_rank", o.threads}, {"cores", std::thread::hardware_concurrency()},
                 {"micro_batch", o.micro_batch}, {"seq_len", o.seq_len}, {"steps", o.steps}, {"rounds", o.rounds},
                 {"precision", "fp32"}, {"device", o.device}, {"rows", out_rows}};
  auto find = [&](const std::string& name) -> const Row* {
    for (const auto& r : rows)
      if (r.ok && r.name == name) return &r;
    return nullptr;
  };
  auto pair = [&](const char* key, const char* label, const Row* a, const Row* b) {
    const zeal_bench::Ratio t = a && b ? zeal_bench::ratio(a->step_s, b->step_s) : zeal_bench::Ratio{};
    const zeal_bench::Ratio m = a && b ? zeal_bench::ratio(a->peak_bytes, b->peak_bytes) : zeal_bench::Ratio{};
    zeal_bench::put_ratio(result, fmt::format("time_ratio_vs_{}", key), t);
    zeal_bench::put_ratio(result, fmt::format("memory_ratio_vs_{}", key), m);
    if (t.valid) std::printf("%s: time %s, peak memory %s\n", label, t.text(3).c_str(), m.text(3).c_str());
  };
  std::printf("\nRatios, median over rounds (min–max of the per-round ratios):\n");
  pair("fsdp2", "zeal stage 3 / FSDP2 (goal: <= 1.0 for both)", find("zeal stage 3"), find("PyTorch FSDP2"));
  pair("fsdp2_fsdp_style", "zeal stage 3, FSDP-style / FSDP2 (goal: time <= 1.0, peak memory <= 0.8)",
       find(zeal_row_name(3, true)), find("PyTorch FSDP2"));
  pair("fsdp2_mapped_fsdp_style", "zeal stage 3, FSDP-style / FSDP2 with a 1 MiB mmap threshold",
       find(zeal_row_name(3, true)), find(peer_row_name("fsdp2", true)));
  const Row* s0 = find("zeal stage 0");
  const Row* ddp = find("PyTorch DDP");
  {
    const zeal_bench::Ratio t = s0 && ddp ? zeal_bench::ratio(s0->step_s, ddp->step_s) : zeal_bench::Ratio{};
    const zeal_bench::Ratio m = s0 && ddp ? zeal_bench::ratio(s0->peak_bytes, ddp->peak_bytes) : zeal_bench::Ratio{};
    zeal_bench::put_ratio(result, "stage0_time_ratio_vs_ddp", t);
    zeal_bench::put_ratio(result, "stage0_memory_ratio_vs_ddp", m);
    if (t.valid) std::printf("zeal stage 0 / DDP: time %s, peak memory %s\n", t.text(3).c_str(), m.text(3).c_str());
  }

  // Each zeal row's peak against its floor: the stage table's model states per rank (fp32: P = G = 4
  // bytes, K = 8 for Adam's m, v; fp32 parameters are their own master), plus the unit parameters the stage-3 settings let
  // be gathered at once (the root, used at both ends of the pass, + the unit being used +
  // stage3_max_live_parameters; everything with the defaults), plus the activations: stage 0's
  // peak minus its model states (its peak is already above the process's baseline). All from the
  // model's sizes, none from the engine's report.
  if (s0) {
    const double psi = static_cast<double>(cfg.num_parameters()), n = o.world;
    const double root = static_cast<double>((cfg.vocab + cfg.context) * cfg.dim + 2 * cfg.dim);
    const double block = static_cast<double>(12 * cfg.dim * cfg.dim + 13 * cfg.dim);
    auto states = [&](int stage) {
      switch (stage) {
        case 0: return 16 * psi;
        case 1: return 8 * psi + 8 * psi / n;
        case 2: return 4 * psi + 12 * psi / n;
        default: return 16 * psi / n;
      }
    };
    auto live = [&](const Row& r) {
      if (r.stage != 3) return 0.0;
      zeal::Config c = zeal::Config::defaults(false);
      if (r.fsdp_style) apply_fsdp_style(c, cfg);
      return 4 * std::min(psi, root + block + static_cast<double>(c.zero.stage3_max_live_parameters));
    };
    const double activations = s0->peak_bytes.median() - states(0);
    std::printf("\nPeak against the floor (model states + live units + activations of %s):\n\n"
                "| configuration | peak | model states | live units | floor | peak / floor |\n|---|---|---|---|---|---|\n",
                zeal::format_bytes(activations).c_str());
    json floors = json::object();
    for (const auto& r : rows) {
      if (!r.ok || r.stage < 0) continue;
      const double floor = states(r.stage) + live(r) + activations;
      const double ratio = r.peak_bytes.median() / floor;
      std::printf("| %s | %s | %s | %s | %s | %.3f |\n", r.name.c_str(), zeal::format_bytes(r.peak_bytes.median()).c_str(),
                  zeal::format_bytes(states(r.stage)).c_str(), zeal::format_bytes(live(r)).c_str(),
                  zeal::format_bytes(floor).c_str(), ratio);
      floors[r.name] = {{"floor_bytes", floor}, {"model_states_bytes", states(r.stage)}, {"live_unit_bytes", live(r)},
                        {"peak_ratio_vs_floor", ratio}};
      if (r.stage == 3) result[r.fsdp_style ? "stage3_peak_ratio_vs_floor" : "stage3_default_peak_ratio_vs_floor"] = ratio;
    }
    result["activation_bytes"] = activations;
    result["floors"] = floors;
    std::printf("goal: the FSDP-style stage-3 row <= 1.15 x its floor\n");
  }

  std::printf("\n");
  env.print();
  result["environment"] = env.json();
  std::remove(dir.c_str());
  if (!o.json_path.empty()) {
    zeal::write_file_whole(o.json_path, result.dump(2).append("\n"), "--json");
    std::printf("wrote %s\n", o.json_path.c_str());
  }
  return 0;
}
