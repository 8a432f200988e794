// offload_bench --step_model (offload_step_model.h). Each contender is a real run: `zeal launch` of
// train_gpt on 2 ranks, fp32, ZeRO-3 as configs/zero3.yaml sets it, with wall_clock_breakdown every
// step and --log_jsonl; the NVMe one adds --offload_optimizer_device nvme --offload_param_device nvme
// in the directory measured and max_in_cpu 0 (every parameter shard on the disk; the gradients go to
// the optimizer's swap). A round runs both, in an order that alternates.
#include "benchmarks/offload_step_model.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>

#include "benchmarks/free_port.h"
#include "benchmarks/rounds.h"

namespace zeal_bench {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// What one run gave: each step's seconds and its breakdown (ms), steps 2.. only.
struct RunResult {
  std::vector<double> step_s, tokens_per_s;
  std::map<std::string, std::vector<double>> time_ms;
  double peak_rss = 0;
};

// kind 0: in memory; 1: NVMe, sub_group_size 1e9; 2: NVMe, o.sub_group_size.
RunResult run_once(const StepModelOptions& o, int kind, const std::string& work, int port) {
  const bool nvme = kind > 0;
  const std::string config = work + "/config.yaml", log = work + "/steps.jsonl", swap = o.dir + "/offload_step_model.swap";
  {
    std::ofstream f(config);
    f << "distributed_type: DEEPSPEED\nnum_processes: 2\nmixed_precision: 'no'\ndeepspeed_config:\n  zero_stage: 3\n"
      << "  zero3_init_flag: true\n  gradient_accumulation_steps: 1\n  gradient_clipping: 1.0\n"
      << "zero_optimization:\n  stage3_prefetch_bucket_size: 5e7\n  stage3_param_persistence_threshold: 1e5\n"
      << "  stage3_max_live_parameters: 1e9\n  stage3_max_reuse_distance: 1e9\n"
      << (nvme ? "  offload_param:\n    max_in_cpu: 0\n" : "")
      << (kind == 2 ? fmt::format("  sub_group_size: {}\n", o.sub_group_size) : std::string("  sub_group_size: 1e9\n"))
      << "steps_per_print: 1\nwall_clock_breakdown: true\n";
  }
  std::string flags;
  if (nvme) {
    fs::create_directories(swap);
    flags = fmt::format(" --offload_optimizer_device nvme --offload_param_device nvme --offload_optimizer_nvme_path '{}' "
                        "--offload_param_nvme_path '{}'", swap, swap);
  }
  fs::remove(log);
  const std::string cmd = fmt::format(
      "'{}/zeal' launch --num_processes 2 --main_process_port {} --config_file '{}'{} '{}/train_gpt' --model {} "
      "--steps {} --seq_len {} --micro_batch 1 --log_every {} --log_jsonl '{}' 2>&1",
      o.bin, port, config, flags, o.bin, o.model, o.steps, o.seq_len, o.steps, log);
  try {
    (void)run_command(cmd);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("the {} run failed: {}", nvme ? "nvme" : "in-memory", e.what()));
  }
  fs::remove_all(swap);
  RunResult r;
  std::ifstream f(log);
  for (std::string line; std::getline(f, line);) {
    const json j = json::parse(line, nullptr, false);
    if (!j.is_object() || !j.contains("step_s")) continue;
    r.peak_rss = std::max(r.peak_rss, j.value("peak_rss_bytes", 0.0));
    if (j.value("step", 0) < 1) continue;  // the first step (index 0) warms up
    r.step_s.push_back(j["step_s"].get<double>());
    r.tokens_per_s.push_back(j["tokens_per_s"].get<double>());
    if (j.contains("time_ms")) {
      for (const auto& [k, v] : j["time_ms"].items())
        if (k != "steps") r.time_ms[k].push_back(v.get<double>());
    }
  }
  if (r.step_s.empty()) throw std::runtime_error(fmt::format("{} has no step after the first", log));
  return r;
}

}  // namespace

