// Activation checkpointing (engine/activation_checkpoint.h): units that checkpoint train to the same
// bits as units that do not, at every stage and world size, with dropout, bf16, accumulation,
// clipping, offload, a frozen LayerNorm first in the unit and an fp16 overflow; each checkpointed unit
// runs its forward twice a step with gradients and once without; zeal::checkpoint on any function;
// the activation memory of a 4-unit model at 512 tokens, measured in the resident set, at most a
// third of what the same step holds without.
#include "tests/engine/engine_harness.h"

#include <fmt/format.h>

#include <limits>

#include "engine/activation_checkpoint.h"
#include "engine/memory_tracker.h"

namespace zeal_test {
namespace {

struct Case {
  std::string label;
  RunSpec spec;
  int bad_step = -1;  // fp16: rank 1's loss is inf at this step
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.label; }

RunSpec base(int world, int stage) {
  RunSpec s;
  s.world = world;
  s.stage = stage;
  s.steps = 4;
  s.accumulation = 2;
  s.dropout = 0.2;
  s.layers = 3;
  return s;
}

class CheckpointedUnits : public ::testing::TestWithParam<Case> {};

TEST_P(CheckpointedUnits, TrainToTheSameBitsAsUnitsThatKeepTheirActivations) {
  const Case c = GetParam();
  RunSpec s = c.spec;
  LossHook hook;
  if (c.bad_step >= 0) {
    hook = [&](zeal::Engine& e, int step, int, at::Tensor loss) {
      return step == c.bad_step && e.process_index() == 1 ? loss * std::numeric_limits<float>::infinity() : loss;
    };
  }
  const RunResult plain = run_engine(s, c.label + "_plain", hook);
  s.checkpointing = true;
  const RunResult ckpt = run_engine(s, c.label + "_ckpt", hook);
  for (int r = 0; r < s.world; ++r) {
    EXPECT_TRUE(at::equal(ckpt.params[r], plain.params[r])) << "rank " << r << ": largest difference "
                                                             << (ckpt.params[r] - plain.params[r]).abs().max().item<double>();
    EXPECT_TRUE(at::equal(ckpt.skipped[r], plain.skipped[r])) << "rank " << r;
  }
  // The same values, an overflow step's inf or nan included.
  auto same = [](const at::Tensor& a, const at::Tensor& b) {
    return a.sizes() == b.sizes() && ((a == b) | (at::isnan(a) & at::isnan(b))).all().item<bool>();
  };
  EXPECT_TRUE(same(ckpt.losses, plain.losses)) << ckpt.losses << plain.losses;
  if (s.clip > 0) EXPECT_TRUE(same(ckpt.norms, plain.norms)) << ckpt.norms << plain.norms;
  // The units really were checkpointed: each checkpointed block ran twice per micro-step, the
  // others once.
  const int64_t micro_steps = s.steps * s.accumulation;
  const int64_t checkpointed = (s.layers + s.checkpoint_interval - 1) / s.checkpoint_interval;
  EXPECT_EQ(plain.forwards[0], micro_steps * s.layers);
  EXPECT_EQ(ckpt.forwards[0], micro_steps * (s.layers + checkpointed));
  // Training moved the parameters (the comparison is not between two untouched models).
  EXPECT_FALSE(at::equal(plain.trajectory[0][s.steps], plain.trajectory[0][0]));
  if (c.bad_step >= 0) EXPECT_EQ(plain.skipped[0][c.bad_step].item<double>(), 1.0);
}

std::vector<Case> cases() {
  std::vector<Case> v;
  v.push_back({"stage0_world1", base(1, 0)});
  v.push_back({"stage0_world2", base(2, 0)});
  v.push_back({"stage1_world2", base(2, 1)});
  v.push_back({"stage2_world3", base(3, 2)});
  v.push_back({"stage3_world1", base(1, 3)});
  v.push_back({"stage3_world2", base(2, 3)});
  v.push_back({"stage3_world3", base(3, 3)});
  RunSpec s = base(2, 3);
  s.precision = "bf16";
  v.push_back({"stage3_world2_bf16", s});
  s = base(2, 2);
  s.offload = true;
  v.push_back({"stage2_world2_cpu_offload", s});
  s = base(2, 3);
  s.offload = true;  // the optimizer and the parameters
  v.push_back({"stage3_world2_cpu_offload", s});
  s = base(2, 3);
  s.freeze_ln1 = true;  // a frozen LayerNorm first in every unit
  s.freeze_embeddings = true;  // and the first unit's input asks for no gradient
  v.push_back({"stage3_world2_frozen_first", s});
  s = base(2, 3);
  s.checkpoint_interval = 2;  // units 0 and 2 of 3
  v.push_back({"stage3_world2_every_second_unit", s});
  s = base(2, 3);
  s.precision = "fp16";
  s.initial_scale_power = 10;
  s.hysteresis = 1;
  v.push_back({"stage3_world2_fp16_overflow", s, 2});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, CheckpointedUnits, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.label; });

// A checkpointed unit's forward runs twice per step with gradients (the forward, the recomputation),
// once in a forward without gradients (evaluation); a unit set through the API checkpoints too.
TEST(ActivationCheckpointing, ForwardRunsTwiceWithGradientsOnceWithout) {
  const std::string dir = temp_dir("ckpt_counts");
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        RunSpec s = base(1, 3);
        zeal::Engine engine(make_config(s), rt);
        TinyGptOptions mo = model_options();
        mo.layers = 3;
        TinyGpt model(mo);
        model->blocks[1]->set_activation_checkpointing(true);  // by hand: only the middle unit
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
        auto [m, o] = engine.prepare(model, opt);
        const at::Tensor tokens = make_tokens(2);
        auto counts = [&] {
          std::vector<int64_t> c;
          for (auto& b : m->blocks) c.push_back(b->inner->forwards);
          return c;
        };
        engine.backward(lm_loss(m, tokens));
        o.step();
        if (counts() != std::vector<int64_t>{1, 2, 1}) throw zeal::Error("training step: not 1, 2, 1 forwards");
        {
          c10::NoGradGuard no_grad;
          (void)lm_loss(m, tokens);
        }
        if (counts() != std::vector<int64_t>{2, 3, 2}) throw zeal::Error("evaluation: the checkpointed unit ran twice");
        if (!m->blocks[1]->activation_checkpointing() || m->blocks[0]->activation_checkpointing())
          throw zeal::Error("the units' settings changed");
      },
      1);
  EXPECT_EQ(zeal::describe_failures(results), "");
}

