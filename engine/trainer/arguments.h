// zeal::TrainingArguments: Hugging Face's TrainingArguments for zeal::Trainer, with its names and
// defaults, read from C++, a YAML or JSON file, or `--name value` flags. No LibTorch headers.
//
//   zeal::TrainingArguments args;                        // HF's defaults
//   args.num_train_epochs = 3; args.eval_strategy = "epoch";
//   auto args = zeal::TrainingArguments::from_file("train.yaml");
//   auto args = zeal::TrainingArguments::parse(argc, argv, &rest);   // --learning_rate 2e-5 …
//
// gradient_accumulation_steps, max_grad_norm and per_device_train_batch_size are also the
// engine config's gradient_accumulation_steps, gradient_clipping and train_micro_batch_size_per_gpu:
// unset here, the config's value holds (Hugging Face's default where the config sets none); set in
// both to different values, the Trainer refuses to start and names both places.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace zeal {

struct TrainingArguments {
  std::string output_dir = "trainer_output";  // checkpoints: output_dir/checkpoint-<step>
  double num_train_epochs = 3.0;              // fractions end inside the last epoch
  int64_t max_steps = -1;                     // > 0: optimizer steps in all (overrides epochs)
  std::optional<int64_t> per_device_train_batch_size;  // HF's default 8
  int64_t per_device_eval_batch_size = 8;
  std::optional<int64_t> gradient_accumulation_steps;  // HF's default 1
  double learning_rate = 5e-5;
  double weight_decay = 0.0;  // not on biases and normalization weights (as HF's Trainer)
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_epsilon = 1e-8;
  std::optional<double> max_grad_norm;  // HF's default 1.0; 0: no clipping
  // linear, cosine, polynomial (to 1e-7, power 1), constant, constant_with_warmup
  std::string lr_scheduler_type = "linear";
  int64_t warmup_steps = 0;   // wins over warmup_ratio when > 0
  double warmup_ratio = 0.0;  // of the total optimizer steps, rounded up
  std::string logging_strategy = "steps";  // no, steps, epoch
  int64_t logging_steps = 500;
  bool logging_first_step = false;
  std::string eval_strategy = "no";  // no, steps, epoch
  int64_t eval_steps = 0;            // 0: logging_steps
  std::string save_strategy = "steps";  // no, steps, epoch
  int64_t save_steps = 500;
  int64_t save_total_limit = 0;  // keep at most this many checkpoints (0: all); the best is kept
  bool load_best_model_at_end = false;
  std::string metric_for_best_model;       // empty: "loss" (eval_loss); "eval_" is prepended
  std::optional<bool> greater_is_better;   // unset: false for a loss, true otherwise
  uint64_t seed = 42;                      // the data's order and at::manual_seed at the start
  // Where train() starts: "" from the beginning, a checkpoint directory, "latest" (output_dir's
  // newest checkpoint; an error when there is none) or "auto" (that one when there is one, else the
  // beginning: for `zeal launch --max_restarts`).
  std::string resume_from_checkpoint;
  // Trackers: tensorboard, csv, jsonl, all or none ("" leaves the config's log_with as it is).
  std::vector<std::string> report_to;
  std::string logging_dir;      // "" : the config's logging_dir
  std::string run_name;         // the trackers' project name; "" : "trainer"
  bool disable_tqdm = false;    // no progress bar (plain lines every logging_steps instead)
  bool dataloader_drop_last = false;
  int64_t dataloader_num_workers = 0;      // threads preparing batches beside the step (zeal::LoaderOptions)
  int64_t dataloader_prefetch_factor = 2;  // batches prepared ahead per worker
  int64_t early_stopping_patience = 0;      // > 0: adds HF's EarlyStoppingCallback with these
  double early_stopping_threshold = 0.0;

  // The metric name train() compares ("eval_loss" by default).
  std::string best_metric_key() const;
  bool best_is_greater() const;

  // Sets one argument by its Hugging Face name from text, `where` naming the origin for errors
  // ("--learning_rate", "train.yaml"). zeal::Error naming both on an unknown name or bad value.
  void set(const std::string& name, const std::string& value, const std::string& where);
  // Checks the arguments together (strategies, steps, best-model settings); zeal::Error listing
  // every problem.
  void validate() const;

  // A YAML or JSON file of name: value pairs, over Hugging Face's defaults or the program's.
  static TrainingArguments from_file(const std::string& path);
  static TrainingArguments from_file(const std::string& path, const TrainingArguments& defaults);
  // `--name value` and `--name=value` flags (a bare boolean flag means true), and one
  // `--training_args FILE` whose values the flags then override, over `defaults` (the program's).
  // What is not an argument's flag is left, in order, in `rest` (the program's own flags,
  // --config_file, …).
  static TrainingArguments parse(int argc, const char* const* argv, std::vector<std::string>* rest,
                                 const TrainingArguments& defaults);
  static TrainingArguments parse(int argc, const char* const* argv, std::vector<std::string>* rest = nullptr);
  // Every argument's name, type and one line of help (a program's --help).
  static std::string help();
  // The arguments as name → value text (the trackers' hyperparameters, a digest across ranks).
  std::map<std::string, std::string> to_map() const;
};

}  // namespace zeal
