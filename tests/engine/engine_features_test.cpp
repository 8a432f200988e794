// zeal::Engine features on several ranks: bf16 against fp32, fp16 overflow handling, frozen
// parameters, memory accounting against the ZeRO stage table (docs/concepts.md), the prepared data loader with
// gather_for_metrics, accumulation at the end of the data, schedules from the config, and the
// collectives on results.
#include "tests/engine/engine_harness.h"

#include <ATen/autocast_mode.h>
#include <torch/data/datasets/base.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <thread>

#include "engine/linear.h"
#include "engine/memory.h"
#include "tests/optim_error_bound.h"

namespace zeal_test {
namespace {

// bf16 compute on a CPU without bf16 instructions is slow: the engine says so at start, naming the
// way out; fp32 and a CPU with AVX512-BF16 get no such line. The CPU's flags are read here with
// the compiler's own cpuid check.
TEST(Precision, Bf16OnACpuWithoutBf16InstructionsIsNamed) {
  for (const std::string precision : {"bf16", "no"}) {
    zeal::Config c = zeal_test::test_config();
    c.mixed_precision = precision;
    testing::internal::CaptureStderr();
    { zeal::Engine engine(c); }
    const std::string err = testing::internal::GetCapturedStderr();
    const bool expected = precision == "bf16" && !__builtin_cpu_supports("avx512bf16");
    EXPECT_EQ(err.find("mixed_precision bf16 on a CPU without AVX512-BF16") != std::string::npos, expected)
        << precision << ": " << err;
    if (expected) EXPECT_NE(err.find("--mixed_precision no"), std::string::npos) << err;
  }
}

// zeal::linear (and every torch::nn::Linear, which runs it) on bf16/fp16 CPU operands: the product
// and its three gradients against float64 computed here from the same operands, within one rounding
// to the operands' type; on a CPU without instructions for the type the product is the widened one
// (its autograd node says so), elsewhere LibTorch's own.
TEST(Precision, LowPrecisionLinearMatchesFloat64OnTheCpu) {
  // The second shape's weight (130 x 65536) is widened in chunks of rows (64, 64, 2).
  struct Shape {
    int64_t batch, tokens, in, out;
  };
  for (const Shape sh : {Shape{2, 5, 24, 12}, Shape{1, 3, 65536, 130}}) {
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    for (const bool with_bias : {true, false}) {
      const int64_t in = sh.in, out = sh.out;
      zeal_test::seed(7);
      const auto f64 = at::TensorOptions().dtype(at::kDouble);
      const at::Tensor x = at::randn({sh.batch, sh.tokens, in}, f64).to(dtype).requires_grad_();
      const at::Tensor w = (at::randn({out, in}, f64) / std::sqrt(static_cast<double>(in))).to(dtype).requires_grad_();
      const at::Tensor b = with_bias ? at::randn({out}, f64).to(dtype).requires_grad_() : at::Tensor();
      const at::Tensor y = zeal::linear(x, w, b);
      ASSERT_EQ(y.scalar_type(), dtype);
      ASSERT_EQ(y.sizes(), (std::vector<int64_t>{sh.batch, sh.tokens, out}));
      const bool widened = zeal::cpu_widens_products(dtype);
      EXPECT_EQ(std::string(y.grad_fn()->name()).find("WidenedLinear") != std::string::npos, widened) << y.grad_fn()->name();
      const at::Tensor gy = at::randn({sh.batch, sh.tokens, out}, f64).to(dtype);
      y.backward(gy);
      // float64 from the same operands.
      const at::Tensor x64 = x.detach().to(at::kDouble), w64 = w.detach().to(at::kDouble), g64 = gy.to(at::kDouble);
      at::Tensor y64 = at::matmul(x64, w64.t());
      if (with_bias) y64 = y64 + b.detach().to(at::kDouble);
      const at::Tensor gx64 = at::matmul(g64, w64);
      const at::Tensor gw64 = g64.reshape({-1, out}).t().mm(x64.reshape({-1, in}));
      // One rounding to bf16 (8 significant bits) or fp16 (11): relative 2^-8 or 2^-11 of the value,
      // plus as much of the largest term for sums that cancel.
      const double rel = dtype == at::kBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
      auto close = [&](const at::Tensor& got, const at::Tensor& want, const char* what) {
        const at::Tensor err = (got.to(at::kDouble) - want).abs();
        const at::Tensor bound = want.abs() * rel + want.abs().max() * rel * 0.5;
        EXPECT_TRUE(err.le(bound).all().item<bool>())
            << what << " " << in << "x" << out << " " << c10::toString(dtype) << " bias " << with_bias << ": worst excess "
            << (err - bound).max().item<double>();
      };
      close(y, y64, "y");
      close(x.grad(), gx64, "dx");
      close(w.grad(), gw64, "dw");
      if (with_bias) close(b.grad(), g64.reshape({-1, out}).sum(0), "db");
      // Under autocast (engine.autocast()) the product is the same, bit for bit: the widened
      // product is not cast back to LibTorch's bf16/fp16 kernels.
      {
        const bool was = at::autocast::is_autocast_enabled(at::kCPU);
        const auto was_dtype = at::autocast::get_autocast_dtype(at::kCPU);
        at::autocast::set_autocast_enabled(at::kCPU, true);
        at::autocast::set_autocast_dtype(at::kCPU, dtype);
        const at::Tensor ya = zeal::linear(x.detach(), w.detach(), with_bias ? b.detach() : at::Tensor());
        at::autocast::set_autocast_enabled(at::kCPU, was);
        at::autocast::set_autocast_dtype(at::kCPU, was_dtype);
        at::autocast::clear_cache();
        if (widened) EXPECT_TRUE(at::equal(ya, y.detach())) << "under autocast " << c10::toString(dtype);
      }
      // A torch::nn::Linear takes the same path.
      torch::nn::Linear layer(torch::nn::LinearOptions(in, out).bias(with_bias));
      layer->to(dtype);
      const at::Tensor z = layer->forward(x.detach());
      EXPECT_EQ(std::string(z.grad_fn()->name()).find("WidenedLinear") != std::string::npos, widened) << z.grad_fn()->name();
    }
  }
  }
}

// bf16 compute with an fp32 master follows the fp32 run: the loss curve and the parameters within
// what bf16's 8-bit significand allows this run (bf16_spread), in stage 2 (flat groups) and stage 3
// (units).
TEST(Precision, Bf16FollowsFp32) {
  for (int stage : {2, 3}) {
    RunSpec s;
    s.world = 2;
    s.stage = stage;
    s.accumulation = 2;
    const RunResult fp32 = run_engine(s, "fp32");
    s.precision = "bf16";
    const RunResult bf16 = run_engine(s, "bf16");
    const double loss_err = ((bf16.losses - fp32.losses).abs() / fp32.losses).max().item<double>();
    const double param_err = rel_diff(bf16.params[0], fp32.params[0]);
    std::printf("[ metric ] stage %d bf16 vs fp32: max relative loss difference %.3g, parameters %.3g\n", stage,
                loss_err, param_err);
    for (int i = 0; i < s.steps; ++i) {
      std::printf("[ metric ]   step %d loss fp32 %.6f bf16 %.6f\n", i, fp32.losses[i].item<double>(),
                  bf16.losses[i].item<double>());
    }
    s.precision = "no";
    const Spread tol = bf16_spread(s);
    EXPECT_LE(loss_err, tol.losses) << "stage " << stage;
    EXPECT_LE(param_err, tol.params) << "stage " << stage;
    EXPECT_GT(loss_err, 0.0) << "bf16 should not be bit-identical to fp32: was it used?";
    EXPECT_LT(fp32.losses[s.steps - 1].item<double>(), fp32.losses[0].item<double>());
  }
}

// fp16: an inf in one rank's loss at step 3 skips that step on every rank (parameters unchanged
// bit for bit), halves the scale (hysteresis 1), and the scale doubles again after
// loss_scale_window good steps.
TEST(Precision, Fp16OverflowSkipsEverywhereHalvesAndRecovers) {
  for (int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    RunSpec s;
    s.world = 3;
    s.stage = stage;
    s.precision = "fp16";
    s.initial_scale_power = 10;
    s.loss_scale_window = 3;
    s.hysteresis = 1;
    const int bad = 3;
    const RunResult r = run_engine(s, "fp16", [&](zeal::Engine& e, int step, int, at::Tensor loss) {
      if (step == bad && e.process_index() == 1) return loss * std::numeric_limits<float>::infinity();
      return loss;
    });
    for (int rank = 0; rank < s.world; ++rank) {
      SCOPED_TRACE("rank " + std::to_string(rank));
      const auto& skipped = r.skipped[rank];
      const auto& scales = r.scales[rank];
      for (int i = 0; i < s.steps; ++i) EXPECT_EQ(skipped[i].item<double>(), i == bad ? 1.0 : 0.0) << "step " << i;
      // The skipped step left every parameter as it was; the others moved.
      EXPECT_TRUE(at::equal(r.trajectory[rank][bad + 1], r.trajectory[rank][bad]));
      EXPECT_FALSE(at::equal(r.trajectory[rank][bad + 2], r.trajectory[rank][bad + 1]));
      const double before = scales[bad - 1].item<double>(), after = scales[bad].item<double>();
      EXPECT_EQ(after, before / 2);
      // Scale after step i; it doubles once loss_scale_window steps passed without overflow.
      EXPECT_EQ(scales[bad + s.loss_scale_window - 1].item<double>(), after);
      EXPECT_EQ(scales[bad + s.loss_scale_window].item<double>(), after * 2);
      EXPECT_TRUE(at::equal(r.params[rank], r.params[0]));
    }
    EXPECT_TRUE(std::isfinite(r.params[0].sum().item<double>()));
  }
}

// bf16 in stage 3 against one LibTorch process computing under the same autocast (fp32 weights,
// bf16 matmuls): both are the fp32 run moved by bf16 rounding, each within bf16_spread of it, so
// within twice that of each other; and bf16's own loss falls.
TEST(Precision, Bf16Stage3MatchesLibTorchUnderAutocast) {
  RunSpec s;
  s.world = 2;
  s.stage = 3;
  s.accumulation = 2;
  s.precision = "bf16";
  const RunResult got = run_engine(s, "bf16s3");
  // The reference: the global batch in one forward under autocast, fp32 weights, torch AdamW.
  RunSpec f = s;
  f.precision = "no";
  zeal_test::Setup u = make_setup(f);
  const at::Tensor initial = flat_params(*u.model).clone();
  const int64_t per_step = s.micro_batch * s.world * s.accumulation;
  const at::Tensor tokens = make_tokens(per_step * s.steps);
  std::vector<double> losses;
  for (int step = 0; step < s.steps; ++step) {
    u.opt->zero_grad();
    at::Tensor loss;
    {
      zeal::Engine::AutocastGuard ac(at::kCPU, at::kBFloat16, true);
      loss = lm_loss(u.model, tokens.narrow(0, step * per_step, per_step));
    }
    loss.backward();
    losses.push_back(loss.item<double>());
    torch::nn::utils::clip_grad_norm_(u.trainable, s.clip);
    u.opt->step();
  }
  const at::Tensor ref_losses = at::tensor(losses, at::kDouble);
  const Spread bound = bf16_spread(f);
  const double loss_err = curve_diff(got.losses, ref_losses), param_err = rel_diff(got.params[0], flat_params(*u.model));
  // The bound above is per tensor and loose (bf16's rounding moves a tensor near 0 by a large part of
  // itself), so it could not tell a run that never trained: the distance to the reference must also
  // be well below the distance training moved the weights (L2 over every parameter; per tensor,
  // weights that barely move, a LayerNorm's near 1, differ by bf16's rounding of their few updates).
  const at::Tensor ref_params = flat_params(*u.model);
  const double moved = (initial - ref_params).norm().item<double>();
  const double worst = (got.params[0] - ref_params).norm().item<double>() / moved;
  std::printf("[ metric ] bf16 stage 3 vs LibTorch autocast: losses %.3g (tolerance %.3g), parameters %.3g "
              "(tolerance %.3g); training moved the weights %.3g (L2), the run differs by %.3g of that; loss %.4f -> "
              "%.4f\n",
              loss_err, 2 * bound.losses, param_err, 2 * bound.params, moved, worst, got.losses[0].item<double>(),
              got.losses[s.steps - 1].item<double>());
  EXPECT_LE(loss_err, 2 * bound.losses);
  EXPECT_LE(param_err, 2 * bound.params);
  // Measured 0.146 (bf16 weights against autocast's fp32 ones, a few Adam steps); a run that did not
  // train is 1.
  EXPECT_LT(worst, 0.5) << "the run differs from the reference by half of how far training moved it or more";
  EXPECT_LT(got.losses[s.steps - 1].item<double>(), got.losses[0].item<double>());
}

// Frozen parameters: no gradient, no optimizer state, no communication; bit for bit unchanged,
// and the rest still matches one-process LibTorch.
TEST(Frozen, EmbeddingsStayBitForBitAndTheRestMatches) {
  for (int stage : {0, 1, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    RunSpec s;
    s.world = 2;
    s.stage = stage;
    s.freeze_embeddings = true;
    const RunResult got = run_engine(s, "frozen" + std::to_string(stage));
    const RunResult ref = run_reference(s);
    zeal_test::seed(s.seed);
    TinyGpt init(model_options());
    const int64_t frozen = init->wte->weight.numel() + init->wpe->weight.numel();  // registered first
    EXPECT_TRUE(at::equal(got.params[0].narrow(0, 0, frozen), flat_params(*init).narrow(0, 0, frozen)));
    EXPECT_LE(rel_diff(got.params[0], ref.params[0]), tolerances(s).zeal_vs_libtorch().params);
    // Accounting: the frozen bytes are the embeddings in fp32, and the trainable count leaves them out.
    EXPECT_EQ(got.memory[0][4].item<double>(), frozen * 4.0);
    EXPECT_EQ(got.memory[0][5].item<double>(), flat_params(*init).numel() - frozen);
  }
}

// Accounting: params + grads + master + optimizer states per rank against the ZeRO stage table (docs/concepts.md), up to
// the shard padding.
TEST(Accounting, ModelStatesMatchTheStageTable) {
  for (const char* precision : {"no", "bf16"}) {
    for (int world : {2, 4}) {
      for (int stage : {0, 1, 2}) {
        RunSpec s;
        s.world = world;
        s.stage = stage;
        s.steps = 1;
        s.bucket = 100'000'000;
        s.precision = precision;
        const RunResult r = run_engine(s, fmt::format("mem{}{}{}", precision, world, stage));
        for (int rank = 0; rank < world; ++rank) {
          const auto& m = r.memory[rank];
          const double held = m[0].item<double>() + m[1].item<double>() + m[2].item<double>() + m[3].item<double>();
          zeal::StageModel model;
          model.stage = stage;
          model.psi = static_cast<int64_t>(m[5].item<double>());
          model.world = world;
          // Parameters in the compute dtype; gradients summed in fp32 (the default accumulation dtype).
          // fp32 parameters are their own master weights (fused AdamW): no separate copy.
          model.param_bytes = std::string(precision) == "bf16" ? 2 : 4;
          model.grad_bytes = 4;
          model.master_bytes = std::string(precision) == "bf16" ? 4 : 0;
          const double expected = zeal::expected_model_state_bytes(model);
          std::printf("[ metric ] %s world %d stage %d rank %d: %.0f bytes held, table says %.0f (%+.2f %%)\n",
                      precision, world, stage, rank, held, expected, 100.0 * (held - expected) / expected);
          // The table counts Ψ elements; the flat buffer (one bucket here) is padded to a multiple of
          // world × 16 elements (FlatLayout's alignment), so what a rank holds exceeds the table by
          // less than world·16 elements of every kind it keeps, and never falls short.
          const double padding =
              world * 16.0 * (model.param_bytes + model.grad_bytes + model.master_bytes + model.optimizer_bytes);
          EXPECT_GE(held, expected) << precision << " world " << world << " stage " << stage;
          EXPECT_LT(held - expected, padding) << precision << " world " << world << " stage " << stage;
        }
      }
    }
  }
}

// --- the data loader ----------------------------------------------------------------------------

struct Indices : torch::data::datasets::Dataset<Indices> {
  explicit Indices(int64_t n) : n(n) {}
  torch::data::Example<> get(size_t i) override {
    return {at::full({1}, static_cast<float>(i)), at::full({}, static_cast<int64_t>(i))};
  }
  std::optional<size_t> size() const override { return n; }
  int64_t n;
};

// Every rank iterates a disjoint part in the same shuffled order; gather_for_metrics returns
// exactly the dataset (sizes no world size divides); the order changes with the epoch.
TEST(Loader, GatherForMetricsReturnsTheDatasetExactly) {
  for (int world : {1, 3, 4}) {
    for (bool split : {false, true}) {
      SCOPED_TRACE(fmt::format("world {} split_batches {}", world, split));
      const std::string dir = temp_dir("loader");
      auto results = zeal::spawn(
          [&](zeal::Runtime& rt) {
            zeal::Engine engine(make_config(RunSpec{}), rt);
            zeal::DataLoader loader(Indices(10),
                                    {.batch_size = split ? 2 * world : 3, .shuffle = true, .seed = 5, .split_batches = split});
            loader = engine.prepare(loader);
            const int64_t per_rank = split ? 2 : 3;
            const int64_t expected_batches = (10 + per_rank * world - 1) / (per_rank * world);
            if (loader.size() != expected_batches) {
              throw zeal::Error(fmt::format("{} batches per rank, expected {}", loader.size(), expected_batches));
            }
            std::vector<at::Tensor> epochs;
            for (int epoch = 0; epoch < 2; ++epoch) {
              std::vector<at::Tensor> seen;
              for (auto& batch : loader) seen.push_back(engine.gather_for_metrics(batch.target));
              epochs.push_back(at::cat(seen));
            }
            if (engine.is_main_process()) {
              write_tensor(dir + "/epoch0", epochs[0]);
              write_tensor(dir + "/epoch1", epochs[1]);
            }
          },
          world);
      ASSERT_EQ(zeal::describe_failures(results), "");
      const at::Tensor e0 = read_tensor(dir + "/epoch0"), e1 = read_tensor(dir + "/epoch1");
      std::filesystem::remove_all(dir);
      EXPECT_TRUE(at::equal(std::get<0>(e0.sort()), at::arange(10, at::kDouble)));
      EXPECT_TRUE(at::equal(std::get<0>(e1.sort()), at::arange(10, at::kDouble)));
      EXPECT_FALSE(at::equal(e0, e1)) << "the shuffle should change with the epoch";
    }
  }
}

// With accumulation 3 and 5 batches per rank, the gradients sync at micro-steps 3 and 5 (the end
// of the data): two optimizer steps per epoch, and zero_grad keeps the partial sum in between.
TEST(Loader, AccumulationSyncsAtTheEndOfTheData) {
  auto results = zeal::spawn(
      [](zeal::Runtime& rt) {
        RunSpec s;
        s.accumulation = 3;
        zeal::Engine engine(make_config(s), rt);
        torch::nn::Linear model(1, 1);
        torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
        zeal::DataLoader loader(Indices(10), {.batch_size = 1});
        auto [m, o, l] = engine.prepare(model, opt, loader);
        std::vector<bool> syncs;
        for (auto& batch : l) {
          auto guard = engine.accumulate(m);
          engine.backward(m->forward(batch.data).sum());
          syncs.push_back(engine.sync_gradients());
          o.step();
          o.zero_grad();
        }
        const std::vector<bool> expected{false, false, true, false, true};
        if (syncs != expected) throw zeal::Error("sync pattern differs");
        if (engine.optimizer_steps() != 2) throw zeal::Error(fmt::format("{} steps", engine.optimizer_steps()));
      },
      2);
  EXPECT_EQ(zeal::describe_failures(results), "");
}

// --- the config's optimizer and schedule -----------------------------------------------------

// optimizer.type SGD and a linear WarmupLR from the config: step t runs at lr_at(t), checked
// against torch::optim::SGD with that rate set by hand.
TEST(Config, OptimizerAndScheduleFromTheConfig) {
  const std::string dir = temp_dir("config_opt");
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Config c = make_config(RunSpec{});
        c.zero.stage = 1;
        c.optimizer.type = "SGD";
        c.optimizer.lr = {0.1, false};
        c.scheduler.type = "WarmupLR";
        c.scheduler.warmup_min_lr = {0.0, false};
        c.scheduler.warmup_max_lr = {0.1, false};
        c.scheduler.warmup_num_steps = {4, false};
        c.scheduler.warmup_type = "linear";
        zeal::Engine engine(c, rt);
        zeal_test::seed(3);
        torch::nn::Linear model(3, 2);
        auto m = engine.prepare(model);
        at::Tensor x = at::ones({4, 3});
        for (int i = 0; i < 6; ++i) {
          engine.backward(m->forward(x).pow(2).sum());
          engine.step();
        }
        if (engine.is_main_process()) write_tensor(dir + "/params", flat_params(*m));
      },
      2);
  ASSERT_EQ(zeal::describe_failures(results), "");
  zeal_test::seed(3);
  torch::nn::Linear ref(3, 2);
  torch::optim::SGD opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  at::Tensor x = at::ones({4, 3});
  for (int t = 0; t < 6; ++t) {
    opt.zero_grad();
    ref->forward(x).pow(2).sum().backward();
    static_cast<torch::optim::SGDOptions&>(opt.param_groups()[0].options()).lr(0.1 * std::min(t, 4) / 4.0);
    opt.step();
  }
  // Both ranks see the same batch, so the average of their gradients is that gradient exactly;
  // zeal's SGD and torch's make the same one multiply-add per element, and WarmupLR's rate is the
  // same double: the same arithmetic, so the same bits.
  EXPECT_TRUE(at::equal(read_tensor(dir + "/params"), flat_params(*ref)));
  std::filesystem::remove_all(dir);
}

