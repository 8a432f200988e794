// The flat-partition optimizers against LibTorch's own torch::optim on the same values, ten
// steps with weight decay; plus state accounting and errors.
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <vector>

#include "engine/config/config.h"
#include "engine/error.h"
#include "engine/optim/optimizer.h"
#include "engine/zero/shard_step.h"
#include "tests/optim_error_bound.h"
#include "tests/engine/fused_segments.h"
#include "tests/test_device.h"

namespace zeal::optim {
namespace {

using zeal_test::AdamElement;
using zeal_test::AdamFormula;
using zeal_test::SgdElement;
using zeal_test::SgdFormula;
using zeal_test::adam_step_bound;
using zeal_test::gamma_f32;
using zeal_test::sgd_step_bound;

// Runs `ours` and `theirs` over the same 10 gradients beside the exact (float64) run of the formula,
// which `advance(i, t, g)` takes one step for element i. Returns the largest |x − exact| / bound
// over elements for each: both must be at most 1 (optim_error_bound.h), so they agree with each
// other within twice the bound, element by element.
struct AgainstExact {
  double ours = 0, theirs = 0;
};

AgainstExact run_both(Optimizer& ours, torch::optim::Optimizer& theirs, torch::Tensor& p_theirs, int64_t n,
                      const std::function<double(int64_t, int, double)>& advance,
                      const std::function<double(int64_t)>& exact, const std::function<double(int64_t)>& bound) {
  zeal_test::seed(7);
  at::Tensor p_ours = p_theirs.detach().clone();
  for (int step = 0; step < 10; ++step) {
    at::Tensor g = torch::randn({n}) * (step + 1);
    ours.step(p_ours, g);
    p_theirs.mutable_grad() = g.clone();
    theirs.step();
    const float* gp = g.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) advance(i, step + 1, gp[i]);
  }
  AgainstExact r;
  const float* a = p_ours.data_ptr<float>();
  const float* b = p_theirs.detach().data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    r.ours = std::max(r.ours, std::fabs(a[i] - exact(i)) / bound(i));
    r.theirs = std::max(r.theirs, std::fabs(b[i] - exact(i)) / bound(i));
  }
  std::printf("[ metric ] %s: largest error / bound %.3g, %s: %.3g\n", ours.name().c_str(), r.ours, "torch::optim",
              r.theirs);
  return r;
}

// Adam elements started from p's values, for run_both.
struct AdamRun {
  std::vector<AdamElement> e;
  AdamFormula f;
  AdamRun(const at::Tensor& p, AdamFormula formula) : f(formula) {
    for (int64_t i = 0; i < p.numel(); ++i) e.push_back({.w = p.detach()[i].item<double>()});
  }
  double advance(int64_t i, int t, double g) {
    adam_step_bound(e[i], f, t, g);
    return e[i].w;
  }
};

TEST(Optimizer, AdamWMatchesTorchOptimAdamW) {
  const int64_t n = 1001;
  torch::Tensor p = torch::randn({n}).requires_grad_(true);
  Hyper h{.lr = 1e-2, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0.1};
  auto ours = make_adamw(h);
  torch::optim::AdamW theirs({p}, torch::optim::AdamWOptions(1e-2).betas({0.8, 0.99}).eps(1e-6).weight_decay(0.1));
  AdamRun x(p, {1e-2, 0.8, 0.99, 1e-6, 0.1, true});
  const auto r = run_both(
      *ours, theirs, p, n, [&](int64_t i, int t, double g) { return x.advance(i, t, g); },
      [&](int64_t i) { return x.e[i].w; }, [&](int64_t i) { return x.e[i].err_w; });
  EXPECT_LE(r.ours, 1.0);
  EXPECT_LE(r.theirs, 1.0);
  EXPECT_EQ(ours->steps(), 10);
  EXPECT_EQ(ours->state_bytes(), 8 * n);
}

