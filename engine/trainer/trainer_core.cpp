// zeal::Trainer's loop bookkeeping: the engine settings from the arguments, the optimizer and
// schedule, Hugging Face's DefaultFlowCallback cadence (log, evaluate, save), the best metric,
// checkpoint rotation, resuming, and the reports.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>
#include <typeinfo>
#include <unordered_set>

#include "engine/memory_tracker.h"
#include "engine/output.h"
#include "engine/progress.h"
#include "engine/trainer/trainer.h"

namespace zeal::detail {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The trackers' names for the Trainer's log keys, as Hugging Face's TensorBoard callback rewrites them.
std::string tracker_name(const std::string& k) {
  if (k.find('/') != std::string::npos) return k;
  for (const char* p : {"eval_", "test_"}) {
    const std::string prefix(p);
    if (k.rfind(prefix, 0) == 0) return prefix.substr(0, 4) + "/" + k.substr(prefix.size());
  }
  return "train/" + k;
}

std::string format_logs(const Metrics& m) {
  std::string out = "{";
  for (const auto& [k, v] : m) {
    if (k.find('/') != std::string::npos) continue;  // memory/… go to the trackers only
    out += fmt::format("{}'{}': {:.6g}", out.size() > 1 ? ", " : "", k, v);
  }
  return out + "}";
}

// Rows of different trailing sizes (token predictions of batches of other lengths) padded with -100.
at::Tensor concat_padded(const std::vector<at::Tensor>& parts) {
  if (parts.empty()) return {};
  std::vector<int64_t> shape = parts[0].sizes().vec();
  bool same = true;
  for (const auto& p : parts) {
    if (p.dim() != parts[0].dim()) throw Error("zeal::Trainer: the step function's predictions change rank between batches");
    for (int64_t d = 1; d < p.dim(); ++d) {
      if (p.size(d) != shape[d]) same = false;
      shape[d] = std::max(shape[d], p.size(d));
    }
  }
  if (same) return at::cat(parts);
  std::vector<at::Tensor> padded;
  for (const auto& p : parts) {
    std::vector<int64_t> s = shape;
    s[0] = p.size(0);
    at::Tensor t = at::full(s, -100, p.options());
    at::Tensor view = t;
    for (int64_t d = 1; d < p.dim(); ++d) view = view.narrow(d, 0, p.size(d));
    view.copy_(p);
    padded.push_back(t);
  }
  return at::cat(padded);
}

// Each callback's state under its type's name ("<type>\n<state>"), so that a callback gets its own
// back whatever the others are.
std::vector<std::string> callback_states(const std::vector<std::shared_ptr<TrainerCallback>>& callbacks) {
  std::vector<std::string> out;
  for (const auto& cb : callbacks) out.push_back(std::string(typeid(*cb).name()) + "\n" + cb->state());
  return out;
}

void load_callback_states(const std::vector<std::shared_ptr<TrainerCallback>>& callbacks, const std::vector<std::string>& states) {
  std::vector<bool> used(states.size(), false);
  for (const auto& cb : callbacks) {
    const std::string type = typeid(*cb).name();
    for (size_t i = 0; i < states.size(); ++i) {
      const size_t nl = states[i].find('\n');
      if (used[i] || nl == std::string::npos || states[i].compare(0, nl, type) != 0) continue;
      used[i] = true;
      cb->load_state(states[i].substr(nl + 1));
      break;
    }
  }
}

}  // namespace

// What one train() call keeps between steps.
struct TrainerCore::Loop {
  ProgressBar bar;
  std::unique_ptr<MemoryTracker> epoch_memory;
  Clock::time_point start = Clock::now(), step_start = Clock::now(), log_start = Clock::now();
  int64_t first_step = 0;
  at::Tensor step_loss;  // local sum of this step's micro-step losses
  int64_t micro_steps = 0;
  double log_loss = 0, total_loss = 0;
  int64_t log_steps = 0, total_steps = 0, last_logged = -1, last_saved = -1;
  int64_t tokens = 0, samples = 0, log_tokens = 0, log_samples = 0, step_tokens = 0, step_samples = 0;  // this rank's
  int64_t all_tokens = 0, all_samples = 0, log_all_tokens = 0, log_all_samples = 0;  // every rank's
  double last_loss = 0;
  Loop(int64_t total, bool draw, int64_t every) : bar(total, draw, every) {}
};

