// Any token model (ids [B, T] → logits [B, T, vocab]) trained through zeal::Engine on N ranks, the
// same training in one LibTorch process (the reference), and the tolerance between the two
// (rounding.h): for the stage-3 tests' own models, as engine_harness.h does for TinyGpt.
#pragma once

#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <fmt/format.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tests/engine/engine_harness.h"

namespace zeal_test {

struct TokenRun {
  int world = 2, stage = 3, accumulation = 1, steps = 8;
  int64_t micro_batch = 3, vocab = 13, seq = 6;  // samples per rank per micro-step
  double lr = 1e-2, weight_decay = 0.1, clip = 1.0;
  uint64_t seed = 5;
  bool two_groups = false;  // weights with decay; biases and norms (1-d) without, at half the rate
  // stage 3
  int64_t persistence = 0, max_live = 1'000'000'000, prefetch = 50'000'000;
  std::string precision = "no";
  bool debug_collectives = false;
};

// The stage-3 settings that release every unit between its forward and its backward (one unit of
// live parameters, nothing kept) or keep them (DeepSpeed's defaults).
inline TokenRun released(TokenRun r) {
  r.persistence = 0;
  r.max_live = 1;
  return r;
}
inline TokenRun kept(TokenRun r) {
  r.persistence = 100'000;
  r.max_live = 1'000'000'000;
  return r;
}

inline at::Tensor token_table(const TokenRun& r) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  return at::randint(0, r.vocab, {r.steps * r.accumulation * r.world * r.micro_batch, r.seq + 1}, gen);
}

// The samples rank `rank` trains on at micro-step `micro` of step `step`.
inline at::Tensor token_batch(const TokenRun& r, const at::Tensor& table, int step, int rank, int micro) {
  const int64_t first = ((int64_t{step} * r.accumulation + micro) * r.world + rank) * r.micro_batch;
  return table.narrow(0, first, r.micro_batch);
}

template <class Model>
at::Tensor token_loss(Model& m, const at::Tensor& batch, int64_t vocab) {
  const int64_t T = batch.size(1) - 1;
  at::Tensor logits = m->forward(batch.narrow(1, 0, T));
  return torch::nn::functional::cross_entropy(logits.reshape({-1, vocab}).to(at::kFloat),
                                              batch.narrow(1, 1, T).reshape({-1}));
}

// Every trainable parameter once (tied ones are registered twice), in model order.
inline std::vector<at::Tensor> unique_trainable(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (auto& p : m.parameters()) {
    bool seen = !p.requires_grad();
    for (auto& q : out) seen = seen || q.is_same(p);
    if (!seen) out.push_back(p);
  }
  return out;
}

inline std::unique_ptr<torch::optim::AdamW> token_optimizer(torch::nn::Module& m, const TokenRun& r) {
  const auto params = unique_trainable(m);
  if (!r.two_groups) {
    return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(r.lr).weight_decay(r.weight_decay));
  }
  std::vector<at::Tensor> decay, plain;
  for (auto& p : params) (p.dim() >= 2 ? decay : plain).push_back(p);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(r.lr).weight_decay(r.weight_decay)));
  groups.emplace_back(plain, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(r.lr / 2).weight_decay(0.0)));
  return std::make_unique<torch::optim::AdamW>(std::move(groups), torch::optim::AdamWOptions(r.lr));
}

inline zeal::Config token_config(const TokenRun& r) {
  zeal::Config c = zeal_test::test_config();
  c.zero.stage = r.stage;
  c.gradient_accumulation_steps = {r.accumulation, false};
  c.gradient_clipping = {r.clip, false};
  c.zero.stage3_param_persistence_threshold = {r.persistence, false};
  c.zero.stage3_prefetch_bucket_size = {r.prefetch, false};
  c.zero.stage3_max_live_parameters = r.max_live;
  c.mixed_precision = r.precision;
  c.bf16_enabled = {r.precision == "bf16", false};
  c.fp16.enabled = {r.precision == "fp16", false};
  return c;
}

// What a zeal run leaves: every rank's final parameters, rank 0's losses per step (the mean over the
// global batch) and which steps were skipped.
struct TokenResult {
  std::vector<at::Tensor> params;
  at::Tensor losses, skipped;
  std::string failures;  // describe_failures of the ranks (empty: all succeeded)
};

// How a rank runs a micro-step's forward and backward (default: the loss under engine.autocast(),
// then engine.backward); returns the loss. Exceptions whose text holds "test hook" are caught by
// the loop (the program goes on to the next step).
template <class Model>
struct TokenHooks {
  std::function<at::Tensor(zeal::Engine&, Model&, const at::Tensor& batch, int step)> forward_backward;
};

