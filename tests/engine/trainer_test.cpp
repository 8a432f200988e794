// zeal::Trainer against a hand-written engine loop (bit for bit), its schedules against
// transformers' in Python, its cadence of evaluations and checkpoints, save_total_limit, the best
// checkpoint loaded at the end, early stopping, and a run killed with SIGKILL resumed from
// "latest" to the same bits as one that was not.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <torch/data/example.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "engine/config/config.h"
#include "engine/engine.h"
#include "engine/error.h"
#include "engine/runtime/runtime.h"
#include "engine/runtime/spawn.h"
#include "tests/test_helpers.h"
#include "engine/trainer/trainer.h"
#include "tests/engine/tiny_gpt.h"

namespace {

namespace fs = std::filesystem;
using zeal_test::peers_python;
using zeal_test::spawn_checked;

using zeal_test::TinyGpt;
using zeal_test::TinyGptOptions;

// Token windows: data [T] and the next tokens [T], fixed by the seed.
class Windows {
 public:
  Windows(int64_t n, uint64_t seed, int64_t vocab = 37, int64_t seq = 8) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    tokens_ = at::randint(0, vocab, {n, seq + 1}, gen);
  }
  torch::data::Example<> get(size_t i) const {
    at::Tensor w = tokens_[static_cast<int64_t>(i)];
    return {w.narrow(0, 0, w.size(0) - 1), w.narrow(0, 1, w.size(0) - 1)};
  }
  size_t size() const { return static_cast<size_t>(tokens_.size(0)); }

 private:
  at::Tensor tokens_;
};

at::Tensor lm_loss(TinyGpt& m, const torch::data::Example<>& b) {
  at::Tensor logits = m->forward(b.data);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), b.target.reshape({-1}));
}

std::string temp(const std::string& what) {
  return (fs::temp_directory_path() / fmt::format("zeal_trainer_{}_{}", what, ::getpid())).string();
}

zeal::Config config(const std::string& json) {
  zeal::Config c = zeal::Config::parse(json, "ds.json");
  c.launch.use_cpu = true;
  return c;
}

// Every parameter's bytes (gathered under stage 3), written by rank 0.
void write_params(zeal::Engine& engine, TinyGpt& model, const std::string& path) {
  auto g = engine.gathered();
  if (!engine.is_main_process()) return;
  std::ofstream f(path, std::ios::binary);
  for (const auto& p : model->named_parameters()) {
    at::Tensor t = p.value().detach().to(at::kFloat).contiguous();
    f.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  }
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

zeal::TrainingArguments base_args(const std::string& out) {
  zeal::TrainingArguments a;
  a.output_dir = out;
  a.per_device_train_batch_size = 2;
  a.num_train_epochs = 2;
  a.learning_rate = 1e-3;
  a.weight_decay = 0.1;
  a.lr_scheduler_type = "cosine";
  a.warmup_steps = 2;
  a.save_strategy = "no";
  a.logging_steps = 2;
  a.seed = 5;
  a.disable_tqdm = true;
  return a;
}

void expect_ok(const std::vector<zeal::RankResult>& r) { EXPECT_EQ(zeal::describe_failures(r), ""); }

// --- against the hand-written loop ------------------------------------------------------------

void trainer_equals_hand_loop(int stage, bool accumulation_in_config) {
  const std::string cfg =
      accumulation_in_config
          ? fmt::format(R"({{"zero_optimization": {{"stage": {}}}, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5}})", stage)
          : fmt::format(R"({{"zero_optimization": {{"stage": {}}}}})", stage);
  const std::string a_out = temp("trainer_params"), b_out = temp("hand_params"), unused = temp("unused");
  expect_ok(spawn_checked(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(config(cfg), rt);
        at::manual_seed(11);
        TinyGpt model(TinyGptOptions{});
        auto args = base_args(unused);
        if (!accumulation_in_config) {
          args.gradient_accumulation_steps = 2;
          args.max_grad_norm = 0.5;
        }
        zeal::Trainer trainer(engine, model, args, Windows(22, 3), std::nullopt,
                              [&](const torch::data::Example<>& b) { return lm_loss(model, b); });
        const auto out = trainer.train();
        EXPECT_EQ(out.global_step, 6);  // 22 samples, 2 ranks × 2: 6 batches per rank, 3 steps per epoch
        write_params(engine, model, a_out);
      },
      2));
  expect_ok(spawn_checked(
      [&](zeal::Runtime& rt) {
        zeal::Config c = config(cfg);
        if (!accumulation_in_config) {
          c.set("gradient_accumulation_steps", "2", {zeal::Origin::Kind::kProgram, "test"});
          c.set("gradient_clipping", "0.5", {zeal::Origin::Kind::kProgram, "test"});
        }
        zeal::Engine engine(c, rt);
        at::manual_seed(11);
        TinyGpt model(TinyGptOptions{});
        at::manual_seed(5);
        // Hugging Face's groups, written out for this model: no decay on LayerNorms and biases.
        std::vector<at::Tensor> decay, plain;
        for (const auto& p : model->named_parameters()) {
          const bool exempt = p.key().find("ln") != std::string::npos || p.key().find("bias") != std::string::npos;
          (exempt ? plain : decay).push_back(p.value());
        }
        std::vector<torch::optim::OptimizerParamGroup> groups;
        groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                       torch::optim::AdamWOptions(1e-3).betas({0.9, 0.999}).eps(1e-8).weight_decay(0.1)));
        groups.emplace_back(plain, std::make_unique<torch::optim::AdamWOptions>(
                                       torch::optim::AdamWOptions(1e-3).betas({0.9, 0.999}).eps(1e-8).weight_decay(0.0)));
        torch::optim::AdamW opt(groups, torch::optim::AdamWOptions(1e-3));
        zeal::DataLoader loader(Windows(22, 3), {.batch_size = 2, .shuffle = true, .seed = 5});
        auto schedule = std::make_shared<zeal::optim::HfSchedule>("cosine", 1e-3, 2, 6);
        auto [m, po, dl] = engine.prepare(model, opt, loader);
        (void)engine.prepare(schedule);
        for (int epoch = 0; epoch < 2; ++epoch) {
          for (auto& b : dl) {
            auto guard = engine.accumulate();
            engine.backward(lm_loss(m, b));
            po.step();
            po.zero_grad();
          }
        }
        EXPECT_EQ(engine.optimizer_steps(), 6);
        write_params(engine, model, b_out);
      },
      2));
  const std::string a = read_file(a_out), b = read_file(b_out);
  EXPECT_FALSE(a.empty());
  EXPECT_TRUE(a == b) << "stage " << stage << ": the Trainer's parameters differ from the hand-written loop's";
  fs::remove(a_out);
  fs::remove(b_out);
}