// The Trainer's state in the engine's checkpoints.
template <class Shared>
class TrainerStateObject : public Checkpointable {
 public:
  explicit TrainerStateObject(std::shared_ptr<Shared> s) : s_(std::move(s)) {}
  std::string state_dict() const override {
    s_->state.callback_states = callback_states(s_->callbacks);
    return s_->state.to_json();
  }
  void load_state_dict(const std::string& text) override {
    const bool zero = s_->state.is_world_process_zero;
    s_->state = TrainerState::from_json(text);
    s_->state.is_world_process_zero = zero;
    load_callback_states(s_->callbacks, s_->state.callback_states);
  }

 private:
  std::shared_ptr<Shared> s_;
};

TrainerCore::TrainerCore(Engine& engine, std::shared_ptr<torch::nn::Module> model, TrainingArguments args)
    : engine_(engine), model_(std::move(model)), args_(std::move(args)) {
  args_.validate();
  state_.is_world_process_zero = engine_.is_main_process();
  if (args_.early_stopping_patience > 0) {
    callbacks_.push_back(std::make_shared<EarlyStoppingCallback>(args_.early_stopping_patience, args_.early_stopping_threshold));
  }
  at::manual_seed(args_.seed);
}

TrainerCore::~TrainerCore() = default;

void TrainerCore::add_callback(std::shared_ptr<TrainerCallback> callback) {
  if (prepared_) throw Error("zeal::Trainer: add callbacks before train() or evaluate()");
  callbacks_.push_back(std::move(callback));
}

void TrainerCore::set_optimizer(std::shared_ptr<torch::optim::Optimizer> optimizer, std::shared_ptr<optim::LrSchedule> schedule) {
  if (prepared_) throw Error("zeal::Trainer: set the optimizer before train() or evaluate()");
  optimizer_ = std::move(optimizer);
  schedule_ = std::move(schedule);
}

// The arguments that are also config keys: one value, or a refusal naming both places.
void TrainerCore::resolve_engine_settings() {
  const Config& c = engine_.config();
  std::vector<Config::Setting> set;
  std::vector<std::string> problems;
  auto given = [&](const std::string& key) {
    auto it = c.origins.find(key);
    return it != c.origins.end() && it->second.kind != Origin::Kind::kDefault;
  };
  auto origin = [&](const std::string& key) { return c.origins.at(key).describe(); };
  auto program = [](const std::string& arg) { return Origin{Origin::Kind::kProgram, "zeal::Trainer's " + arg}; };
  auto decide = [&](const char* arg, auto value, bool config_set, auto config_value, auto hf_default, const char* key) {
    if (value && config_set && *value != config_value) {
      problems.push_back(fmt::format("{} is {} in the training arguments but {} is {} in the config ({}); set one of them",
                                     arg, *value, key, config_value, origin(key)));
      return;
    }
    const auto v = value ? *value : config_set ? config_value : hf_default;
    if (!config_set || v != config_value) set.push_back({key, fmt::format("{}", v), program(arg)});
  };
  const auto& micro = c.train_micro_batch_size_per_gpu;
  const auto& accum = c.gradient_accumulation_steps;
  const auto& total = c.train_batch_size;
  const bool accum_set = !accum.is_auto && given("gradient_accumulation_steps");
  const bool total_set = !total.is_auto && total.value > 0 && given("train_batch_size");
  // The micro-batch: the argument's, the config's, one a config's train_batch_size implies
  // (over the accumulation and the ranks, as DeepSpeed derives it), or Hugging Face's 8.
  int64_t implied = 8;
  if (total_set) {
    const int64_t a = args_.gradient_accumulation_steps.value_or(accum_set ? accum.value : 1);
    const int64_t per = a * engine_.num_processes();
    if (total.value % per == 0) implied = total.value / per;
  }
  decide("per_device_train_batch_size", args_.per_device_train_batch_size,
         !micro.is_auto && micro.value > 0 && given("train_micro_batch_size_per_gpu"), micro.value, implied,
         "train_micro_batch_size_per_gpu");
  // The accumulation only when the arguments give it: otherwise the config's (its default is Hugging
  // Face's 1; "auto" derives it from train_batch_size).
  if (args_.gradient_accumulation_steps) {
    decide("gradient_accumulation_steps", args_.gradient_accumulation_steps, accum_set, accum.value, int64_t{1},
           "gradient_accumulation_steps");
  } else if (accum.is_auto) {
    // Resolved now (the Trainer counts its steps before prepare): train_batch_size over the
    // micro-batch and the ranks, else 1.
    const bool micro_set = !micro.is_auto && micro.value > 0 && given("train_micro_batch_size_per_gpu");
    const int64_t m = args_.per_device_train_batch_size.value_or(micro_set ? micro.value : implied);
    const int64_t a = total_set ? std::max<int64_t>(1, total.value / (m * engine_.num_processes())) : 1;
    set.push_back({"gradient_accumulation_steps", std::to_string(a), program("gradient_accumulation_steps")});
  }
  const auto& clip = c.gradient_clipping;
  if (args_.max_grad_norm || !clip.is_auto) {
    decide("max_grad_norm", args_.max_grad_norm, !clip.is_auto && given("gradient_clipping"), clip.value, 1.0,
           "gradient_clipping");
  }
  if (!problems.empty()) throw ConfigError(problems);
  // A config optimizer's "auto" values from the arguments, as Hugging Face fills DeepSpeed's.
  if (c.optimizer.lr.is_auto) set.push_back({"optimizer.params.lr", fmt::format("{}", args_.learning_rate), program("learning_rate")});
  if (c.optimizer.betas.is_auto) {
    set.push_back({"optimizer.params.betas", fmt::format("[{}, {}]", args_.adam_beta1, args_.adam_beta2), program("adam_beta1/2")});
  }
  if (c.optimizer.eps.is_auto) set.push_back({"optimizer.params.eps", fmt::format("{}", args_.adam_epsilon), program("adam_epsilon")});
  if (c.optimizer.weight_decay.is_auto) {
    set.push_back({"optimizer.params.weight_decay", fmt::format("{}", args_.weight_decay), program("weight_decay")});
  }
  if (!args_.report_to.empty()) {
    std::vector<std::string> names;
    for (const auto& t : args_.report_to)
      if (t != "none") names.push_back(t);
    std::string list = "[";
    for (const auto& n : names) list += (list.size() > 1 ? ", " : "") + n;
    set.push_back({"log_with", list + "]", program("report_to")});
  }
  if (!args_.logging_dir.empty()) set.push_back({"logging_dir", args_.logging_dir, program("logging_dir")});
  if (!set.empty()) engine_.configure(set);
}