TEST(Optimizer, AdamMatchesTorchOptimAdamWithL2) {
  const int64_t n = 777;
  torch::Tensor p = torch::randn({n}).requires_grad_(true);
  Hyper h{.lr = 3e-3, .weight_decay = 0.01};
  auto ours = make_adam(h);
  torch::optim::Adam theirs({p}, torch::optim::AdamOptions(3e-3).weight_decay(0.01));
  AdamRun x(p, {3e-3, 0.9, 0.999, 1e-8, 0.01, false});
  const auto r = run_both(
      *ours, theirs, p, n, [&](int64_t i, int t, double g) { return x.advance(i, t, g); },
      [&](int64_t i) { return x.e[i].w; }, [&](int64_t i) { return x.e[i].err_w; });
  EXPECT_LE(r.ours, 1.0);
  EXPECT_LE(r.theirs, 1.0);
}

TEST(Optimizer, SgdMomentumAndNesterovMatchTorchOptimSGD) {
  for (bool nesterov : {false, true}) {
    const int64_t n = 513;
    torch::Tensor p = torch::randn({n}).requires_grad_(true);
    Hyper h{.lr = 0.05, .weight_decay = 1e-3, .momentum = 0.9, .nesterov = nesterov};
    auto ours = make_sgd(h);
    torch::optim::SGD theirs({p}, torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(nesterov).weight_decay(1e-3));
    std::vector<SgdElement> e;
    for (int64_t i = 0; i < n; ++i) e.push_back({.w = p.detach()[i].item<double>()});
    const SgdFormula f{0.05, 0.9, 1e-3, nesterov};
    const auto r = run_both(
        *ours, theirs, p, n, [&](int64_t i, int, double g) { sgd_step_bound(e[i], f, g); return e[i].w; },
        [&](int64_t i) { return e[i].w; }, [&](int64_t i) { return e[i].err_w; });
    EXPECT_LE(r.ours, 1.0) << "nesterov " << nesterov;
    EXPECT_LE(r.theirs, 1.0) << "nesterov " << nesterov;
    EXPECT_EQ(ours->state_bytes(), 4 * n);
  }
}

// The fused CPU kernel behind the same interface: against the exact run, as torch::optim and the
// reference are. The default betas: 1 − 0.999 rounded from a float β2 would be 1.3e-5 off, which
// the bound does not allow (the kernel takes the hyperparameters in double).
TEST(Optimizer, FusedAdamMatchesTorchOptimAndTheReference) {
  const int64_t n = 1003;  // a tail for every SIMD width
  for (bool decoupled : {true, false}) {
    Hyper h{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-6, .weight_decay = 0.1};
    auto fused = decoupled ? make_fused_adamw(h) : make_fused_adam(h);
    auto reference = decoupled ? make_adamw(h) : make_adam(h);
    torch::Tensor p = torch::randn({n}).requires_grad_(true);
    at::Tensor p_ref = p.detach().clone(), p_fused = p.detach().clone();
    std::unique_ptr<torch::optim::Optimizer> theirs;
    if (decoupled) {
      theirs = std::make_unique<torch::optim::AdamW>(std::vector<at::Tensor>{p}, torch::optim::AdamWOptions(1e-2).betas({0.9, 0.999}).eps(1e-6).weight_decay(0.1));
    } else {
      theirs = std::make_unique<torch::optim::Adam>(std::vector<at::Tensor>{p}, torch::optim::AdamOptions(1e-2).betas({0.9, 0.999}).eps(1e-6).weight_decay(0.1));
    }
    AdamRun x(p, {1e-2, 0.9, 0.999, 1e-6, 0.1, decoupled});
    const auto r = run_both(
        *fused, *theirs, p, n, [&](int64_t i, int t, double g) { return x.advance(i, t, g); },
        [&](int64_t i) { return x.e[i].w; }, [&](int64_t i) { return x.e[i].err_w; });
    EXPECT_LE(r.ours, 1.0) << (decoupled ? "AdamW" : "Adam");
    EXPECT_LE(r.theirs, 1.0) << (decoupled ? "AdamW" : "Adam");
    fused = decoupled ? make_fused_adamw(h) : make_fused_adam(h);
    zeal_test::seed(7);
    for (int step = 0; step < 10; ++step) {
      at::Tensor g = torch::randn({n}) * (step + 1);
      fused->step(p_fused, g);
      reference->step(p_ref, g);
    }
    // Both against the same exact run (x, the same gradients): the weights and the state (m, v:
    // where a wrong constant shows long before it reaches the weights' precision) within the bound.
    const auto fs = fused->state(), rs = reference->state();
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_LE(std::fabs(p_fused[i].item<double>() - x.e[i].w), x.e[i].err_w) << i;
      ASSERT_LE(std::fabs(p_ref[i].item<double>() - x.e[i].w), x.e[i].err_w) << i;
      for (const auto* st : {&fs, &rs}) {
        ASSERT_LE(std::fabs(st->at("exp_avg")[i].item<double>() - x.e[i].m), x.e[i].err_m) << i;
        ASSERT_LE(std::fabs(st->at("exp_avg_sq")[i].item<double>() - x.e[i].v), x.e[i].err_v) << i;
      }
    }
    EXPECT_EQ(fused->state_bytes(), 8 * n);
  }
}