// DeepSpeed's rule for the config's optimizer: "type": "Adam" with weight decay is AdamW (decoupled
// decay) unless adam_w_mode is false, then Adam with L2 decay. A model whose gradient does not depend
// on its weights (loss = x · w), so the run is the optimizer alone: every element within the float32
// forward error bound of the exact (float64) AdamW, or Adam, recursion — and far outside the other
// one's, so the mode is really what differs.
TEST(Config, DeepSpeedAdamIsAdamWUnlessAdamWModeIsFalse) {
  for (bool adam_w_mode : {true, false}) {
    const std::string dir = temp_dir("ds_adam");
    auto results = zeal::spawn(
        [&](zeal::Runtime& rt) {
          zeal::Config c = zeal::Config::parse(
              fmt::format(R"({{"zero_optimization": {{"stage": 3}}, "optimizer": {{"type": "Adam", "params":
                  {{"lr": 0.01, "weight_decay": 0.1, "adam_w_mode": {}}}}}}})",
                          adam_w_mode ? "true" : "false"),
              "ds.json");
          c.launch.use_cpu = true;
          zeal::Engine engine(c, rt);
          zeal_test::seed(3);
          torch::nn::Linear model(torch::nn::LinearOptions(7, 1).bias(false));
          auto m = engine.prepare(model);
          const at::Tensor x = at::arange(1, 8, at::kFloat).reshape({1, 7}) / 4;
          for (int i = 0; i < 10; ++i) {
            engine.backward(m->forward(x).sum());
            engine.step();
          }
          auto g = engine.gathered();
          if (engine.is_main_process()) write_tensor(dir + "/w", m->weight.detach().reshape({-1}));
        },
        2);
    ASSERT_EQ(zeal::describe_failures(results), "");
    const at::Tensor w = read_tensor(dir + "/w");
    zeal_test::seed(3);
    torch::nn::Linear init(torch::nn::LinearOptions(7, 1).bias(false));
    for (bool decoupled : {true, false}) {
      double worst = 0;
      for (int64_t i = 0; i < 7; ++i) {
        AdamElement e{.w = init->weight[0][i].item<double>()};
        const double g = (i + 1) / 4.0;  // ∂(x·w)/∂w: both ranks see the same x, the average is x
        for (int t = 1; t <= 10; ++t) adam_step_bound(e, {0.01, 0.9, 0.999, 1e-8, 0.1, decoupled}, t, g);
        worst = std::max(worst, std::fabs(w[i].item<double>() - e.w) / e.err_w);
      }
      std::printf("[ metric ] adam_w_mode %d: largest error / bound against exact %s: %.3g\n", adam_w_mode,
                  decoupled ? "AdamW" : "Adam (L2)", worst);
      if (decoupled == adam_w_mode) EXPECT_LE(worst, 1.0);
      else EXPECT_GT(worst, 100.0) << "the two modes must differ far beyond rounding";
    }
  }
}