// Every rank must train with the same arguments: a rank started with other flags is named.
void TrainerCore::check_same_arguments() {
  if (engine_.num_processes() == 1) return;
  std::string text;
  const auto mine = args_.to_map();
  for (const auto& [k, v] : mine) text += k + "=" + v + "\n";
  at::Tensor bytes = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
  std::memcpy(bytes.data_ptr(), text.data(), text.size());
  at::Tensor dev = bytes.to(engine_.device());
  at::Tensor len = engine_.gather(at::scalar_tensor(static_cast<int64_t>(text.size()), at::kLong).to(engine_.device())).cpu();
  at::Tensor all = engine_.gather(engine_.pad_across_processes(dev, 0, 0)).cpu();
  const int64_t width = all.size(0) / engine_.num_processes();
  for (int r = 0; r < engine_.num_processes(); ++r) {
    const int64_t n = len[r].item<int64_t>();
    const std::string other(reinterpret_cast<const char*>(all.data_ptr<uint8_t>()) + r * width, static_cast<size_t>(n));
    if (other == text) continue;
    std::map<std::string, std::string> theirs;
    size_t pos = 0;
    while (pos < other.size()) {
      const size_t nl = other.find('\n', pos), eq = other.find('=', pos);
      theirs[other.substr(pos, eq - pos)] = other.substr(eq + 1, nl - eq - 1);
      pos = nl + 1;
    }
    for (const auto& [k, v] : mine) {
      if (theirs[k] != v) {
        throw Error(fmt::format("zeal::Trainer: rank {} was started with {} '{}' but rank {} with '{}': every rank must "
                                "train with the same arguments",
                                r, k, theirs[k], engine_.process_index(), v));
      }
    }
  }
}

std::shared_ptr<torch::optim::Optimizer> TrainerCore::make_optimizer() {
  // Hugging Face's two groups: weight decay except on biases and normalization layers' weights.
  std::unordered_set<const void*> no_decay, seen;
  for (const auto& item : model_->named_modules()) {
    if (item.value()->name().find("Norm") == std::string::npos) continue;
    for (const auto& p : item.value()->parameters(false)) no_decay.insert(p.unsafeGetTensorImpl());
  }
  std::vector<at::Tensor> decay, plain;
  for (const auto& item : model_->named_parameters(true)) {
    const at::Tensor& p = item.value();
    if (!p.requires_grad() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    const bool exempt = no_decay.count(p.unsafeGetTensorImpl()) || item.key().find("bias") != std::string::npos;
    (exempt ? plain : decay).push_back(p);
  }
  if (decay.empty() && plain.empty()) throw Error("zeal::Trainer: the model has no parameter that requires a gradient");
  std::vector<torch::optim::OptimizerParamGroup> groups;
  auto options = [&](double wd) {
    auto o = std::make_unique<torch::optim::AdamWOptions>(args_.learning_rate);
    o->betas({args_.adam_beta1, args_.adam_beta2}).eps(args_.adam_epsilon).weight_decay(wd);
    return o;
  };
  if (!decay.empty()) groups.emplace_back(decay, options(args_.weight_decay));
  if (!plain.empty()) groups.emplace_back(plain, options(0.0));
  return std::make_shared<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(args_.learning_rate));
}