template <class Model>
TokenResult run_tokens(const TokenRun& r, const std::string& name, const TokenHooks<Model>& hooks = {}) {
  const std::string dir = temp_dir(name);
  zeal::SpawnOptions so;
  so.comm_timeout = 60;
  so.debug_collectives = r.debug_collectives;
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(token_config(r), rt);
        zeal_test::seed(r.seed);
        Model model;
        auto opt = token_optimizer(*model, r);
        auto [m, o] = engine.prepare(model, *opt);
        const at::Tensor table = token_table(r);
        std::vector<double> losses, skipped;
        for (int step = 0; step < r.steps; ++step) {
          double step_loss = 0;
          for (int micro = 0; micro < r.accumulation; ++micro) {
            auto guard = engine.accumulate(m);
            const at::Tensor batch = token_batch(r, table, step, engine.process_index(), micro);
            at::Tensor loss;
            try {
              if (hooks.forward_backward) {
                loss = hooks.forward_backward(engine, m, batch, step);
              } else {
                {
                  auto ac = engine.autocast();
                  loss = token_loss(m, batch, r.vocab);
                }
                engine.backward(loss);
              }
            } catch (const std::exception& e) {
              if (std::string(e.what()).find("test hook") == std::string::npos) throw;
            }
            if (loss.defined()) step_loss += engine.reduce(loss.detach(), "mean").item<double>() / r.accumulation;
            o.step();
            o.zero_grad();
          }
          losses.push_back(step_loss);
          skipped.push_back(engine.optimizer_step_was_skipped());
        }
        auto g = engine.gathered();
        const std::string me = std::to_string(engine.process_index());
        write_tensor(dir + "/params_" + me, flat_params(*m));
        if (engine.is_main_process()) {
          write_tensor(dir + "/losses", at::tensor(losses, at::kDouble));
          write_tensor(dir + "/skipped", at::tensor(skipped, at::kDouble));
        }
      },
      r.world, so);
  TokenResult out;
  out.failures = zeal::describe_failures(results);
  if (!out.failures.empty()) return out;
  for (int rank = 0; rank < r.world; ++rank) out.params.push_back(read_tensor(dir + "/params_" + std::to_string(rank)));
  out.losses = read_tensor(dir + "/losses");
  out.skipped = read_tensor(dir + "/skipped");
  std::filesystem::remove_all(dir);
  return out;
}

// The same training in one LibTorch process: each step one forward over the whole global batch,
// torch::nn::utils::clip_grad_norm_ and torch::optim::AdamW.
template <class Model>
ReferenceCurves token_reference(const TokenRun& r) {
  zeal_test::seed(r.seed);
  Model model;
  auto opt = token_optimizer(*model, r);
  const auto params = unique_trainable(*model);
  const at::Tensor table = token_table(r);
  const int64_t per_step = r.micro_batch * r.world * r.accumulation;
  std::vector<double> losses, norms;
  for (int step = 0; step < r.steps; ++step) {
    opt->zero_grad();
    at::Tensor loss = token_loss(model, table.narrow(0, step * per_step, per_step), r.vocab);
    loss.backward();
    losses.push_back(loss.item<double>());
    norms.push_back(r.clip > 0 ? torch::nn::utils::clip_grad_norm_(params, r.clip) : 0.0);
    opt->step();
  }
  return {flat_params(*model), at::tensor(losses, at::kDouble), at::tensor(norms, at::kDouble)};
}

// The reference trainer of rounding.h for a token model.
template <class Model>
ReferenceTrainer token_trainer(const TokenRun& r, bool fused) {
  struct State {
    Model model{nullptr};
    std::vector<at::Tensor> params;
    std::unique_ptr<torch::optim::AdamW> opt;
    std::vector<std::unique_ptr<zeal::optim::Optimizer>> zeal_opts;
    at::Tensor table;
  };
  auto st = std::make_shared<State>();
  zeal_test::seed(r.seed);
  st->model = Model();
  st->params = unique_trainable(*st->model);
  st->opt = token_optimizer(*st->model, r);
  if (fused) {
    for (auto& g : st->opt->param_groups()) {
      const auto& o = static_cast<const torch::optim::AdamWOptions&>(g.options());
      st->zeal_opts.push_back(zeal::optim::make_fused_adamw({.lr = o.lr(), .eps = o.eps(), .weight_decay = o.weight_decay()}));
    }
  }
  st->table = token_table(r);
  ReferenceTrainer t;
  t.params = st->params;
  t.backward = [st, r](int step, int rank, int micro) {
    for (auto& p : st->params) p.mutable_grad() = at::Tensor();
    at::Tensor loss = token_loss(st->model, token_batch(r, st->table, step, rank, micro), r.vocab);
    (r.accumulation == 1 ? loss : loss * (1.0 / r.accumulation)).backward();
    return loss.item<double>();
  };
  t.update = [st, r] {
    std::vector<zeal::optim::Optimizer*> z;
    for (auto& o : st->zeal_opts) z.push_back(o.get());
    return clip_and_step(st->params, r.clip, *st->opt, z);
  };
  t.flat = [st] { return flat_params(*st->model); };
  return t;
}

// max |a − b| / max |b| per parameter of the model, the largest over its parameters.
template <class Model>
double token_rel_diff(const at::Tensor& a, const at::Tensor& b) {
  Model shape;
  double worst = 0;
  int64_t off = 0;
  for (auto& p : shape->parameters()) {
    const int64_t n = p.numel();
    const at::Tensor x = a.narrow(0, off, n), y = b.narrow(0, off, n);
    worst = std::max(worst, (x - y).abs().max().item<double>() / std::max(y.abs().max().item<double>(), 1e-12));
    off += n;
  }
  return worst;
}

// Tolerances for a token model, as tolerances() gives them for TinyGpt (rounding.h).
template <class Model>
Tolerances token_tolerances(const TokenRun& r) {
  Tolerances t;
  const auto diff = [](const at::Tensor& a, const at::Tensor& b) { return token_rel_diff<Model>(a, b); };
  t.sum_order = sum_order_spread([&] { return token_trainer<Model>(r, true); }, r.world, r.accumulation, r.steps, diff);
  const ReferenceCurves zeal_optimizer = run_reference_trainer(token_trainer<Model>(r, true), r.world, r.accumulation, r.steps);
  const ReferenceCurves torch_optimizer = run_reference_trainer(token_trainer<Model>(r, false), r.world, r.accumulation, r.steps);
  t.optimizer = measured_spread(zeal_optimizer, torch_optimizer, diff);
  t.split = measured_spread(torch_optimizer, token_reference<Model>(r), diff);
  return t;
}

}  // namespace zeal_test
