// Trains a GPT (examples/models/gpt.h) with zeal: the model is built with engine.init (partitioned
// in stage 3 with zero3_init_flag), then zeal::Trainer runs the loop with gradient accumulation from
// the config.
//
//   zeal launch --config_file configs/zero3.yaml build/bin/train_gpt --model tiny --steps 200
//       --seq_len 64 --micro_batch 8 --data README.md --log_jsonl train.jsonl   (one line)
//
// --data: files of tokens. A file with llm.c's header (int32 magic 20240520, version 1, token
// count, 1024 header bytes) holds uint16 GPT-2 tokens; any other file is read as bytes (tokens
// 0-255, which every preset's vocabulary covers). Without --data the tokens are random (timing).
// Sample i of the run is a window of seq_len + 1 tokens at a position drawn from --seed and i; the
// ranks take consecutive samples (the global batch of a step is micro_batch x ranks x accumulation
// of them), so a step's samples are the same on any number of ranks with the same global batch.
// Rank 0 shows a progress bar on a terminal (step, loss, tokens/s, s/step, ETA; under `zeal launch`
// too) and the Trainer's log every --log_every steps; --log_jsonl writes one JSON line per step
// with the resident set and its peak. --eval_every K holds the last tenth of the tokens out and
// reports the held-out loss every K steps and after the last (--eval_batches windows per rank).
// Each training epoch and evaluation prints its memory in PEFT's lines (before, consumed, peak,
// total peak, in MB, per device); at the end, where the training's peak went.
// --save_dir D saves a checkpoint as D/checkpoint-<k> every --save_every steps and after the last
// one; --resume D continues from D (or the checkpoint D/latest names) at the step it was saved
// after, whatever the world size and config of the run that saved it; --resume auto continues from
// --save_dir when it holds a checkpoint.
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
#include <memory>
#include <optional>
#include <vector>

#include "engine/engine.h"
#include "engine/estimate.h"
#include "engine/error.h"
#include "engine/output.h"
#include "engine/memory_tracker.h"
#include "engine/trainer/trainer.h"
#include "examples/common/flags.h"
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

using Window = torch::data::Example<at::Tensor, torch::data::example::NoTarget>;

// Sample i: seq_len + 1 tokens of the stream at a position drawn from the seed and i (random
// tokens without a stream); or, made with rows(), row i of fixed windows.
class Windows {
 public:
  Windows(at::Tensor stream, int64_t vocab, int64_t seq_len, int64_t count, uint64_t seed)
      : stream_(std::move(stream)), vocab_(vocab), seq_len_(seq_len), count_(count), seed_(seed) {}
  static Windows rows(at::Tensor rows) {
    Windows w({}, 0, rows.size(1) - 1, rows.size(0), 0);
    w.rows_ = std::move(rows);
    return w;
  }
  Window get(size_t i) const {
    if (rows_.defined()) return {rows_[static_cast<int64_t>(i)]};
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed_ * 1'000'003 + static_cast<uint64_t>(i));
    if (!stream_.defined() || stream_.numel() == 0) return {at::randint(0, vocab_, {seq_len_ + 1}, gen)};
    const int64_t start = at::randint(0, stream_.numel() - seq_len_ - 1, {1}, gen).item<int64_t>();
    return {stream_.narrow(0, start, seq_len_ + 1)};
  }
  size_t size() const { return static_cast<size_t>(count_); }

 private:
  at::Tensor stream_, rows_;
  int64_t vocab_, seq_len_, count_;
  uint64_t seed_;
};

