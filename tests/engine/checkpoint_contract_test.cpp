// zeal::checkpoint's contract beyond plain tensors: tensors inside optional, vector and tuple
// arguments and results are inputs and outputs like the others (the same gradients, bit for bit);
// what it cannot do right it refuses with zeal::Error — torch::autograd::grad, create_graph, an input
// changed in place after the forward, a second backward without retain_graph, a recomputation that
// returns other tensors — and its inputs are let go once its backward has run, as autograd lets go of
// what a node saved.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "engine/activation_checkpoint.h"
#include "engine/error.h"
#include "tests/test_device.h"

namespace zeal_test {
namespace {

at::Tensor block(const at::Tensor& x, const at::Tensor& w) { return at::tanh(at::matmul(x, w)); }

// The message of what `f` throws ("" when it does not).
template <class F>
std::string thrown(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

using Result = std::tuple<at::Tensor, std::optional<at::Tensor>, std::vector<at::Tensor>, int>;

TEST(CheckpointContract, TensorsInsideOptionalVectorAndTupleArgumentsAndResultsGetTheirGradients) {
  auto fn = [](const at::Tensor& x, const std::optional<at::Tensor>& bias, const std::vector<at::Tensor>& ws) -> Result {
    at::Tensor h = at::dropout(at::matmul(x, ws[0]) + *bias, 0.25, true);
    std::vector<at::Tensor> parts{at::relu(h), at::matmul(h, ws[1])};
    return {h.sum(-1), std::optional<at::Tensor>(h.pow(2).mean()), parts, 5};
  };
  const at::Tensor x0 = at::randn({6, 4}), b0 = at::randn({3}), w0 = at::randn({4, 3}), w1 = at::randn({3, 2});
  auto run = [&](bool ckpt) {
    at::Tensor x = x0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true);
    at::Tensor u = w0.clone().requires_grad_(true), v = w1.clone().requires_grad_(true);
    const std::optional<at::Tensor> bias = b * 2;  // computed: its gradient flows back to b
    seed(21);
    Result r = ckpt ? zeal::checkpoint(fn, x, bias, std::vector<at::Tensor>{u, v}) : fn(x, bias, {u, v});
    EXPECT_EQ(std::get<3>(r), 5);
    EXPECT_TRUE(std::get<1>(r).has_value());
    (std::get<0>(r).sum() + *std::get<1>(r) * 3 + std::get<2>(r)[0].sum() + std::get<2>(r)[1].pow(2).sum()).backward();
    return std::vector<at::Tensor>{std::get<0>(r).detach(), x.grad(), b.grad(), u.grad(), v.grad()};
  };
  const auto plain = run(false), ckpt = run(true);
  for (size_t i = 0; i < plain.size(); ++i) {
    ASSERT_TRUE(ckpt[i].defined()) << i;
    EXPECT_TRUE(at::equal(plain[i], ckpt[i])) << i;
  }
}

TEST(CheckpointContract, AutogradGradAndCreateGraphAreRefused) {
  at::Tensor x = at::randn({3, 4}).requires_grad_(true), w = at::randn({4, 4}).requires_grad_(true);
  at::Tensor y = zeal::checkpoint(block, x, w).sum();
  const std::string grad = thrown([&] { (void)torch::autograd::grad({y}, {x}, {}, /*retain_graph=*/true); });
  EXPECT_NE(grad.find("torch::autograd::grad"), std::string::npos) << grad;
  EXPECT_FALSE(w.grad().defined()) << "the refused pass accumulated a gradient";
  const std::string twice = thrown([&] { y.backward({}, /*retain_graph=*/true, /*create_graph=*/true); });
  EXPECT_NE(twice.find("create_graph"), std::string::npos) << twice;
}

TEST(CheckpointContract, AnInputChangedInPlaceAfterTheForwardIsRefused) {
  at::Tensor x = at::randn({3, 4}).requires_grad_(true), w = at::randn({4, 4}).requires_grad_(true);
  at::Tensor h = x * 2;
  at::Tensor y = zeal::checkpoint(block, h, w).sum();
  h.add_(1);
  const std::string what = thrown([&] { y.backward(); });
  EXPECT_NE(what.find("input 0 of an activation checkpoint ([3, 4], Float) was modified by an in-place operation"),
            std::string::npos)
      << what;
}

// The kept input is let go by the backward (the loss still alive), kept by one with retain_graph;
// a backward after it was let go is refused.
TEST(CheckpointContract, InputsAreReleasedAfterTheBackwardUnlessTheGraphIsRetained) {
  const at::Tensor x = at::randn({3, 4});  // no gradient: only the checkpoint holds it besides x
  at::Tensor w = at::randn({4, 4}).requires_grad_(true);
  at::Tensor loss = zeal::checkpoint(block, x, w).sum();
  EXPECT_EQ(x.storage().use_count(), 2);
  loss.backward({}, /*retain_graph=*/true);
  EXPECT_EQ(x.storage().use_count(), 2);
  const at::Tensor once = w.grad().clone();
  loss.backward();
  EXPECT_TRUE(at::equal(w.grad(), once * 2));
  EXPECT_EQ(x.storage().use_count(), 1) << "the checkpoint kept its input after the backward";
  const std::string again = thrown([&] { loss.backward(); });
  EXPECT_FALSE(again.empty());
}

TEST(CheckpointContract, ARecomputationThatReturnsOtherTensorsIsRefused) {
  int calls = 0;
  auto fn = [&calls](const at::Tensor& x, const at::Tensor& w) {
    std::vector<at::Tensor> out;
    for (int i = 0; i <= calls; ++i) out.push_back(block(x, w) * (i + 1));
    ++calls;
    return out;
  };
  at::Tensor x = at::randn({3, 4}).requires_grad_(true), w = at::randn({4, 4}).requires_grad_(true);
  std::vector<at::Tensor> out = zeal::checkpoint(fn, x, w);
  ASSERT_EQ(out.size(), 1u);
  const std::string what = thrown([&] { out[0].sum().backward(); });
  EXPECT_NE(what.find("returned 2 tensors where the forward returned 1"), std::string::npos) << what;
}

}  // namespace
}  // namespace zeal_test