// zeal::checkpoint on a function of several tensors with dropout inside, one input without a
// gradient and an undefined one, returning a tuple: the same outputs and gradients, bit for bit, as
// the plain function, and the function ran twice.
TEST(ActivationCheckpointing, AnyFunctionOfTensorsGivesThePlainGradients) {
  int calls = 0;
  auto fn = [&calls](const at::Tensor& a, const at::Tensor& b, const at::Tensor& none, const at::Tensor& w) {
    ++calls;
    EXPECT_FALSE(none.defined());
    at::Tensor h = at::dropout(at::tanh(at::matmul(a, w)), 0.3, true) * b;
    return std::make_tuple(h.sum(-1), 7, at::relu(h));
  };
  const at::Tensor a0 = at::randn({4, 5}), b = at::randn({4, 3}), w0 = at::randn({5, 3});
  auto run = [&](bool ckpt) {
    at::Tensor a = a0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    seed(11);
    auto out = ckpt ? zeal::checkpoint(fn, a, b, at::Tensor(), w) : fn(a, b, at::Tensor(), w);
    (std::get<0>(out).sum() * 3 + std::get<2>(out).pow(2).sum()).backward();
    EXPECT_EQ(std::get<1>(out), 7);
    return std::vector<at::Tensor>{std::get<0>(out).detach(), a.grad(), w.grad()};
  };
  calls = 0;
  const auto plain = run(false);
  EXPECT_EQ(calls, 1);
  calls = 0;
  const auto ckpt = run(true);
  EXPECT_EQ(calls, 2);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(at::equal(plain[i], ckpt[i])) << i;
  // In a forward without gradients the function runs once.
  calls = 0;
  {
    c10::NoGradGuard no_grad;
    (void)zeal::checkpoint(fn, a0, b, at::Tensor(), w0);
  }
  EXPECT_EQ(calls, 1);
}

// A 4-unit model at 512 tokens: the resident set's growth over one forward and backward, less the
// gradients (parameter count × 4 bytes, from the model's shapes), with every unit checkpointed is at
// most a third of that without. Each measurement in a fresh process after a warm-up step.
TEST(ActivationCheckpointing, ActivationMemoryOfAFourUnitModelIsAThirdOrLess) {
  TinyGptOptions mo;
  mo.vocab = 64, mo.dim = 192, mo.heads = 4, mo.layers = 4, mo.seq = 512, mo.hidden = 768;
  const int64_t batch = 2;
  auto activations = [&](bool ckpt) {
    const std::string dir = temp_dir(ckpt ? "ckpt_mem_on" : "ckpt_mem_off");
    auto results = zeal::spawn(
        [&](zeal::Runtime& rt) {
          RunSpec s = base(1, 0);
          s.accumulation = 1;
          s.checkpointing = ckpt;
          zeal::Engine engine(make_config(s), rt);
          seed(3);
          TinyGpt model(mo);
          int64_t params = 0;
          for (const auto& p : model->parameters()) params += p.numel();
          torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-4));
          auto [m, o] = engine.prepare(model, opt);
          auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
          const at::Tensor tokens = at::randint(0, mo.vocab, {batch, mo.seq}, gen);
          auto step = [&] {
            at::Tensor logits = m->forward(tokens);
            engine.backward(at::cross_entropy_loss(logits.reshape({-1, mo.vocab}), tokens.reshape({-1})));
          };
          step();  // warm-up: the optimizer's state, the allocator's pools
          o.step();
          o.zero_grad();
          zeal::detail::reset_resident_peak();
          const int64_t before = zeal::detail::resident_bytes();
          step();
          const int64_t grown = zeal::detail::resident_peak_bytes() - before - 4 * params;
          write_tensor(dir + "/grown", at::tensor({static_cast<double>(grown)}, at::kDouble));
        },
        1);
    EXPECT_EQ(zeal::describe_failures(results), "");
    return read_tensor(dir + "/grown")[0].item<double>();
  };
  const double without = activations(false), with = activations(true);
  // What the shapes say a unit keeps without checkpointing: its hidden-size tensors and the attention
  // scores (B·heads·T² per copy); with it, one hidden state per unit and one unit's activations.
  const double hidden = 4.0 * batch * mo.seq * mo.dim, scores = 4.0 * batch * mo.heads * mo.seq * mo.seq;
  std::printf("[ metric ] activation memory, 4 units x %lld tokens: %.1f MiB without checkpointing, %.1f MiB with "
              "(ratio %.3f; a hidden state is %.2f MiB, one head's scores %.2f MiB)\n",
              static_cast<long long>(batch * mo.seq), without / 1048576, with / 1048576, with / without,
              hidden / 1048576, scores / mo.heads / 1048576);
  EXPECT_GT(without, 4 * (hidden + scores)) << "the plain step holds less than each unit's scores and input: the "
                                               "measurement does not see the activations";
  EXPECT_LE(with, without / 3);
}

}  // namespace
}  // namespace zeal_test