json run_step_model(const StepModelOptions& o) {
  const std::string work = (fs::temp_directory_path() / fmt::format("zeal_offload_step_{}", ::getpid())).string();
  fs::create_directories(work);
  std::printf("step model: %s, 2 ranks, %lld tokens per rank per step, %d steps per run (the first left out), %d "
              "rounds; NVMe in %s\n",
              o.model.c_str(), static_cast<long long>(o.seq_len), o.steps, o.rounds, o.dir.c_str());
  std::fflush(stdout);
  const int kinds = o.sub_group_size > 0 ? 3 : 2;
  const char* names[] = {"in memory", "nvme", "nvme, sub_group_size set"};
  std::vector<std::vector<RunResult>> runs(kinds);
  for (int round = 0; round < o.rounds; ++round) {
    for (int k = 0; k < kinds; ++k) {
      const int kind = (k + round) % kinds;
      RunResult r = run_once(o, kind, work, free_port());
      std::printf("  round %d, %s: %.2f s per step (%.2f–%.2f), peak resident set %.2f GiB on rank 0\n", round + 1,
                  names[kind], Series{r.step_s}.median(), Series{r.step_s}.min(), Series{r.step_s}.max(),
                  r.peak_rss / double(1 << 30));
      std::fflush(stdout);
      runs[kind].push_back(std::move(r));
    }
  }
  fs::remove_all(work);
  std::vector<Series> step(kinds), tok(kinds);
  for (int kind = 0; kind < kinds; ++kind) {
    for (const auto& r : runs[kind]) {
      step[kind].values.push_back(Series{r.step_s}.median());
      tok[kind].values.push_back(Series{r.tokens_per_s}.median());
    }
  }
  // The breakdown of each: the median over all its runs' steps.
  auto breakdown = [](const std::vector<RunResult>& rs) {
    std::map<std::string, double> out;
    std::map<std::string, std::vector<double>> all;
    for (const auto& r : rs)
      for (const auto& [k, v] : r.time_ms) all[k].insert(all[k].end(), v.begin(), v.end());
    for (const auto& [k, v] : all) out[k] = Series{v}.median();
    return out;
  };
  auto line = [](const std::map<std::string, double>& b) {
    auto at = [&](const char* k) { return b.count(k) ? b.at(k) : 0.0; };
    return fmt::format("forward {:.0f}, backward {:.0f}, step {:.0f}; waiting for reductions {:.0f}, gathers {:.0f}, "
                       "reads {:.0f}, writes {:.0f}",
                       at("forward"), at("backward"), at("step"), at("wait_reductions"), at("wait_gathers"),
                       at("wait_reads"), at("wait_writes"));
  };
  json out = {{"model", o.model}, {"seq_len", o.seq_len}, {"steps_per_run", o.steps}};
  const char* keys[] = {"in_memory", "nvme", "nvme_sub_group"};
  for (int kind = 0; kind < kinds; ++kind) {
    const auto b = breakdown(runs[kind]);
    out[std::string(keys[kind]) + "_step_s"] = step[kind].values;
    out[std::string(keys[kind]) + "_tokens_per_s"] = tok[kind].values;
    out[std::string(keys[kind]) + "_time_ms"] = b;
    double peak = 0;
    for (const auto& r : runs[kind]) peak = std::max(peak, r.peak_rss);
    out[std::string(keys[kind]) + "_peak_rss_bytes"] = peak;
    std::string ratio_text = "";
    if (kind > 0) {
      const Ratio ratio = zeal_bench::ratio(step[kind], step[0]);
      put_ratio(out, kind == 1 ? "nvme_step_ratio_vs_in_memory" : "nvme_sub_group_step_ratio_vs_in_memory", ratio);
      ratio_text = fmt::format(" | / in memory {} (goal <= 1.3)", ratio.text());
    }
    std::printf("| %s step, %s%s | %.2f s (%.2f–%.2f), %.0f tokens/s, peak resident set %.2f GiB (rank 0)%s |\n",
                o.model.c_str(), names[kind],
                kind == 2 ? fmt::format(" to {}", o.sub_group_size).c_str() : "", step[kind].median(),
                step[kind].min(), step[kind].max(), tok[kind].median(), peak / double(1 << 30), ratio_text.c_str());
    std::printf("  ms per step: %s\n", line(b).c_str());
  }
  if (kinds == 3) out["sub_group_size"] = o.sub_group_size;
  return out;
}

}  // namespace zeal_bench
