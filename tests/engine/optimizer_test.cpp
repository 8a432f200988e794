// The flat-partition optimizers against LibTorch's own torch::optim on the same values, ten
// steps with weight decay; plus state accounting and errors.
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <gtest/gtest.h>

#include "engine/config/config.h"
#include "engine/error.h"
#include "engine/optim/optimizer.h"

namespace zeal::optim {
namespace {

// Runs `ours` and `theirs` over the same 10 gradients; returns the largest relative difference.
double run_both(Optimizer& ours, torch::optim::Optimizer& theirs, torch::Tensor& p_theirs, int64_t n) {
  torch::manual_seed(7);
  at::Tensor p_ours = p_theirs.detach().clone();
  for (int step = 0; step < 10; ++step) {
    at::Tensor g = torch::randn({n}) * (step + 1);
    ours.step(p_ours, g);
    p_theirs.mutable_grad() = g.clone();
    theirs.step();
  }
  return ((p_ours - p_theirs.detach()).abs() / p_theirs.detach().abs().clamp_min(1e-12)).max().item<double>();
}

TEST(Optimizer, AdamWMatchesTorchOptimAdamW) {
  const int64_t n = 1001;
  torch::Tensor p = torch::randn({n}).requires_grad_(true);
  Hyper h{.lr = 1e-2, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0.1};
  auto ours = make_adamw(h);
  torch::optim::AdamW theirs({p}, torch::optim::AdamWOptions(1e-2).betas({0.8, 0.99}).eps(1e-6).weight_decay(0.1));
  EXPECT_LE(run_both(*ours, theirs, p, n), 1e-6);
  EXPECT_EQ(ours->steps(), 10);
  EXPECT_EQ(ours->state_bytes(), 8 * n);
}

TEST(Optimizer, AdamMatchesTorchOptimAdamWithL2) {
  const int64_t n = 777;
  torch::Tensor p = torch::randn({n}).requires_grad_(true);
  Hyper h{.lr = 3e-3, .weight_decay = 0.01};
  auto ours = make_adam(h);
  torch::optim::Adam theirs({p}, torch::optim::AdamOptions(3e-3).weight_decay(0.01));
  EXPECT_LE(run_both(*ours, theirs, p, n), 1e-6);
}

TEST(Optimizer, SgdMomentumAndNesterovMatchTorchOptimSGD) {
  for (bool nesterov : {false, true}) {
    const int64_t n = 513;
    torch::Tensor p = torch::randn({n}).requires_grad_(true);
    Hyper h{.lr = 0.05, .weight_decay = 1e-3, .momentum = 0.9, .nesterov = nesterov};
    auto ours = make_sgd(h);
    torch::optim::SGD theirs({p}, torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(nesterov).weight_decay(1e-3));
    EXPECT_LE(run_both(*ours, theirs, p, n), 1e-6) << "nesterov " << nesterov;
    EXPECT_EQ(ours->state_bytes(), 4 * n);
  }
}

// The fused CPU kernel behind the same interface: against torch::optim and the reference.
TEST(Optimizer, FusedAdamMatchesTorchOptimAndTheReference) {
  const int64_t n = 1003;  // a tail for every SIMD width
  for (bool decoupled : {true, false}) {
    Hyper h{.lr = 1e-2, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0.1};
    auto fused = decoupled ? make_fused_adamw(h) : make_fused_adam(h);
    auto reference = decoupled ? make_adamw(h) : make_adam(h);
    torch::Tensor p = torch::randn({n}).requires_grad_(true);
    at::Tensor p_ref = p.detach().clone(), p_fused = p.detach().clone();
    std::unique_ptr<torch::optim::Optimizer> theirs;
    if (decoupled) {
      theirs = std::make_unique<torch::optim::AdamW>(std::vector<at::Tensor>{p}, torch::optim::AdamWOptions(1e-2).betas({0.8, 0.99}).eps(1e-6).weight_decay(0.1));
    } else {
      theirs = std::make_unique<torch::optim::Adam>(std::vector<at::Tensor>{p}, torch::optim::AdamOptions(1e-2).betas({0.8, 0.99}).eps(1e-6).weight_decay(0.1));
    }
    // Element-wise relative: float32 scalars (lr, betas) against LibTorch's doubles move
    // elements near 0 by a few 1e-6 of their size.
    EXPECT_LE(run_both(*fused, *theirs, p, n), 2e-5) << (decoupled ? "AdamW" : "Adam");
    fused = decoupled ? make_fused_adamw(h) : make_fused_adam(h);
    torch::manual_seed(7);
    for (int step = 0; step < 10; ++step) {
      at::Tensor g = torch::randn({n}) * (step + 1);
      fused->step(p_fused, g);
      reference->step(p_ref, g);
    }
    EXPECT_LE((p_fused - p_ref).abs().max().item<double>() / p_ref.abs().max().item<double>(), 1e-6);
    EXPECT_EQ(fused->state_bytes(), 8 * n);
  }
}

// State allocated ahead (as the engine does) changes nothing: same steps as created lazily.
// The fused step over segments: bf16 gradients scaled by a factor (loss-scale inverse × clip
// coefficient), two segments covering the partition in pieces, the bf16 compute copy written in
// the same pass. Against the reference optimizer stepping on the fp32 scaled gradient, then cast.
TEST(Optimizer, FusedSegmentsWithScaleAndCopyMatchTheReference) {
  const int64_t n = 1003, cut = 517;
  Hyper h{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  auto fused = make_fused_adamw(h);
  auto ref = make_adamw(h);
  ASSERT_TRUE(fused->fused());
  EXPECT_FALSE(ref->fused());
  EXPECT_THROW(ref->fused_step(torch::zeros({n}), {}, 1.0), Error);
  torch::manual_seed(3);
  at::Tensor p_fused = torch::randn({n}), p_ref = p_fused.clone();
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
  }
  EXPECT_LE(((p_fused - p_ref).abs() / p_ref.abs().clamp_min(1e-12)).max().item<double>(), 1e-5);
  EXPECT_TRUE(torch::equal(copy, p_fused.to(torch::kBFloat16)));
  EXPECT_EQ(fused->steps(), 5);
}

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
