// Tolerances derived from floating-point rounding, for tests that compare a zeal run with another
// zeal run or with one process of plain LibTorch.
//
// Two runs of the same training differ, when nothing is wrong, only where they round differently:
//
//  1. The order in which each step's gradient is summed. With W ranks and A micro-steps a
//     parameter's gradient is the sum of n = W·A micro-batch gradients t_k. Stages 0 and 1 add a
//     rank's micro-steps first and then the ranks; stages 2 and 3 add the ranks of each micro-step
//     first; every collective (Gloo's all-reduce, zeal's ring reduce-scatter) has its own order,
//     which depends on where an element lies in the flat buffer; the division by W happens once or
//     once per micro-step. Summing n numbers in any order lands within (n−1)·u·Σ|t_k| of the exact
//     sum (u = 2⁻²⁴ for float32; Higham, "Accuracy and Stability of Numerical Algorithms", §4.2),
//     and each division or clip multiplication adds one rounding of the result. So at equal
//     parameters two such runs' gradients differ, element by element, by at most
//         δ = 2·γ(n + 2)·Σ_k |t_k|,   γ(m) = m·u / (1 − m·u).
//     What δ becomes after clipping, Adam's division by √v + eps (a gradient element near 0 is
//     amplified by lr/eps: this is what made a fixed 1e-6 pass on one CPU and fail on another) and
//     ten steps of feedback through the model is not something a formula gives; so it is run: the
//     reference is trained with +δ and with −δ added to every step's summed gradient, and the
//     larger departure from the unperturbed run is the bound (`Spread::sum_order`).
//  2. The optimizer's own arithmetic: zeal's fused Adam evaluates the same formula as
//     torch::optim::AdamW with other roundings. Measured: the same reference run once with each
//     optimizer on the same gradients (`Spread::optimizer`).
//  3. How the batch is split: a one-batch backward sums per-token contributions inside LibTorch's
//     kernels, micro-batches sum them in pieces. Measured: the reference run on the ranks'
//     micro-batches against the reference run on the whole batch (`Spread::split`) — LibTorch's
//     own spread when the same batch is split differently.
//
// The triangle inequality then gives the tolerances the tests use:
//   zeal vs zeal at the same world size and accumulation (different stages, layouts, buckets):
//       sum_order                                  (both use zeal's optimizer)
//   zeal vs one LibTorch process on the whole batch:
//       sum_order + optimizer + split
// Where two runs perform the same arithmetic in the same order the tests assert bit-identity
// instead (see engine_test.cpp).
//
// Every quantity is computed in the test itself, on the machine it runs on, so it follows that
// machine's LibTorch kernels (AVX2, AVX-512, …) the way the runs being compared do.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <vector>

#include "engine/optim/optimizer.h"