// What the run reports beside the Trainer: the model's memory once prepared, one JSON line per step
// (rank 0; written once the step's evaluation, if any, is known), the training's memory, and an
// evaluation after the last step with --eval_every.
class RunLog : public zeal::TrainerCallback {
 public:
  RunLog(zeal::Engine& engine, std::ofstream* out, std::string path, int64_t seq_len, bool eval_at_end)
      : engine_(engine), out_(out), path_(std::move(path)), seq_len_(seq_len), eval_at_end_(eval_at_end) {}
  void on_train_begin(const Args&, const zeal::TrainerState&, zeal::TrainerControl&) override {
    engine_.print("zeal: per-rank memory: ", engine_.memory().summary());
    phase_ = std::make_unique<zeal::MemoryTracker>(engine_, "train");
  }
  void on_step_end(const Args&, const zeal::TrainerState& s, zeal::TrainerControl& c) override {
    flush();
    if (eval_at_end_ && s.global_step == s.max_steps) c.should_evaluate = true;
    const auto mem = engine_.memory();
    const zeal::PhaseMemory so_far = phase_->now();
    pending_ = fmt::format("{{\"step\": {}, \"loss\": {:.6f}, \"grad_norm\": {:.6g}, \"step_s\": {:.4f}, "
                           "\"tokens_per_s\": {:.1f}, \"skipped\": {}, \"model_state_bytes\": {}, "
                           "\"gathered_peak_bytes\": {}, \"offload_host_bytes\": {}, \"offload_disk_bytes\": {}, "
                           "\"rss_bytes\": {}, \"peak_rss_bytes\": {}{}",
                           s.global_step - 1, s.step_loss, engine_.last_grad_norm(), s.step_seconds,
                           static_cast<double>(s.step_samples * seq_len_) / std::max(s.step_seconds, 1e-9),
                           engine_.optimizer_step_was_skipped() ? "true" : "false", mem.model_states(), mem.gathered_peak,
                           mem.offload_host, mem.offload_disk, so_far.cpu.end, so_far.cpu.peak,
                           so_far.device.measured ? fmt::format(", \"device_peak_bytes\": {}", so_far.device.peak) : "");
    // wall_clock_breakdown: the means of the window that ended at this step, on the step that ends it.
    if (const auto& b = engine_.wall_clock(); b.at_step > breakdown_at_) {
      breakdown_at_ = b.at_step;
      pending_ += fmt::format(", \"time_ms\": {{\"steps\": {}, \"forward\": {:.3f}, \"backward\": {:.3f}, \"step\": {:.3f}, "
                              "\"wait_reductions\": {:.3f}, \"wait_gathers\": {:.3f}, \"wait_reads\": {:.3f}, "
                              "\"wait_writes\": {:.3f}}}",
                              b.steps, b.forward_ms, b.backward_ms, b.step_ms, b.reduction_wait_ms, b.gather_wait_ms,
                              b.read_wait_ms, b.write_wait_ms);
    }
  }
  void on_evaluate(const Args&, const zeal::TrainerState&, zeal::TrainerControl&, const zeal::Metrics& m) override {
    if (!pending_.empty() && m.count("eval_loss")) pending_ += fmt::format(", \"eval_loss\": {:.6f}", m.at("eval_loss"));
    flush();
  }
  // A checkpoint holds this step: its line is written now, before a failure could lose it.
  void on_save(const Args&, const zeal::TrainerState&, zeal::TrainerControl&, const std::string&) override { flush(); }
  void on_train_end(const Args&, const zeal::TrainerState&, zeal::TrainerControl&) override {
    flush();
    if (!phase_) return;
    // Where the training's peak went (rank 0).
    const zeal::PhaseMemory m = phase_->end(false);
    if (!engine_.is_main_process()) return;
    std::string parts;
    for (const auto& p : m.breakdown()) {
      if (p.bytes == 0) continue;
      parts += fmt::format("{}{} {}", parts.empty() ? "" : ", ", p.name, zeal::format_bytes(static_cast<double>(p.bytes)));
    }
    engine_.print(fmt::format("zeal: train peak resident set {} (rank 0) = {}", zeal::format_bytes(static_cast<double>(m.cpu.peak)),
                              parts));
    if (m.engine.offload_disk > 0) {
      engine_.print(fmt::format("zeal: on disk: {} (offloaded optimizer state, gradients, parameters)",
                                zeal::format_bytes(static_cast<double>(m.engine.offload_disk))));
    }
  }

