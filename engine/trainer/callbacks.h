// zeal::Trainer's state and callbacks, as Hugging Face's TrainerState, TrainerControl and
// TrainerCallback. No LibTorch headers.
//
//   struct PrintEval : zeal::TrainerCallback {
//     void on_evaluate(const zeal::TrainingArguments&, const zeal::TrainerState& s, zeal::TrainerControl&,
//                      const zeal::Metrics& m) override { ... }
//   };
//   trainer.add_callback(std::make_shared<PrintEval>());
//
// Every rank calls the callbacks, with the same values; a callback that writes should do so on
// one rank only (state.is_world_process_zero).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "engine/trackers.h"
#include "engine/trainer/arguments.h"

namespace zeal {

// Where training stands; saved in every checkpoint (trainer_state.json) and restored on resume.
struct TrainerState {
  int64_t global_step = 0;     // optimizer steps taken (fp16 steps skipped on overflow included)
  int64_t max_steps = 0;       // the steps train() will take in all
  int64_t num_train_epochs = 0;
  int64_t steps_per_epoch = 0;
  double epoch = 0;            // epochs done, with the fraction of the current one
  int64_t epochs_completed = 0;
  std::optional<double> best_metric;
  int64_t best_global_step = 0;
  std::string best_model_checkpoint;  // the checkpoint of the best metric, once saved
  std::vector<Metrics> log_history;   // every log and evaluation, each with "step" (and "epoch")
  bool is_world_process_zero = false;
  std::vector<std::string> callback_states;  // the callbacks' own states, in their order
  // The last optimizer step (zeal's, not in Hugging Face's state): its loss (every rank's mean),
  // seconds, and tokens (integer inputs' elements) and samples of every rank.
  double step_loss = 0, step_seconds = 0;
  int64_t step_tokens = 0, step_samples = 0;

  std::string to_json() const;
  static TrainerState from_json(const std::string& text);
};

// What the callbacks ask of the loop after the event they were told of.
struct TrainerControl {
  bool should_training_stop = false;
  bool should_epoch_stop = false;
  bool should_log = false;
  bool should_evaluate = false;
  bool should_save = false;
};

class TrainerCallback {
 public:
  virtual ~TrainerCallback() = default;
  using Args = TrainingArguments;
  virtual void on_train_begin(const Args&, const TrainerState&, TrainerControl&) {}
  virtual void on_epoch_begin(const Args&, const TrainerState&, TrainerControl&) {}
  // After each optimizer step, before its log, evaluation and save.
  virtual void on_step_end(const Args&, const TrainerState&, TrainerControl&) {}
  virtual void on_log(const Args&, const TrainerState&, TrainerControl&, const Metrics& /*logs*/) {}
  virtual void on_evaluate(const Args&, const TrainerState&, TrainerControl&, const Metrics& /*metrics*/) {}
  virtual void on_save(const Args&, const TrainerState&, TrainerControl&, const std::string& /*checkpoint*/) {}
  virtual void on_epoch_end(const Args&, const TrainerState&, TrainerControl&) {}
  virtual void on_train_end(const Args&, const TrainerState&, TrainerControl&) {}
  // State kept in checkpoints (a counter a resumed run must continue from).
  virtual std::string state() const { return ""; }
  virtual void load_state(const std::string&) {}
};

// Hugging Face's EarlyStoppingCallback: after `patience` evaluations in a row whose
// metric_for_best_model did not improve on the best so far by more than `threshold`, training stops.
class EarlyStoppingCallback : public TrainerCallback {
 public:
  explicit EarlyStoppingCallback(int64_t patience = 1, double threshold = 0.0)
      : patience_(patience), threshold_(threshold) {}
  void on_evaluate(const Args& args, const TrainerState& state, TrainerControl& control, const Metrics& metrics) override;
  std::string state() const override { return std::to_string(counter_); }
  void load_state(const std::string& s) override { counter_ = s.empty() ? 0 : std::stoll(s); }
  int64_t patience_counter() const { return counter_; }

 private:
  int64_t patience_;
  double threshold_;
  int64_t counter_ = 0;
};

}  // namespace zeal