// Keys that would change the math without zeal implementing them are refused by name.
TEST(Config, AmsgradIsRefusedByName) {
  try {
    (void)zeal::Config::parse(R"({"optimizer": {"type": "Adam", "params": {"lr": 0.01, "amsgrad": true}}})", "ds.json");
    FAIL() << "amsgrad accepted";
  } catch (const zeal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer.params.amsgrad"), std::string::npos) << e.what();
  }
}

// --- collectives on results ------------------------------------------------------------------

TEST(Results, GatherReducePadAndMainProcessFirst) {
  const std::string dir = temp_dir("results");
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(make_config(RunSpec{}), rt);
        const int r = engine.process_index(), w = engine.num_processes();
        auto check = [&](bool ok, const std::string& what) {
          if (!ok) throw zeal::Error("rank " + std::to_string(r) + ": " + what);
        };
        // Uneven first dimensions: rank r contributes r + 1 rows of value r.
        at::Tensor g = engine.gather(at::full({r + 1, 2}, static_cast<float>(r)));
        std::vector<at::Tensor> expected;
        for (int k = 0; k < w; ++k) expected.push_back(at::full({k + 1, 2}, static_cast<float>(k)));
        check(at::equal(g, at::cat(expected)), "gather of uneven sizes");
        check(at::equal(engine.gather(at::scalar_tensor(r, at::kLong)), at::arange(w, at::kLong)), "gather of 0-d");
        at::Tensor v = at::full({3}, static_cast<double>(r + 1), at::kDouble);
        check(at::allclose(engine.reduce(v, "sum"), at::full({3}, w * (w + 1) / 2.0, at::kDouble)), "reduce sum");
        check(at::allclose(engine.reduce(v, "mean"), at::full({3}, (w + 1) / 2.0, at::kDouble)), "reduce mean");
        check(at::equal(v, at::full({3}, static_cast<double>(r + 1), at::kDouble)), "reduce left its input");
        at::Tensor p = engine.pad_across_processes(at::ones({2, r + 1}), 1, -1, true);
        check(p.size(1) == w && p.narrow(1, w - r - 1, r + 1).eq(1).all().item<bool>() &&
                  (w - r - 1 == 0 || p.narrow(1, 0, w - r - 1).eq(-1).all().item<bool>()),
              "pad_across_processes");
        // The main process finishes its block before any other rank enters.
        {
          auto first = engine.main_process_first();
          if (engine.is_main_process()) {
            std::this_thread::sleep_for(std::chrono::milliseconds(300));
            std::ofstream(dir + "/main_done") << "done";
          } else {
            check(std::filesystem::exists(dir + "/main_done"), "entered before the main process finished");
          }
        }
        engine.wait_for_everyone();
        check(engine.is_local_main_process() == (r == 0), "local main");
        check(engine.device() == at::Device(at::kCPU), "device");
        check(engine.zero_stage() == 0, "zero stage");
      },
      3);
  EXPECT_EQ(zeal::describe_failures(results), "");
  std::filesystem::remove_all(dir);
}