TEST(Trainer, Stage0WithTheConfigsAccumulationMatchesAHandWrittenLoopBitForBit) { trainer_equals_hand_loop(0, true); }
TEST(Trainer, Stage3WithTheArgumentsAccumulationMatchesAHandWrittenLoopBitForBit) { trainer_equals_hand_loop(3, false); }

// A model whose forward takes the batch and returns the loss (no step function needed).
struct LossGptImpl : torch::nn::Module {
  LossGptImpl() : gpt(register_module("gpt", TinyGpt(TinyGptOptions{}))) {}
  at::Tensor forward(const torch::data::Example<>& b) { return lm_loss(gpt, b); }
  TinyGpt gpt;
};
TORCH_MODULE(LossGpt);

TEST(Trainer, AModelWhoseForwardReturnsTheLossTrainsAsAStepFunctionDoes) {
  const std::string a_out = temp("forward_params"), b_out = temp("step_params"), unused = temp("unused");
  for (bool with_step : {false, true}) {
    expect_ok(spawn_checked(
        [&](zeal::Runtime& rt) {
          zeal::Engine engine(config(R"({"zero_optimization": {"stage": 2}})"), rt);
          at::manual_seed(11);
          LossGpt model;
          auto args = base_args(unused);
          if (with_step) {
            zeal::Trainer trainer(engine, model, args, Windows(22, 3), std::nullopt,
                                  [&](const torch::data::Example<>& b) { return lm_loss(model->gpt, b); });
            trainer.train();
          } else {
            zeal::Trainer trainer(engine, model, args, Windows(22, 3));
            trainer.train();
          }
          write_params(engine, model->gpt, with_step ? b_out : a_out);
        },
        2));
  }
  const std::string a = read_file(a_out), b = read_file(b_out);
  EXPECT_FALSE(a.empty());
  EXPECT_TRUE(a == b);
  fs::remove(a_out);
  fs::remove(b_out);
}

// --- schedules against transformers -----------------------------------------------------------

