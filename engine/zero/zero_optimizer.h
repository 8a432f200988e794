// ZeroOptimizer: the sharded optimizer of stages 0-2 over one FlatGroup per parameter group.
//
// It runs the parts of a step that span groups and ranks: the global gradient norm (local sums
// of squares, one all-reduce when gradients are sharded), the overflow check that comes with it
// (a non-finite norm on any rank skips the step on every rank), clipping by norm or by value,
// and the update of every group at its learning rate.
#pragma once

#include <ATen/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/comm/communicator.h"
#include "engine/zero/flat_group.h"

namespace zeal::zero {

// What the engine drives, whatever the stage: stages 0-2 (ZeroOptimizer) and 3 (Stage3).
class Sharding {
 public:
  struct StepResult {
    bool stepped = false;  // false: skipped for inf/nan gradients
    double grad_norm = 0;  // of the unscaled gradients, before clipping
  };
  virtual ~Sharding() = default;

  // Lifecycle of one micro-step: begin (sync: this micro-step's gradients complete a step), the
  // backward runs, end_backward finishes every reduction it started.
  virtual void begin_micro_step(bool sync) = 0;
  virtual void end_backward() = 0;
  // The global norm of the unscaled gradients (norm_type 2 or inf); computed once per step.
  virtual double grad_norm(double inv_scale, double norm_type = 2.0) = 0;
  // Scales the gradients so their global norm is at most max_norm; returns the norm before.
  virtual double clip_grad_norm(double max_norm, double norm_type, double inv_scale) = 0;
  // Clamps every gradient element to [-value, value].
  virtual void clip_grad_value(double value, double inv_scale) = 0;
  // One optimizer step at `lrs` (one per group). `clip`: the config's gradient_clipping, applied
  // unless clip_grad_norm ran this step. Gradients are cleared afterwards, stepped or not.
  virtual StepResult step(double inv_scale, double clip, const std::vector<double>& lrs) = 0;
  virtual void zero_grad() = 0;
  virtual size_t num_groups() const = 0;
  virtual GroupBytes bytes() const = 0;
  virtual int64_t num_elements() const = 0;
  virtual int stage() const = 0;
};

class ZeroOptimizer final : public Sharding {
 public:
  struct Group {
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
    std::unique_ptr<optim::Optimizer> optimizer;
  };

  ZeroOptimizer(Communicator& comm, std::vector<Group> groups, const GroupOptions& options);

  void begin_micro_step(bool sync) override;
  void end_backward() override;
  double grad_norm(double inv_scale, double norm_type = 2.0) override;
  double clip_grad_norm(double max_norm, double norm_type, double inv_scale) override;
  void clip_grad_value(double value, double inv_scale) override;
  StepResult step(double inv_scale, double clip, const std::vector<double>& lrs) override;
  void zero_grad() override;

  size_t num_groups() const override { return groups_.size(); }
  FlatGroup& group(size_t g) { return *groups_[g]; }
  GroupBytes bytes() const override;
  int64_t num_elements() const override;
  int stage() const override { return options_.stage; }

 private:
  Communicator& comm_;
  GroupOptions options_;
  std::vector<std::unique_ptr<FlatGroup>> groups_;
  bool have_norm_ = false, clipped_ = false, overflow_ = false;
  double sumsq_ = 0, norm_before_clip_ = 0;
};

}  // namespace zeal::zero
