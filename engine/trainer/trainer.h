// zeal::Trainer: Hugging Face's Trainer over the Engine. It builds the data loaders, the AdamW
// optimizer and the learning-rate schedule from TrainingArguments, prepares them with the model,
// and runs the loop: gradient accumulation, clipping, logging to the config's trackers, evaluation
// and checkpoints on their cadence, the best checkpoint loaded at the end, early stopping, and
// resuming from a checkpoint. Every rank runs it; the main process prints, logs and draws the
// progress bar. docs/trainer.md is the guide.
//
//   zeal::Engine engine(zeal::Config::from_env_or_file(argc, argv));
//   auto model = engine.init<Classifier>(...);
//   zeal::Trainer trainer(engine, model, args, train_set, eval_set,
//                         [&](const auto& batch) {            // the loss of a batch, or a StepOutput
//                           auto logits = model->forward(batch.data);
//                           return zeal::StepOutput{cross_entropy(logits, batch.target), logits.argmax(-1), batch.target};
//                         });
//   trainer.compute_metrics = [](const zeal::EvalPrediction& p) { return zeal::Metrics{{"accuracy", ...}}; };
//   trainer.train();
//   auto metrics = trainer.evaluate();
//
// Without a step function the model's forward(batch) must return the loss (an at::Tensor) or a
// StepOutput. The datasets are zeal::DataLoader datasets (get(i), size()); train and evaluation
// batches are collated the same way.
#pragma once

#include <torch/optim/adamw.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "engine/trainer/arguments.h"
#include "engine/trainer/callbacks.h"

namespace zeal {

// What a step function returns: the loss, and for evaluation the predictions and labels to gather
// for compute_metrics (either may be left undefined).
struct StepOutput {
  at::Tensor loss;
  at::Tensor predictions;
  at::Tensor labels;
};

// Every rank's predictions and labels of an evaluation, in dataset order, the samples repeated to
// even out the last batch left out (on the CPU; rows of different lengths padded with -100).
struct EvalPrediction {
  at::Tensor predictions, label_ids;
};

struct PredictionOutput {
  at::Tensor predictions, label_ids;
  Metrics metrics;  // test_loss and compute_metrics' values, "test_"-prefixed
};

struct TrainOutput {
  int64_t global_step = 0;
  double training_loss = 0;  // the mean loss over the steps this train() ran
  Metrics metrics;           // train_runtime, train_samples_per_second, train_steps_per_second, train_loss, epoch
};

namespace detail {

// The Trainer's work that does not depend on the batch type (engine/trainer/trainer_core.cpp).
class TrainerCore {
 public:
  TrainerCore(Engine& engine, std::shared_ptr<torch::nn::Module> model, TrainingArguments args);
  virtual ~TrainerCore();

  const TrainingArguments& args() const { return args_; }
  const TrainerState& state() const { return state_; }
  void add_callback(std::shared_ptr<TrainerCallback> callback);
  // Hugging Face's `optimizers=(optimizer, scheduler)`: use these instead of the ones made from
  // the arguments (before train/evaluate). The optimizer's groups keep their own rates; the
  // schedule (any zeal::optim::LrSchedule; null: the arguments') is prepared with it.
  void set_optimizer(std::shared_ptr<torch::optim::Optimizer> optimizer,
                     std::shared_ptr<optim::LrSchedule> schedule = nullptr);
  // Hugging Face's compute_metrics: metrics of the gathered predictions ("eval_"-prefixed in the result).
  std::function<Metrics(const EvalPrediction&)> compute_metrics;
  // More hyperparameters the trackers record beside the arguments (the model's name, …).
  std::map<std::string, std::string> tracker_config;