// Records every step's learning rates (each group's) as the engine gives them.
struct RateRecorder : zeal::TrainerCallback {
  explicit RateRecorder(zeal::Engine& e) : engine(e) {}
  void on_train_begin(const Args&, const zeal::TrainerState&, zeal::TrainerControl&) override { rates.push_back(engine.get_lr()); }
  void on_step_end(const Args&, const zeal::TrainerState& s, zeal::TrainerControl&) override {
    if (s.global_step < s.max_steps) rates.push_back(engine.get_lr());
  }
  zeal::Engine& engine;
  std::vector<std::vector<double>> rates;
};

TEST(Trainer, SchedulesOnTwoGroupsMatchTransformers) {
  const std::string spec = temp("schedules.json");
  struct Case {
    std::string type;
    int64_t warmup_steps;
    double warmup_ratio;
  };
  const std::vector<Case> cases = {{"linear", 3, 0}, {"cosine", 0, 0.25}, {"polynomial", 2, 0},
                                   {"constant", 0, 0}, {"constant_with_warmup", 4, 0}};
  std::string json = "[";
  for (const auto& c : cases) {
    const std::string out = temp("rates");
    expect_ok(spawn_checked(
        [&](zeal::Runtime& rt) {
          zeal::Engine engine(config("{}"), rt);
          at::manual_seed(11);
          TinyGpt model(TinyGptOptions{});
          auto args = base_args(temp("unused"));
          args.lr_scheduler_type = c.type;
          args.warmup_steps = c.warmup_steps;
          args.warmup_ratio = c.warmup_ratio;
          args.max_steps = 12;
          args.per_device_train_batch_size = 1;
          // Two groups with their own rates: the blocks at 2e-4, the rest at 1e-3.
          std::vector<at::Tensor> blocks, rest;
          for (const auto& p : model->named_parameters()) (p.key().rfind("block", 0) == 0 ? blocks : rest).push_back(p.value());
          std::vector<torch::optim::OptimizerParamGroup> groups;
          groups.emplace_back(blocks, std::make_unique<torch::optim::AdamWOptions>(2e-4));
          groups.emplace_back(rest, std::make_unique<torch::optim::AdamWOptions>(1e-3));
          zeal::Trainer trainer(engine, model, args, Windows(40, 3), std::nullopt,
                                [&](const torch::data::Example<>& b) { return lm_loss(model, b); });
          trainer.set_optimizer(std::make_shared<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(2e-4)));
          auto recorder = std::make_shared<RateRecorder>(engine);
          trainer.add_callback(recorder);
          trainer.train();
          std::ofstream f(out);
          for (const auto& r : recorder->rates) f << fmt::format("{:.17g} {:.17g}\n", r.at(0), r.at(1));
        },
        1));
    std::ifstream f(out);
    std::string rows;
    double a, b;
    int n = 0;
    while (f >> a >> b) rows += fmt::format("{}[{:.17g}, {:.17g}]", n++ ? ", " : "", a, b);
    fs::remove(out);
    EXPECT_EQ(n, 12) << c.type;
    json += fmt::format(R"({}{{"type": "{}", "warmup_steps": {}, "warmup_ratio": {}, "total": 12, "base_lrs": [2e-4, 1e-3], "lr_init": 2e-4, "zeal": [{}]}})",
                        json.size() > 1 ? ", " : "", c.type, c.warmup_steps, c.warmup_ratio, rows);
  }
  std::ofstream(spec) << json << "]";
  const std::string python = peers_python();
  if (!fs::exists(python)) {
    fs::remove(spec);
    const char* required = std::getenv("ZEAL_REQUIRE_PEERS");
    if (required && std::string(required) == "1") FAIL() << "no peers Python at " << python;
    GTEST_SKIP() << "no peers Python at " << python << " (scripts/peers installs it)";
  }
  const int rc = std::system(fmt::format("{} {}/tests/engine/trainer_schedules_check.py {}", python, ZEAL_SOURCE_DIR, spec).c_str());
  fs::remove(spec);
  const int code = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  if (code == 77) GTEST_SKIP() << python << " has no transformers (scripts/peers installs it)";
  EXPECT_EQ(code, 0) << "zeal's rates differ from transformers' (see above)";
}

// --- cadence, limits, the best model, early stopping --------------------------------------------

