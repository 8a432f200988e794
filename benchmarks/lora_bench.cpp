// lora_bench: one fine-tuning step on CPU ranks, fp32, AdamW, LoRA (r 8 on the attention's query and
// value projections) and full fine-tuning, zeal at ZeRO stages 0 and 3 and, in the same run, Python
// transformers + peft under DDP (benchmarks/lora_peer.py), on the same weights, token ids, labels,
// ranks and torch threads per rank. Two models:
// - `--model minilm` (default): all-MiniLM-L6-v2 (BERT, 22.7 M parameters, loaded from its Hugging
//   Face files) with a 5-way classification head, trained whole beside the adapters;
// - `--model llama`: a LLaMA-shaped decoder (grouped-query attention, SwiGLU, untied head; its shape
//   from --llama_config, a transformers config.json, or the default below) that the peer's
//   transformers initializes and saves and zeal loads: the causal-LM loss on every token.
//
//   build/bin/lora_bench [--model minilm|llama] [--model_dir DIR] [--llama_config FILE] [--world N]
//       [--threads T] [--steps S] [--rounds R] [--seq_len L] [--micro_batch B] [--stages 0,3]
//       [--json PATH] [--python EXE] [--no-peers] [--stage3_param_persistence_threshold N]
//
// Per configuration run: the median step time (forward, backward, optimizer step, zero_grad; the
// slowest rank per step; one untimed warm-up step first) and the per-rank peak memory: the peak
// resident set (VmHWM, reset through /proc/self/clear_refs) above the resident set just before the
// model is loaded, the most over ranks. The peer measures the same way. Configurations run once per
// round in an order rotated each round (rounds.h); ratios are taken round by round.
//
// zeal's engine has glibc's malloc map every block of 128 KiB and up and unmap it when freed (the
// resident set then follows what is live), and keeps LibTorch's freed large blocks in its host cache
// (engine/host_cache.h) so that each step does not fault its temporaries in afresh. Two more rows of
// zeal stage 0 LoRA show the alternatives: the cache off (ZEAL_HOST_CACHE=off), and a user who sets
// MALLOC_MMAP_THRESHOLD_=33554432 (the engine then leaves glibc and LibTorch's allocator alone).
//
// What frozen weights cost is read off the measurements: full fine-tuning's peak minus LoRA's at
// the same stage, against the gradients and Adam states (12 bytes a parameter; divided by the
// ranks at stage 3) that full fine-tuning keeps for the weights LoRA freezes.
#include <CLI/CLI.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>

#include <malloc.h>

#include "benchmarks/peer_json.h"
#include "benchmarks/rank_results.h"
#include "benchmarks/rounds.h"
#include "engine/engine.h"
#include "engine/memory.h"
#include "engine/memory_tracker.h"
#include "engine/peft/lora.h"
#include "engine/runtime/runtime.h"
#include "engine/runtime/spawn.h"
#include "examples/models/bert.h"
#include "examples/models/llama.h"
#include "engine/output.h"

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

struct Options {
  std::string model = "minilm";  // or llama
  std::string model_dir, llama_config;
  int world = 2, threads = 1, steps = 5, rounds = 3;
  int64_t seq_len = 128, micro_batch = 8, num_labels = 5, r = 8, lora_alpha = 16;
  double lora_dropout = 0.1;
  std::vector<int> stages{0, 3};
  std::string json_path, python;
  bool peers = true;
  int64_t persistence_threshold = -1;  // stage3_param_persistence_threshold; -1: the default
};

struct Run {
  bool ok = false;
  std::string why;
  std::vector<double> step_s;
  double peak_bytes = 0;
  double peak_total_bytes = 0;  // the resident set's peak itself (the runtime included)
  int64_t trainable = 0;
  double median() const {
    zeal_bench::Series s;
    s.values = step_s;
    return s.median();
  }
};