std::shared_ptr<optim::LrSchedule> TrainerCore::make_schedule(int64_t total_steps) {
  const int64_t warmup = args_.warmup_steps > 0
                             ? args_.warmup_steps
                             : static_cast<int64_t>(std::ceil(static_cast<double>(total_steps) * args_.warmup_ratio));
  // Hugging Face's lr_init (polynomial's) is the optimizer's default rate.
  const double lr = optimizer_ ? optimizer_->defaults().get_lr() : args_.learning_rate;
  return std::make_shared<optim::HfSchedule>(args_.lr_scheduler_type, lr, warmup, total_steps);
}

void TrainerCore::prepare_once(bool has_eval, const std::function<Sizes()>& prepare_loaders,
                               const std::function<void(torch::optim::Optimizer*, std::shared_ptr<optim::LrSchedule>)>& prepare_model) {
  check_same_arguments();
  resolve_engine_settings();
  // What would stop the run at its first evaluation or save is found now.
  if (args_.eval_strategy != "no" && !has_eval) {
    throw Error(fmt::format("eval_strategy {} needs an evaluation dataset (the Trainer's eval_dataset)", args_.eval_strategy));
  }
  if (args_.save_strategy != "no") check_output_dir(args_.output_dir, "output_dir");
  track_best_ = args_.load_best_model_at_end || !args_.metric_for_best_model.empty();
  for (const auto& cb : callbacks_) track_best_ = track_best_ || dynamic_cast<EarlyStoppingCallback*>(cb.get()) != nullptr;
  const Sizes sizes = prepare_loaders();
  if (sizes.train_batches <= 0) {
    throw Error(fmt::format("zeal::Trainer: the training dataset ({} samples) gives each of the {} ranks no batch of {}",
                            sizes.train_samples, engine_.num_processes(), engine_.config().train_micro_batch_size_per_gpu.value));
  }
  const int64_t accum = engine_.gradient_accumulation_steps();
  state_.steps_per_epoch = (sizes.train_batches + accum - 1) / accum;
  state_.max_steps = args_.max_steps > 0
                         ? args_.max_steps
                         : static_cast<int64_t>(std::ceil(args_.num_train_epochs * static_cast<double>(state_.steps_per_epoch)));
  state_.max_steps = std::max<int64_t>(state_.max_steps, 1);
  state_.num_train_epochs = (state_.max_steps + state_.steps_per_epoch - 1) / state_.steps_per_epoch;
  train_samples_ = sizes.train_samples;
  const Config& c = engine_.config();
  // A config scheduler's "auto" steps from the arguments.
  std::vector<Config::Setting> set;
  const auto program = [](const std::string& arg) { return Origin{Origin::Kind::kProgram, "zeal::Trainer's " + arg}; };
  if (c.scheduler.warmup_num_steps.is_auto) {
    const int64_t w = args_.warmup_steps > 0 ? args_.warmup_steps
                                             : static_cast<int64_t>(std::ceil(static_cast<double>(state_.max_steps) * args_.warmup_ratio));
    set.push_back({"scheduler.params.warmup_num_steps", std::to_string(w), program("warmup_steps")});
  }
  if (c.scheduler.total_num_steps.is_auto) {
    set.push_back({"scheduler.params.total_num_steps", std::to_string(state_.max_steps), program("max_steps")});
  }
  if (c.scheduler.warmup_max_lr.is_auto) {
    set.push_back({"scheduler.params.warmup_max_lr", fmt::format("{}", args_.learning_rate), program("learning_rate")});
  }
  if (!set.empty()) engine_.configure(set);
  if (!optimizer_ && c.optimizer.type.empty()) optimizer_ = make_optimizer();
  if (!schedule_ && c.scheduler.type.empty()) schedule_ = make_schedule(state_.max_steps);
  if (optimizer_) engine_.keep_alive(optimizer_);
  if (schedule_) engine_.keep_alive(schedule_);
  prepare_model(optimizer_.get(), schedule_);
  prepared_optimizer_ = std::make_unique<PreparedOptimizer>(&engine_);
  engine_.register_for_checkpointing(std::make_shared<TrainerStateObject<Shared>>(shared_));
  prepared_ = true;
}