// What the callbacks saw: global steps of evaluations, saves and logs.
struct Events : zeal::TrainerCallback {
  void on_evaluate(const Args&, const zeal::TrainerState& s, zeal::TrainerControl&, const zeal::Metrics&) override {
    evaluated.push_back(s.global_step);
  }
  void on_save(const Args&, const zeal::TrainerState& s, zeal::TrainerControl&, const std::string& dir) override {
    saved.push_back(s.global_step);
    EXPECT_TRUE(fs::exists(fs::path(dir) / "manifest.json")) << dir;
  }
  void on_log(const Args&, const zeal::TrainerState& s, zeal::TrainerControl&, const zeal::Metrics& logs) override {
    if (logs.count("loss")) logged.push_back(s.global_step);
  }
  std::vector<int64_t> evaluated, saved, logged;
};

std::set<std::string> checkpoints_in(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("checkpoint-", 0) == 0) out.insert(n);
  }
  return out;
}

// One rank, 12 samples of batch 1: 12 steps per epoch. `setup` adjusts the arguments and the
// trainer; `after` checks on the rank.
void one_rank(const std::function<void(zeal::TrainingArguments&)>& setup,
              const std::function<void(zeal::Engine&, TinyGpt&, zeal::Trainer<Windows>&)>& run) {
  expect_ok(spawn_checked(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(config("{}"), rt);
        at::manual_seed(11);
        TinyGpt model(TinyGptOptions{});
        auto args = base_args(temp("out"));
        args.per_device_train_batch_size = 1;
        args.num_train_epochs = 1;
        setup(args);
        zeal::Trainer trainer(engine, model, args, Windows(12, 3), Windows(4, 9),
                              [&](const torch::data::Example<>& b) {
                                at::Tensor logits = model->forward(b.data);
                                return zeal::StepOutput{
                                    torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), b.target.reshape({-1})),
                                    logits.argmax(-1), b.target};
                              });
        run(engine, model, trainer);
      },
      1));
}

TEST(Trainer, EvaluatesSavesAndLogsOnTheirStepCadence) {
  const std::string out = temp("steps");
  fs::remove_all(out);
  one_rank(
      [&](zeal::TrainingArguments& a) {
        a.output_dir = out;
        a.max_steps = 7;
        a.eval_strategy = "steps";
        a.eval_steps = 2;
        a.save_strategy = "steps";
        a.save_steps = 3;
        a.logging_steps = 3;
        a.report_to = {"jsonl"};
        a.logging_dir = out + "/runs";
      },
      [&](zeal::Engine&, TinyGpt&, zeal::Trainer<Windows>& t) {
        auto events = std::make_shared<Events>();
        t.add_callback(events);
        const auto result = t.train();
        EXPECT_EQ(result.global_step, 7);
        EXPECT_EQ(events->evaluated, (std::vector<int64_t>{2, 4, 6}));
        EXPECT_EQ(events->saved, (std::vector<int64_t>{3, 6, 7}));  // and at the end, as Hugging Face's
        EXPECT_EQ(events->logged, (std::vector<int64_t>{3, 6}));
        EXPECT_EQ(checkpoints_in(out), (std::set<std::string>{"checkpoint-3", "checkpoint-6", "checkpoint-7"}));
        EXPECT_EQ(read_file(out + "/latest"), "checkpoint-7\n");
        // The trackers got the logs: train/loss at 3 and 6, eval/loss at 2, 4 and 6.
        std::ifstream f(out + "/runs/trainer/metrics.jsonl");
        int losses = 0, evals = 0;
        for (std::string line; std::getline(f, line);) {
          losses += line.find("\"train/loss\"") != std::string::npos;
          evals += line.find("\"eval/loss\"") != std::string::npos;
        }
        EXPECT_EQ(losses, 2);
        EXPECT_EQ(evals, 3);
        // trainer_state.json beside each checkpoint, as Hugging Face's.
        const auto state = zeal::TrainerState::from_json(read_file(out + "/checkpoint-6/trainer_state.json"));
        EXPECT_EQ(state.global_step, 6);
      });
  fs::remove_all(out);
}

TEST(Trainer, EvaluatesAndSavesEveryEpoch) {
  const std::string out = temp("epochs");
  fs::remove_all(out);
  one_rank(
      [&](zeal::TrainingArguments& a) {
        a.output_dir = out;
        a.num_train_epochs = 3;
        a.gradient_accumulation_steps = 4;  // 3 steps per epoch
        a.eval_strategy = "epoch";
        a.save_strategy = "epoch";
        a.logging_strategy = "epoch";
      },
      [&](zeal::Engine&, TinyGpt&, zeal::Trainer<Windows>& t) {
        auto events = std::make_shared<Events>();
        t.add_callback(events);
        EXPECT_EQ(t.train().global_step, 9);
        EXPECT_EQ(events->evaluated, (std::vector<int64_t>{3, 6, 9}));
        EXPECT_EQ(events->saved, (std::vector<int64_t>{3, 6, 9}));
        EXPECT_EQ(events->logged, (std::vector<int64_t>{3, 6, 9}));
        EXPECT_EQ(checkpoints_in(out), (std::set<std::string>{"checkpoint-3", "checkpoint-6", "checkpoint-9"}));
      });
  fs::remove_all(out);
}

