// `zeal estimate-memory`: per-rank memory for every stage and offload choice before a run — zeal's
// prediction of the peak (model states, offload buffers, gathered units, activations, the
// runtime) and DeepSpeed's model-state estimators reproduced exactly.
//
//   zeal estimate-memory --model gpt2-1.3b --num_processes 2 --mixed_precision bf16 --seq_len 128
//   zeal estimate-memory --hf_config path/config.json --num_processes 8 --num_machines 2 --json est.json
//   zeal estimate-memory --params 7e9 --largest_layer_params 2.6e8
#include <cstdio>
#include <fstream>

#include <fmt/format.h>

#include "cli/commands.h"
#include "cli/number_flags.h"
#include "engine/error.h"
#include "engine/output.h"
#include "engine/estimate.h"
#include "engine/memory_tracker.h"
#include "examples/models/gpt_config.h"

namespace zeal::cli {

Runner add_estimate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("estimate-memory",
                                 "Per-rank memory for every ZeRO stage and offload choice: zeal's prediction of the peak "
                                 "and DeepSpeed's model-state estimators");
  struct Options {
    double params = 0, largest_layer = 0;
    std::string preset, hf_config, precision = "fp32", json_path, stages = "0,1,2,3", offloads = "none,cpu,nvme";
    int num_processes = 1, num_machines = 1;
    int64_t micro_batch = 1, seq_len = 1024;
    bool gpu = false;
    bool checkpointing = false, chunked_loss = false, untied_head = false;
    int64_t checkpoint_interval = 1, loss_chunk = 0, max_in_cpu = 1'000'000'000, trainable = -1,
            persistence = 100'000;
    std::string frozen_head = "auto";
  };
  auto o = std::make_shared<Options>();
  std::string presets;
  for (const auto& p : zeal::models::gpt_presets()) presets += (presets.empty() ? "" : ", ") + p.name;
  auto* src = cmd->add_option_group("model", "the model: one of");
  src->add_option("--params", o->params, "a parameter count (with --largest_layer_params)")
      ->check(flags::real_in(1, 1e15));
  src->add_option("--model", o->preset, "a GPT preset of train_gpt: " + presets);
  src->add_option("--hf_config", o->hf_config, "a Hugging Face config.json (GPT-2, BERT, LLaMA-style)");
  src->require_option(1);
  cmd->add_option("--largest_layer_params", o->largest_layer, "the largest module's own parameters (DeepSpeed's zero3 estimate)")
      ->check(flags::real_in(1, 1e15));
  cmd->add_option("--num_processes", o->num_processes, "ranks per machine (default 1)")->check(flags::integer_in(1, 1 << 16));
  cmd->add_option("--num_machines", o->num_machines, "machines (default 1)")->check(flags::integer_in(1, 1 << 16));
  cmd->add_option("--mixed_precision", o->precision, "fp32 (no), bf16 or fp16 (default fp32)")
      ->transform(CLI::IsMember({"no", "fp32", "bf16", "fp16"}));
  cmd->add_option("--micro_batch", o->micro_batch, "samples per rank per micro-step (default 1)")
      ->check(flags::integer_in(1, 1 << 20));
  cmd->add_option("--seq_len", o->seq_len, "tokens per sample (default 1024)")->check(flags::integer_in(1, 1 << 24));
  cmd->add_option("--stages", o->stages, "ZeRO stages, comma-separated (default 0,1,2,3)");
  cmd->add_option("--offload", o->offloads, "offload choices, comma-separated: none, cpu, nvme (default all)");
  cmd->add_flag("--gpu", o->gpu, "the model computes on GPUs (device and host columns); default: on the CPU");
  cmd->add_option("--activation_checkpointing", o->checkpointing,
                  "the blocks checkpoint their activations (the config's activation_checkpointing): true or false")
      ->default_str("false");
  cmd->add_option("--checkpoint_interval", o->checkpoint_interval,
                  "with checkpointing: every k-th block (activation_checkpointing.unit_interval; default 1)")
      ->check(flags::integer_in(1, 1 << 20));
  cmd->add_option("--chunked_loss", o->chunked_loss,
                  "the head and loss through zeal::chunked_cross_entropy, no whole logits (train_gpt's default): true or "
                  "false")
      ->default_str("false");
  cmd->add_option("--loss_chunk", o->loss_chunk, "tokens per chunk of the chunked loss (0: its default)")
      ->check(flags::integer_in(0, int64_t{1} << 40));
  cmd->add_option("--max_in_cpu", o->max_in_cpu,
                  "offload_param nvme: shard elements per rank kept in host memory (default DeepSpeed's 1e9)")
      ->check(flags::integer_in(0, int64_t{1} << 50));
  cmd->add_option("--stage3_param_persistence_threshold", o->persistence,
                  "stage 3: units with at most this many elements stay gathered (default 100000, the engine's "
                  "default and its value for \"auto\")")
      ->check(flags::integer_in(0, int64_t{1} << 50));
  cmd->add_option("--trainable_params", o->trainable,
                  "elements that train (LoRA's adapters); the rest are frozen (default: all train)")
      ->check(flags::integer_in(0, int64_t{1} << 50));
  cmd->add_option("--frozen_head", o->frozen_head,
                  "with --trainable_params: whether the LM head is frozen (true, LoRA's base) or trains (false); "
                  "default true")
      ->transform(CLI::IsMember({"auto", "true", "false"}));
  cmd->add_flag("--untied_head", o->untied_head, "with --model: an LM head of its own (train_gpt --untied_head)");
  cmd->add_option("--json", o->json_path, "also write the estimate as JSON here");
  return [o] {
    if (!o->json_path.empty()) check_output_file(o->json_path, "--json");  // before the work
    estimate::ModelShape m;
    if (!o->preset.empty()) {
      zeal::models::GptConfig c;
      try {
        c = zeal::models::gpt_preset(o->preset);
      } catch (const std::invalid_argument& e) {
        throw Error(std::string("--model: ") + e.what());
      }
      m = estimate::gpt_shape(c.name, c.vocab, c.context, c.layers, c.dim, c.heads, !o->untied_head);
    } else if (!o->hf_config.empty()) {
      try {
        m = estimate::hf_config_shape(o->hf_config);
      } catch (const std::runtime_error& e) {
        throw Error(e.what());
      }
    } else {
      if (o->largest_layer <= 0) throw Error("--params needs --largest_layer_params (DeepSpeed's zero3 estimate uses it)");
      m.name = fmt::format("{:.0f} parameters", o->params);
      m.params = static_cast<int64_t>(o->params);
      m.largest_layer = static_cast<int64_t>(o->largest_layer);
    }
    if (o->largest_layer > 0) m.largest_layer = static_cast<int64_t>(o->largest_layer);
    if (m.largest_layer > m.params) {
      throw Error(fmt::format("--largest_layer_params: {} is more than the model's {} parameters", m.largest_layer, m.params));
    }
    if (static_cast<int64_t>(o->num_processes) * o->num_machines > (1 << 20)) {
      throw Error(fmt::format("--num_processes {} x --num_machines {}: more than 1048576 ranks", o->num_processes,
                              o->num_machines));
    }
    estimate::RunShape r;
    r.world = o->num_processes * o->num_machines;
    r.nodes = o->num_machines;
    r.precision = o->precision == "no" ? "fp32" : o->precision;
    r.on_gpu = o->gpu;
    r.micro_batch = o->micro_batch;
    r.seq_len = o->seq_len;
    r.activation_checkpointing = o->checkpointing;
    r.checkpoint_interval = o->checkpoint_interval;
    r.chunked_loss = o->chunked_loss;
    r.loss_chunk = o->loss_chunk;
    r.max_in_cpu = o->max_in_cpu;
    r.persistence_threshold = o->persistence;
    if (o->trainable >= 0) {
      if (o->trainable > m.params) {
        throw Error(fmt::format("--trainable_params: {} is more than the model's {} parameters", o->trainable, m.params));
      }
      r.trainable_params = o->trainable;
    }
    if (o->untied_head && o->preset.empty()) throw Error("--untied_head goes with --model (a train_gpt preset)");
    if (!m.transformer && (o->checkpointing || o->chunked_loss)) {
      throw Error(std::string(o->checkpointing ? "--activation_checkpointing" : "--chunked_loss") +
                  " needs the model's layers: give --model or --hf_config (--params has model states only)");
    }
    if (o->checkpoint_interval != 1 && !o->checkpointing) {
      throw Error("--checkpoint_interval goes with --activation_checkpointing true");
    }
    if (o->loss_chunk != 0 && !o->chunked_loss) throw Error("--loss_chunk goes with --chunked_loss true");
    if (o->frozen_head != "auto") {
      if (o->trainable < 0) throw Error("--frozen_head goes with --trainable_params");
      r.frozen_head = o->frozen_head == "true";
    }
    // The runtime's share of every rank's memory, measured here after a short training run of
    // the tiny GPT (the libraries, the kernels' code a step pages in, the threads).
    r.runtime_bytes = measured_runtime_bytes(o->gpu);
    std::vector<int> stages;
    for (const auto& s : CLI::detail::split(o->stages, ',')) {
      if (s != "0" && s != "1" && s != "2" && s != "3") throw Error("--stages: '" + s + "' is not a ZeRO stage (0, 1, 2 or 3)");
      stages.push_back(std::stoi(s));
    }
    std::vector<estimate::Offload> offloads;
    for (const auto& s : CLI::detail::split(o->offloads, ',')) {
      if (s == "none") offloads.push_back(estimate::Offload::kNone);
      else if (s == "cpu") offloads.push_back(estimate::Offload::kCpu);
      else if (s == "nvme") offloads.push_back(estimate::Offload::kNvme);
      else throw Error("--offload: '" + s + "' is not none, cpu or nvme");
    }
    const auto rep = estimate::report(m, r, stages, offloads);
    std::fputs(rep.text.c_str(), stdout);
    if (!o->json_path.empty()) write_file_whole(o->json_path, rep.json + "\n", "--json");
    return 0;
  };
}

}  // namespace zeal::cli