std::string TrainerCore::resume_dir() const {
  const std::string& r = args_.resume_from_checkpoint;
  if (r != "latest" && r != "auto") return r;
  std::error_code ec;
  if (fs::exists(fs::path(args_.output_dir) / "latest", ec)) return args_.output_dir;
  if (r == "auto") return "";
  throw Error(fmt::format("resume_from_checkpoint latest: {} holds no checkpoint (no {}/latest)", args_.output_dir,
                          args_.output_dir));
}

bool TrainerCore::begin_train() {
  const std::string resume = resume_dir();
  const TrainerState planned = state_;
  if (!resume.empty()) {
    MemoryTracker load(engine_, "load");
    engine_.load_state(resume);
    const PhaseMemory loaded = load.end(false);
    // The plan is this run's (its arguments); where training stands is the checkpoint's.
    state_.max_steps = planned.max_steps;
    state_.num_train_epochs = planned.num_train_epochs;
    state_.steps_per_epoch = planned.steps_per_epoch;
    engine_.print(fmt::format("zeal: resumed from {} at step {} (epoch {:.2f}); the load's peak resident set {} (rank 0)",
                              resume, state_.global_step, state_.epoch, format_bytes(static_cast<double>(loaded.cpu.peak))));
  }
  auto hyperparameters = args_.to_map();
  for (const auto& [k, v] : tracker_config) hyperparameters[k] = v;
  engine_.init_trackers(args_.run_name.empty() ? "trainer" : args_.run_name, hyperparameters);
  const int64_t micro = engine_.config().train_micro_batch_size_per_gpu.value;
  const int64_t accum = engine_.gradient_accumulation_steps();
  engine_.print(fmt::format(
      "***** Running training *****\n  Num examples = {}\n  Num Epochs = {}\n  Instantaneous batch size per device = {}\n"
      "  Total train batch size (w. parallel, distributed & accumulation) = {}\n  Gradient Accumulation steps = {}\n"
      "  Total optimization steps = {}\n  Number of trainable parameters = {}",
      train_samples_, state_.num_train_epochs, micro, micro * accum * engine_.num_processes(), accum, state_.max_steps,
      engine_.num_trainable_parameters()));
  // The bar on a terminal only: elsewhere the logs are the lines.
  loop_ = std::make_unique<Loop>(state_.max_steps,
                                 engine_.is_main_process() && !args_.disable_tqdm && ProgressBar::terminal(),
                                 args_.logging_steps);
  loop_->first_step = state_.global_step;
  loop_->last_logged = state_.global_step;
  control_ = {};
  for (auto& cb : callbacks_) cb->on_train_begin(args_, state_, control_);
  return state_.global_step < state_.max_steps && !control_.should_training_stop;
}

void TrainerCore::begin_epoch(int64_t epoch) {
  (void)epoch;
  model_->train();
  loop_->epoch_memory = std::make_unique<MemoryTracker>(engine_, "train");
  loop_->step_start = Clock::now();
  control_.should_epoch_stop = false;
  for (auto& cb : callbacks_) cb->on_epoch_begin(args_, state_, control_);
}

void TrainerCore::micro_step(const at::Tensor& loss, int64_t tokens, int64_t samples) {
  at::Tensor l = loss.to(at::kFloat).reshape({});
  loop_->step_loss = loop_->step_loss.defined() ? loop_->step_loss + l : l;
  ++loop_->micro_steps;
  loop_->tokens += tokens;
  loop_->samples += samples;
}