// A metric that follows a script, one value per evaluation.
std::function<zeal::Metrics(const zeal::EvalPrediction&)> scripted(std::vector<double> values) {
  auto k = std::make_shared<size_t>(0);
  return [values, k](const zeal::EvalPrediction& p) {
    EXPECT_EQ(p.predictions.size(0), 4);  // every evaluation sample, once
    EXPECT_EQ(p.label_ids.sizes(), p.predictions.sizes());
    return zeal::Metrics{{"accuracy", values.at(std::min((*k)++, values.size() - 1))}};
  };
}

TEST(Trainer, KeepsTheBestCheckpointUnderTheLimitAndLoadsItAtTheEnd) {
  const std::string out = temp("best");
  fs::remove_all(out);
  one_rank(
      [&](zeal::TrainingArguments& a) {
        a.output_dir = out;
        a.max_steps = 5;
        a.eval_strategy = "steps";
        a.eval_steps = 1;
        a.save_strategy = "steps";
        a.save_steps = 1;
        a.save_total_limit = 2;
        a.load_best_model_at_end = true;
        a.metric_for_best_model = "accuracy";
      },
      [&](zeal::Engine&, TinyGpt& model, zeal::Trainer<Windows>& t) {
        t.compute_metrics = scripted({0.5, 0.9, 0.3, 0.4, 0.6});  // peaks at step 2
        struct Snapshot : zeal::TrainerCallback {
          explicit Snapshot(TinyGpt& m) : model(m) {}
          void on_step_end(const Args&, const zeal::TrainerState& s, zeal::TrainerControl&) override {
            if (s.global_step == 2) {
              for (const auto& p : model->parameters()) at_step_2.push_back(p.detach().clone());
            }
          }
          TinyGpt& model;
          std::vector<at::Tensor> at_step_2;
        };
        auto snap = std::make_shared<Snapshot>(model);
        t.add_callback(snap);
        t.train();
        EXPECT_EQ(t.state().best_global_step, 2);
        EXPECT_EQ(t.state().best_model_checkpoint, out + "/checkpoint-2");
        EXPECT_DOUBLE_EQ(*t.state().best_metric, 0.9);
        // The limit of 2 keeps the best and the newest.
        EXPECT_EQ(checkpoints_in(out), (std::set<std::string>{"checkpoint-2", "checkpoint-5"}));
        const auto params = model->parameters();
        ASSERT_EQ(params.size(), snap->at_step_2.size());
        for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(params[i].equal(snap->at_step_2[i])) << "parameter " << i;
        EXPECT_EQ(t.state().global_step, 5);  // the state is the end's
      });
  fs::remove_all(out);
}

TEST(Trainer, TheOldestCheckpointsGoBeyondTheLimit) {
  const std::string out = temp("limit");
  fs::remove_all(out);
  one_rank(
      [&](zeal::TrainingArguments& a) {
        a.output_dir = out;
        a.max_steps = 5;
        a.save_strategy = "steps";
        a.save_steps = 1;
        a.save_total_limit = 2;
      },
      [&](zeal::Engine&, TinyGpt&, zeal::Trainer<Windows>& t) {
        t.train();
        EXPECT_EQ(checkpoints_in(out), (std::set<std::string>{"checkpoint-4", "checkpoint-5"}));
      });
  fs::remove_all(out);
  // Evaluations without metric_for_best_model keep no best checkpoint: the newest two stay.
  one_rank(
      [&](zeal::TrainingArguments& a) {
        a.output_dir = out;
        a.max_steps = 5;
        a.eval_strategy = "steps";
        a.eval_steps = 1;
        a.save_strategy = "steps";
        a.save_steps = 1;
        a.save_total_limit = 2;
      },
      [&](zeal::Engine&, TinyGpt&, zeal::Trainer<Windows>& t) {
        t.train();
        EXPECT_EQ(checkpoints_in(out), (std::set<std::string>{"checkpoint-4", "checkpoint-5"}));
        EXPECT_EQ(t.state().best_model_checkpoint, "");
      });
  fs::remove_all(out);
  // A longer earlier run's checkpoint in the folder: the one just saved is never the one removed.
  fs::create_directories(out + "/checkpoint-100");
  one_rank(
      [&](zeal::TrainingArguments& a) {
        a.output_dir = out;
        a.max_steps = 3;
        a.save_strategy = "steps";
        a.save_steps = 1;
        a.save_total_limit = 1;
      },
      [&](zeal::Engine&, TinyGpt&, zeal::Trainer<Windows>& t) {
        t.train();
        EXPECT_TRUE(checkpoints_in(out).count("checkpoint-3"));
        EXPECT_EQ(read_file(out + "/latest"), "checkpoint-3\n");
      });
  fs::remove_all(out);
}

