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

  void step(const at::Tensor& params, const at::Tensor& grads) override {
    if (params.scalar_type() != at::kFloat || grads.scalar_type() != at::kFloat || !params.is_cpu() ||
        !grads.is_cpu() || !params.is_contiguous() || !grads.is_contiguous() || params.numel() != grads.numel()) {
      throw Error(fmt::format("{}: needs contiguous float32 CPU parameters and gradients of the same size", name()));
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
    cpu::AdamPartition p;
    p.master = params.data_ptr<float>();
    p.m = exp_avg_.data_ptr<float>();
    p.v = exp_avg_sq_.data_ptr<float>();
    p.grad = grads.data_ptr<float>();
    p.n = params.numel();
    cpu::adam_step(h, p, cpu::best_simd(), at::get_num_threads());
  }
};

}  // namespace

std::unique_ptr<Optimizer> make_fused_cpu_adam(const Hyper& h) { return std::make_unique<FusedCpuAdam>(h, false); }
std::unique_ptr<Optimizer> make_fused_cpu_adamw(const Hyper& h) { return std::make_unique<FusedCpuAdam>(h, true); }

}  // namespace zeal::optim