namespace zeal_test {

// One process training as `world` ranks × `accumulation` micro-steps would, exposed step by step.
struct ReferenceTrainer {
  // The trainable parameters, in the order the optimizer holds them.
  std::vector<at::Tensor> params;
  // Sets every params[i].grad() to the gradient of rank `rank`'s micro-step `micro` at `step` (the
  // loss divided by the accumulation count, as engine.backward divides it); returns that loss.
  std::function<double(int step, int rank, int micro)> backward;
  // Clips the gradients in params[i].grad() (the model's rule) and takes one optimizer step;
  // returns the gradient norm before clipping (0 when the run does not clip).
  std::function<double()> update;
  // Every parameter of the model, flat, in float64 (what the tests compare).
  std::function<at::Tensor()> flat;
};

struct ReferenceCurves {
  at::Tensor params;  // final, flat, float64
  at::Tensor losses;  // per step: the mean micro-batch loss
  at::Tensor norms;   // per step: the gradient norm before clipping
};

// Runs `steps` steps of `t`: each step's world·accumulation micro-batch gradients are summed rank by
// rank (a rank's micro-steps, then the next rank) and divided by the world size. sign ±1 adds ±δ
// (above) to every summed gradient element before the update.
// `unit` is the unit roundoff of the dtype the sums are formed in (float32's 2⁻²⁴ by default).
inline ReferenceCurves run_reference_trainer(ReferenceTrainer t, int world, int accumulation, int steps,
                                             int sign = 0, double unit = std::ldexp(1.0, -24)) {
  const double u = unit;
  const double m = world * accumulation + 2.0;
  const double gamma = m * u / (1 - m * u);
  std::vector<double> losses, norms;
  for (int step = 0; step < steps; ++step) {
    std::vector<at::Tensor> sum(t.params.size()), magnitude(t.params.size());
    double loss = 0;
    for (int rank = 0; rank < world; ++rank) {
      for (int micro = 0; micro < accumulation; ++micro) {
        loss += t.backward(step, rank, micro) / (world * accumulation);
        c10::NoGradGuard no_grad;
        for (size_t i = 0; i < t.params.size(); ++i) {
          const at::Tensor& g = t.params[i].grad();
          if (!g.defined()) continue;
          sum[i] = sum[i].defined() ? sum[i] + g : g.clone();
          const at::Tensor a = g.to(at::kDouble).abs() / world;
          magnitude[i] = magnitude[i].defined() ? magnitude[i] + a : a;
        }
      }
    }
    {
      c10::NoGradGuard no_grad;
      for (size_t i = 0; i < t.params.size(); ++i) {
        if (!sum[i].defined()) {
          t.params[i].mutable_grad() = at::Tensor();
          continue;
        }
        at::Tensor g = sum[i] / world;
        if (sign != 0) g = (g.to(at::kDouble) + sign * 2 * gamma * magnitude[i]).to(g.scalar_type());
        t.params[i].mutable_grad() = g;
      }
    }
    losses.push_back(loss);
    norms.push_back(t.update());
  }
  return {t.flat(), at::tensor(losses, at::kDouble), at::tensor(norms, at::kDouble)};
}

// One update as zeal makes it: the gradients in params[i].grad() clipped by zeal's rule (the global
// norm summed in float64, torch's coefficient max_norm / (norm + 1e-6) applied when below 1: one
// rounding per element) when clip > 0, then one step of `torch_opt`, or of zeal's optimizers (one per
// parameter group of torch_opt, each over its group's parameters laid end to end, at that group's
// current learning rate). Returns the norm (0: no clip).
inline double clip_and_step(const std::vector<at::Tensor>& params, double clip, torch::optim::Optimizer& torch_opt,
                            const std::vector<zeal::optim::Optimizer*>& zeal_opts) {
  c10::NoGradGuard no_grad;
  double norm = 0;
  if (clip > 0) {
    double sumsq = 0;
    for (const auto& p : params)
      if (p.grad().defined()) sumsq += p.grad().to(at::kDouble).pow(2).sum().item<double>();
    norm = std::sqrt(sumsq);
    const double coef = clip / (norm + 1e-6);
    if (coef < 1) {
      for (const auto& p : params)
        if (p.grad().defined()) p.grad().mul_(coef);
    }
  }
  if (zeal_opts.empty()) {
    torch_opt.step();
    return norm;
  }
  auto& groups = torch_opt.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<at::Tensor> ps, gs;
    for (const auto& p : groups[g].params()) {
      ps.push_back(p.detach().reshape({-1}));
      gs.push_back(p.grad().defined() ? p.grad().reshape({-1}) : at::zeros({p.numel()}));
    }
    if (ps.empty()) continue;
    at::Tensor master = at::cat(ps), grads = at::cat(gs);
    zeal_opts.at(g)->set_lr(groups[g].options().get_lr());
    zeal_opts.at(g)->step(master, grads);
    int64_t off = 0;
    for (const auto& p : groups[g].params()) {
      p.detach().copy_(master.narrow(0, off, p.numel()).view(p.sizes()));
      off += p.numel();
    }
  }
  return norm;
}

inline double clip_and_step(const std::vector<at::Tensor>& params, double clip, torch::optim::Optimizer& torch_opt,
                            zeal::optim::Optimizer* zeal_opt) {
  return clip_and_step(params, clip, torch_opt,
                       zeal_opt ? std::vector<zeal::optim::Optimizer*>{zeal_opt} : std::vector<zeal::optim::Optimizer*>{});
}

// Largest relative difference of two curves, step by step (0 when either is empty).
inline double curve_diff(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return 0;
  return ((a - b).abs() / b.abs().clamp_min(1e-300)).max().item<double>();
}

// How far apart two runs may be, split by cause (each a relative difference in the measure the
// tests use: `params_diff` for parameters, `curve_diff` for losses and norms).
struct Spread {
  double params = 0, losses = 0, norms = 0;
  Spread operator+(const Spread& o) const { return {params + o.params, losses + o.losses, norms + o.norms}; }
};

// The bound for summation order: the reference (`make` builds it afresh, with zeal's optimizer
// when comparing zeal runs) with +δ and −δ against the unperturbed run.
inline Spread sum_order_spread(const std::function<ReferenceTrainer()>& make, int world, int accumulation, int steps,
                               const std::function<double(const at::Tensor&, const at::Tensor&)>& params_diff) {
  const ReferenceCurves base = run_reference_trainer(make(), world, accumulation, steps, 0);
  Spread s;
  for (int sign : {1, -1}) {
    const ReferenceCurves r = run_reference_trainer(make(), world, accumulation, steps, sign);
    s.params = std::max(s.params, params_diff(r.params, base.params));
    s.losses = std::max(s.losses, curve_diff(r.losses, base.losses));
    s.norms = std::max(s.norms, curve_diff(r.norms, base.norms));
  }
  return s;
}

// The measured difference between two reference runs (another optimizer, another split).
inline Spread measured_spread(const ReferenceCurves& a, const ReferenceCurves& b,
                              const std::function<double(const at::Tensor&, const at::Tensor&)>& params_diff) {
  return {params_diff(a.params, b.params), curve_diff(a.losses, b.losses), curve_diff(a.norms, b.norms)};
}

}  // namespace zeal_test
