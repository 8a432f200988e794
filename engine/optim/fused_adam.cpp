// Adam and AdamW on CPU partitions through the fused SIMD kernel (kernels/cpu/adam.h): one pass
// over master, m, v and the gradient, split over LibTorch's intra-op thread count. The reference
// implementations in optimizer.cpp stay the test oracle.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <fmt/format.h>

#include "engine/error.h"
#include "engine/optim/adam_state.h"
#include "kernels/cpu/adam.h"

namespace zeal::optim {
namespace {

class FusedCpuAdam final : public AdamState {
 public:
  FusedCpuAdam(Hyper h, bool decoupled) : AdamState(h, decoupled) {}
  std::string name() const override { return decoupled_ ? "AdamW (fused CPU)" : "Adam (fused CPU)"; }
  bool fused() const override { return true; }

  void step(const at::Tensor& params, const at::Tensor& grads) override {
    if (grads.scalar_type() != at::kFloat || !grads.is_cpu() || !grads.is_contiguous() ||
        params.numel() != grads.numel()) {
      throw Error(fmt::format("{}: needs contiguous float32 CPU gradients of the parameters' size", name()));
    }
    FusedSegment all;
    all.n = params.numel();
    all.grad = grads.data_ptr<float>();
    fused_step(params, {all}, 1.0);
  }

  void fused_step(const at::Tensor& params, const std::vector<FusedSegment>& segments, double grad_scale) override {
    if (params.scalar_type() != at::kFloat || !params.is_cpu() || !params.is_contiguous()) {
      throw Error(fmt::format("{}: needs contiguous float32 CPU parameters", name()));
    }
    ensure_state(params);
    ++steps_;
    cpu::AdamHyper h;
    h.lr = static_cast<float>(hyper_.lr);
    h.beta1 = static_cast<float>(hyper_.beta1);
    h.beta2 = static_cast<float>(hyper_.beta2);
    h.eps = static_cast<float>(hyper_.eps);
    h.weight_decay = static_cast<float>(hyper_.weight_decay);
    h.decoupled = decoupled_;
    h.step = steps_;
    h.grad_scale = static_cast<float>(grad_scale);
    const int threads = at::get_num_threads();
    for (const FusedSegment& s : segments) {
      ZEAL_CHECK(s.offset >= 0 && s.offset + s.n <= params.numel()) << "segment outside the partition";
      if (s.n == 0) continue;
      cpu::AdamPartition p;
      p.master = params.data_ptr<float>() + s.offset;
      p.m = exp_avg_.data_ptr<float>() + s.offset;
      p.v = exp_avg_sq_.data_ptr<float>() + s.offset;
      p.grad = s.grad;
      p.grad_type = s.grad_type;
      p.copy = s.copy;
      p.copy_type = s.copy_type;
      p.n = s.n;
      cpu::adam_step(h, p, cpu::best_simd(), threads);
    }
  }
};

}  // namespace

std::unique_ptr<Optimizer> make_fused_cpu_adam(const Hyper& h) { return std::make_unique<FusedCpuAdam>(h, false); }
std::unique_ptr<Optimizer> make_fused_cpu_adamw(const Hyper& h) { return std::make_unique<FusedCpuAdam>(h, true); }

}  // namespace zeal::optim
