// Adam's state (m and v over the partition) shared by the reference and the fused optimizers.
// Private to engine/optim.
#pragma once

#include <ATen/ATen.h>

#include <fmt/format.h>

#include "engine/error.h"
#include "engine/optim/optimizer.h"

namespace zeal::optim {

class AdamState : public Optimizer {
 public:
  AdamState(Hyper h, bool decoupled) : Optimizer(h), decoupled_(decoupled) {}

  using Optimizer::allocate_state;
  void allocate_state(int64_t n, const at::TensorOptions& o) override {
    exp_avg_ = new_state(n, o);
    exp_avg_sq_ = new_state(n, o);
  }
  std::map<std::string, at::Tensor> state() const override {
    if (!exp_avg_.defined()) return {};
    return {{"exp_avg", exp_avg_}, {"exp_avg_sq", exp_avg_sq_}};
  }
  int64_t state_bytes() const override { return exp_avg_.defined() ? 2 * exp_avg_.nbytes() : 0; }
  int64_t state_bytes_per_param() const override { return 8; }

 protected:
  // Creates the state at the first step; the partition may not change size afterwards.
  void ensure_state(int64_t n, const at::TensorOptions& o) {
    if (!exp_avg_.defined()) {
      allocate_state(n, o);
    } else if (exp_avg_.numel() != n) {
      throw Error(fmt::format("{}: the partition changed from {} to {} elements", name(), exp_avg_.numel(), n));
    }
  }
  void ensure_state(const at::Tensor& params) { ensure_state(params.numel(), params.options()); }
  bool decoupled_;
  at::Tensor exp_avg_, exp_avg_sq_;
};

}  // namespace zeal::optim
