// zeal::chunked_cross_entropy against the plain product and cross-entropy computed in float64: the
// loss and both gradients within a bound derived from float32's unit roundoff and the length of
// each sum, for chunks of 1 token, a divisor, a non-divisor and more than all tokens, every
// reduction, with ignored targets; the plain float32 computation stays within the same bound (the
// bound is not loose for it alone). Memory: the resident set's growth over a forward and backward
// at a fraction of the plain computation's. Errors name the bad target or shape.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <malloc.h>
#include <torch/autograd.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <string>
#include <vector>

#include "engine/chunked_loss.h"
#include "engine/error.h"
#include "engine/memory_tracker.h"
#include "engine/runtime/spawn.h"
#include "examples/models/gpt.h"
#include "tests/engine/engine_harness.h"

namespace zeal_test {
namespace {

constexpr int64_t kIgnore = -100;

struct Problem {
  at::Tensor h, w, t;  // float32 [B, T, C], [V, C]; int64 [B, T] with some kIgnore
};

Problem problem(int64_t B, int64_t T, int64_t C, int64_t V, uint64_t seed) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  Problem p;
  p.h = at::randn({B, T, C}, g) * 2;
  p.w = at::randn({V, C}, g) * 0.5;
  p.t = at::randint(0, V, {B, T}, g);
  p.t.view({-1}).index_put_({at::arange(0, B * T, 5)}, kIgnore);
  return p;
}

struct Result {
  at::Tensor loss, gh, gw;  // float64
  at::Tensor gh_frozen;     // bound(): the hidden states' gradient with a frozen head
};

// The loss and gradients of `loss_of(h, w)` with a random upstream gradient for "none".
// With frozen_head the weight wants no gradient (LoRA's head): gw is then undefined.
Result evaluate(const Problem& p, at::ScalarType dtype, const std::string& reduction,
                const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& loss_of, bool frozen_head = false) {
  at::Tensor h = p.h.to(dtype).detach().clone().requires_grad_(true);
  at::Tensor w = p.w.to(dtype).detach().clone().requires_grad_(!frozen_head);
  at::Tensor loss = loss_of(h, w);
  at::Tensor up = reduction == "none" ? at::linspace(0.5, 1.5, loss.numel(), at::kDouble).reshape(loss.sizes())
                                      : at::ones({}, at::kDouble);
  loss.backward(up.to(loss.scalar_type()));
  return {loss.detach().to(at::kDouble), h.grad().to(at::kDouble), frozen_head ? at::Tensor() : w.grad().to(at::kDouble)};
}

at::Tensor plain_loss(const at::Tensor& h, const at::Tensor& w, const at::Tensor& t, const std::string& reduction) {
  const int64_t r = reduction == "mean" ? at::Reduction::Mean : reduction == "sum" ? at::Reduction::Sum
                                                                                    : at::Reduction::None;
  at::Tensor logits = at::matmul(h, w.t());
  at::Tensor l = at::cross_entropy_loss(logits.reshape({-1, w.size(0)}), t.reshape({-1}), {}, r, kIgnore);
  return reduction == "none" ? l.reshape(t.sizes()) : l;
}

// Elementwise bounds for a float32 computation of the loss and gradients, from float64 quantities of
// the problem: each logit is a sum of C products (error ≤ γ_C Σ|h||w|), each log-sum-exp a sum of V
// exponentials, each gradient a sum over V (the hidden states') or over the tokens (the weight's).
Result bound(const Problem& p, const std::string& reduction) {
  const double u = std::ldexp(1.0, -24);
  auto gamma = [u](double n) { return n * u / (1 - n * u); };
  const int64_t C = p.w.size(1), V = p.w.size(0);
  const at::Tensor h = p.h.to(at::kDouble).reshape({-1, C}), w = p.w.to(at::kDouble);
  const at::Tensor t = p.t.reshape({-1});
  const int64_t N = h.size(0);
  const at::Tensor keep = (t != kIgnore).to(at::kDouble);
  const double count = keep.sum().item<double>();
  const at::Tensor l = at::mm(h, w.t());
  const at::Tensor lse = at::logsumexp(l, 1);
  const at::Tensor prob = at::softmax(l, 1);
  const at::Tensor onehot = at::zeros_like(l).scatter_(1, t.clamp_min(0).unsqueeze(1), 1.0) * keep.unsqueeze(1);
  const at::Tensor E = std::get<0>((at::mm(h.abs(), w.abs().t()) * gamma(C + 1)).max(1));  // logit error per row
  const at::Tensor mag = lse.abs() + std::get<0>(l.abs().max(1));
  const at::Tensor row = 2 * E + gamma(V + 4) * mag;  // the error of one token's loss
  at::Tensor s = keep;                                  // each token's gradient weight
  if (reduction == "mean") s = s / count;
  if (reduction == "none") s = s * at::linspace(0.5, 1.5, N, at::kDouble);
  const at::Tensor per_token = (lse - (l * onehot).sum(1)) * keep;
  Result b;
  if (reduction == "none") {
    b.loss = (row * keep).reshape(p.t.sizes()) + 1e-30;
  } else {
    const double scale = reduction == "mean" ? 1.0 / count : 1.0;
    b.loss = at::tensor((row * keep).sum().item<double>() * scale + gamma(N + 1) * per_token.abs().sum().item<double>() * scale);
  }
  // A probability off by a factor (1 ± (2·row + γ)) from the logits' and the log-sum-exp's errors.
  const at::Tensor dp = prob * (2 * row + gamma(V + 4)).unsqueeze(1);
  const at::Tensor diff = (prob - onehot).abs();
  b.gh = s.unsqueeze(1) * (at::mm(dp, w.abs()) + gamma(V + 2) * at::mm(diff, w.abs()));
  // A frozen head's gradient is softmax · w − w[target], summed over V with a rescaling per
  // vocabulary slice: its rounding follows (softmax + one-hot) · |w| rather than |softmax − one-hot| · |w|.
  b.gh_frozen = (s.unsqueeze(1) * (at::mm(dp, w.abs()) + gamma(2 * V + 4) * at::mm(prob + onehot, w.abs())))
                    .reshape(p.h.sizes()) + 1e-30;
  b.gw = at::mm((s.unsqueeze(1) * (dp + gamma(N + 2) * diff)).t(), h.abs());
  b.gh = b.gh.reshape(p.h.sizes()) + 1e-30;
  b.gw = b.gw + 1e-30;
  return b;
}

// max |got − want| / bound over the elements: at most 1 for a computation within the bound.
double worst(const at::Tensor& got, const at::Tensor& want, const at::Tensor& b) {
  return ((got - want).abs() / b).max().item<double>();
}

TEST(ChunkedLoss, MatchesFloat64WithinTheSummationBoundForEveryChunkAndReduction) {
  const Problem p = problem(3, 11, 16, 50, 1);  // 33 tokens, 7 of them ignored
  const int64_t N = 33;
  for (const std::string reduction : {"mean", "sum", "none"}) {
    SCOPED_TRACE(reduction);
    const Result ref = evaluate(p, at::kDouble, reduction, [&](const at::Tensor& h, const at::Tensor& w) {
      return plain_loss(h, w, p.t, reduction);
    });
    const Result b = bound(p, reduction);
    // The bound is tight enough to matter: far below the values it bounds.
    EXPECT_LT((b.gh / (ref.gh.abs() + 1e-12)).median().item<double>(), 1e-3);
    EXPECT_LT((b.gw / (ref.gw.abs() + 1e-12)).median().item<double>(), 1e-3);
    const Result plain = evaluate(p, at::kFloat, reduction, [&](const at::Tensor& h, const at::Tensor& w) {
      return plain_loss(h, w, p.t, reduction);
    });
    EXPECT_LE(worst(plain.loss, ref.loss, b.loss), 1.0);
    EXPECT_LE(worst(plain.gh, ref.gh, b.gh), 1.0);
    EXPECT_LE(worst(plain.gw, ref.gw, b.gw), 1.0);
    for (int64_t chunk : {int64_t{1}, N / 3, int64_t{7}, N + 5, int64_t{0}}) {
      SCOPED_TRACE("chunk " + std::to_string(chunk));
      const Result got = evaluate(p, at::kFloat, reduction, [&](const at::Tensor& h, const at::Tensor& w) {
        return zeal::chunked_cross_entropy(h, w, p.t, {.chunk = chunk, .ignore_index = kIgnore, .reduction = reduction});
      });
      ASSERT_EQ(got.loss.sizes(), ref.loss.sizes());
      const double wl = worst(got.loss, ref.loss, b.loss), wh = worst(got.gh, ref.gh, b.gh), ww = worst(got.gw, ref.gw, b.gw);
      std::printf("[ metric ] %s, chunk %lld: error / bound: loss %.3g, hidden's gradient %.3g, weight's %.3g\n",
                  reduction.c_str(), static_cast<long long>(chunk), wl, wh, ww);
      EXPECT_LE(wl, 1.0);
      EXPECT_LE(wh, 1.0);
      EXPECT_LE(ww, 1.0);
      // Ignored tokens: no loss, no gradient.
      const at::Tensor ignored = (p.t == kIgnore).reshape({-1});
      EXPECT_TRUE((got.gh.reshape({N, -1}).index({ignored}) == 0).all().item<bool>());
      // A frozen head (the gradient computed in the forward): the same loss, the hidden states' gradient
      // within its bound.
      const Result frozen = evaluate(
          p, at::kFloat, reduction,
          [&](const at::Tensor& h, const at::Tensor& w) {
            return zeal::chunked_cross_entropy(h, w, p.t, {.chunk = chunk, .ignore_index = kIgnore, .reduction = reduction});
          },
          /*frozen_head=*/true);
      const double fh = worst(frozen.gh, ref.gh, b.gh_frozen);
      std::printf("[ metric ] %s, chunk %lld, frozen head: error / bound: loss %.3g, hidden's gradient %.3g\n",
                  reduction.c_str(), static_cast<long long>(chunk), worst(frozen.loss, ref.loss, b.loss), fh);
      EXPECT_LE(worst(frozen.loss, ref.loss, b.loss), 1.0);
      EXPECT_LE(fh, 1.0);
      EXPECT_TRUE((frozen.gh.reshape({N, -1}).index({ignored}) == 0).all().item<bool>());
      if (reduction == "none") EXPECT_TRUE((got.loss.reshape({-1}).index({ignored}) == 0).all().item<bool>());
    }
  }
}

// A vocabulary of several slices (more than 4 Mi weights): the frozen head's running sum is rescaled
// each time a slice raises a token's maximum. Targets in both slices; within the float64-derived bound.
TEST(ChunkedLoss, AFrozenHeadOverSeveralVocabularySlicesMatchesFloat64) {
  Problem p = problem(1, 6, 16, 270000, 9);  // 4.32 M weights: two slices of at most 262,144 rows
  p.t = at::tensor(std::vector<int64_t>{5, 269990, kIgnore, 140000, 262143, 262144}, at::kLong).view({1, 6});
  // Make the second slice hold some tokens' largest logits, so that their maximum moves there.
  p.w.narrow(0, 262144, 100).mul_(4);
  const Result ref = evaluate(p, at::kDouble, "mean", [&](const at::Tensor& h, const at::Tensor& w) {
    return plain_loss(h, w, p.t, "mean");
  }, /*frozen_head=*/true);
  const Result b = bound(p, "mean");
  const Result got = evaluate(p, at::kFloat, "mean", [&](const at::Tensor& h, const at::Tensor& w) {
    return zeal::chunked_cross_entropy(h, w, p.t, {.ignore_index = kIgnore});
  }, /*frozen_head=*/true);
  const double wh = worst(got.gh, ref.gh, b.gh_frozen);
  std::printf("[ metric ] two slices, frozen head: error / bound: loss %.3g, hidden's gradient %.3g\n",
              worst(got.loss, ref.loss, b.loss), wh);
  EXPECT_LE(worst(got.loss, ref.loss, b.loss), 1.0);
  EXPECT_LE(wh, 1.0);
  // The worst-case bound is loose at this vocabulary (sums of 270,000 terms); the error itself must
  // also be far below the gradient's size: a slice's sum left unrescaled would be off by O(1).
  const double rel = ((got.gh - ref.gh).abs().max() / ref.gh.abs().max()).item<double>();
  std::printf("[ metric ] two slices, frozen head: max error / max gradient %.3g\n", rel);
  EXPECT_LT(rel, 1e-5);
}

// float64 inputs are computed in float64 throughout: the chunked and plain results agree to the
// rounding of float64 sums.
TEST(ChunkedLoss, Float64InputsStayInFloat64) {
  const Problem p = problem(2, 9, 8, 21, 2);
  const Result ref = evaluate(p, at::kDouble, "mean", [&](const at::Tensor& h, const at::Tensor& w) {
    return plain_loss(h, w, p.t, "mean");
  });
  const Result got = evaluate(p, at::kDouble, "mean", [&](const at::Tensor& h, const at::Tensor& w) {
    return zeal::chunked_cross_entropy(h, w, p.t, {.chunk = 4, .ignore_index = kIgnore});
  });
  EXPECT_LT((got.loss - ref.loss).abs().item<double>(), 1e-12);
  EXPECT_LT((got.gh - ref.gh).abs().max().item<double>(), 1e-12);
  EXPECT_LT((got.gw - ref.gw).abs().max().item<double>(), 1e-12);
  const Result frozen = evaluate(
      p, at::kDouble, "mean",
      [&](const at::Tensor& h, const at::Tensor& w) { return zeal::chunked_cross_entropy(h, w, p.t, {.chunk = 4, .ignore_index = kIgnore}); },
      /*frozen_head=*/true);
  EXPECT_LT((frozen.gh - ref.gh).abs().max().item<double>(), 1e-12);
}

// Every target ignored (a micro-batch that is all prompt or padding): the mean is NaN and the
// gradients are zero, as torch's cross_entropy gives them; the sum is 0.
TEST(ChunkedLoss, AllIgnoredTargetsGiveZeroGradientsAsTorch) {
  Problem p = problem(2, 5, 8, 13, 5);
  p.t.fill_(kIgnore);
  for (const std::string reduction : {"mean", "sum"}) {
    const Result ref = evaluate(p, at::kFloat, reduction, [&](const at::Tensor& h, const at::Tensor& w) {
      return plain_loss(h, w, p.t, reduction);
    });
    const Result got = evaluate(p, at::kFloat, reduction, [&](const at::Tensor& h, const at::Tensor& w) {
      return zeal::chunked_cross_entropy(h, w, p.t, {.chunk = 3, .ignore_index = kIgnore, .reduction = reduction});
    });
    EXPECT_EQ(std::isnan(got.loss.item<double>()), std::isnan(ref.loss.item<double>())) << reduction;
    EXPECT_TRUE(at::equal(got.gh, ref.gh)) << reduction;
    EXPECT_TRUE(at::equal(got.gw, ref.gw)) << reduction;
    EXPECT_EQ(got.gh.abs().sum().item<double>(), 0.0) << reduction;
  }
}

TEST(ChunkedLoss, BadTargetsAndShapesAreNamed) {
  const Problem p = problem(1, 4, 8, 10, 3);
  at::Tensor t = p.t.clone();
  t[0][2] = 10;
  try {
    (void)zeal::chunked_cross_entropy(p.h, p.w, t);
    FAIL() << "a target of 10 with 10 words";
  } catch (const zeal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("target 10 at position 2 is outside [0, 10)"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)zeal::chunked_cross_entropy(p.h, p.w.t(), p.t), zeal::Error);
  EXPECT_THROW((void)zeal::chunked_cross_entropy(p.h, p.w, p.t.reshape({-1})), zeal::Error);
  EXPECT_THROW((void)zeal::chunked_cross_entropy(p.h, p.w, p.t, {.reduction = "avg"}), zeal::Error);
}

// 2,048 tokens over 16,384 words: the plain computation holds [tokens, vocab] logits, their
// log-softmax and gradient (128 MiB each in fp32); the chunked one at most one block. Measured as the
// resident set's growth over a forward and backward, each in a fresh process.
TEST(ChunkedLoss, HoldsAFractionOfThePlainComputationsMemory) {
  const int64_t B = 2, T = 1024, C = 64, V = 16384;
  auto grown = [&](bool chunked) {
    const std::string dir = temp_dir(chunked ? "ce_chunked" : "ce_plain");
    auto results = zeal::spawn(
        [&](zeal::Runtime&) {
          // What the algorithm holds, not the machine: two threads (per-thread BLAS buffers grow with
          // the cores) and blocks of a MiB or more always mapped, so a freed block leaves the resident
          // set (glibc's threshold otherwise rises to the size of the last freed block).
          at::set_num_threads(2);
          ::mallopt(M_MMAP_THRESHOLD, 1 << 20);
          const Problem p = problem(B, T, C, V, 4);
          at::Tensor h = p.h.clone().requires_grad_(true), w = p.w.clone().requires_grad_(true);
          zeal::detail::reset_resident_peak();
          const int64_t before = zeal::detail::resident_bytes();
          at::Tensor loss = chunked ? zeal::chunked_cross_entropy(h, w, p.t, {.chunk = 64, .ignore_index = kIgnore})
                                    : plain_loss(h, w, p.t, "mean");
          loss.backward();
          const double g = static_cast<double>(zeal::detail::resident_peak_bytes() - before);
          write_tensor(dir + "/grown", at::tensor({g}, at::kDouble));
        },
        1);
    EXPECT_EQ(zeal::describe_failures(results), "");
    return read_tensor(dir + "/grown")[0].item<double>();
  };
  const double plain = grown(false), chunked = grown(true);
  const double logits = 4.0 * B * T * V;
  std::printf("[ metric ] cross-entropy over %lld x %lld logits (%.0f MiB in fp32): plain grew %.1f MiB, chunked %.1f "
              "MiB\n",
              static_cast<long long>(B * T), static_cast<long long>(V), logits / 1048576, plain / 1048576,
              chunked / 1048576);
  EXPECT_GT(plain, 2 * logits) << "the plain computation should hold the logits more than once";
  EXPECT_LT(chunked, logits / 4);
}

// The GPT example's chunked loss with its head tied to the token embedding: the embedding's full
// gradient (engine.full_grad: the head's share and the lookup's, reduced over ranks) at stage 3 on 2
// ranks, and with the plain loss at stage 0 on 1 rank, agree within float32 rounding of the sums.
TEST(ChunkedLoss, TheTiedEmbeddingsGradientUnderStage3MatchesThePlainLoss) {
  auto tied_grad = [&](int stage, int world, bool chunked) {
    const std::string dir = temp_dir(fmt::format("ce_tied_{}_{}_{}", stage, world, chunked));
    auto results = zeal::spawn(
        [&](zeal::Runtime& rt) {
          zeal::Config c = test_config();
          c.zero.stage = stage;
          c.zero.stage3_param_persistence_threshold = {0, false};
          zeal::Engine engine(c, rt);
          zeal::models::GptConfig cfg = zeal::models::gpt_preset("tiny");
          cfg.chunked_loss = chunked;
          cfg.loss_chunk = 5;  // several chunks, the last one short
          seed(9);
          zeal::models::Gpt model(cfg);
          torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
          auto [m, o] = engine.prepare(model, opt);
          auto gen = at::make_generator<at::CPUGeneratorImpl>(2);
          const at::Tensor tokens = at::randint(0, cfg.vocab, {4, 17}, gen);
          const int64_t per = 4 / world;
          engine.backward(m->loss(tokens.narrow(0, engine.process_index() * per, per)));
          const at::Tensor g = engine.full_grad(m->wte->weight);
          if (engine.is_main_process()) write_tensor(dir + "/grad", g);
        },
        world);
    EXPECT_EQ(zeal::describe_failures(results), "");
    return read_tensor(dir + "/grad");
  };
  const at::Tensor plain = tied_grad(0, 1, false);
  const at::Tensor chunked0 = tied_grad(0, 1, true), chunked3 = tied_grad(3, 2, true);
  const double scale = plain.abs().max().item<double>();
  std::printf("[ metric ] tied embedding's gradient: chunked stage 0 vs plain %.3g, chunked stage 3 (2 ranks) vs plain "
              "%.3g (relative to its largest element)\n",
              (chunked0 - plain).abs().max().item<double>() / scale, (chunked3 - plain).abs().max().item<double>() / scale);
  // float32's unit roundoff times the longest sums' length (a logit over the hidden size, the
  // softmax over the vocabulary, the gradient over the tokens), relative to the gradient's largest
  // element.
  const zeal::models::GptConfig cfg = zeal::models::gpt_preset("tiny");
  const double bound = static_cast<double>(cfg.dim + cfg.vocab + 4 * 16) * std::ldexp(1.0, -24) * scale;
  EXPECT_GT(scale, 0.0);
  EXPECT_LT((chunked0 - plain).abs().max().item<double>(), bound);
  EXPECT_LT((chunked3 - plain).abs().max().item<double>(), bound);
}

}  // namespace
}  // namespace zeal_test