bool TrainerCore::after_step(int64_t epoch) {
  Loop& L = *loop_;
  engine_.synchronize();
  const double step_s = seconds_since(L.step_start);
  // One reduction per step: the loss summed over the micro-steps, the tokens and the samples.
  at::Tensor local = at::stack({L.step_loss.defined() ? L.step_loss.to(at::kDouble).cpu() : at::zeros({}, at::kDouble),
                                at::scalar_tensor(static_cast<double>(L.tokens - L.step_tokens), at::kDouble),
                                at::scalar_tensor(static_cast<double>(L.samples - L.step_samples), at::kDouble)});
  const at::Tensor counts = engine_.reduce(local.to(engine_.device()), "sum").cpu();
  const double loss = counts[0].item<double>() / static_cast<double>(engine_.num_processes()) /
                      static_cast<double>(std::max<int64_t>(L.micro_steps, 1));
  L.step_loss = at::Tensor();
  L.micro_steps = 0;
  L.last_loss = loss;
  L.log_loss += loss;
  L.total_loss += loss;
  ++L.log_steps;
  ++L.total_steps;
  L.step_tokens = L.tokens;
  L.step_samples = L.samples;
  state_.step_loss = loss;
  state_.step_seconds = step_s;
  state_.step_tokens = static_cast<int64_t>(counts[1].item<double>());
  state_.step_samples = static_cast<int64_t>(counts[2].item<double>());
  L.all_tokens += state_.step_tokens;
  L.all_samples += state_.step_samples;
  ++state_.global_step;
  state_.epoch = static_cast<double>(epoch) +
                 static_cast<double>(state_.global_step - epoch * state_.steps_per_epoch) / static_cast<double>(state_.steps_per_epoch);
  // Hugging Face's DefaultFlowCallback first, then the callbacks (which may change its choices).
  const int64_t g = state_.global_step;
  const int64_t eval_steps = args_.eval_steps > 0 ? args_.eval_steps : args_.logging_steps;
  if ((args_.logging_strategy == "steps" && g % args_.logging_steps == 0) || (args_.logging_first_step && g == 1)) {
    control_.should_log = true;
  }
  if (args_.eval_strategy == "steps" && g % eval_steps == 0) control_.should_evaluate = true;
  if (args_.save_strategy == "steps" && g % args_.save_steps == 0) control_.should_save = true;
  if (g >= state_.max_steps) {
    control_.should_training_stop = true;
    if (args_.save_strategy == "steps") control_.should_save = true;
  }
  for (auto& cb : callbacks_) cb->on_step_end(args_, state_, control_);
  maybe_log_save_evaluate();
  const double elapsed = seconds_since(L.start);
  const double eta = elapsed / static_cast<double>(g - L.first_step) * static_cast<double>(state_.max_steps - g);
  const double rate = static_cast<double>(L.all_tokens > 0 ? L.all_tokens : L.all_samples) / std::max(elapsed, 1e-9);
  L.bar.set_unit(L.all_tokens > 0 ? "tok" : "samples");
  L.bar.update(g, loss, rate, step_s, eta);
  L.step_start = Clock::now();
  return control_.should_training_stop || control_.should_epoch_stop;
}


bool TrainerCore::end_epoch(int64_t epoch, bool finished, const data::LoaderStats& data) {
  // An epoch a stop left early stays the current one: a resumed run goes on inside it, where its
  // loader stands.
  state_.epochs_completed = finished ? epoch + 1 : epoch;
  if (args_.logging_strategy == "epoch") control_.should_log = true;
  if (args_.eval_strategy == "epoch") control_.should_evaluate = true;
  if (args_.save_strategy == "epoch") control_.should_save = true;
  for (auto& cb : callbacks_) cb->on_epoch_end(args_, state_, control_);
  // The epoch's memory, in the lines PEFT's examples print (before, consumed, peak, total peak).
  if (loop_->epoch_memory) {
    const PhaseMemory m = loop_->epoch_memory->end(false);
    loop_->epoch_memory.reset();
    if (engine_.is_main_process()) {
      for (const auto& l : m.lines()) say(l);
    }
  }
  if (engine_.is_main_process() && data.batches > 0) {
    say(fmt::format("data: {:.3f} s of the loop's time in the train loader for {} batches; preparing them took {:.3f} s{}",
                    data.critical_seconds, data.batches, data.prepare_seconds,
                    args_.dataloader_num_workers > 0
                        ? fmt::format(" on {} worker thread{}", args_.dataloader_num_workers, args_.dataloader_num_workers > 1 ? "s" : "")
                        : std::string(" in the loop")));
  }
  maybe_log_save_evaluate();
  return control_.should_training_stop;
}

void TrainerCore::maybe_log_save_evaluate() {
  Loop& L = *loop_;
  if (control_.should_log && state_.global_step > L.last_logged) {
    const double seconds = seconds_since(L.log_start);
    const double n = static_cast<double>(std::max<int64_t>(L.log_steps, 1));
    const double tokens = static_cast<double>(L.all_tokens - L.log_all_tokens);
    const double samples = static_cast<double>(L.all_samples - L.log_all_samples);
    Metrics logs = {{"loss", L.log_loss / n},
                    {"grad_norm", engine_.last_grad_norm()},
                    {"learning_rate", engine_.get_lr().front()},
                    {"epoch", state_.epoch},
                    {"step_s", seconds / n},
                    {"samples_per_s", samples / std::max(seconds, 1e-9)}};
    if (tokens > 0) logs["tokens_per_s"] = tokens / std::max(seconds, 1e-9);
    if (L.epoch_memory) {
      const PhaseMemory m = L.epoch_memory->now();
      logs["memory/rss_bytes"] = static_cast<double>(m.cpu.end);
      logs["memory/peak_rss_bytes"] = static_cast<double>(m.cpu.peak);
      if (m.device.measured) logs["memory/device_peak_bytes"] = static_cast<double>(m.device.peak);
    }
    L.log_loss = 0;
    L.log_steps = 0;
    L.log_all_tokens = L.all_tokens;
    L.log_all_samples = L.all_samples;
    L.log_start = Clock::now();
    L.last_logged = state_.global_step;
    log(std::move(logs));
  }
  if (control_.should_evaluate) {
    const Metrics metrics = evaluate_now();
    update_best(metrics);
  }
  if (control_.should_save && state_.global_step != L.last_saved) save_checkpoint();
  control_.should_log = control_.should_evaluate = control_.should_save = false;
}

