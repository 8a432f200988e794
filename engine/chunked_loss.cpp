// chunked_cross_entropy's autograd function. Forward: for each chunk of tokens, the logits a slice
// of the vocabulary at a time, folded into a running log-sum-exp (max and sum of exponentials), and
// the target's logit picked from its slice. Backward: vocabulary slices outside, token chunks inside,
// so that each slice's weight gradient is summed over every token in fp32 and rounded once; each block
// of logits is computed again and turned into softmax − one-hot, scaled by the loss's gradient.
//
// A frozen head (LoRA's: only the hidden states want a gradient) in fp32 or fp64 takes a shorter way:
// the forward also sums exp(logits − running max) · weight per token, rescaled whenever the running
// max moves (flash attention's online softmax), which gives softmax · weight − weight[target] once the
// vocabulary is done. The backward then only scales those rows by each token's share of the loss's
// gradient: two products per block in all instead of three (the logits are not computed again).
#include "engine/chunked_loss.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <limits>
#include <string>

#include <fmt/format.h>

#include "engine/error.h"
#include "engine/linear.h"

namespace zeal {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kBlockLogits = int64_t{1} << 23;  // logits in one block (32 MiB in fp32)
constexpr int64_t kSliceWeights = int64_t{1} << 22;  // a vocabulary slice's weight rows (its fp32 gradient: 16 MiB)

// How the work is cut and in which dtype the products run.
struct Plan {
  int64_t chunk = 1, slice = 1;   // tokens by vocabulary rows per block
  at::ScalarType compute = at::kFloat;
  at::ScalarType acc = at::kFloat;  // logits, softmax and gradient sums: fp32, or fp64 for fp64 inputs
  bool widen = false;               // products in fp32 from 16-bit operands (zeal::linear's CPU rule)
};

// A vocabulary slice holds at most kSliceWeights weights (hidden · rows), so the backward's fp32 sum
// of a slice's weight gradient stays small; a chunk is as many tokens as make a block of
// kBlockLogits logits with it (or the caller's count); a block never exceeds chunk × slice.
Plan make_plan(int64_t tokens, int64_t vocab, int64_t hidden, int64_t chunk, at::ScalarType compute,
               const at::Device& device) {
  Plan p;
  p.compute = compute;
  p.acc = compute == at::kDouble ? at::kDouble : at::kFloat;
  p.widen = device.is_cpu() && cpu_widens_products(compute);
  p.slice = std::max<int64_t>(1, std::min(vocab, kSliceWeights / std::max<int64_t>(1, hidden)));
  p.chunk = chunk > 0 ? chunk : std::max<int64_t>(1, kBlockLogits / p.slice);
  p.chunk = std::max<int64_t>(1, std::min(p.chunk, std::max<int64_t>(1, tokens)));
  p.slice = std::max<int64_t>(1, std::min(p.slice, kBlockLogits / p.chunk));
  return p;
}

// One block of logits in the accumulation dtype: h [n, C] and w [m, C] in the compute dtype (h32:
// h's fp32 copy when the products are widened). Rounded to the compute dtype first, as a linear
// layer's output is.
at::Tensor block_logits(const at::Tensor& h, const at::Tensor& h32, const at::Tensor& w, const Plan& p) {
  if (p.widen) return at::mm(h32, w.to(at::kFloat).t()).to(p.compute).to(p.acc);
  return at::mm(h, w.t()).to(p.acc);
}

struct ChunkedCrossEntropy : public torch::autograd::Function<ChunkedCrossEntropy> {
  // hidden [N, C], weight [V, C], targets [N] (int64).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& targets, int64_t chunk, int64_t ignore_index, int64_t reduction,
                            int64_t compute) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const int64_t N = hidden.size(0), V = weight.size(0);
    const Plan p = make_plan(N, V, hidden.size(1), chunk, static_cast<at::ScalarType>(compute), hidden.device());
    const at::Tensor h = hidden.to(p.compute).contiguous(), w = weight.to(p.compute).contiguous();
    const at::Tensor h32 = p.widen ? h.to(at::kFloat) : at::Tensor();
    const auto f32 = hidden.options().dtype(p.acc);
    at::Tensor lse = at::empty({N}, f32), picked = at::zeros({N}, f32);
    // The frozen head's way (above): d(loss of token t)/d(hidden t), for a unit gradient.
    const bool eager = hidden.requires_grad() && !weight.requires_grad() && !p.widen && p.compute == p.acc;
    at::Tensor gh = eager ? at::empty({N, hidden.size(1)}, f32) : at::Tensor();
    for (int64_t i = 0; i < N; i += p.chunk) {
      const int64_t n = std::min(p.chunk, N - i);
      const at::Tensor hc = h.narrow(0, i, n), hc32 = p.widen ? h32.narrow(0, i, n) : at::Tensor();
      const at::Tensor tc = targets.narrow(0, i, n);
      at::Tensor m = at::full({n}, -std::numeric_limits<double>::infinity(), f32), s = at::zeros({n}, f32);
      at::Tensor acc = eager ? at::zeros({n, hidden.size(1)}, f32) : at::Tensor();
      for (int64_t r = 0; r < V; r += p.slice) {
        const int64_t k = std::min(p.slice, V - r);
        const at::Tensor ws = w.narrow(0, r, k);
        at::Tensor l = block_logits(hc, hc32, ws, p);
        const at::Tensor in = (tc >= r) & (tc < r + k);
        const at::Tensor col = (tc - r).clamp(0, k - 1).unsqueeze(1);
        picked.narrow(0, i, n).add_(at::where(in, l.gather(1, col).squeeze(1), at::zeros({}, f32)));
        const at::Tensor m_new = at::maximum(m, std::get<0>(l.max(1)));
        const at::Tensor rescale = at::exp(m - m_new);
        l.sub_(m_new.unsqueeze(1)).exp_();  // in place: one block
        s = s * rescale + l.sum(1);
        if (eager) acc.mul_(rescale.unsqueeze(1)).add_(at::mm(l, ws));
        m = m_new;
      }
      lse.narrow(0, i, n).copy_(m + at::log(s));
      if (eager) {
        // softmax · weight − the target's row (an ignored target's row is never used: its share is 0).
        const at::Tensor rows = w.index_select(0, tc.clamp(0, V - 1));
        gh.narrow(0, i, n).copy_(acc.div_(s.unsqueeze(1)).sub_(rows));
      }
    }
    const at::Tensor keep = targets != ignore_index;
    const at::Tensor per_token = at::where(keep, lse - picked, at::zeros({}, f32));
    // The eager gradient replaces what the backward would recompute from.
    ctx->save_for_backward(eager ? variable_list{gh, at::Tensor(), targets, at::Tensor()}
                                 : variable_list{hidden, weight, targets, lse});
    ctx->saved_data["eager"] = eager;
    ctx->saved_data["hidden_dtype"] = static_cast<int64_t>(hidden.scalar_type());
    ctx->saved_data["chunk"] = p.chunk;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["reduction"] = reduction;
    ctx->saved_data["compute"] = compute;
    if (reduction == 2) return per_token;
    // The sum a chunk at a time, in a fixed order.
    at::Tensor total = at::zeros({}, f32);
    for (int64_t i = 0; i < N; i += p.chunk) total.add_(per_token.narrow(0, i, std::min(p.chunk, N - i)).sum());
    if (reduction == 1) return total;
    const at::Tensor count = keep.sum().to(p.acc);
    ctx->saved_data["count"] = count.item<double>();
    return total / count;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    const int64_t reduction = ctx->saved_data["reduction"].toInt();
    if (ctx->saved_data["eager"].toBool()) {
      const at::Tensor &gh = saved[0], &targets = saved[2];
      const int64_t N = gh.size(0);
      if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
      at::Tensor g = grads[0].to(gh.scalar_type());
      if (reduction == 0) {
        const double count = ctx->saved_data["count"].toDouble();
        g = count > 0 ? g / count : at::zeros_like(g);
      }
      const at::Tensor scale = (reduction == 2 ? g.reshape({N}) : g.expand({N})) * (targets != ignore_index).to(gh.scalar_type());
      return {(gh * scale.unsqueeze(1)).to(static_cast<at::ScalarType>(ctx->saved_data["hidden_dtype"].toInt())), at::Tensor(),
              at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const at::Tensor &hidden = saved[0], &weight = saved[1], &targets = saved[2], &lse = saved[3];
    const int64_t N = hidden.size(0), V = weight.size(0), C = hidden.size(1);
    const Plan p = make_plan(N, V, C, ctx->saved_data["chunk"].toInt(),
                             static_cast<at::ScalarType>(ctx->saved_data["compute"].toInt()), hidden.device());
    const bool want_h = ctx->needs_input_grad(0), want_w = ctx->needs_input_grad(1);
    if (!grads[0].defined() || (!want_h && !want_w)) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
                                                             at::Tensor(), at::Tensor(), at::Tensor()};
    const auto f32 = hidden.options().dtype(p.acc);
    // Each token's share of the loss's gradient: 0 for the ignored ones.
    at::Tensor g = grads[0].to(p.acc);
    if (reduction == 0) {
    // A mean over no token (every target ignored) is NaN, as torch's; its gradient is zero, as torch's.
    const double count = ctx->saved_data["count"].toDouble();
    g = count > 0 ? g / count : at::zeros_like(g);
  }
    at::Tensor scale = (reduction == 2 ? g.reshape({N}) : g.expand({N})) * (targets != ignore_index).to(p.acc);
    const at::Tensor h = hidden.to(p.compute).contiguous(), w = weight.to(p.compute).contiguous();
    const at::Tensor h32 = p.widen ? h.to(at::kFloat) : at::Tensor();
    at::Tensor gh32 = want_h ? at::zeros({N, C}, f32) : at::Tensor();
    at::Tensor gw = want_w ? at::empty({V, C}, weight.options()) : at::Tensor();
    for (int64_t r = 0; r < V; r += p.slice) {
      const int64_t k = std::min(p.slice, V - r);
      const at::Tensor ws = w.narrow(0, r, k);
      const at::Tensor ws32 = p.widen ? ws.to(at::kFloat) : at::Tensor();
      at::Tensor gws32 = want_w ? at::zeros({k, C}, f32) : at::Tensor();
      for (int64_t i = 0; i < N; i += p.chunk) {
        const int64_t n = std::min(p.chunk, N - i);
        const at::Tensor hc = h.narrow(0, i, n), hc32 = p.widen ? h32.narrow(0, i, n) : at::Tensor();
        const at::Tensor tc = targets.narrow(0, i, n);
        // softmax − one-hot, times the token's share.
        at::Tensor gl = block_logits(hc, hc32, ws, p);
        gl.sub_(lse.narrow(0, i, n).unsqueeze(1)).exp_();  // in place: one block of logits at a time
        const at::Tensor in = (tc >= r) & (tc < r + k);
        const at::Tensor col = (tc - r).clamp(0, k - 1).unsqueeze(1);
        gl.scatter_add_(1, col, -in.to(p.acc).unsqueeze(1));
        gl.mul_(scale.narrow(0, i, n).unsqueeze(1));
        if (p.compute != p.acc) gl = gl.to(p.compute);  // the logits' gradient in their dtype
        if (p.widen) {
          const at::Tensor gl32 = gl.to(at::kFloat);
          if (want_h) gh32.narrow(0, i, n).add_(at::mm(gl32, ws32));
          if (want_w) gws32.add_(at::mm(gl32.t(), hc32));
        } else {
          if (want_h) gh32.narrow(0, i, n).add_(at::mm(gl, ws).to(p.acc));
          if (want_w) gws32.add_(at::mm(gl.t(), hc).to(p.acc));
        }
      }
      if (want_w) gw.narrow(0, r, k).copy_(gws32);
    }
    return {want_h ? gh32.to(hidden.scalar_type()) : at::Tensor(), gw, at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

std::string shape(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace

at::Tensor chunked_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                 const ChunkedLossOptions& options) {
  if (!hidden.defined() || !weight.defined() || !targets.defined())
    throw Error("chunked_cross_entropy: hidden, weight and targets must be defined");
  if (weight.dim() != 2) throw Error(fmt::format("chunked_cross_entropy: the weight must be [vocab, hidden], got {}", shape(weight.sizes())));
  if (hidden.dim() < 1 || hidden.size(-1) != weight.size(1)) {
    throw Error(fmt::format("chunked_cross_entropy: hidden {} does not end in the weight's {} columns",
                            shape(hidden.sizes()), weight.size(1)));
  }
  const std::vector<int64_t> lead(hidden.sizes().begin(), hidden.sizes().end() - 1);
  if (targets.sizes().vec() != lead) {
    throw Error(fmt::format("chunked_cross_entropy: targets {} must have hidden's leading shape {}",
                            shape(targets.sizes()), shape(lead)));
  }
  if (targets.scalar_type() != at::kLong) throw Error("chunked_cross_entropy: targets must be int64");
  if (!at::isFloatingType(hidden.scalar_type()) || !at::isFloatingType(weight.scalar_type()))
    throw Error("chunked_cross_entropy: hidden and weight must be floating point");
  int64_t reduction = 0;
  if (options.reduction == "sum") {
    reduction = 1;
  } else if (options.reduction == "none") {
    reduction = 2;
  } else if (options.reduction != "mean") {
    throw Error(fmt::format("chunked_cross_entropy: reduction '{}'; expected mean, sum or none", options.reduction));
  }
  const int64_t V = weight.size(0);
  const at::Tensor t = targets.reshape({-1});
  const at::Tensor bad = (t != options.ignore_index) & ((t < 0) | (t >= V));
  if (bad.any().item<bool>()) {
    const int64_t at_index = bad.nonzero()[0][0].item<int64_t>();
    throw Error(fmt::format("chunked_cross_entropy: target {} at position {} is outside [0, {}) and is not the "
                            "ignore_index {}",
                            t[at_index].item<int64_t>(), at_index, V, options.ignore_index));
  }
  // The products' dtype: autocast's when it is on for this device (as it casts a linear layer's
  // operands), else the weight's.
  const auto type = hidden.device().type();
  const at::ScalarType compute =
      at::autocast::is_autocast_enabled(type) ? at::autocast::get_autocast_dtype(type) : weight.scalar_type();
  at::Tensor loss = ChunkedCrossEntropy::apply(hidden.reshape({-1, hidden.size(-1)}), weight, t, options.chunk,
                                               options.ignore_index, reduction, static_cast<int64_t>(compute));
  return reduction == 2 ? loss.reshape(targets.sizes()) : loss;
}

}  // namespace zeal