// A callback that ends every epoch after its second step: the next epoch starts at its beginning.
TEST(Trainer, ACallbackEndingAnEpochEndsOnlyThatEpoch) {
  one_rank(
      [&](zeal::TrainingArguments& a) { a.num_train_epochs = 3; },
      [&](zeal::Engine&, TinyGpt&, zeal::Trainer<Windows>& t) {
        struct EndEpoch : zeal::TrainerCallback {
          int64_t in_epoch = 0;
          void on_epoch_begin(const Args&, const zeal::TrainerState&, zeal::TrainerControl&) override { in_epoch = 0; }
          void on_step_end(const Args&, const zeal::TrainerState&, zeal::TrainerControl& c) override {
            if (++in_epoch == 2) c.should_epoch_stop = true;
          }
        };
        t.add_callback(std::make_shared<EndEpoch>());
        EXPECT_EQ(t.train().global_step, 6);
        EXPECT_EQ(t.state().epochs_completed, 3);
      });
}

void early_stopping_stops_at(std::vector<double> values, int64_t patience, double threshold, int64_t expected) {
  one_rank(
      [&](zeal::TrainingArguments& a) {
        a.max_steps = 10;
        a.eval_strategy = "steps";
        a.eval_steps = 1;
        a.metric_for_best_model = "accuracy";
        a.early_stopping_patience = patience;
        a.early_stopping_threshold = threshold;
      },
      [&](zeal::Engine&, TinyGpt&, zeal::Trainer<Windows>& t) {
        t.compute_metrics = scripted(values);
        EXPECT_EQ(t.train().global_step, expected);
      });
}

TEST(Trainer, EarlyStoppingStopsAfterPatienceEvaluationsWithoutImprovement) {
  // Better at 1, 2; not at 3, 4: patience 2 stops at step 4.
  early_stopping_stops_at({0.5, 0.6, 0.55, 0.58, 0.9, 0.95}, 2, 0.0, 4);
  // An improvement under the threshold does not count: 0.52 and 0.56 are within 0.1 of 0.5.
  early_stopping_stops_at({0.5, 0.52, 0.56, 0.9}, 2, 0.1, 3);
  // Always improving: runs to the end.
  early_stopping_stops_at({0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0}, 1, 0.0, 10);
}

// predict: every rank's predictions in dataset order, the samples repeated to even out the last
// batch left out; test_loss the mean over the samples.
TEST(Trainer, PredictGathersEveryRanksPredictionsInDatasetOrder) {
  const std::string unused = temp("unused");
  expect_ok(spawn_checked(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(config("{}"), rt);
        at::manual_seed(11);
        TinyGpt model(TinyGptOptions{});
        auto args = base_args(unused);
        args.per_device_eval_batch_size = 2;
        zeal::Trainer trainer(engine, model, args, Windows(8, 3), std::nullopt,
                              [&](const torch::data::Example<>& b) {
                                // The prediction is the input itself; the loss its first token.
                                return zeal::StepOutput{b.data.select(1, 0).to(at::kFloat).mean(), b.data, b.target};
                              });
        const Windows test(7, 21);  // 7 samples on 2 ranks of 2: the last global batch is padded
        const auto out = trainer.predict(test);
        std::vector<at::Tensor> data, target;
        for (size_t i = 0; i < test.size(); ++i) {
          data.push_back(test.get(i).data);
          target.push_back(test.get(i).target);
        }
        EXPECT_TRUE(out.predictions.equal(at::stack(data))) << out.predictions.sizes();
        EXPECT_TRUE(out.label_ids.equal(at::stack(target)));
        EXPECT_TRUE(out.metrics.count("test_loss"));
        EXPECT_TRUE(out.metrics.count("test_runtime"));
      },
      2));
}