// A line on the main process, above the progress bar when one is drawn.
void TrainerCore::say(const std::string& line) {
  if (!engine_.is_main_process()) return;
  if (loop_ && loop_->bar.on_terminal()) {
    loop_->bar.line(line);
  } else {
    engine_.print(line);
  }
}

void TrainerCore::log(Metrics logs) {
  logs["epoch"] = state_.epoch;
  Metrics tracked;
  for (const auto& [k, v] : logs)
    if (k != "epoch" || logs.size() == 1) tracked[tracker_name(k)] = v;
  tracked["train/epoch"] = state_.epoch;
  engine_.log(tracked, state_.global_step);
  say(fmt::format("step {}/{}: {}", state_.global_step, state_.max_steps, format_logs(logs)));
  logs["step"] = static_cast<double>(state_.global_step);
  state_.log_history.push_back(logs);
  for (auto& cb : callbacks_) cb->on_log(args_, state_, control_, logs);
}

void TrainerCore::gather_batch(const StepOutput& out, int64_t batch_size, std::vector<at::Tensor>& losses,
                               std::vector<at::Tensor>& preds, std::vector<at::Tensor>& labels) {
  if (out.loss.defined()) {
    at::Tensor l = out.loss.detach().to(at::kFloat).reshape({1}).expand({batch_size}).contiguous();
    losses.push_back(engine_.gather_for_metrics(l).cpu());
  }
  auto gather = [&](const at::Tensor& t, std::vector<at::Tensor>& into) {
    if (!t.defined()) return;
    at::Tensor x = t.detach();
    if (x.dim() == 0) x = x.reshape({1});
    if (x.dim() >= 2) x = engine_.pad_across_processes(x, 1, -100);
    into.push_back(engine_.gather_for_metrics(x).cpu());
  };
  gather(out.predictions, preds);
  gather(out.labels, labels);
}

Metrics TrainerCore::evaluation_metrics(const std::string& prefix, std::vector<at::Tensor>& losses,
                                        std::vector<at::Tensor>& preds, std::vector<at::Tensor>& labels, double seconds,
                                        int64_t samples) {
  Metrics m;
  (void)samples;
  int64_t n = 0;
  if (!losses.empty()) {
    at::Tensor all = at::cat(losses).to(at::kDouble);
    n = all.numel();
    m[prefix + "_loss"] = all.mean().item<double>();
  }
  if (compute_metrics && !preds.empty()) {
    EvalPrediction p{concat_padded(preds), concat_padded(labels)};
    n = std::max<int64_t>(n, p.predictions.size(0));
    for (const auto& [k, v] : compute_metrics(p)) m[k.rfind(prefix + "_", 0) == 0 ? k : prefix + "_" + k] = v;
  }
  m[prefix + "_runtime"] = seconds;
  m[prefix + "_samples_per_second"] = static_cast<double>(n) / std::max(seconds, 1e-9);
  return m;
}

Metrics TrainerCore::evaluate_now() {
  MemoryTracker phase(engine_, "eval");
  Metrics metrics = run_evaluation("eval");
  const PhaseMemory mem = phase.end(false);
  metrics["epoch"] = state_.epoch;
  log(metrics);
  for (const auto& l : mem.lines()) say(l);
  for (auto& cb : callbacks_) cb->on_evaluate(args_, state_, control_, metrics);
  return metrics;
}

void TrainerCore::update_best(const Metrics& metrics) {
  if (!track_best_) return;
  const std::string key = args_.best_metric_key();
  auto it = metrics.find(key);
  if (it == metrics.end()) {
    std::string names;
    for (const auto& [k, v] : metrics) names += (names.empty() ? "" : ", ") + k;
    throw Error(fmt::format("metric_for_best_model: the evaluation has no metric {}; it has {}", key, names));
  }
  const double v = it->second;
  if (!state_.best_metric || (args_.best_is_greater() ? v > *state_.best_metric : v < *state_.best_metric)) {
    state_.best_metric = v;
    state_.best_global_step = state_.global_step;
  }
}

