// Stage 3 on the models people train: blocks with frozen parameters inside (a frozen LayerNorm
// first, LoRA written three ways, a block with nothing trainable, units inside units, a tied
// embedding and head), released between forward and backward or kept; the backward run by the
// program itself; a hook that throws; several parameter groups. Each against one LibTorch process
// within the tolerance rounding.h derives, and against stage 0 bit for bit where the arithmetic is
// the same (two ranks, one micro-step).
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <gtest/gtest.h>

#include "engine/zero/sharded.h"
#include "tests/engine/token_harness.h"

using namespace zeal_test;

namespace {

constexpr int64_t kDim = 16, kVocab = 13;

// A frozen LayerNorm first, then trainable Linears: the shape of a PEFT block. Its backward needs
// the frozen weights after the Linears' gradients are in.
struct NormFirstImpl : torch::nn::Module {
  NormFirstImpl() {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    fc1 = register_module("fc1", torch::nn::Linear(kDim, 2 * kDim));
    fc2 = register_module("fc2", torch::nn::Linear(2 * kDim, kDim));
    {
      torch::NoGradGuard g;  // a frozen norm that is not the identity
      ln->weight.uniform_(0.5, 1.5);
      ln->bias.uniform_(-0.2, 0.2);
    }
    ln->weight.set_requires_grad(false);
    ln->bias.set_requires_grad(false);
  }
  at::Tensor forward(const at::Tensor& x) { return x + fc2(torch::nn::functional::gelu(fc1(ln(x)))); }
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(NormFirst);

// LoRA over a frozen base, the sum written three ways (the order autograd meets the two branches
// decides which of the base's or the adapters' backward runs first).
enum class LoraForm { kTwoStatements, kBaseFirst, kAdapterFirst };
struct LoraImpl : torch::nn::Module {
  explicit LoraImpl(LoraForm f) : form(f) {
    base = register_module("base", torch::nn::Linear(kDim, kDim));
    a = register_parameter("lora_a", at::randn({4, kDim}) * 0.2);
    b = register_parameter("lora_b", at::randn({kDim, 4}) * 0.2);
    base->weight.set_requires_grad(false);
    base->bias.set_requires_grad(false);
  }
  at::Tensor adapter(const at::Tensor& x) { return at::matmul(at::matmul(x, a.t()), b.t()); }
  at::Tensor forward(const at::Tensor& x) {
    switch (form) {
      case LoraForm::kTwoStatements: {
        at::Tensor y = base(x);
        return at::tanh(y + adapter(x));
      }
      case LoraForm::kBaseFirst: return at::tanh(base(x) + adapter(x));
      default: return at::tanh(adapter(x) + base(x));
    }
  }
  LoraForm form;
  torch::nn::Linear base{nullptr};
  at::Tensor a, b;
};
TORCH_MODULE(Lora);

// Nothing trainable: a unit that is gathered and released but never reduced.
struct FrozenBlockImpl : torch::nn::Module {
  FrozenBlockImpl() {
    fc = register_module("fc", torch::nn::Linear(kDim, kDim));
    for (auto& p : fc->parameters()) p.set_requires_grad(false);
  }
  at::Tensor forward(const at::Tensor& x) { return x + at::tanh(fc(x)); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(FrozenBlock);

// A unit inside a unit: the outer one owns `pre`, the inner one its Linear.
struct InnerImpl : torch::nn::Module {
  InnerImpl() { fc = register_module("fc", torch::nn::Linear(kDim, kDim)); }
  at::Tensor forward(const at::Tensor& x) { return at::tanh(fc(x)); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Inner);
struct OuterImpl : torch::nn::Module {
  OuterImpl() {
    pre = register_module("pre", torch::nn::Linear(kDim, kDim));
    inner = register_module("inner", zeal::Sharded<Inner>());
  }
  at::Tensor forward(const at::Tensor& x) { return x + inner->forward(pre(x)); }
  torch::nn::Linear pre{nullptr};
  zeal::Sharded<Inner> inner{nullptr};
};
TORCH_MODULE(Outer);

// Every kind above in one model, the embedding tied to the output projection (both in the root).
struct PeftNetImpl : torch::nn::Module {
  PeftNetImpl() {
    wte = register_module("wte", torch::nn::Embedding(kVocab, kDim));
    norm_first = register_module("norm_first", zeal::Sharded<NormFirst>());
    two = register_module("lora_two_statements", zeal::Sharded<Lora>(LoraForm::kTwoStatements));
    base_first = register_module("lora_base_first", zeal::Sharded<Lora>(LoraForm::kBaseFirst));
    adapter_first = register_module("lora_adapter_first", zeal::Sharded<Lora>(LoraForm::kAdapterFirst));
    frozen = register_module("frozen", zeal::Sharded<FrozenBlock>());
    outer = register_module("outer", zeal::Sharded<Outer>());
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
  }
  at::Tensor forward(const at::Tensor& idx) {
    at::Tensor h = wte(idx);
    h = norm_first->forward(h);
    h = two->forward(h);
    h = base_first->forward(h);
    h = adapter_first->forward(h);
    h = frozen->forward(h);
    h = outer->forward(h);
    return at::matmul(ln_f(h), wte->weight.t());
  }
  torch::nn::Embedding wte{nullptr};
  zeal::Sharded<NormFirst> norm_first{nullptr};
  zeal::Sharded<Lora> two{nullptr}, base_first{nullptr}, adapter_first{nullptr};
  zeal::Sharded<FrozenBlock> frozen{nullptr};
  zeal::Sharded<Outer> outer{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(PeftNet);

// The same blocks with a frozen embedding: the first unit's inputs need no gradient, so its
// post-backward point is the end of the backward.
struct FrozenInputNetImpl : torch::nn::Module {
  FrozenInputNetImpl() {
    wte = register_module("wte", torch::nn::Embedding(kVocab, kDim));
    wte->weight.set_requires_grad(false);
    first = register_module("first", zeal::Sharded<NormFirst>());
    lora = register_module("lora", zeal::Sharded<Lora>(LoraForm::kTwoStatements));
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
  }
  at::Tensor forward(const at::Tensor& idx) { return head(lora->forward(first->forward(wte(idx)))); }
  torch::nn::Embedding wte{nullptr};
  zeal::Sharded<NormFirst> first{nullptr};
  zeal::Sharded<Lora> lora{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(FrozenInputNet);

template <class Model>
at::Tensor initial_params(const TokenRun& r) {
  zeal_test::seed(r.seed);
  Model m;
  return flat_params(*m);
}

// Stage 3 of `r` against one LibTorch process (derived tolerance) and, at two ranks with one
// micro-step, against stage 0 bit for bit; frozen parameters bit for bit their initial values.
template <class Model>
void check_against_references(const TokenRun& r, const std::string& what) {
  SCOPED_TRACE(what);
  const TokenResult got = run_tokens<Model>(r, "s3life");
  ASSERT_EQ(got.failures, "");
  for (int k = 1; k < r.world; ++k) EXPECT_TRUE(at::equal(got.params[k], got.params[0])) << "rank " << k;
  const ReferenceCurves ref = token_reference<Model>(r);
  const Spread tol = token_tolerances<Model>(r).zeal_vs_libtorch();
  const double err = token_rel_diff<Model>(got.params[0], ref.params);
  std::printf("[ metric ] %s: world %d accumulation %d, stage 3 vs one LibTorch process %.3g (tolerance %.3g), "
              "losses %.3g (tolerance %.3g)\n",
              what.c_str(), r.world, r.accumulation, err, tol.params, curve_diff(got.losses, ref.losses), tol.losses);
  EXPECT_LE(err, tol.params);
  EXPECT_LE(curve_diff(got.losses, ref.losses), tol.losses);
  // Trained, not untouched; frozen parameters unchanged.
  const at::Tensor init = initial_params<Model>(r);
  EXPECT_GT(token_rel_diff<Model>(init, ref.params), 100 * tol.params);
  zeal_test::seed(r.seed);
  Model shape;
  int64_t off = 0;
  for (const auto& item : shape->named_parameters()) {
    const int64_t n = item.value().numel();
    if (!item.value().requires_grad()) {
      EXPECT_TRUE(at::equal(got.params[0].narrow(0, off, n), init.narrow(0, off, n))) << item.key();
    }
    off += n;
  }
  if (r.world == 2 && r.accumulation == 1) {
    TokenRun zero = r;
    zero.stage = 0;
    const TokenResult z = run_tokens<Model>(zero, "s3life0");
    ASSERT_EQ(z.failures, "");
    EXPECT_TRUE(at::equal(got.params[0], z.params[0])) << "two ranks, one micro-step: the arithmetic of stage 0";
  }
}

}  // namespace

// Frozen LayerNorm first in a unit, LoRA in both operand orders and in two statements, a unit with
// nothing trainable, nested units, a tied embedding: released between forward and backward (one
// unit live, nothing kept) and kept (the defaults), on 1-4 ranks with and without accumulation.
TEST(Stage3Lifecycle, PeftShapedBlocksMatchOneLibTorchProcess) {
  for (bool release : {true, false}) {
    for (auto [world, accumulation] : {std::pair{1, 2}, std::pair{2, 1}, std::pair{3, 2}, std::pair{4, 1}}) {
      TokenRun r;
      r.world = world;
      r.accumulation = accumulation;
      r = release ? released(r) : kept(r);
      check_against_references<PeftNet>(r, release ? "released" : "kept");
    }
  }
}

// The first unit's inputs need no gradient (frozen embedding): it is finished at the end of the
// backward, and the frozen LayerNorm's backward still has its weights.
TEST(Stage3Lifecycle, UnitWhoseInputsNeedNoGradientEndsWithTheBackward) {
  for (int world : {1, 2, 3}) {
    TokenRun r;
    r.world = world;
    r.accumulation = world == 2 ? 1 : 2;
    check_against_references<FrozenInputNet>(released(r), "frozen inputs");
  }
}

// The program runs the backward itself: loss.backward(), and two losses in one pass
// (torch::autograd::backward({l1, l2})). Bit for bit what engine.backward gives (the same
// arithmetic: fp32, one micro-step), and what stage 0 gives for the two losses.
TEST(Stage3Lifecycle, BackwardRunByTheProgram) {
  TokenRun r = released(TokenRun{});
  r.world = 2;
  const TokenResult engine_backward = run_tokens<PeftNet>(r, "engine_bw");
  ASSERT_EQ(engine_backward.failures, "");
  TokenHooks<PeftNet> direct;
  direct.forward_backward = [](zeal::Engine&, PeftNet& m, const at::Tensor& batch, int) {
    at::Tensor loss = token_loss(m, batch, kVocab);
    loss.backward();
    return loss;
  };
  const TokenResult own = run_tokens<PeftNet>(r, "own_bw", direct);
  ASSERT_EQ(own.failures, "");
  EXPECT_TRUE(at::equal(own.params[0], engine_backward.params[0])) << "loss.backward() instead of engine.backward";

  // The micro-batch as two parts, two forwards (every unit fetched twice) and one backward pass
  // with two roots, weighted to the same mean.
  TokenHooks<PeftNet> two;
  two.forward_backward = [](zeal::Engine&, PeftNet& m, const at::Tensor& batch, int) {
    const int64_t n = batch.size(0), h = n / 2;
    at::Tensor l1 = token_loss(m, batch.narrow(0, 0, h), kVocab) * (double(h) / n);
    at::Tensor l2 = token_loss(m, batch.narrow(0, h, n - h), kVocab) * (double(n - h) / n);
    torch::autograd::backward({l1, l2});
    return (l1 + l2).detach();
  };
  const TokenResult three = run_tokens<PeftNet>(r, "two_losses3", two);
  ASSERT_EQ(three.failures, "");
  TokenRun z = r;
  z.stage = 0;
  const TokenResult zero = run_tokens<PeftNet>(z, "two_losses0", two);
  ASSERT_EQ(zero.failures, "");
  EXPECT_TRUE(at::equal(three.params[0], zero.params[0])) << "two losses in one pass: stage 3 vs stage 0";
  const double tol = token_tolerances<PeftNet>(r).zeal_vs_zeal().params;
  EXPECT_LE(token_rel_diff<PeftNet>(three.params[0], engine_backward.params[0]), tol)
      << "two losses add up to the one loss";
}

// A hook that throws in the middle of a backward (on every rank, at step 3): engine.backward throws
// the program's exception, what the pass had reduced is dropped, step 3 is skipped, and training
// goes on — exactly as in stage 0, and with every rank holding the same parameters.
TEST(Stage3Lifecycle, HookThatThrowsLeavesTheEngineUsable) {
  TokenRun r = released(TokenRun{});
  r.world = 2;
  TokenHooks<PeftNet> hooks;
  hooks.forward_backward = [](zeal::Engine& e, PeftNet& m, const at::Tensor& batch, int step) {
    const int64_t T = batch.size(1) - 1;
    at::Tensor h = m->wte(batch.narrow(1, 0, T));
    h = m->norm_first->forward(h);
    h = m->two->forward(h);
    if (step == 3) {
      h.register_hook([](at::Tensor g) -> at::Tensor { throw std::runtime_error("test hook: thrown in the backward"); });
    }
    h = m->base_first->forward(h);
    h = m->adapter_first->forward(h);
    h = m->frozen->forward(h);
    h = m->outer->forward(h);
    at::Tensor logits = at::matmul(m->ln_f(h), m->wte->weight.t());
    at::Tensor loss = torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), batch.narrow(1, 1, T).reshape({-1}));
    e.backward(loss);
    return loss;
  };
  const TokenResult three = run_tokens<PeftNet>(r, "throw3", hooks);
  ASSERT_EQ(three.failures, "");
  EXPECT_TRUE(at::equal(three.params[1], three.params[0]));
  for (int step = 0; step < r.steps; ++step) {
    EXPECT_EQ(three.skipped[step].item<double>(), step == 3 ? 1.0 : 0.0) << "step " << step;
  }
  TokenRun z = r;
  z.stage = 0;
  const TokenResult zero = run_tokens<PeftNet>(z, "throw0", hooks);
  ASSERT_EQ(zero.failures, "");
  EXPECT_TRUE(at::equal(three.params[0], zero.params[0])) << "the same recovery as stage 0";
  // And the run without the failing step differs (the step really was skipped).
  const TokenResult clean = run_tokens<PeftNet>(r, "nothrow3");
  EXPECT_FALSE(at::equal(clean.params[0], three.params[0]));
}

// Two parameter groups (weights with decay; biases and norms without, at half the rate) inside
// every unit: against LibTorch's AdamW with the same groups, and stage 0 bit for bit.
TEST(Stage3Lifecycle, ParameterGroupsApplyInsideEveryUnit) {
  for (auto [world, accumulation] : {std::pair{2, 1}, std::pair{3, 2}}) {
    TokenRun r = released(TokenRun{});
    r.world = world;
    r.accumulation = accumulation;
    r.two_groups = true;
    check_against_references<PeftNet>(r, "two groups");
  }
}

// Eval forwards between the backward and the optimizer step: the second one follows the recorded
// no-grad order and prefetches the units it uses next, which the step then updates. The next
// training forward must see the new values, not the prefetched old ones: bit for bit stage 0.
TEST(Stage3Lifecycle, PrefetchAcrossAStepNeverServesOldValues) {
  TokenRun r = released(TokenRun{});
  r.world = 2;
  r.max_live = 1'000'000'000;  // room to prefetch
  TokenHooks<PeftNet> hooks;
  hooks.forward_backward = [](zeal::Engine& e, PeftNet& m, const at::Tensor& batch, int) {
    at::Tensor loss = token_loss(m, batch, kVocab);
    e.backward(loss);
    torch::NoGradGuard eval;
    for (int i = 0; i < 3; ++i) (void)token_loss(m, batch, kVocab);
    return loss;
  };
  const TokenResult three = run_tokens<PeftNet>(r, "eval_prefetch3", hooks);
  ASSERT_EQ(three.failures, "");
  TokenRun z = r;
  z.stage = 0;
  const TokenResult zero = run_tokens<PeftNet>(z, "eval_prefetch0", hooks);
  ASSERT_EQ(zero.failures, "");
  EXPECT_TRUE(at::equal(three.params[0], zero.params[0]));
}

namespace {

// A decoder block that returns its hidden state and a cache (here a projection of its input, as a
// key cache would be): a tuple from a Sharded forward.
struct CachingBlockImpl : torch::nn::Module {
  CachingBlockImpl() {
    fc = register_module("fc", torch::nn::Linear(kDim, kDim));
    key = register_module("key", torch::nn::Linear(kDim, kDim));
  }
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, int64_t /*position*/) {
    return {x + at::tanh(fc(x)), key(x)};
  }
  torch::nn::Linear fc{nullptr}, key{nullptr};
};
TORCH_MODULE(CachingBlock);

struct CachingNetImpl : torch::nn::Module {
  CachingNetImpl() {
    wte = register_module("wte", torch::nn::Embedding(kVocab, kDim));
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("block" + std::to_string(i), zeal::Sharded<CachingBlock>()));
  }
  at::Tensor forward(const at::Tensor& idx) {
    at::Tensor h = wte(idx), caches = at::zeros_like(h);
    for (size_t i = 0; i < blocks.size(); ++i) {
      auto [out, cache] = blocks[i]->forward(h, static_cast<int64_t>(i));
      h = out;
      caches = caches + cache;  // the cache takes part in the loss too
    }
    return at::matmul(h + 0.1 * caches, wte->weight.t());
  }
  torch::nn::Embedding wte{nullptr};
  std::vector<zeal::Sharded<CachingBlock>> blocks;
};
TORCH_MODULE(CachingNet);

}  // namespace

// A block whose forward takes a tensor and an integer and returns a tuple: every output's gradient
// reaches its unit, against one LibTorch process and stage 0.
TEST(Stage3Lifecycle, BlocksMayReturnTuples) {
  for (int world : {2, 3}) {
    TokenRun r = released(TokenRun{});
    r.world = world;
    check_against_references<CachingNet>(r, "tuple outputs");
  }
}

// Eval forwards (no gradient) prefetch along their own recorded order: once one pass is recorded,
// the next ones prefetch (counted), and the outputs are those of stage 0, bit for bit.
TEST(Stage3Lifecycle, NoGradPassesPrefetchAlongTheirOwnOrder) {
  const std::string dir = temp_dir("nograd_prefetch");
  for (int stage : {0, 3}) {
    auto results = zeal::spawn(
        [&](zeal::Runtime& rt) {
          TokenRun r = released(TokenRun{});
          r.stage = stage;
          r.max_live = 1'000'000'000;
          zeal::Engine engine(token_config(r), rt);
          zeal_test::seed(r.seed);
          PeftNet model;
          auto opt = token_optimizer(*model, r);
          auto [m, o] = engine.prepare(model, *opt);
          const at::Tensor idx = token_table(r).narrow(0, 0, 4).narrow(1, 0, r.seq);
          std::vector<at::Tensor> outs;
          torch::NoGradGuard eval;
          for (int pass = 0; pass < 4; ++pass) outs.push_back(m->forward(idx));
          const auto counts = engine.fetch_counts();
          if (engine.is_main_process()) {
            write_tensor(dir + "/out" + std::to_string(stage), at::cat(outs).reshape({-1}));
            write_tensor(dir + "/prefetched" + std::to_string(stage), at::tensor({double(counts.prefetched)}, at::kDouble));
          }
        },
        2);
    ASSERT_EQ(zeal::describe_failures(results), "");
  }
  EXPECT_TRUE(at::equal(read_tensor(dir + "/out3"), read_tensor(dir + "/out0")));
  const double prefetched = read_tensor(dir + "/prefetched3")[0].item<double>();
  std::printf("[ metric ] 4 eval passes over 7 units: %.0f prefetches\n", prefetched);
  EXPECT_GT(prefetched, 0);
}

// engine.full_grad after the backward: every parameter's whole reduced gradient, the same in every
// stage at two ranks with one micro-step (the same arithmetic), and on every rank.
TEST(Stage3Lifecycle, FullGradIsTheSameInEveryStage) {
  const std::string dir = temp_dir("full_grad");
  for (int stage : {0, 1, 2, 3}) {
    auto results = zeal::spawn(
        [&](zeal::Runtime& rt) {
          TokenRun r = released(TokenRun{});
          r.stage = stage;
          zeal::Engine engine(token_config(r), rt);
          zeal_test::seed(r.seed);
          PeftNet model;
          auto opt = token_optimizer(*model, r);
          auto [m, o] = engine.prepare(model, *opt);
          const at::Tensor batch = token_batch(r, token_table(r), 0, engine.process_index(), 0);
          engine.backward(token_loss(m, batch, kVocab));
          std::vector<at::Tensor> grads;
          for (auto& p : unique_trainable(*m)) grads.push_back(engine.full_grad(p).reshape({-1}).to(at::kDouble));
          write_tensor(dir + "/g" + std::to_string(stage) + "_" + std::to_string(engine.process_index()), at::cat(grads));
        },
        2);
    ASSERT_EQ(zeal::describe_failures(results), "");
  }
  const at::Tensor g0 = read_tensor(dir + "/g0_0");
  EXPECT_GT(g0.abs().max().item<double>(), 0);
  for (int stage : {0, 1, 2, 3}) {
    for (int rank : {0, 1}) {
      EXPECT_TRUE(at::equal(read_tensor(dir + "/g" + std::to_string(stage) + "_" + std::to_string(rank)), g0))
          << "stage " << stage << " rank " << rank;
    }
  }
}