// --- resuming after SIGKILL ------------------------------------------------------------------

void resumes_after_a_kill(const std::string& save_strategy, int64_t kill_at, const std::string& latest) {
  const std::string out = temp("resume"), straight = temp("straight_params"), resumed = temp("resumed_params");
  fs::remove_all(out);
  auto run = [&](const std::string& resume, int64_t kill_at, const std::string& params_out) {
    return spawn_checked(
        [&](zeal::Runtime& rt) {
          zeal::Engine engine(config(R"({"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 2})"), rt);
          at::manual_seed(11);
          TinyGpt model(TinyGptOptions{});
          auto args = base_args(out);
          args.num_train_epochs = 3;
          args.save_strategy = save_strategy;
          args.save_steps = 2;
          args.resume_from_checkpoint = resume;
          zeal::Trainer trainer(engine, model, args, Windows(22, 3), std::nullopt,
                                [&](const torch::data::Example<>& b) { return lm_loss(model, b); });
          struct Killer : zeal::TrainerCallback {
            int64_t at;
            explicit Killer(int64_t k) : at(k) {}
            void on_step_end(const Args&, const zeal::TrainerState& s, zeal::TrainerControl&) override {
              if (s.global_step == at) std::raise(SIGKILL);
            }
          };
          trainer.add_callback(std::make_shared<Killer>(kill_at));
          EXPECT_EQ(trainer.train().global_step, 9);
          write_params(engine, model, params_out);
        },
        2);
  };
  expect_ok(run("", -1, straight));
  fs::remove_all(out);
  const auto killed = run("", kill_at, resumed);
  EXPECT_FALSE(killed[0].ok());
  EXPECT_EQ(killed[0].signal, SIGKILL);
  EXPECT_EQ(read_file(out + "/latest"), latest + "\n");
  expect_ok(run("latest", -1, resumed));
  const std::string a = read_file(straight), b = read_file(resumed);
  EXPECT_FALSE(a.empty());
  EXPECT_TRUE(a == b) << "the resumed run's parameters differ from the uninterrupted run's";
  fs::remove_all(out);
  fs::remove(straight);
  fs::remove(resumed);
}

// 3 steps per epoch. Killed in the middle of the second epoch after the checkpoint of step 4 (the
// loader stands inside the epoch); killed at the second epoch's first step after the checkpoint of
// the first epoch's end (the loader's next epoch).
TEST(Trainer, ResumesFromLatestAfterAKillToTheSameBits) { resumes_after_a_kill("steps", 5, "checkpoint-4"); }
TEST(Trainer, ResumesFromAnEpochsEndCheckpointAfterAKillToTheSameBits) { resumes_after_a_kill("epoch", 4, "checkpoint-3"); }

// --- the arguments ---------------------------------------------------------------------------

