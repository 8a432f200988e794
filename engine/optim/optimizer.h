// Optimizers on flat fp32 partitions: what a ZeRO rank owns is one contiguous slice of the
// master weights, its gradient slice and the optimizer state for exactly that slice.
//
// These are the reference implementations (LibTorch tensor ops, the same arithmetic as
// torch::optim's Adam, AdamW and SGD); the fused CPU/CUDA kernels plug in behind this interface.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/TensorOptions.h>

#include "kernels/cpu/adam.h"

namespace at {
class Tensor;
}

namespace zeal {
struct OptimizerConfig;

namespace optim {

struct Hyper {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double momentum = 0.0;  // SGD
  bool nesterov = false;  // SGD
  bool bias_correction = true;  // Adam: divide the moments by 1 − βᵗ
};

// A piece of a partition for the fused path: `n` elements of the optimizer state from `offset`,
// their master weights (`master`; null: the partition tensor's elements from `offset`), their
// gradient in its own precision (read once and multiplied by the step's grad_scale), and where the
// updated weights go in compute precision (written in the same pass; null for none). Raw memory
// on the partition's device.
struct FusedSegment {
  int64_t offset = 0, n = 0;
  float* master = nullptr;
  const void* grad = nullptr;
  cpu::DType grad_type = cpu::DType::kFp32;
  void* copy = nullptr;
  cpu::DType copy_type = cpu::DType::kBf16;
  // The optimizer state of these elements when it lives outside the optimizer (NVMe offload: a
  // window read from disk); null: the optimizer's own state at `offset`.
  float* m = nullptr;
  float* v = nullptr;
};

class Optimizer {
 public:
  explicit Optimizer(Hyper h) : hyper_(h) {}
  virtual ~Optimizer() = default;

  virtual std::string name() const = 0;
  // One step over `params` (fp32, contiguous, 1-D) with `grads` (same size; fp32). State is
  // created at the first step. Throws zeal::Error on a size change or wrong dtype.
  virtual void step(const at::Tensor& params, const at::Tensor& grads) = 0;
  // Creates the state for a partition of `n` elements (fp32, on `o`'s device) now instead of at
  // the first step (so memory is held, and reported, from the start).
  virtual void allocate_state(int64_t n, const at::TensorOptions& o) = 0;
  void allocate_state(const at::Tensor& params);
  // The state tensors by name ("exp_avg", "exp_avg_sq", "momentum_buffer"), for checkpoints.
  virtual std::map<std::string, at::Tensor> state() const = 0;
  // Bytes of optimizer state held (0 before the first step).
  virtual int64_t state_bytes() const = 0;
  // Bytes of state per parameter once created (Adam: 8, SGD with momentum: 4, else 0).
  virtual int64_t state_bytes_per_param() const = 0;

  // Whether fused_step is available: an update from gradients in any precision that writes the
  // compute copy in the same pass (the fused kernels).
  virtual bool fused() const { return false; }
  // One step over all segments of `params` (fp32, contiguous); every gradient is multiplied by
  // grad_scale first.
  void fused_step(const at::Tensor& params, std::vector<FusedSegment> segments, double grad_scale);
  // The same over a partition of `n` elements on `device` whose master weights lie wherever each
  // segment's `master` points (every one set): the compute-precision parameters themselves when
  // they are fp32, so no separate master copy is kept.
  // new_step: this call begins an optimizer step (false for the later windows of a step that is
  // applied window by window, every segment then carrying its own m and v).
  virtual void fused_update(int64_t n, at::Device device, const std::vector<FusedSegment>& segments,
                            double grad_scale, bool new_step = true);

  // Where allocate_state puts the state tensors (the offload manager's host memory); at::zeros on
  // the given options by default. Set before allocate_state.
  using StateAllocator = std::function<at::Tensor(int64_t n, at::ScalarType dtype)>;
  void set_state_allocator(StateAllocator a) { state_alloc_ = std::move(a); }

  double lr() const { return hyper_.lr; }
  void set_lr(double lr) { hyper_.lr = lr; }
  int64_t steps() const { return steps_; }
  void set_steps(int64_t s) { steps_ = s; }  // a resumed run continues the bias corrections
  const Hyper& hyper() const { return hyper_; }

 protected:
  // A zero-filled fp32 state tensor of n elements: from the state allocator when one is set.
  at::Tensor new_state(int64_t n, const at::TensorOptions& o) const;

  Hyper hyper_;
  int64_t steps_ = 0;
  StateAllocator state_alloc_;
};


// Adam with L2 weight decay added to the gradient (torch.optim.Adam).
std::unique_ptr<Optimizer> make_adam(const Hyper& h);
// Adam with decoupled weight decay (torch.optim.AdamW).
std::unique_ptr<Optimizer> make_adamw(const Hyper& h);
// The same through the fused kernels: the SIMD kernel on CPU partitions (kernels/cpu/adam.h,
// threads from LibTorch's intra-op count), the multi-tensor kernel on CUDA partitions
// (kernels/cuda/adam.h, in builds with CUDA). What the engine uses for Adam and AdamW.
std::unique_ptr<Optimizer> make_fused_adam(const Hyper& h);
std::unique_ptr<Optimizer> make_fused_adamw(const Hyper& h);
// SGD with optional momentum (dampening 0), Nesterov, and L2 weight decay (torch.optim.SGD).
std::unique_ptr<Optimizer> make_sgd(const Hyper& h);

// The optimizer the config names: "AdamW"; "Adam", which is AdamW unless optimizer.params.adam_w_mode
// is false (DeepSpeed's rule: then Adam with L2 weight decay, torch.optim.Adam); "SGD". Throws
// zeal::Error for an unknown type, amsgrad, or an unresolved "auto".
// fused: Adam and AdamW with the fused kernels.
std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& config, bool fused = false);

}  // namespace optim
}  // namespace zeal