struct Row {
  std::string name;
  int stage = -1;  // zeal's rows; -1 for the peer
  bool lora = true;
  int variant = 0;  // kCacheOff, kBigThreshold: how the process allocates
  bool ok = true;
  std::string why;
  int64_t trainable = 0;
  zeal_bench::Series step_s, peak_bytes, peak_total_bytes;
  void add(const Run& r) {
    if (!r.ok) {
      ok = false;
      why = r.why;
      return;
    }
    step_s.values.push_back(r.median());
    peak_bytes.values.push_back(r.peak_bytes);
    if (r.peak_total_bytes > 0) peak_total_bytes.values.push_back(r.peak_total_bytes);
    trainable = r.trainable;
  }
};

constexpr int kThresholdBytes = 32 << 20;

// The allocation variants of zeal's stage-0 LoRA row: the engine's host cache (default), without it
// (ZEAL_HOST_CACHE=off: glibc maps every large block afresh), and a user's glibc threshold (the
// cache then stays out of the way).
constexpr int kCacheOff = 1, kBigThreshold = 2;

std::string row_name(int stage, bool lora, int variant = 0) {
  const std::string what = std::string(lora ? "LoRA" : "full fine-tune") +
                           (variant == kBigThreshold ? ", MALLOC_MMAP_THRESHOLD_=32 MiB"
                            : variant == kCacheOff   ? ", host cache off"
                                                     : "");
  return stage < 0 ? (lora ? "transformers + peft, DDP, LoRA" : "transformers, DDP, full fine-tune")
                   : fmt::format("zeal stage {}, {}", stage, what);
}

// One zeal configuration on `world` ranks; each rank writes its times, peak and trainable count.
Run run_zeal(const Options& o, int stage, bool lora, int variant, const at::Tensor& ids, const at::Tensor& labels,
             const std::string& dir) {
  Run row;
  zeal::SpawnOptions so;
  so.comm_timeout = 1800;
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        at::set_num_threads(o.threads);
        if (variant == kBigThreshold) {  // what glibc does with the variable at start-up; the engine then leaves it
          setenv("MALLOC_MMAP_THRESHOLD_", std::to_string(kThresholdBytes).c_str(), 1);
          mallopt(M_MMAP_THRESHOLD, kThresholdBytes);
        }
        if (variant == kCacheOff) setenv("ZEAL_HOST_CACHE", "off", 1);
        zeal::Config c = zeal::Config::defaults(false);
        c.zero.stage = stage;
        c.zero.zero3_init_flag = stage == 3;
        if (o.persistence_threshold >= 0) c.zero.stage3_param_persistence_threshold = {o.persistence_threshold, false};
        zeal::Engine engine(c, rt);
        zeal::detail::reset_resident_peak();
        const int64_t base = zeal::detail::resident_bytes();
        at::manual_seed(1234);
        zeal::PretrainedOptions lo;
        lo.quiet = true;
        zeal::peft::LoraConfig lc;
        lc.r = o.r;
        lc.lora_alpha = static_cast<double>(o.lora_alpha);
        lc.lora_dropout = o.lora_dropout;
        std::shared_ptr<torch::nn::Module> model;
        std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> loss;
        if (o.model == "llama") {
          auto m = engine.init<zeal::models::LlamaForCausalLM>(zeal::models::LlamaConfig::from_file(o.model_dir + "/config.json"));
          lo.strict = true;
          zeal::load_pretrained(m, o.model_dir, lo);
          lc.target_modules = {"q_proj", "v_proj"};
          lc.task_type = "CAUSAL_LM";
          loss = [m](const at::Tensor& x, const at::Tensor&) mutable { return m->loss(x, x, at::ones_like(x)); };
          model = m.ptr();
        } else {
          auto m = engine.init<zeal::models::BertForSequenceClassification>(
              zeal::models::BertConfig::from_file(o.model_dir + "/config.json"), o.num_labels);
          zeal::load_pretrained(m, o.model_dir, lo);
          lc.target_modules = {"query", "value"};
          lc.modules_to_save = {"classifier"};
          lc.task_type = "SEQ_CLS";
          loss = [m](const at::Tensor& x, const at::Tensor& y) mutable {
            return torch::nn::functional::cross_entropy(m->forward(x, at::ones_like(x)), y);
          };
          model = m.ptr();
        }
        std::vector<at::Tensor> trainable;
        zeal::peft::PeftModel peft;
        if (lora) {
          peft = zeal::peft::get_peft_model(model, lc);
          trainable = peft.trainable_parameters();
        } else {
          trainable = model->parameters();
        }
        torch::optim::AdamW opt(trainable, torch::optim::AdamWOptions(1e-4).weight_decay(0.01));
        auto [m, po] = engine.prepare(model, opt);
        m->train();
        (void)m;
        std::vector<double> out;
        const int64_t rank = engine.process_index();
        for (int step = 0; step <= o.steps; ++step) {
          const at::Tensor x = ids[step][rank], y = labels[step][rank];
          const auto t0 = std::chrono::steady_clock::now();
          engine.backward(loss(x, y));
          po.step();
          po.zero_grad();
          out.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        out.erase(out.begin());  // the warm-up step
        zeal_bench::write_rank_result(dir, rank, out, double(zeal::detail::resident_peak_bytes() - base),
                                      {double(engine.num_trainable_parameters()),
                                       double(zeal::detail::resident_peak_bytes())});
      },
      o.world, so);
  const std::string failure = zeal::describe_failures(results);
  if (!failure.empty()) {
    row.why = failure;
    return row;
  }
  const auto res = zeal_bench::read_rank_results(dir, o.world, o.steps, 2);
  row.step_s = res.step_s;
  row.peak_bytes = res.peak_bytes;
  row.trainable = static_cast<int64_t>(res.extras[0]);
  row.peak_total_bytes = res.extras[1];
  row.ok = true;
  return row;
}