TEST(TrainingArguments, ReadFromYamlJsonAndFlags) {
  const std::string yaml = temp("args.yaml"), json = temp("args.json");
  std::ofstream(yaml) << "learning_rate: 2e-5\nnum_train_epochs: 4\nreport_to: [tensorboard, csv]\neval_strategy: epoch\n";
  std::ofstream(json) << R"({"learning_rate": 3e-4, "max_steps": 100, "load_best_model_at_end": true,
                             "eval_strategy": "steps", "save_steps": 50, "eval_steps": 25})";
  auto a = zeal::TrainingArguments::from_file(yaml);
  EXPECT_DOUBLE_EQ(a.learning_rate, 2e-5);
  EXPECT_DOUBLE_EQ(a.num_train_epochs, 4);
  EXPECT_EQ(a.report_to, (std::vector<std::string>{"tensorboard", "csv"}));
  auto b = zeal::TrainingArguments::from_file(json);
  EXPECT_EQ(b.max_steps, 100);
  EXPECT_TRUE(b.load_best_model_at_end);
  // Flags over a file; the rest left for the program, in order.
  const std::vector<std::string> argv_s = {"prog", "--training_args", yaml, "--learning_rate", "1e-4", "--dim", "64",
                                           "--load_best_model_at_end", "--save_strategy=epoch", "--config_file", "c.yaml"};
  std::vector<const char*> argv;
  for (const auto& s : argv_s) argv.push_back(s.c_str());
  std::vector<std::string> rest;
  auto c = zeal::TrainingArguments::parse(static_cast<int>(argv.size()), argv.data(), &rest);
  EXPECT_DOUBLE_EQ(c.learning_rate, 1e-4);
  EXPECT_DOUBLE_EQ(c.num_train_epochs, 4);  // from the file
  EXPECT_TRUE(c.load_best_model_at_end);
  EXPECT_EQ(c.save_strategy, "epoch");
  EXPECT_EQ(rest, (std::vector<std::string>{"--dim", "64", "--config_file", "c.yaml"}));
  // A file keeps the program's defaults it does not name; booleans take false, 0, no too.
  zeal::TrainingArguments program;
  program.output_dir = "program_out";
  program.save_total_limit = 3;
  const std::vector<std::string> argv2_s = {"prog", "--training_args=" + yaml, "--disable_tqdm", "false",
                                            "--load_best_model_at_end", "0", "--dataloader_drop_last"};
  std::vector<const char*> argv2;
  for (const auto& s : argv2_s) argv2.push_back(s.c_str());
  rest.clear();
  auto d = zeal::TrainingArguments::parse(static_cast<int>(argv2.size()), argv2.data(), &rest, program);
  EXPECT_EQ(d.output_dir, "program_out");
  EXPECT_EQ(d.save_total_limit, 3);
  EXPECT_DOUBLE_EQ(d.learning_rate, 2e-5);
  EXPECT_FALSE(d.disable_tqdm);
  EXPECT_FALSE(d.load_best_model_at_end);
  EXPECT_TRUE(d.dataloader_drop_last);
  EXPECT_TRUE(rest.empty());
  fs::remove(yaml);
  fs::remove(json);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(TrainingArguments, WrongOnesAreNamed) {
  zeal::TrainingArguments a;
  EXPECT_NE(error_of([&] { a.set("learning_rat", "1", "--learning_rat"); }).find("did you mean learning_rate"), std::string::npos);
  EXPECT_NE(error_of([&] { a.set("max_steps", "ten", "x.yaml:3"); }).find("x.yaml:3: max_steps must be a whole number"),
            std::string::npos);
  EXPECT_NE(error_of([&] { a.set("lr_scheduler_type", "cosine_ish", "--lr_scheduler_type"); }).find("linear, cosine"),
            std::string::npos);
  a = {};
  a.load_best_model_at_end = true;
  a.eval_strategy = "steps";
  a.save_strategy = "epoch";
  EXPECT_NE(error_of([&] { a.validate(); }).find("save_strategy equal to eval_strategy"), std::string::npos);
  const std::string yaml = temp("bad.yaml");
  std::ofstream(yaml) << "learning_rate: 1e-4\nwarmup_ratio: 2\n";
  EXPECT_NE(error_of([&] { zeal::TrainingArguments::from_file(yaml); }).find(yaml + ":2: warmup_ratio must be from 0 to 1"),
            std::string::npos);
  fs::remove(yaml);
}

TEST(Trainer, AnArgumentThatContradictsTheConfigIsRefusedNamingBoth) {
  const auto r = spawn_checked(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(config(R"({"gradient_accumulation_steps": 4})"), rt);
        TinyGpt model(TinyGptOptions{});
        auto args = base_args(temp("unused"));
        args.gradient_accumulation_steps = 2;
        zeal::Trainer trainer(engine, model, args, Windows(8, 3), std::nullopt,
                              [&](const torch::data::Example<>& b) { return lm_loss(model, b); });
        trainer.train();
      },
      1);
  ASSERT_FALSE(r[0].ok());
  EXPECT_NE(r[0].failure.find("gradient_accumulation_steps is 2 in the training arguments but gradient_accumulation_steps is 4 "
                              "in the config (file ds.json"),
            std::string::npos)
      << r[0].failure;
}

TEST(Trainer, RanksStartedWithOtherArgumentsAreNamed) {
  const std::string unused = temp("unused");
  const auto r = spawn_checked(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(config("{}"), rt);
        TinyGpt model(TinyGptOptions{});
        auto args = base_args(unused);
        if (rt.rank() == 1) args.learning_rate = 2e-3;
        zeal::Trainer trainer(engine, model, args, Windows(8, 3), std::nullopt,
                              [&](const torch::data::Example<>& b) { return lm_loss(model, b); });
        trainer.train();
      },
      2);
  ASSERT_FALSE(r[0].ok());
  EXPECT_NE(r[0].failure.find("rank 1 was started with learning_rate '0.002' but rank 0 with '0.001'"), std::string::npos)
      << r[0].failure;
}

}  // namespace