 protected:
  // --- for the loop in Trainer<...> ---
  struct Sizes {
    int64_t train_batches = 0;  // per rank per epoch
    int64_t train_samples = 0;  // per epoch, all ranks
  };
  void prepare_once(bool has_eval, const std::function<Sizes()>& prepare_loaders,
                    const std::function<void(torch::optim::Optimizer*, std::shared_ptr<optim::LrSchedule>)>& prepare_model);
  bool begin_train();  // false: nothing left to train
  void begin_epoch(int64_t epoch);
  // A micro-step's local loss (detached) and the tokens and samples it saw on this rank.
  void micro_step(const at::Tensor& loss, int64_t tokens, int64_t samples);
  // After a sync micro-step: the step's log, evaluation, save, callbacks; true when the epoch ends
  // here (training stops, or a callback ends the epoch).
  bool after_step(int64_t epoch);
  // `finished`: the loader ran to the epoch's end (a stop may leave it before). True when training ends.
  // `data`: the train loader's time this epoch (a line says how much was on the loop's path).
  bool end_epoch(int64_t epoch, bool finished, const data::LoaderStats& data);
  TrainOutput end_train();
  int64_t epochs_to_run() const { return state_.num_train_epochs; }
  bool training_stops() const { return control_.should_training_stop; }

  // The evaluation loop over the prepared evaluation loader (the template's), with the loss and
  // what to gather for each batch.
  virtual Metrics run_evaluation(const std::string& prefix) = 0;
  Metrics evaluation_metrics(const std::string& prefix, std::vector<at::Tensor>& losses, std::vector<at::Tensor>& preds,
                             std::vector<at::Tensor>& labels, double seconds, int64_t samples);
  // Appends a batch's gathered tensors (on the CPU).
  void gather_batch(const StepOutput& out, int64_t batch_size, std::vector<at::Tensor>& losses,
                    std::vector<at::Tensor>& preds, std::vector<at::Tensor>& labels);
  Metrics evaluate_now();

  Engine& engine_;
  std::shared_ptr<torch::nn::Module> model_;
  TrainingArguments args_;
  bool prepared_ = false;

 private:
  struct Loop;
  void resolve_engine_settings();
  void check_same_arguments();
  std::shared_ptr<torch::optim::Optimizer> make_optimizer();
  std::shared_ptr<optim::LrSchedule> make_schedule(int64_t total_steps);
  void log(Metrics logs);
  void say(const std::string& line);
  void maybe_log_save_evaluate();
  void save_checkpoint();
  void rotate_checkpoints(const std::string& just_saved);
  void update_best(const Metrics& metrics);
  void load_best();
  std::string resume_dir() const;

  // The state and the callbacks, shared with the engine's checkpoints (which may outlive the Trainer).
  struct Shared {
    TrainerState state;
    std::vector<std::shared_ptr<TrainerCallback>> callbacks;
  };
  std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
  TrainerState& state_ = shared_->state;
  std::vector<std::shared_ptr<TrainerCallback>>& callbacks_ = shared_->callbacks;
  TrainerControl control_;
  bool track_best_ = false;  // metric_for_best_model, load_best_model_at_end or early stopping asks for it
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  std::shared_ptr<optim::LrSchedule> schedule_;
  std::unique_ptr<PreparedOptimizer> prepared_optimizer_;
  std::unique_ptr<Loop> loop_;
  int64_t train_samples_ = 0;

 protected:
  PreparedOptimizer& optimizer() { return *prepared_optimizer_; }
};

template <class T>
int64_t leading_size(const T& x) {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    return x.dim() > 0 ? x.size(0) : 1;
  } else if constexpr (requires { x.data.size(0); }) {
    return x.data.dim() > 0 ? x.data.size(0) : 1;
  } else {
    return 1;
  }
}

// Tokens of a batch: the elements of its integer input (token ids), else 0.
template <class T>
int64_t token_count(const T& x) {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    return at::isIntegralType(x.scalar_type(), false) && x.dim() >= 2 ? x.numel() : 0;
  } else if constexpr (requires { x.data.numel(); }) {
    return token_count(x.data);
  } else {
    return 0;
  }
}

}  // namespace detail

