// Adam and AdamW through the fused kernels: on CPU partitions the SIMD kernel (kernels/cpu/adam.h),
// one pass over master, m, v and the gradient split over LibTorch's intra-op thread count; on CUDA
// partitions the multi-tensor kernel (kernels/cuda/adam.h), one launch for all segments, on the
// default stream. The reference implementations in optimizer.cpp stay the test oracle.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <fmt/format.h>

#include "engine/error.h"
#include "engine/optim/adam_state.h"
#include "kernels/cpu/adam.h"
#include "engine/optim/cuda_stream.h"
#ifdef ZEAL_HAVE_CUDA
#include "kernels/cuda/adam.h"
#endif

namespace zeal::optim {
namespace {

class FusedAdam final : public AdamState {
 public:
  FusedAdam(Hyper h, bool decoupled) : AdamState(h, decoupled) {}
  std::string name() const override { return decoupled_ ? "AdamW (fused)" : "Adam (fused)"; }
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

  void fused_update(int64_t n, at::Device device, const std::vector<FusedSegment>& segments, double grad_scale,
                    bool new_step = true) override {
    // State outside the optimizer (NVMe windows, every segment carrying m and v): none is
    // allocated here.
    bool own_state = false;
    for (const FusedSegment& s : segments) own_state = own_state || !s.m || !s.v;
    if (own_state) ensure_state(n, at::TensorOptions().dtype(at::kFloat).device(device));
    if (new_step) ++steps_;
    cpu::AdamHyper h;
    h.lr = hyper_.lr;
    h.beta1 = hyper_.beta1;
    h.beta2 = hyper_.beta2;
    h.eps = hyper_.eps;
    h.weight_decay = hyper_.weight_decay;
    h.decoupled = decoupled_;
    h.bias_correction = hyper_.bias_correction;
    h.step = steps_;
    h.grad_scale = grad_scale;
    for (const FusedSegment& s : segments) {
      ZEAL_CHECK(s.offset >= 0 && s.offset + s.n <= n && (s.master || s.n == 0)) << "segment outside the partition";
    }
    if (device.is_cuda()) return cuda_step(h, device, segments);
    const int threads = at::get_num_threads();
    for (const FusedSegment& s : segments) {
      if (s.n == 0) continue;
      cpu::AdamPartition p;
      p.master = s.master;
      p.m = s.m ? s.m : exp_avg_.data_ptr<float>() + s.offset;
      p.v = s.v ? s.v : exp_avg_sq_.data_ptr<float>() + s.offset;
      p.grad = s.grad;
      p.grad_type = s.grad_type;
      p.copy = s.copy;
      p.copy_type = s.copy_type;
      p.n = s.n;
      cpu::adam_step(h, p, cpu::active_simd(), threads);
    }
  }

 private:
  void cuda_step(const cpu::AdamHyper& h, const at::Device& device, const std::vector<FusedSegment>& segments) {
#ifdef ZEAL_HAVE_CUDA
    CudaDeviceScope scope(device);
    std::vector<cuda::AdamTensor> tensors;
    for (const FusedSegment& s : segments) {
      ZEAL_CHECK(s.grad_type == segments[0].grad_type && s.copy_type == segments[0].copy_type && !s.copy == !segments[0].copy)
          << "segments of one step share their gradient and copy types";
      // A segment's own m and v (NVMe windows, CPU-offloaded state) or the optimizer's, as on the CPU.
      tensors.push_back({s.master, s.m ? s.m : exp_avg_.data_ptr<float>() + s.offset,
                         s.v ? s.v : exp_avg_sq_.data_ptr<float>() + s.offset, s.grad, s.copy, s.n});
    }
    // On the current stream, after the gradients' reduction the program's stream waits for.
    if (!tensors.empty()) {
      cuda::multi_tensor_adam(h, tensors, segments[0].grad_type, segments[0].copy_type, current_stream(device));
    }
#else
    (void)h, (void)device, (void)segments;
    throw Error(fmt::format("{}: this build of zeal has no CUDA kernels", name()));
#endif
  }
};

}  // namespace

std::unique_ptr<Optimizer> make_fused_adam(const Hyper& h) { return std::make_unique<FusedAdam>(h, false); }
std::unique_ptr<Optimizer> make_fused_adamw(const Hyper& h) { return std::make_unique<FusedAdam>(h, true); }

}  // namespace zeal::optim
