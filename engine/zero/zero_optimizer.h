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

class ZeroOptimizer {
 public:
  struct Group {
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
    std::unique_ptr<optim::Optimizer> optimizer;
  };
  struct StepResult {
    bool stepped = false;  // false: skipped for inf/nan gradients
    double grad_norm = 0;  // of the unscaled gradients, before clipping
  };

  ZeroOptimizer(Communicator& comm, std::vector<Group> groups, const GroupOptions& options);

  void begin_micro_step(bool sync);
  void end_backward();

  // The global norm of the unscaled gradients (norm_type 2 or inf); computed once per step.
  double grad_norm(double inv_scale, double norm_type = 2.0);
  // Scales the gradients so their global norm is at most max_norm; returns the norm before.
  double clip_grad_norm(double max_norm, double norm_type, double inv_scale);
  // Clamps every gradient element to [-value, value].
  void clip_grad_value(double value, double inv_scale);
  // One optimizer step at `lrs` (one per group). `clip`: the config's gradient_clipping, applied
  // unless clip_grad_norm ran this step. Gradients are cleared afterwards, stepped or not.
  StepResult step(double inv_scale, double clip, const std::vector<double>& lrs);
  void zero_grad();

  size_t num_groups() const { return groups_.size(); }
  FlatGroup& group(size_t g) { return *groups_[g]; }
  GroupBytes bytes() const;
  int64_t num_elements() const;
  int stage() const { return options_.stage; }

 private:
  Communicator& comm_;
  GroupOptions options_;
  std::vector<std::unique_ptr<FlatGroup>> groups_;
  bool have_norm_ = false, clipped_ = false, overflow_ = false;
  double sumsq_ = 0, norm_before_clip_ = 0;
};

}  // namespace zeal::zero