template <class Dataset, class Collate = data::Stack>
class Trainer : public detail::TrainerCore {
 public:
  using Loader = DataLoader<Dataset, Collate>;
  using Batch = typename Loader::Batch;
  using StepFn = std::function<StepOutput(const Batch&)>;

  // `step`: the loss of a batch (returning at::Tensor or StepOutput). Without one, the model's
  // forward(batch) gives it.
  template <class Model, class Step>
  Trainer(Engine& engine, const Model& model, TrainingArguments args, Dataset train_dataset,
          std::type_identity_t<std::optional<Dataset>> eval_dataset, Step step, Collate collate = {})
      : TrainerCore(engine, as_module(model), std::move(args)), collate_(std::move(collate)) {
    step_ = wrap(std::move(step));
    make_loaders(std::move(train_dataset), std::move(eval_dataset));
  }
  template <class Model>
  Trainer(Engine& engine, const Model& model, TrainingArguments args, Dataset train_dataset,
          std::type_identity_t<std::optional<Dataset>> eval_dataset = std::nullopt)
      : TrainerCore(engine, as_module(model), std::move(args)) {
    auto impl = as_impl(model);
    step_ = wrap([impl](const Batch& b) { return impl->forward(b); });
    make_loaders(std::move(train_dataset), std::move(eval_dataset));
  }

  TrainOutput train() {
    ensure_prepared();
    if (!begin_train()) return end_train();
    for (int64_t epoch = state().epochs_completed; epoch < epochs_to_run(); ++epoch) {
      begin_epoch(epoch);
      bool finished = true;
      for (auto it = train_->begin(); it != train_->end(); ++it) {
        const Batch& batch = *it;
        {
          auto guard = engine_.accumulate();
          at::Tensor loss;
          {
            auto ac = engine_.autocast();
            loss = step_(batch).loss;
          }
          if (!loss.defined()) throw Error("zeal::Trainer: the step function returned no loss for a training batch");
          engine_.backward(loss);
          micro_step(loss.detach(), detail::token_count(batch), detail::leading_size(batch));
          optimizer().step();
          optimizer().zero_grad();
        }
        if (engine_.sync_gradients() && after_step(epoch)) {
          if (training_stops()) {
            // Left early: the epoch is finished only if that was its last batch (comparing with
            // the end then closes the loader's epoch, as running to the end would have).
            ++it;
            finished = it == train_->end();
          } else {
            // A callback ended the epoch: the loader's epoch is closed without reading the rest.
            for (++it; it != train_->end(); ++it) {
            }
          }
          break;
        }
      }
      // As Hugging Face's loop: the epoch's end (its evaluation and save) comes even after a stop.
      if (end_epoch(epoch, finished, train_->stats())) break;
    }
    return end_train();
  }

  // Prepares the model, optimizer, schedule and loaders now (train, evaluate and predict do it
  // themselves): before using a model engine.init built, outside the Trainer, ahead of training.
  void prepare() { ensure_prepared(); }

  // The evaluation dataset's loss ("eval_loss") and compute_metrics' values ("eval_" prefixed),
  // logged to the trackers and told to the callbacks. Collective.
  Metrics evaluate() {
    ensure_prepared();
    return evaluate_now();
  }

  // Predictions for `dataset` (every rank's, in order), with test_loss and compute_metrics'
  // values. Collective.
  PredictionOutput predict(Dataset dataset) {
    ensure_prepared();
    Loader loader(std::move(dataset), {.batch_size = args_.per_device_eval_batch_size}, collate_);
    loader = engine_.prepare(loader);
    PredictionOutput out;
    std::vector<at::Tensor> losses, preds, labels;
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t samples = run_loader(loader, losses, preds, labels);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    out.metrics = evaluation_metrics("test", losses, preds, labels, s, samples);
    if (!preds.empty()) out.predictions = at::cat(preds);
    if (!labels.empty()) out.label_ids = at::cat(labels);
    return out;
  }

