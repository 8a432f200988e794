// Forward error bounds for float32 optimizer steps, element by element, against exact arithmetic
// (evaluated in float64 beside them). Used where a float32 optimizer — zeal's kernels, its
// reference optimizers, torch::optim — is compared with the float64 formula or with another float32
// implementation of it.
//
// Every float32 operation returns the exact result of its rounded inputs times (1 + e), |e| ≤ u =
// 2⁻²⁴ (IEEE round to nearest); a constant such as 1 − β or lr / (1 − β1ᵗ) is itself rounded once.
// Counting the roundings along each quantity's formula, and carrying the bounds of the state (m, v,
// the momentum buffer, the weight) from step to step, gives a bound that holds for any order of
// those operations and any fusing of them (a fused multiply-add only drops a rounding), so one bound
// covers zeal's fused kernel, its reference optimizers and torch::optim alike. γ(k) = k·u/(1 − k·u)
// bounds k roundings in a row (Higham, §3.1). Terms of order u² are below γ's slack.
#pragma once

#include <cmath>
#include <cstdint>

namespace zeal_test {

inline double gamma_f32(int k) {
  const double u = std::ldexp(1.0, -24);
  return k * u / (1 - k * u);
}

// One element of an Adam/AdamW run in exact arithmetic, with the bounds of |float32 − exact| for
// its weight and state.
struct AdamElement {
  double w = 0, m = 0, v = 0;        // exact
  double err_w = 0, err_m = 0, err_v = 0;  // bounds
};

struct AdamFormula {
  double lr, beta1, beta2, eps, weight_decay;
  bool decoupled;  // AdamW: w ← w·(1 − lr·wd) before the update; Adam: g ← g + wd·w
};

// Advances `e` by step t (1-based) with gradient g (exact; `err_g` bounds the float32 gradient the
// implementation reads, e.g. the rounding of a scale applied to it).
inline void adam_step_bound(AdamElement& e, const AdamFormula& f, int64_t t, double g, double err_g = 0) {
  const double u = std::ldexp(1.0, -24);
  // g' = g (+ wd·w): one multiply and one add, the constant wd rounded.
  double gg = g, err_gg = err_g;
  if (!f.decoupled) {
    gg = g + f.weight_decay * e.w;
    err_gg = err_g + f.weight_decay * e.err_w + gamma_f32(3) * (std::fabs(g) + f.weight_decay * std::fabs(e.w));
  }
  // m ← β1·m + (1 − β1)·g': two constants, two products, one sum.
  const double m1 = f.beta1 * e.m + (1 - f.beta1) * gg;
  const double err_m1 = f.beta1 * e.err_m + (1 - f.beta1) * err_gg +
                        gamma_f32(5) * (f.beta1 * std::fabs(e.m) + (1 - f.beta1) * std::fabs(gg));
  // v ← β2·v + (1 − β2)·g'²: two constants, three products, one sum.
  const double v1 = f.beta2 * e.v + (1 - f.beta2) * gg * gg;
  const double err_v1 = f.beta2 * e.err_v + (1 - f.beta2) * 2 * std::fabs(gg) * err_gg +
                        gamma_f32(8) * (f.beta2 * e.v + (1 - f.beta2) * gg * gg);
  // denom = √v / √(1 − β2ᵗ) + eps: a square root, a constant, a product or division, a sum with a
  // rounded eps. Near v = 0 the square root is only Hölder: √(v + δ) − √v ≤ √δ.
  const double bc1 = 1 - std::pow(f.beta1, static_cast<double>(t));
  const double ibc2 = 1 / std::sqrt(1 - std::pow(f.beta2, static_cast<double>(t)));
  const double root = std::sqrt(v1);
  const double err_root = root > 0 ? std::min(err_v1 / (2 * root), std::sqrt(err_v1)) : std::sqrt(err_v1);
  const double denom = root * ibc2 + f.eps;
  const double err_denom = ibc2 * err_root + gamma_f32(5) * denom;
  // Δ = lr / (1 − β1ᵗ) · m / denom: a constant, a division, a product.
  const double step = f.lr / bc1;
  const double ratio = m1 / denom;
  const double err_ratio = (err_m1 + std::fabs(m1) * err_denom / denom) / denom;
  const double delta = step * ratio;
  const double err_delta = step * err_ratio + gamma_f32(3) * std::fabs(delta);
  // w ← w·decay − Δ: a constant, a product, a difference.
  const double decay = f.decoupled ? 1 - f.lr * f.weight_decay : 1.0;
  const double w1 = e.w * decay - delta;
  e.err_w = decay * e.err_w + gamma_f32(2) * std::fabs(e.w * decay) + err_delta + u * std::fabs(w1);
  e.w = w1;
  e.m = m1;
  e.err_m = err_m1;
  e.v = v1;
  e.err_v = err_v1;
}

// SGD with momentum μ (dampening 0), optional Nesterov and L2 weight decay, as torch.optim.SGD.
struct SgdElement {
  double w = 0, buf = 0;
  double err_w = 0, err_buf = 0;
  bool started = false;  // the first step sets buf = d
};

struct SgdFormula {
  double lr, momentum, weight_decay;
  bool nesterov;
};

inline void sgd_step_bound(SgdElement& e, const SgdFormula& f, double g, double err_g = 0) {
  const double u = std::ldexp(1.0, -24);
  double d = g + f.weight_decay * e.w;
  double err_d = err_g + f.weight_decay * e.err_w + gamma_f32(3) * (std::fabs(g) + f.weight_decay * std::fabs(e.w));
  if (f.momentum != 0) {
    if (!e.started) {
      e.buf = d, e.err_buf = err_d;
    } else {
      const double b = f.momentum * e.buf + d;
      e.err_buf = f.momentum * e.err_buf + err_d + gamma_f32(3) * (f.momentum * std::fabs(e.buf) + std::fabs(d));
      e.buf = b;
    }
    if (f.nesterov) {
      err_d = err_d + f.momentum * e.err_buf + gamma_f32(3) * (std::fabs(d) + f.momentum * std::fabs(e.buf));
      d = d + f.momentum * e.buf;
    } else {
      d = e.buf, err_d = e.err_buf;
    }
  }
  e.started = true;
  const double w1 = e.w - f.lr * d;
  e.err_w = e.err_w + f.lr * err_d + gamma_f32(3) * f.lr * std::fabs(d) + u * std::fabs(w1);
  e.w = w1;
}

}  // namespace zeal_test