Run run_peer(const Options& o, bool lora, const std::string& ids_path, const std::string& labels_path) {
  Run row;
  const std::string cmd = fmt::format(
      "OMP_NUM_THREADS={} '{}' '{}/lora_peer.py' --model {} --mode {} --model_dir '{}' --ids '{}' --labels '{}' --world {} "
      "--threads {} --steps {} --micro_batch {} --seq_len {} --num_labels {} --r {} --lora_alpha {} --lora_dropout {} "
      "2>/dev/null",
      o.threads, o.python, ZEAL_BENCH_DIR, o.model, lora ? "lora" : "full", o.model_dir, ids_path, labels_path, o.world, o.threads,
      o.steps, o.micro_batch, o.seq_len, o.num_labels, o.r, o.lora_alpha, o.lora_dropout);
  const json r = zeal_bench::run_peer_json(cmd, o.python);
  if (r.contains("error")) {
    row.why = r["error"].get<std::string>();
  } else if (!r.value("ok", false)) {
    row.why = r.value("why", std::string("no reason given"));
  } else {
    row.step_s = r["step_s"].get<std::vector<double>>();
    row.peak_bytes = r["peak_bytes"].get<double>();
    row.trainable = r.value("trainable", int64_t{0});
    row.ok = true;
  }
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  const char* home = std::getenv("HOME");
  const char* models = std::getenv("ZEAL_MODELS");
  o.model_dir = std::string(models ? models : std::string(home ? home : "") + "/.cache/zeal/models") + "/all-MiniLM-L6-v2";
  o.python = std::getenv("ZEAL_PEERS_PYTHON") ? std::getenv("ZEAL_PEERS_PYTHON")
                                                : std::string(home ? home : "") + "/.cache/zeal/peers/bin/python";
  std::string stages = "0,3";
  CLI::App app{"lora_bench: LoRA and full fine-tuning, zeal stages against transformers + peft"};
  app.add_option("--model", o.model, "minilm (all-MiniLM-L6-v2 classifying) or llama (a LLaMA-shaped decoder)")
      ->check(CLI::IsMember({"minilm", "llama"}))->capture_default_str();
  app.add_option("--model_dir", o.model_dir, "--model minilm: all-MiniLM-L6-v2 in Hugging Face's layout (scripts/setup installs it)")->capture_default_str();
  app.add_option("--llama_config", o.llama_config, "--model llama: a transformers LlamaForCausalLM config.json (default: 8 layers, hidden 512, 8 heads, 2 key-value heads, vocabulary 16,000)")->check(CLI::ExistingFile);
  app.add_option("--world", o.world, "ranks")->check(CLI::Range(1, 64))->capture_default_str();
  app.add_option("--threads", o.threads, "torch threads per rank, zeal and peer alike")->check(CLI::Range(1, 256))->capture_default_str();
  app.add_option("--steps", o.steps, "timed steps per run (after one warm-up step)")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--rounds", o.rounds, "rounds, each configuration once per round")->check(CLI::Range(1, 100))->capture_default_str();
  app.add_option("--seq_len", o.seq_len, "tokens per sequence")->check(CLI::Range(2, 512))->capture_default_str();
  app.add_option("--micro_batch", o.micro_batch, "sequences per rank and step")->check(CLI::Range(1, 4096))->capture_default_str();
  app.add_option("--stages", stages, "zeal's ZeRO stages, comma-separated")->capture_default_str();
  app.add_option("--json", o.json_path, "write the results here");
  app.add_option("--python", o.python, "the peers' Python (torch 2.11, transformers, peft: scripts/peers)")->capture_default_str();
  app.add_flag("--no-peers", [&](int64_t) { o.peers = false; }, "zeal's rows only");
  app.add_option("--stage3_param_persistence_threshold", o.persistence_threshold,
                 "stage 3: units of fewer elements stay gathered between steps (1e9: every unit, no per-step gathers)")
      ->check(CLI::NonNegativeNumber);
  try {
    app.parse(argc, argv);
    o.stages.clear();
    std::stringstream ss(stages);
    std::string s;
    while (std::getline(ss, s, ',')) {
      const int v = std::stoi(s);
      if (v < 0 || v > 3) throw CLI::ValidationError("--stages", "a ZeRO stage is 0, 1, 2 or 3, not " + s);
      o.stages.push_back(v);
    }
    if (o.model == "minilm" && (!fs::exists(o.model_dir + "/model.safetensors") || !fs::exists(o.model_dir + "/config.json"))) {
      throw CLI::ValidationError("--model_dir", o.model_dir + " has no model.safetensors and config.json (scripts/setup installs all-MiniLM-L6-v2)");
    }
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lora_bench: --stages: %s\n", e.what());
    return 2;
  }
  char dir_template[] = "/tmp/lora_bench.XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  int64_t vocab = 0, psi = 0;
  std::string what;
  if (o.model == "llama") {
    // The peer's transformers initializes the decoder and saves it; both sides load those files.
    json shape = {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"vocab_size", 16000},
                  {"hidden_size", 512}, {"intermediate_size", 1376}, {"num_hidden_layers", 8},
                  {"num_attention_heads", 8}, {"num_key_value_heads", 2}, {"max_position_embeddings", 2048},
                  {"rms_norm_eps", 1e-6}, {"rope_theta", 10000.0}, {"tie_word_embeddings", false}, {"hidden_act", "silu"}};
    if (!o.llama_config.empty()) shape = json::parse(std::ifstream(o.llama_config));
    o.model_dir = dir + "/llama";
    std::ofstream(dir + "/shape.json") << shape.dump(2);
    const json made = zeal_bench::run_peer_json(fmt::format("'{}' '{}/lora_peer.py' --make_llama '{}' --llama_config '{}' 2>&1",
                                                            o.python, ZEAL_BENCH_DIR, o.model_dir, dir + "/shape.json"),
                                                o.python);
    if (!made.value("ok", false)) {
      std::fprintf(stderr, "lora_bench: --model llama needs the peers' Python to write the model: %s\n",
                   made.value("why", made.value("error", std::string("no reason given"))).c_str());
      fs::remove_all(dir);
      return 1;
    }
    const auto cfg = zeal::models::LlamaConfig::from_file(o.model_dir + "/config.json");
    vocab = cfg.vocab_size;
    psi = cfg.num_parameters();
    what = fmt::format("a LLaMA-shaped decoder ({} layers, hidden {}, {} heads, {} key-value heads, vocabulary {}: {:.2f} M "
                       "parameters), the causal-LM loss on every token, LoRA r {} alpha {} dropout {:.2f} on q_proj and v_proj",
                       cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size,
                       psi / 1e6, o.r, o.lora_alpha, o.lora_dropout);
  } else {
    const auto cfg = zeal::models::BertConfig::from_file(o.model_dir + "/config.json");
    vocab = cfg.vocab_size;
    psi = cfg.num_parameters() + (cfg.hidden_size + 1) * o.num_labels;
    what = fmt::format("all-MiniLM-L6-v2 + a {}-way head ({:.2f} M parameters) from {}, LoRA r {} alpha {} dropout {:.2f} on "
                       "query and value",
                       o.num_labels, psi / 1e6, o.model_dir, o.r, o.lora_alpha, o.lora_dropout);
  }
  // The data, for zeal and the peer alike: random tokens (BERT's: [CLS] word pieces [SEP]), every token real.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(42);
  at::Tensor ids = at::randint(o.model == "llama" ? 0 : 1000, vocab, {o.steps + 1, o.world, o.micro_batch, o.seq_len}, gen);
  if (o.model == "minilm") {
    ids.select(3, 0).fill_(101);
    ids.select(3, o.seq_len - 1).fill_(102);
  }
  const at::Tensor labels = at::randint(0, o.num_labels, {o.steps + 1, o.world, o.micro_batch}, gen);
  const std::string ids_path = dir + "/ids.bin", labels_path = dir + "/labels.bin";
  std::ofstream(ids_path, std::ios::binary).write(static_cast<const char*>(ids.data_ptr()), static_cast<std::streamsize>(ids.nbytes()));
  std::ofstream(labels_path, std::ios::binary)
      .write(static_cast<const char*>(labels.data_ptr()), static_cast<std::streamsize>(labels.nbytes()));

  std::printf("lora_bench: %s, %d ranks x %d threads (%u cores), %lld x %lld tokens per rank, fp32, AdamW, %d timed steps, "
              "%d rounds in rotated order\n",
              what.c_str(), o.world, o.threads, std::thread::hardware_concurrency(), (long long)o.micro_batch,
              (long long)o.seq_len, o.steps, o.rounds);
  std::fflush(stdout);
  zeal_bench::Environment env;
  env.begin();
  struct Config {
    int stage;
    bool lora;
    int variant;
    std::function<Run()> run;
  };
  std::vector<Config> configs;
  for (int stage : o.stages) {
    for (bool lora : {true, false}) {
      configs.push_back({stage, lora, 0, [&, stage, lora] { return run_zeal(o, stage, lora, 0, ids, labels, dir); }});
    }
  }
  const int first = o.stages.front();
  for (int variant : {kCacheOff, kBigThreshold}) {
    configs.push_back({first, true, variant, [&, variant] { return run_zeal(o, first, true, variant, ids, labels, dir); }});
  }
  if (o.peers) {
    for (bool lora : {true, false}) {
      configs.push_back({-1, lora, 0, [&, lora] { return run_peer(o, lora, ids_path, labels_path); }});
    }
  }
  std::vector<Row> rows(configs.size());
  for (size_t i = 0; i < configs.size(); ++i) {
    rows[i].name = row_name(configs[i].stage, configs[i].lora, configs[i].variant);
    rows[i].stage = configs[i].stage;
    rows[i].lora = configs[i].lora;
    rows[i].variant = configs[i].variant;
  }
  for (int r = 0; r < o.rounds; ++r) {
    for (size_t k = 0; k < configs.size(); ++k) {
      const size_t i = (k + static_cast<size_t>(r)) % configs.size();
      if (!rows[i].ok) continue;  // it could not run: no use retrying every round
      const Run run = configs[i].run();
      rows[i].add(run);
      std::printf("  round %d  %-56s %s\n", r + 1, rows[i].name.c_str(),
                  run.ok ? fmt::format("{:.3f} s/step, peak {}", run.median(), zeal::format_bytes(run.peak_bytes)).c_str()
                         : ("cannot run: " + run.why).c_str());
      std::fflush(stdout);
    }
  }
  env.end();
  fs::remove_all(dir);

  std::printf("\n| configuration | trainable parameters | step (s), median (min–max) over rounds | peak memory per rank |\n"
              "|---|---|---|---|\n");
  json out_rows = json::array();
  for (const auto& r : rows) {
    if (r.ok) {
      std::printf("| %s | %s | %.3f (%.3f–%.3f) | %s (%s–%s) |\n", r.name.c_str(), fmt::format("{}", r.trainable).c_str(),
                  r.step_s.median(), r.step_s.min(), r.step_s.max(), zeal::format_bytes(r.peak_bytes.median()).c_str(),
                  zeal::format_bytes(r.peak_bytes.min()).c_str(), zeal::format_bytes(r.peak_bytes.max()).c_str());
    } else {
      std::printf("| %s | - | - | cannot run: %s |\n", r.name.c_str(), r.why.c_str());
    }
    out_rows.push_back({{"name", r.name}, {"ok", r.ok}, {"why", r.why}, {"trainable", r.trainable},
                        {"step_s_per_round", r.step_s.values}, {"peak_bytes_per_round", r.peak_bytes.values},
                        {"median_step_s", r.ok ? json(r.step_s.median()) : json(nullptr)},
                        {"peak_bytes", r.ok ? json(r.peak_bytes.median()) : json(nullptr)},
                        {"peak_total_bytes", r.ok && !r.peak_total_bytes.empty() ? json(r.peak_total_bytes.median())
                                                                                : json(nullptr)}});
  }
  json result = {{"model", o.model == "llama" ? "llama" : "all-MiniLM-L6-v2"}, {"parameters", psi},
                 {"num_labels", o.model == "llama" ? json(nullptr) : json(o.num_labels)}, {"world", o.world},
                 {"threads_per_rank", o.threads}, {"cores", std::thread::hardware_concurrency()},
                 {"micro_batch", o.micro_batch}, {"seq_len", o.seq_len}, {"steps", o.steps}, {"rounds", o.rounds},
                 {"lora", {{"r", o.r}, {"lora_alpha", o.lora_alpha}, {"lora_dropout", o.lora_dropout},
                           {"target_modules", o.model == "llama" ? json{"q_proj", "v_proj"} : json{"query", "value"}},
                           {"modules_to_save", o.model == "llama" ? json::array() : json{"classifier"}}}},
                 {"precision", "fp32"}, {"rows", out_rows},
                 {"stage3_param_persistence_threshold", o.persistence_threshold >= 0 ? json(o.persistence_threshold) : json("default")}};
  auto find = [&](int stage, bool lora, int variant = 0) -> const Row* {
    for (const auto& r : rows)
      if (r.ok && r.stage == stage && r.lora == lora && r.variant == variant) return &r;
    return nullptr;
  };
  std::printf("\nRatios, median over rounds (min–max of the per-round ratios):\n");
  auto pair = [&](const std::string& key, const std::string& label, const Row* a, const Row* b) {
    const zeal_bench::Ratio t = a && b ? zeal_bench::ratio(a->step_s, b->step_s) : zeal_bench::Ratio{};
    const zeal_bench::Ratio m = a && b ? zeal_bench::ratio(a->peak_bytes, b->peak_bytes) : zeal_bench::Ratio{};
    zeal_bench::put_ratio(result, "time_ratio_" + key, t);
    zeal_bench::put_ratio(result, "memory_ratio_" + key, m);
    if (t.valid) std::printf("  %s: time %s, peak memory %s\n", label.c_str(), t.text(3).c_str(), m.text(3).c_str());
  };
  for (int stage : o.stages) {
    pair(fmt::format("stage{}_lora_vs_peft", stage), fmt::format("zeal stage {} LoRA / transformers + peft LoRA", stage),
         find(stage, true), find(-1, true));
    pair(fmt::format("stage{}_full_vs_ddp", stage), fmt::format("zeal stage {} full / transformers DDP full", stage),
         find(stage, false), find(-1, false));
    pair(fmt::format("stage{}_lora_vs_full", stage), fmt::format("zeal stage {} LoRA / zeal stage {} full", stage, stage),
         find(stage, true), find(stage, false));
  }
  for (int stage : o.stages) {  // what sharding costs: each stage against the first (goal for 3: within 1.1)
    if (stage == first) continue;
    pair(fmt::format("stage{}_lora_vs_stage{}_lora", stage, first),
         fmt::format("zeal stage {} LoRA / zeal stage {} LoRA", stage, first), find(stage, true), find(first, true));
    pair(fmt::format("stage{}_full_vs_stage{}_full", stage, first),
         fmt::format("zeal stage {} full / zeal stage {} full", stage, first), find(stage, false), find(first, false));
  }
  pair(fmt::format("stage{}_lora_cache_off_vs_peft", first),
       fmt::format("zeal stage {} LoRA, host cache off / transformers + peft LoRA", first), find(first, true, kCacheOff),
       find(-1, true));
  pair(fmt::format("stage{}_lora_cache_on_vs_off", first),
       fmt::format("zeal stage {} LoRA, host cache on / off", first), find(first, true), find(first, true, kCacheOff));
  pair(fmt::format("stage{}_lora_32mib_threshold_vs_peft", first),
       fmt::format("zeal stage {} LoRA, MALLOC_MMAP_THRESHOLD_=32 MiB / transformers + peft LoRA", first), find(first, true, kBigThreshold),
       find(-1, true));
  pair("peft_lora_vs_full", "peft LoRA / transformers full", find(-1, true), find(-1, false));

  // What the frozen weights cost: full fine-tuning keeps a gradient and Adam's two moments for each
  // weight LoRA freezes (12 bytes; partitioned over the ranks at stage 3, as stage 3's grads and
  // states are); LoRA keeps none. Full's peak minus LoRA's peak, measured, against that.
  std::printf("\nWhat full fine-tuning keeps that LoRA does not (peak difference, measured, against the frozen weights' "
              "gradients + Adam states):\n\n| | full − LoRA peak | 12 bytes × frozen parameters%s | ratio |\n|---|---|---|---|\n",
              o.world > 1 ? " (÷ ranks at stage 3)" : "");
  json frozen = json::object();
  for (const auto& r : rows) {
    if (!r.ok || !r.lora || r.variant != 0) continue;
    const Row* full = find(r.stage, false);
    if (!full) continue;
    const double diff = full->peak_bytes.median() - r.peak_bytes.median();
    const double want = 12.0 * static_cast<double>(psi - r.trainable) / (r.stage == 3 ? o.world : 1);
    const std::string label = r.stage < 0 ? "transformers + peft" : fmt::format("zeal stage {}", r.stage);
    std::printf("| %s | %s | %s | %.3f |\n", label.c_str(), zeal::format_bytes(diff).c_str(), zeal::format_bytes(want).c_str(),
                diff / want);
    frozen[label] = {{"peak_difference_bytes", diff}, {"frozen_grad_and_adam_bytes", want}, {"ratio", diff / want}};
  }
  result["full_minus_lora"] = frozen;

  std::printf("\n");
  env.print();
  result["environment"] = env.json();
  if (!o.json_path.empty()) {
    zeal::write_file_whole(o.json_path, result.dump(2).append("\n"), "--json");
    std::printf("wrote %s\n", o.json_path.c_str());
  }
  return 0;
}