  // The training samples in a new order each epoch (seed and epoch), as Hugging Face's; off for a
  // dataset whose order is already random (before train or evaluate).
  bool shuffle_train = true;

  // The prepared loaders (after train, evaluate or predict).
  Loader& train_loader() { return *train_; }

 private:
  template <class Model>
  static std::shared_ptr<torch::nn::Module> as_module(const Model& m) {
    if constexpr (ModuleHolderLike<Model>) {
      return m.ptr();
    } else {
      return m;
    }
  }
  // The model's own class (its forward), shared.
  template <class Model>
  static auto as_impl(const Model& m) {
    if constexpr (ModuleHolderLike<Model>) {
      return m.ptr();
    } else {
      return m;
    }
  }
  template <class F>
  static StepFn wrap(F f) {
    return [f = std::move(f)](const Batch& b) -> StepOutput {
      using R = std::decay_t<decltype(f(b))>;
      if constexpr (std::is_same_v<R, StepOutput>) {
        return f(b);
      } else {
        static_assert(std::is_convertible_v<R, at::Tensor>, "the step function must return an at::Tensor loss or a zeal::StepOutput");
        return StepOutput{f(b), {}, {}};
      }
    };
  }
  void make_loaders(Dataset train, std::optional<Dataset> eval) {
    train_set_.emplace(std::move(train));
    eval_set_ = std::move(eval);
  }
  void ensure_prepared() {
    if (prepared_) return;
    prepare_once(
        eval_set_.has_value(), [&] {
          // The micro-batch is known only now (the arguments or the config's).
          LoaderOptions t;
          t.batch_size = engine_.config().train_micro_batch_size_per_gpu.value;
          t.shuffle = shuffle_train;
          t.seed = args_.seed;
          t.drop_last = args_.dataloader_drop_last;
          t.num_workers = static_cast<int>(args_.dataloader_num_workers);
          t.prefetch_factor = static_cast<int>(args_.dataloader_prefetch_factor);
          train_.emplace(std::move(*train_set_), t, collate_);
          train_set_.reset();
          *train_ = engine_.prepare(*train_);
          if (eval_set_) {
            eval_.emplace(std::move(*eval_set_),
                          LoaderOptions{.batch_size = args_.per_device_eval_batch_size,
                                        .num_workers = t.num_workers,
                                        .prefetch_factor = t.prefetch_factor},
                          collate_);
            eval_set_.reset();
            *eval_ = engine_.prepare(*eval_);
          }
          return Sizes{train_->size(), train_->dataset_size()};
        },
        [&](torch::optim::Optimizer* opt, std::shared_ptr<optim::LrSchedule> schedule) {
          if (opt) {
            (void)engine_.prepare(model_, *opt);
          } else {
            (void)engine_.prepare(model_);  // the config's optimizer
          }
          if (schedule) (void)engine_.prepare(schedule);
        });
  }
  int64_t run_loader(Loader& loader, std::vector<at::Tensor>& losses, std::vector<at::Tensor>& preds,
                     std::vector<at::Tensor>& labels) {
    model_->eval();
    c10::NoGradGuard no_grad;
    int64_t samples = 0;
    for (auto& batch : loader) {
      StepOutput out;
      {
        auto ac = engine_.autocast();
        out = step_(batch);
      }
      const int64_t n = detail::leading_size(batch);
      samples += n;
      gather_batch(out, n, losses, preds, labels);
    }
    model_->train();
    return samples;
  }
  Metrics run_evaluation(const std::string& prefix) override {
    if (!eval_) throw Error("zeal::Trainer: evaluation needs an evaluation dataset (the constructor's eval_dataset)");
    std::vector<at::Tensor> losses, preds, labels;
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t samples = run_loader(*eval_, losses, preds, labels);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return evaluation_metrics(prefix, losses, preds, labels, s, samples);
  }

  Collate collate_;
  StepFn step_;
  std::optional<Dataset> train_set_, eval_set_;  // until prepared
  std::optional<Loader> train_, eval_;
};

}  // namespace zeal