// Clear errors for the mistakes users make.
TEST(Errors, NameTheProblem) {
  auto results = zeal::spawn(
      [](zeal::Runtime& rt) {
        auto expect_error = [](const std::function<void()>& f, const std::string& needle) {
          try {
            f();
          } catch (const zeal::Error& e) {
            if (std::string(e.what()).find(needle) == std::string::npos) {
              throw zeal::Error("error '" + std::string(e.what()) + "' does not mention '" + needle + "'");
            }
            return;
          }
          throw zeal::Error("no error; expected one about '" + needle + "'");
        };
        {
          zeal::Engine engine(make_config(RunSpec{}), rt);
          torch::nn::Linear model(2, 2);
          torch::optim::SGD opt(std::vector<at::Tensor>{model->weight}, torch::optim::SGDOptions(0.1));
          expect_error([&] { engine.prepare(model, opt); }, "'bias' requires grad but is in none");
        }
        {
          zeal::Engine engine(make_config(RunSpec{}), rt);
          expect_error([&] { engine.backward(at::ones({1}, at::requires_grad())); }, "prepare the model");
        }
        zeal::Config c = make_config(RunSpec{});
        c.zero.stage = 3;
        zeal::Engine e3(c, rt);
        zeal_test::Setup u = make_setup(RunSpec{});
        // Stage 3 takes any number of groups, but every trainable parameter must be in one.
        std::vector<at::Tensor> some(u.trainable.begin() + 1, u.trainable.end());
        torch::optim::AdamW partial(some, torch::optim::AdamWOptions(1e-3));
        expect_error([&] { (void)e3.prepare(u.model, partial); }, "'wte.weight' requires grad but is in none");
      },
      1);
  EXPECT_EQ(zeal::describe_failures(results), "");
}

}  // namespace
}  // namespace zeal_test
