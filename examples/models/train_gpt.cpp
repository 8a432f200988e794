// Trains a GPT (examples/models/gpt.h) with zeal: the model is built with engine.init (partitioned
// in stage 3 with zero3_init_flag), then the usual loop with gradient accumulation from the config.
//
//   zeal launch --config_file configs/zero3.yaml build/bin/train_gpt --model tiny --steps 200
//       --seq_len 64 --micro_batch 8 --data README.md --log_jsonl train.jsonl   (one line)
//
// --data: files of tokens. A file with llm.c's header (int32 magic 20240520, version 1, token
// count, 1024 header bytes) holds uint16 GPT-2 tokens; any other file is read as bytes (tokens
// 0-255, which every preset's vocabulary covers). Without --data the tokens are random (timing).
// Each step every rank reads its own windows of seq_len + 1 tokens at positions drawn from --seed.
// Rank 0 shows a progress bar on a terminal (step, loss, tokens/s, s/step, ETA; under `zeal launch`
// too) and plain lines every --log_every steps otherwise; --log_jsonl writes one JSON line per step
// with the resident set and its peak. --eval_every K holds the last tenth of the tokens out and
// reports the held-out loss every K steps (--eval_batches windows per rank). At the end each phase
// prints its memory report: PEFT's lines (before, consumed, peak, total peak, in MB, per device)
// and where the peak went.
// --save_dir D saves a checkpoint as D/step_<k> every --save_every steps and after the last one;
// --resume D continues from D (or the checkpoint D/latest names) at the step it was saved after,
// whatever the world size and config of the run that saved it (the samples of a step depend only
// on --seed and the step); --resume auto continues from --save_dir when it holds a checkpoint.
#include <torch/optim/adamw.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <vector>

#include "engine/engine.h"
#include "engine/error.h"
#include "engine/output.h"
#include "engine/memory_tracker.h"
#include "examples/common/flags.h"
#include "engine/progress.h"
#include "examples/models/gpt.h"