 private:
  void flush() {
    if (pending_.empty()) return;
    if (out_->is_open()) {
      *out_ << pending_ << "}\n";
      if (!out_->flush()) throw zeal::Error(fmt::format("--log_jsonl: writing {} failed (disk full?)", path_));
    }
    pending_.clear();
  }
  zeal::Engine& engine_;
  std::ofstream* out_;
  std::string path_;
  int64_t seq_len_;
  bool eval_at_end_;
  std::unique_ptr<zeal::MemoryTracker> phase_;
  std::string pending_;
  int64_t breakdown_at_ = 0;  // the optimizer step of the last breakdown written
};

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
  app.add_option("--save_dir", save_dir, "save checkpoints here (D/checkpoint-<k>, D/latest)");
  app.add_option("--save_every", save_every, "steps between checkpoints (0: after the last step only)")
      ->check(zeal_examples::non_negative());
  app.add_option("--resume", resume,
                 "continue from this checkpoint (or the one its latest names); auto: from --save_dir's latest when "
                 "there is one, else from the start (for zeal launch --max_restarts)");
  if (auto code = zeal_examples::parse_flags(app, argc, argv, "train_gpt")) return *code;
  const bool micro_given = app.count("--micro_batch") > 0;
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
    // The Trainer's arguments from this program's flags.
    const zeal::Config& c = engine.config();
    auto set_in_config = [&](const std::string& key) {
      auto it = c.origins.find(key);
      return it != c.origins.end() && it->second.kind != zeal::Origin::Kind::kDefault;
    };
    zeal::TrainingArguments args;
    args.max_steps = steps;
    args.learning_rate = lr;
    args.weight_decay = weight_decay;
    args.lr_scheduler_type = "constant";
    args.seed = seed;
    args.logging_steps = log_every;
    args.run_name = "train_gpt";
    // --micro_batch unless the config sets its own and the flag is not given.
    if (micro_given || !set_in_config("train_micro_batch_size_per_gpu") || c.train_micro_batch_size_per_gpu.is_auto) {
      args.per_device_train_batch_size = micro_batch;
    }
    const int64_t micro = args.per_device_train_batch_size.value_or(c.train_micro_batch_size_per_gpu.value);
    const int64_t accum = engine.gradient_accumulation_steps();
    const int world = engine.num_processes();
    engine.print(fmt::format("zeal: {} ({:.1f} M parameters), {} ranks, ZeRO stage {}, {} x {} tokens per rank per "
                             "micro-step, {} micro-steps per step",
                             cfg.name, cfg.num_parameters() / 1e6, world, engine.zero_stage(), micro, seq_len,
                             accum));
    if (built.construction_peak > 0) {
      engine.print(fmt::format("zeal: construction held at most {} (bound {})", zeal::format_bytes(built.construction_peak),
                               zeal::format_bytes(built.construction_bound)));
    }

    args.per_device_eval_batch_size = micro;
    // No clipping unless the config asks for it ("auto": Hugging Face's 1.0).
    if (c.gradient_clipping.is_auto) {
      args.max_grad_norm = 1.0;
    } else if (!set_in_config("gradient_clipping")) {
      args.max_grad_norm = 0.0;
    }
    if (eval_every > 0) {
      args.eval_strategy = "steps";
      args.eval_steps = eval_every;
    }
    if (!save_dir.empty()) {
      args.output_dir = save_dir;
      args.save_strategy = "steps";
      args.save_steps = save_every > 0 ? save_every : steps;  // and after the last step
    } else {
      args.save_strategy = "no";
    }
    args.resume_from_checkpoint = resume_auto ? "auto" : resume;

    // The run's samples, and the held-out windows (the same every evaluation).
    const int64_t per_step = micro * world * accum;
    Windows train_set(stream, cfg.vocab, seq_len, steps * per_step, seed);
    std::optional<Windows> eval_set;
    if (eval_every > 0) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 7'000'003 + 1);
      const int64_t n = eval_batches * micro * world;
      eval_set = Windows::rows(held_out.defined() ? held_out.index({at::randint(0, held_out.numel() - seq_len - 1, {n, 1}, gen) +
                                                                     at::arange(seq_len + 1).unsqueeze(0)})
                                                  : at::randint(0, cfg.vocab, {n, seq_len + 1}, gen));
    }
    zeal::Trainer trainer(engine, model, args, std::move(train_set), std::move(eval_set),
                          [&](const Window& b) { return model->loss(b.data); });
    trainer.shuffle_train = false;  // sample i is drawn from the seed and i already
    trainer.tracker_config = {{"model", cfg.name}, {"seq_len", std::to_string(seq_len)}};

    std::ofstream jsonl;
    if (!log_jsonl.empty() && engine.is_main_process()) {
      // --resume auto (a restart, or a job run again) continues the log instead of losing the steps
      // of the attempts before; a run started or resumed by hand starts it afresh.
      jsonl.open(log_jsonl, std::ios::out | (resume_auto ? std::ios::app : std::ios::trunc));
      if (!jsonl) throw zeal::Error(fmt::format("--log_jsonl: cannot write {}", log_jsonl));
    }
    trainer.add_callback(std::make_shared<RunLog>(engine, &jsonl, log_jsonl, seq_len, eval_every > 0));
    // The micro-batch's activations against the memory each rank may use, checked when the Trainer
    // prepares the model: a batch no rank can hold ends here, named, not in the kernel's OOM killer.
    zeal::estimate::RunShape batch;
    batch.micro_batch = micro;
    batch.seq_len = seq_len;
    batch.chunked_loss = cfg.chunked_loss;
    batch.loss_chunk = cfg.loss_chunk;
    engine.check_batch_memory(
        zeal::estimate::gpt_shape(cfg.name, cfg.vocab, cfg.context, cfg.layers, cfg.dim, cfg.heads, cfg.tie_head), batch);
    trainer.train();
    engine.end_training();
  } catch (const std::exception& e) {
    return zeal_examples::report_failure("train_gpt", e);
  }
  return zeal_examples::finish("train_gpt");
}