// The fused step over segments: bf16 gradients scaled by a factor (loss-scale inverse × clip
// coefficient), two segments covering the partition in pieces, the bf16 compute copy written in
// the same pass. Against the exact run on the scaled bf16 values (the scaling is one rounding
// more), as the reference optimizer stepping on the fp32 scaled gradient is; the copy is the
// rounded master exactly.
TEST(Optimizer, FusedSegmentsWithScaleAndCopyMatchTheReference) {
  const int64_t n = 1003, cut = 517;
  Hyper h{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  auto fused = make_fused_adamw(h);
  auto ref = make_adamw(h);
  ASSERT_TRUE(fused->fused());
  EXPECT_FALSE(ref->fused());
  EXPECT_THROW(ref->fused_step(torch::zeros({n}), {}, 1.0), Error);
  zeal_test::seed(3);
  at::Tensor p_fused = torch::randn({n}), p_ref = p_fused.clone();
  AdamRun x(p_fused, {1e-2, 0.9, 0.95, 1e-8, 0.1, true});
  at::Tensor copy = torch::empty({n}, torch::kBFloat16);
  const double scale = 0.75 / 1024.0;
  for (int step = 0; step < 5; ++step) {
    at::Tensor g = (torch::randn({n}) * 1024.0).to(torch::kBFloat16);
    std::vector<FusedSegment> segs(2);
    for (int k = 0; k < 2; ++k) {
      segs[k].offset = k == 0 ? 0 : cut;
      segs[k].n = k == 0 ? cut : n - cut;
      segs[k].grad = static_cast<const uint16_t*>(g.data_ptr()) + segs[k].offset;
      segs[k].grad_type = cpu::DType::kBf16;
      segs[k].copy = static_cast<uint16_t*>(copy.data_ptr()) + segs[k].offset;
      segs[k].copy_type = cpu::DType::kBf16;
    }
    fused->fused_step(p_fused, segs, scale);
    ref->step(p_ref, g.to(torch::kFloat) * scale);
    const at::Tensor g64 = g.to(torch::kDouble) * scale;
    for (int64_t i = 0; i < n; ++i) {
      const double gi = g64[i].item<double>();
      adam_step_bound(x.e[i], x.f, step + 1, gi, gamma_f32(2) * std::fabs(gi));
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_LE(std::fabs(p_fused[i].item<double>() - x.e[i].w), x.e[i].err_w) << i;
    ASSERT_LE(std::fabs(p_ref[i].item<double>() - x.e[i].w), x.e[i].err_w) << i;
  }
  EXPECT_TRUE(torch::equal(copy, p_fused.to(torch::kBFloat16)));
  EXPECT_EQ(fused->steps(), 5);
}

// Segments carrying their own m and v (NVMe windows) step as the optimizer's own state does (the
// GPU's half of this check is in cuda_engine_test).
TEST(Optimizer, FusedSegmentsWithTheirOwnStateStepAsTheOptimizersOwn) {
  zeal_test::expect_segment_state_matches_own_state(at::kCPU);
}

// State allocated ahead (as the engine does) changes nothing: same steps as created lazily.
TEST(Optimizer, StateAllocatedAheadGivesTheSameSteps) {
  const int64_t n = 257;
  for (auto make : {+[] { return make_sgd(Hyper{.lr = 0.05, .momentum = 0.9}); },
                    +[] { return make_adamw(Hyper{.lr = 1e-2, .weight_decay = 0.1}); }}) {
    auto lazy = make(), ahead = make();
    at::Tensor p1 = torch::randn({n}), p2 = p1.clone();
    ahead->allocate_state(p2);
    EXPECT_EQ(ahead->state_bytes(), ahead->state_bytes_per_param() * n);
    for (int step = 0; step < 5; ++step) {
      at::Tensor g = torch::randn({n});
      lazy->step(p1, g);
      ahead->step(p2, g);
    }
    EXPECT_TRUE(at::equal(p1, p2)) << lazy->name();
  }
}

TEST(Optimizer, LearningRateChangesTakeEffect) {
  // lr 0 leaves AdamW's parameters where they were (decoupled decay is lr-scaled too).
  auto opt = make_adamw(Hyper{.lr = 1e-2, .weight_decay = 0.5});
  at::Tensor p = torch::randn({100});
  const at::Tensor before = p.clone();
  opt->set_lr(0.0);
  opt->step(p, torch::randn({100}));
  EXPECT_TRUE(at::equal(p, before));
  opt->set_lr(1e-2);
  opt->step(p, torch::randn({100}));
  EXPECT_FALSE(at::equal(p, before));
}

TEST(Optimizer, FromConfigAndErrors) {
  Config c = Config::parse(R"({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.5}}})", "ds.json");
  auto opt = make_optimizer(c.optimizer);
  EXPECT_EQ(opt->name(), "SGD");
  EXPECT_DOUBLE_EQ(opt->lr(), 0.1);
  EXPECT_EQ(opt->state_bytes_per_param(), 4);
  at::Tensor p = torch::zeros({4});
  EXPECT_THROW(opt->step(p, torch::zeros({5})), Error);
  EXPECT_THROW(opt->step(p, torch::zeros({4}, torch::kBFloat16)), Error);
  Config autos = Config::parse(R"({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})", "ds.json");
  try {
    make_optimizer(autos.optimizer);
    FAIL() << "an unresolved auto was used";
  } catch (const zeal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer.params.lr is \"auto\""), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace zeal::optim

// The step's statistics computed on the partition's device (what a GPU step reduces without a host
// wait per piece) against a float64 computation of the same gradients, for fp32 and bf16 pieces,
// with a pending loss scale and a deferred clip factor; and equal to the host statistics.
TEST(ShardStepStatistics, OnTheDeviceMatchFloat64) {
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    zeal_test::seed(7);
    const std::vector<int64_t> sizes{1000, 1, 4097, 33};
    std::vector<zeal::zero::ShardStep::Piece> pieces;
    int64_t offset = 0;
    double want_sumsq = 0, want_amax = 0;
    const double inv_scale = 1.0 / 1024.0, clip = 0.37;
    for (int64_t n : sizes) {
      at::Tensor g = (at::randn({n}) * 300.0).to(dtype);
      const at::Tensor g64 = g.to(at::kDouble) * inv_scale * clip;
      want_sumsq += g64.square().sum().item<double>();
      want_amax = std::max(want_amax, g64.abs().max().item<double>());
      pieces.push_back({offset, g, at::zeros({n}, at::TensorOptions().dtype(dtype))});
      offset += n;
    }
    zeal::optim::Hyper h;
    zeal::zero::ShardStep step(at::zeros({offset}), zeal::optim::make_fused_adamw(h), std::move(pieces));
    step.scale(clip);  // deferred into the update's multiplier
    const double sumsq = step.sumsq_on_device(inv_scale, at::kCPU).item<double>();
    const double amax = step.amax_on_device(inv_scale, at::kCPU).item<double>();
    // Every element squared and summed in double: (n + 2) roundings of 2^-53 each, relative.
    const double n = static_cast<double>(offset);
    EXPECT_LE(std::abs(sumsq - want_sumsq), (n + 4) * std::ldexp(1.0, -53) * want_sumsq) << c10::toString(dtype);
    EXPECT_LE(std::abs(amax - want_amax), 4 * std::ldexp(1.0, -53) * want_amax) << c10::toString(dtype);
    const auto host = step.stats(inv_scale);
    EXPECT_LE(std::abs(host.sumsq - sumsq), (n + 4) * std::ldexp(1.0, -53) * 2 * want_sumsq);
  }
}