void TrainerCore::save_checkpoint() {
  const std::string dir = (fs::path(args_.output_dir) / fmt::format("checkpoint-{}", state_.global_step)).string();
  if (state_.best_metric && state_.best_global_step == state_.global_step) state_.best_model_checkpoint = dir;
  MemoryTracker save(engine_, "save");
  engine_.save_state(dir);
  const PhaseMemory saved = save.end(false);
  if (engine_.is_main_process()) {
    write_file_whole((fs::path(dir) / "trainer_state.json").string(), state_.to_json(), "trainer_state.json");
    rotate_checkpoints(dir);
  }
  engine_.wait_for_everyone();
  loop_->last_saved = state_.global_step;
  say(fmt::format("zeal: saved {}; the save's peak resident set {} (rank 0)", dir,
                  format_bytes(static_cast<double>(saved.cpu.peak))));
  for (auto& cb : callbacks_) cb->on_save(args_, state_, control_, dir);
}

// Hugging Face's rotation: the oldest beyond save_total_limit go, never the best nor the newest.
void TrainerCore::rotate_checkpoints(const std::string& just_saved) {
  if (args_.save_total_limit <= 0) return;
  std::vector<std::pair<int64_t, fs::path>> found;
  for (const auto& e : fs::directory_iterator(args_.output_dir)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("checkpoint-", 0) != 0 || !e.is_directory()) continue;
    const std::string digits = n.substr(11);
    if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    found.push_back({std::stoll(digits), e.path()});
  }
  std::sort(found.begin(), found.end());
  std::vector<fs::path> sorted;
  for (auto& f : found)
    if (f.second != fs::path(just_saved)) sorted.push_back(f.second);
  sorted.push_back(just_saved);  // the newest, whatever an earlier run left with higher numbers
  int64_t limit = args_.save_total_limit;
  if (!state_.best_model_checkpoint.empty()) {
    auto it = std::find(sorted.begin(), sorted.end(), fs::path(state_.best_model_checkpoint));
    if (it != sorted.end() && sorted.size() >= 2) {
      fs::path best = *it;
      sorted.erase(it);
      sorted.insert(sorted.end() - 1, best);
      if (limit == 1 && sorted.back() != best) limit = 2;
    }
  }
  for (size_t i = 0; i + static_cast<size_t>(limit) < sorted.size(); ++i) {
    // Out of sight first (a reader never finds half a checkpoint), then removed.
    const fs::path hidden = sorted[i].parent_path() / ("." + sorted[i].filename().string() + ".old");
    std::error_code ec;
    fs::remove_all(hidden, ec);
    fs::rename(sorted[i], hidden);
    fs::remove_all(hidden, ec);
  }
}

void TrainerCore::load_best() {
  const TrainerState kept = state_;
  const std::vector<std::string> states = callback_states(callbacks_);
  engine_.print(fmt::format("zeal: loading the best model from {} ({} {:.6g}, step {})", state_.best_model_checkpoint,
                            args_.best_metric_key(), state_.best_metric.value_or(0), state_.best_global_step));
  engine_.load_state(state_.best_model_checkpoint);
  state_ = kept;
  load_callback_states(callbacks_, states);
}

TrainOutput TrainerCore::end_train() {
  TrainOutput out;
  if (!loop_) throw Error("zeal::Trainer: end_train without train");
  Loop& L = *loop_;
  L.bar.finish();
  if (args_.load_best_model_at_end && !state_.best_model_checkpoint.empty()) {
    std::error_code ec;
    if (fs::exists(state_.best_model_checkpoint, ec)) {
      load_best();
    } else {
      say(fmt::format("zeal: warning: the best checkpoint {} is gone; the model stays the last step's",
                      state_.best_model_checkpoint));
    }
  } else if (args_.load_best_model_at_end) {
    say("zeal: warning: no checkpoint was saved at an evaluation's step; the model stays the last step's");
  }
  for (auto& cb : callbacks_) cb->on_train_end(args_, state_, control_);
  const double runtime = seconds_since(L.start);
  out.global_step = state_.global_step;
  out.training_loss = L.total_steps > 0 ? L.total_loss / static_cast<double>(L.total_steps) : 0.0;
  out.metrics = {{"train_runtime", runtime},
                 {"train_samples_per_second", static_cast<double>(L.all_samples) / std::max(runtime, 1e-9)},
                 {"train_steps_per_second", static_cast<double>(L.total_steps) / std::max(runtime, 1e-9)},
                 {"train_loss", out.training_loss},
                 {"epoch", state_.epoch}};
  log(out.metrics);
  loop_.reset();
  return out;
}

}  // namespace zeal::detail
