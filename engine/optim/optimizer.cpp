#include "engine/optim/optimizer.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>

#include <fmt/format.h>

#include "engine/config/config.h"
#include "engine/error.h"
#include "engine/optim/adam_state.h"

namespace zeal::optim {
namespace {

void check(const at::Tensor& params, const at::Tensor& grads, const char* who) {
  if (params.scalar_type() != at::kFloat || grads.scalar_type() != at::kFloat) {
    throw Error(fmt::format("{}: parameters and gradients must be float32 (the fp32 master partition), got {} and {}",
                            who, c10::toString(params.scalar_type()), c10::toString(grads.scalar_type())));
  }
  if (params.numel() != grads.numel()) {
    throw Error(fmt::format("{}: {} parameters but {} gradients", who, params.numel(), grads.numel()));
  }
  if (!params.is_contiguous() || !grads.is_contiguous()) throw Error(fmt::format("{}: tensors must be contiguous", who));
}

class AdamImpl final : public AdamState {
 public:
  AdamImpl(Hyper h, bool decoupled) : AdamState(h, decoupled) {}
  std::string name() const override { return decoupled_ ? "AdamW" : "Adam"; }

  void step(const at::Tensor& params, const at::Tensor& grads) override {
    check(params, grads, decoupled_ ? "AdamW" : "Adam");
    ensure_state(params);
    c10::NoGradGuard no_grad;
    ++steps_;
    const Hyper& h = hyper_;
    at::Tensor g = grads;
    if (h.weight_decay != 0) {
      if (decoupled_) {
        params.mul_(1 - h.lr * h.weight_decay);
      } else {
        g = g.add(params, h.weight_decay);
      }
    }
    const double bc1 = h.bias_correction ? 1 - std::pow(h.beta1, static_cast<double>(steps_)) : 1.0;
    const double bc2 = h.bias_correction ? 1 - std::pow(h.beta2, static_cast<double>(steps_)) : 1.0;
    exp_avg_.mul_(h.beta1).add_(g, 1 - h.beta1);
    exp_avg_sq_.mul_(h.beta2).addcmul_(g, g, 1 - h.beta2);
    at::Tensor denom = (exp_avg_sq_.sqrt() / std::sqrt(bc2)).add_(h.eps);
    params.addcdiv_(exp_avg_, denom, -h.lr / bc1);
  }
};

class SgdImpl final : public Optimizer {
 public:
  explicit SgdImpl(Hyper h) : Optimizer(h) {
    if (h.nesterov && h.momentum <= 0) throw Error("SGD: nesterov needs momentum > 0");
  }
  std::string name() const override { return "SGD"; }

  void step(const at::Tensor& params, const at::Tensor& grads) override {
    check(params, grads, "SGD");
    c10::NoGradGuard no_grad;
    ++steps_;
    const Hyper& h = hyper_;
    at::Tensor g = grads;
    if (h.weight_decay != 0) g = g.add(params, h.weight_decay);
    if (h.momentum != 0) {
      if (!buf_.defined()) {
        buf_ = g.clone();
      } else if (steps_ == 1) {  // allocated ahead: the first step starts it, as LibTorch's does
        if (buf_.numel() != params.numel()) throw Error("SGD: the partition changed size");
        buf_.copy_(g);
      } else {
        if (buf_.numel() != params.numel()) throw Error("SGD: the partition changed size");
        buf_.mul_(h.momentum).add_(g);
      }
      g = h.nesterov ? g.add(buf_, h.momentum) : buf_;
    }
    params.add_(g, -h.lr);
  }

  using Optimizer::allocate_state;
  void allocate_state(int64_t n, const at::TensorOptions& o) override {
    if (hyper_.momentum != 0) buf_ = new_state(n, o);
  }

  std::map<std::string, at::Tensor> state() const override {
    if (!buf_.defined()) return {};
    return {{"momentum_buffer", buf_}};
  }
  int64_t state_bytes() const override { return buf_.defined() ? buf_.nbytes() : 0; }
  int64_t state_bytes_per_param() const override { return hyper_.momentum != 0 ? 4 : 0; }

 private:
  at::Tensor buf_;
};

}  // namespace

void Optimizer::allocate_state(const at::Tensor& params) { allocate_state(params.numel(), params.options()); }

at::Tensor Optimizer::new_state(int64_t n, const at::TensorOptions& o) const {
  if (state_alloc_) return state_alloc_(n, at::kFloat);
  return at::zeros({n}, o.dtype(at::kFloat));
}

void Optimizer::fused_step(const at::Tensor& params, std::vector<FusedSegment> segments, double grad_scale) {
  if (!fused()) throw Error(fmt::format("{} has no fused step", name()));
  if (params.scalar_type() != at::kFloat || !params.is_contiguous() || !(params.is_cpu() || params.is_cuda())) {
    throw Error(fmt::format("{}: needs contiguous float32 parameters on the CPU or a CUDA device", name()));
  }
  for (FusedSegment& s : segments) {
    ZEAL_CHECK(s.offset >= 0 && s.offset + s.n <= params.numel()) << "segment outside the partition";
    if (!s.master) s.master = params.data_ptr<float>() + s.offset;
  }
  fused_update(params.numel(), params.device(), segments, grad_scale);
}

void Optimizer::fused_update(int64_t, at::Device, const std::vector<FusedSegment>&, double, bool) {
  throw Error(fmt::format("{} has no fused step", name()));
}

std::unique_ptr<Optimizer> make_adam(const Hyper& h) { return std::make_unique<AdamImpl>(h, false); }
std::unique_ptr<Optimizer> make_adamw(const Hyper& h) { return std::make_unique<AdamImpl>(h, true); }
std::unique_ptr<Optimizer> make_sgd(const Hyper& h) { return std::make_unique<SgdImpl>(h); }

std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& c, bool fused) {
  auto need = [](const auto& v, const char* key) {
    if (v.is_auto) throw Error(fmt::format("optimizer.params.{} is \"auto\" and was not resolved (call Config::resolve_auto)", key));
    return v.value;
  };
  Hyper h;
  h.lr = need(c.lr, "lr");
  const auto betas = need(c.betas, "betas");
  h.beta1 = betas[0];
  h.beta2 = betas[1];
  h.eps = need(c.eps, "eps");
  h.weight_decay = need(c.weight_decay, "weight_decay");
  h.momentum = c.momentum;
  h.nesterov = c.nesterov;
  h.bias_correction = c.bias_correction;
  if (c.amsgrad) throw Error("optimizer.params.amsgrad: zeal's Adam has no AMSGrad variant");
  // DeepSpeed's rule: "Adam" is AdamW (decoupled weight decay) unless adam_w_mode is false.
  const bool decoupled = c.type == "AdamW" || (c.type == "Adam" && c.adam_w_mode);
  if (c.type == "Adam" || c.type == "AdamW") {
    if (decoupled) return fused ? make_fused_adamw(h) : make_adamw(h);
    return fused ? make_fused_adam(h) : make_adam(h);
  }
  if (c.type == "SGD") return make_sgd(h);
  throw Error(fmt::format("optimizer.type '{}' is not one zeal implements (Adam, AdamW, SGD){}", c.type,
                          c.type.empty() ? "; pass your own optimizer to the engine instead" : ""));
}

}  // namespace zeal::optim