namespace {

std::vector<int64_t> read_tokens(const std::string& path, int64_t vocab) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw zeal::Error(fmt::format("--data: {} is a directory, not a file", path));
  std::ifstream f(path, std::ios::binary);
  if (!f) throw zeal::Error(fmt::format("--data: cannot open {}: {}", path, std::strerror(errno)));
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) throw zeal::Error(fmt::format("--data: cannot read {}: {}", path, std::strerror(errno)));
  std::vector<int64_t> out;
  int32_t header[3] = {0, 0, 0};
  if (bytes.size() >= 1024) {
    std::memcpy(header, bytes.data(), sizeof header);
  } else if (bytes.size() >= 4) {
    int32_t magic = 0;
    std::memcpy(&magic, bytes.data(), sizeof magic);
    if (magic == 20240520) {
      throw zeal::Error(fmt::format("--data: {} has llm.c's magic but is shorter than its 1024-byte header ({} bytes)",
                                    path, bytes.size()));
    }
  }
  if (header[0] == 20240520) {
    // llm.c's header: magic, version 1, token count; the tokens (uint16) follow its 1024 bytes.
    const int64_t count = header[2];
    const int64_t room = (static_cast<int64_t>(bytes.size()) - 1024) / 2;
    std::string wrong;
    if (header[1] != 1) wrong = fmt::format("version {} (only 1 is known)", header[1]);
    else if (count < 0) wrong = fmt::format("a token count of {}", count);
    else if (count > room) wrong = fmt::format("{} tokens but room for {} in its {} bytes", count, room, bytes.size());
    if (!wrong.empty()) {
      throw zeal::Error(fmt::format("--data: {} has llm.c's magic but an impossible header: {}", path, wrong));
    }
    const size_t n = static_cast<size_t>(count);
    out.resize(n);
    for (size_t i = 0; i < n; ++i) {
      uint16_t t;
      std::memcpy(&t, bytes.data() + 1024 + 2 * i, 2);
      out[i] = t;
    }
  } else {
    for (char c : bytes) out.push_back(static_cast<unsigned char>(c));
  }
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] >= vocab) {
      throw zeal::Error(fmt::format("--data: token {} at position {} of {} is outside the model's vocabulary of {}",
                                    out[i], i, path, vocab));
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train a GPT decoder with zeal"};
  app.allow_extras();  // --config_file and the config override flags are the engine's
  std::string preset = "tiny", log_jsonl;
  std::vector<std::string> data;
  int64_t steps = 100, seq_len = 64, micro_batch = 4, log_every = 10;
  double lr = 3e-4, weight_decay = 0.1;
  uint64_t seed = 1234;
  std::string presets;
  for (const auto& p : zeal::models::gpt_presets()) {
    presets += fmt::format("{}{} ({:.0f} M)", presets.empty() ? "" : ", ", p.name, p.num_parameters() / 1e6);
  }
  app.add_option("--model", preset, "model preset: " + presets)->capture_default_str();
  app.add_option("--steps", steps, "optimizer steps")->capture_default_str()->check(zeal_examples::at_least_one());
  app.add_option("--seq_len", seq_len, "tokens per sample")->capture_default_str()->check(zeal_examples::at_least_one());
  app.add_option("--micro_batch", micro_batch, "samples per rank per micro-step")
      ->capture_default_str()
      ->check(zeal_examples::integer_in(1, int64_t{1} << 20));
  app.add_option("--data", data, "token files (llm.c .bin, or bytes); none: random tokens");
  app.add_option("--log_jsonl", log_jsonl, "write one JSON line per step here (rank 0)");
  app.add_option("--log_every", log_every, "steps between printed lines")
      ->capture_default_str()
      ->check(zeal_examples::at_least_one());
  app.add_option("--lr", lr)->capture_default_str()->check(zeal_examples::positive_finite());
  app.add_option("--weight_decay", weight_decay)->capture_default_str()->check(zeal_examples::non_negative_finite());
  app.add_option("--seed", seed)->capture_default_str()->check(zeal_examples::non_negative());
  int64_t eval_every = 0, eval_batches = 4;
  app.add_option("--eval_every", eval_every, "steps between held-out evaluations (0: none); holds out the last tenth of --data")
      ->check(zeal_examples::non_negative());
  app.add_option("--eval_batches", eval_batches, "micro-batches per rank in each evaluation")
      ->capture_default_str()
      ->check(zeal_examples::at_least_one());
  bool chunked_loss = true, untied_head = false;
  int64_t loss_chunk = 0;
  app.add_flag("--untied_head", untied_head, "an LM head of its own (LLaMA-style lm_head) instead of wte's matrix");
  app.add_option("--chunked_loss", chunked_loss,
                 "the head and loss a chunk of tokens at a time, never the whole logits (false: the plain logits)")
      ->capture_default_str();
  app.add_option("--loss_chunk", loss_chunk, "tokens per chunk of the loss (0: about 8 Mi logits a block)")
      ->capture_default_str()
      ->check(zeal_examples::non_negative());
  std::string save_dir, resume;
  int64_t save_every = 0;
  app.add_option("--save_dir", save_dir, "save checkpoints here (D/step_<k>, D/latest)");
  app.add_option("--save_every", save_every, "steps between checkpoints (0: after the last step only)")
      ->check(zeal_examples::non_negative());
  app.add_option("--resume", resume,
                 "continue from this checkpoint (or the one its latest names); auto: from --save_dir's latest when "
                 "there is one, else from the start (for zeal launch --max_restarts)");
  if (auto code = zeal_examples::parse_flags(app, argc, argv, "train_gpt")) return *code;
  // The flags that depend on each other: wrong ones end here too, with exit code 2.
  zeal::models::GptConfig cfg;
  try {
    cfg = zeal::models::gpt_preset(preset);
    cfg.chunked_loss = chunked_loss;
    cfg.loss_chunk = loss_chunk;
    cfg.tie_head = !untied_head;
  } catch (const std::invalid_argument& e) {
    std::cerr << "train_gpt: --model: " << e.what() << "\n";
    return 2;
  }
  if (seq_len < 1 || seq_len > cfg.context) {
    std::cerr << fmt::format("train_gpt: --seq_len {} must be in 1..{} (the {} preset's context)\n", seq_len, cfg.context,
                             cfg.name);
    return 2;
  }
  const bool resume_auto = resume == "auto";
  if (resume_auto) {
    if (save_dir.empty()) {
      std::cerr << "train_gpt: --resume auto continues from --save_dir's latest checkpoint: give --save_dir too\n";
      return 2;
    }
    std::error_code ec;
    resume = std::filesystem::exists(std::filesystem::path(save_dir) / "latest", ec) ? save_dir : "";
  }
  std::optional<zeal::Config> config = zeal_examples::load_config(argc, argv, "train_gpt");
  if (!config) return 2;
  try {
    // The places results go, checked before any training time is spent.
    if (!save_dir.empty()) zeal::check_output_dir(save_dir, "--save_dir");
    if (!log_jsonl.empty()) zeal::check_output_file(log_jsonl, "--log_jsonl");
    zeal::Engine engine(std::move(*config));
    std::vector<int64_t> tokens;
    for (const auto& path : data) {
      auto t = read_tokens(path, cfg.vocab);
      tokens.insert(tokens.end(), t.begin(), t.end());
    }
    if (!data.empty() && static_cast<int64_t>(tokens.size()) < seq_len + 2) {
      throw zeal::Error(fmt::format("--data: {} tokens in all, fewer than --seq_len + 2 = {}", tokens.size(), seq_len + 2));
    }
    at::Tensor stream = at::tensor(tokens, at::kLong), held_out;
    if (eval_every > 0 && stream.numel() > 0) {
      const int64_t n_eval = stream.numel() / 10;
      if (n_eval < seq_len + 2 || stream.numel() - n_eval < seq_len + 2) {
        throw zeal::Error(fmt::format("--eval_every: {} tokens are too few to hold a tenth out for windows of --seq_len {}",
                                      stream.numel(), seq_len));
      }
      held_out = stream.narrow(0, stream.numel() - n_eval, n_eval);
      stream = stream.narrow(0, 0, stream.numel() - n_eval);
    }

    at::manual_seed(seed);
    auto model = engine.init<zeal::models::Gpt>(cfg);
    const auto built = engine.memory();
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(lr).weight_decay(weight_decay));
    auto [m, opt] = engine.prepare(model, optimizer);
    const int64_t accum = engine.gradient_accumulation_steps();
    const int world = engine.num_processes();
    engine.print(fmt::format("zeal: {} ({:.1f} M parameters), {} ranks, ZeRO stage {}, {} x {} tokens per rank per "
                             "micro-step, {} micro-steps per step",
                             cfg.name, cfg.num_parameters() / 1e6, world, engine.zero_stage(), micro_batch, seq_len,
                             accum));
    if (built.construction_peak > 0) {
      engine.print(fmt::format("zeal: construction held at most {} (bound {})", zeal::format_bytes(built.construction_peak),
                               zeal::format_bytes(built.construction_bound)));
    }
    engine.print("zeal: per-rank memory: ", engine.memory().summary());

    std::ofstream jsonl;
    if (!log_jsonl.empty() && engine.is_main_process()) {
      // --resume auto (a restart, or a job run again) continues the log instead of losing the steps
      // of the attempts before; a run started or resumed by hand starts it afresh.
      jsonl.open(log_jsonl, std::ios::out | (resume_auto ? std::ios::app : std::ios::trunc));
      if (!jsonl) throw zeal::Error(fmt::format("--log_jsonl: cannot write {}", log_jsonl));
    }
    const int64_t per_step = micro_batch * world * accum;
    // The config's trackers (log_with, tensorboard, csv_monitor) get every step's numbers.
    engine.init_trackers("train_gpt", {{"model", cfg.name},
                                       {"seq_len", std::to_string(seq_len)},
                                       {"micro_batch", std::to_string(micro_batch)},
                                       {"gradient_accumulation_steps", std::to_string(accum)},
                                       {"lr", fmt::format("{}", lr)},
                                       {"weight_decay", fmt::format("{}", weight_decay)},
                                       {"seed", std::to_string(seed)}});
    // The loop's own step count (fp16 steps skipped on overflow are steps here) goes into every
    // checkpoint with the engine's state.
    struct LoopStep : zeal::Checkpointable {
      int64_t step = 0;
      std::string state_dict() const override { return std::to_string(step); }
      void load_state_dict(const std::string& s) override { step = std::stoll(s); }
    };
    auto loop = std::make_shared<LoopStep>();
    engine.register_for_checkpointing(loop);
    if (!resume.empty()) {
      zeal::MemoryTracker load_phase(engine, "load");
      engine.load_state(resume);
      const zeal::PhaseMemory loaded = load_phase.end(false);
      engine.print(fmt::format("zeal: resumed from {} after step {}; the load's peak resident set {} (rank 0)", resume,
                               loop->step, zeal::format_bytes(static_cast<double>(loaded.cpu.peak))));
    }
    const int64_t first_step = loop->step;
    // Held-out loss: the same windows every time (drawn from --seed), each rank its rows, averaged
    // over the ranks.
    std::vector<zeal::PhaseMemory> evals;
    auto evaluate = [&]() {
      zeal::MemoryTracker phase(engine, "eval");
      m->eval();
      c10::NoGradGuard no_grad;
      auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 7'000'003 + 1);
      at::Tensor sum = at::zeros({}, at::TensorOptions(at::kFloat).device(engine.device()));
      for (int64_t k = 0; k < eval_batches; ++k) {
        const int64_t rows_n = micro_batch * world;
        at::Tensor rows;
        if (held_out.defined()) {
          at::Tensor starts = at::randint(0, held_out.numel() - seq_len - 1, {rows_n, 1}, gen);
          rows = held_out.index({starts + at::arange(seq_len + 1).unsqueeze(0)});
        } else {
          rows = at::randint(0, cfg.vocab, {rows_n, seq_len + 1}, gen);
        }
        rows = rows.narrow(0, engine.process_index() * micro_batch, micro_batch).to(engine.device());
        auto ac = engine.autocast();
        sum += m->loss(rows).to(at::kFloat);
      }
      m->train();
      const double loss = engine.reduce(sum, "mean").item<double>() / static_cast<double>(eval_batches);
      evals.push_back(phase.end(false));
      return loss;
    };
    zeal::ProgressBar bar(steps, engine.is_main_process(), log_every);
    zeal::MemoryTracker train_phase(engine, "train");
    double last_eval = std::nan("");
    const auto run_start = std::chrono::steady_clock::now();
    for (int64_t step = first_step; step < steps; ++step) {
      const auto t0 = std::chrono::steady_clock::now();
      // This step's windows for every rank and micro-step, from the seed: rank r, micro-step k
      // takes rows (k·world + r)·micro_batch onwards.
      auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 1'000'003 + static_cast<uint64_t>(step));
      at::Tensor batch;
      if (stream.numel() > 0) {
        at::Tensor starts = at::randint(0, stream.numel() - seq_len - 1, {per_step, 1}, gen);
        batch = stream.index({starts + at::arange(seq_len + 1).unsqueeze(0)});
      } else {
        batch = at::randint(0, cfg.vocab, {per_step, seq_len + 1}, gen);
      }
      at::Tensor loss_sum = at::zeros({}, at::TensorOptions(at::kFloat).device(engine.device()));  // reduced once per step
      for (int64_t k = 0; k < accum; ++k) {
        auto guard = engine.accumulate(m);
        at::Tensor rows = batch.narrow(0, (k * world + engine.process_index()) * micro_batch, micro_batch).to(engine.device());
        at::Tensor loss;
        {
          auto ac = engine.autocast();
          loss = m->loss(rows);
        }
        engine.backward(loss);
        loss_sum += loss.detach().to(at::kFloat);
        opt.step();
        opt.zero_grad();
      }
      engine.synchronize();  // the step's GPU work is done before the clock is read
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double loss = engine.reduce(loss_sum, "mean").item<double>() / static_cast<double>(accum);
      const double tokens_per_s = static_cast<double>(per_step * seq_len) / seconds;
      const auto mem = engine.memory();
      const zeal::PhaseMemory so_far = train_phase.now();
      bool evaluated = false;
      if (eval_every > 0 && ((step + 1) % eval_every == 0 || step + 1 == steps)) {
        last_eval = evaluate();
        evaluated = true;
        bar.line(fmt::format("step {}/{}: held-out loss {:.4f} (train loss {:.4f})", step + 1, steps, last_eval, loss));
      }
      zeal::Metrics metrics = {{"train/loss", loss},
                               {"train/grad_norm", engine.last_grad_norm()},
                               {"train/lr", engine.get_lr().empty() ? lr : engine.get_lr().front()},
                               {"train/tokens_per_s", tokens_per_s},
                               {"train/step_s", seconds},
                               {"memory/rss_bytes", static_cast<double>(so_far.cpu.end)},
                               {"memory/peak_rss_bytes", static_cast<double>(so_far.cpu.peak)}};
      if (evaluated) metrics["eval/loss"] = last_eval;
      engine.log(metrics, step + 1);
      if (jsonl.is_open()) {
        jsonl << fmt::format("{{\"step\": {}, \"loss\": {:.6f}, \"grad_norm\": {:.6g}, \"step_s\": {:.4f}, "
                             "\"tokens_per_s\": {:.1f}, \"skipped\": {}, \"model_state_bytes\": {}, "
                             "\"gathered_peak_bytes\": {}, \"offload_host_bytes\": {}, \"offload_disk_bytes\": {}, "
                             "\"rss_bytes\": {}, \"peak_rss_bytes\": {}{}{}}}\n",
                             step, loss, engine.last_grad_norm(), seconds, tokens_per_s,
                             engine.optimizer_step_was_skipped() ? "true" : "false", mem.model_states(),
                             mem.gathered_peak, mem.offload_host, mem.offload_disk, so_far.cpu.end, so_far.cpu.peak,
                             so_far.device.measured ? fmt::format(", \"device_peak_bytes\": {}", so_far.device.peak) : "",
                             evaluated ? fmt::format(", \"eval_loss\": {:.6f}", last_eval) : "");
        if (!jsonl.flush()) throw zeal::Error(fmt::format("--log_jsonl: writing {} failed (disk full?)", log_jsonl));
      }
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
      const double eta = elapsed / static_cast<double>(step + 1 - first_step) * static_cast<double>(steps - step - 1);
      bar.update(step + 1, loss, tokens_per_s, seconds, eta,
                 fmt::format(" | peak RSS {}{}", zeal::format_bytes(static_cast<double>(so_far.cpu.peak)),
                             engine.zero_stage() == 3 ? fmt::format(", gathered {}", zeal::format_bytes(mem.gathered_peak)) : ""));
      if (!save_dir.empty() && ((save_every > 0 && (step + 1) % save_every == 0) || step + 1 == steps)) {
        loop->step = step + 1;
        const std::string saved = engine.save_state(fmt::format("{}/step_{}", save_dir, step + 1));
        bar.line("zeal: saved " + saved);
      }
    }
    bar.finish();
    engine.end_training();
    const zeal::PhaseMemory train_mem = train_phase.end(false);
    if (engine.is_main_process()) {
      for (const auto& l : train_mem.lines()) engine.print(l);
      if (!evals.empty()) {
        for (const auto& l : evals.back().lines()) engine.print(l);
      }
      std::string parts;
      for (const auto& p : train_mem.breakdown()) {
        if (p.bytes == 0) continue;
        parts += fmt::format("{}{} {}", parts.empty() ? "" : ", ", p.name, zeal::format_bytes(static_cast<double>(p.bytes)));
      }
      engine.print(fmt::format("zeal: train peak resident set {} (rank 0) = {}", zeal::format_bytes(static_cast<double>(train_mem.cpu.peak)),
                               parts));
      if (train_mem.engine.offload_disk > 0) {
        engine.print(fmt::format("zeal: on disk: {} (offloaded optimizer state, gradients, parameters)", zeal::format_bytes(static_cast<double>(train_mem.engine.offload_disk))));
      }
    }
  } catch (const std::exception& e) {
    return zeal_examples::report_failure("train_gpt", e);
  }
  return zeal_examples::finish("train_gpt");
}
