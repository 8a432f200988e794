// Sharding, the interface the engine drives for every ZeRO stage, with the step logic all stages
// share; ZeroOptimizer, stages 0-2 over one FlatGroup per parameter group.
#pragma once

#include <ATen/Tensor.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/comm/communicator.h"
#include "engine/zero/flat_group.h"

namespace zeal::zero {

// What the engine drives, whatever the stage: stages 0-2 (ZeroOptimizer) and 3 (Stage3). The
// parts of a step that span groups and ranks are here, once: the global gradient norm (local sums
// of squares, one all-reduce when gradients are sharded), the overflow check that comes with it (a
// non-finite norm on any rank skips the step on every rank), clipping, and the update.
class Sharding {
 public:
  struct StepResult {
    bool stepped = false;  // false: skipped (inf/nan gradients, or an abandoned backward)
    double grad_norm = 0;  // of the unscaled gradients, before clipping
    std::string abandoned;  // why the step was skipped without looking at the gradients, if it was
  };
  virtual ~Sharding() = default;

  // Lifecycle of one micro-step: begin (sync: this micro-step's gradients complete a step), the
  // backward runs, end_backward finishes every reduction it started. The end of a backward pass
  // runs by itself (a callback queued on the autograd engine), so loss.backward() and
  // torch::autograd::backward({l1, l2}) work too; engine.backward calls end_backward after the pass
  // for what no hook saw (a pass in which no trainable parameter took part).
  virtual void begin_micro_step(bool sync) = 0;
  virtual void end_backward() = 0;
  // Whether a backward pass started and has not ended (its callback is still queued).
  virtual bool backward_pending() const = 0;
  // How many backward passes have ended (by engine.backward or the program's own loss.backward()).
  virtual int64_t backward_passes() const = 0;
  // Outside a backward: a pass that ended with an error is noticed (its reductions finished, its
  // gradients dropped) and the next step will be skipped.
  virtual void notice_abandoned() = 0;
  // The full gradient of `param` (every rank's contribution reduced, × inv_scale), after a backward
  // and before the step. Collective.
  virtual at::Tensor full_grad(const at::Tensor& param, double inv_scale) = 0;
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

  // Checkpoints: the pieces of named parameters this rank holds. `to_write`: each element once over
  // all ranks (stage 0 splits its replicas as stage 1 would); otherwise every element this rank
  // keeps (stage 0: all). Between begin_state_access and end_state_access a range's values are
  // present while its group is open (a range of group -1 always): open_group(g) reads that group's
  // shards in from disk (stage 3 with offload_param nvme: one unit's), close_group(g, changed)
  // writes them back when changed and frees them, so one group's shards are in memory at a time;
  // open one after closing the last. end_state_access(changed) closes what is open and, after a
  // load (changed), makes the new values visible everywhere (all-gathers: collective).
  using StateRange = zero::StateRange;
  virtual std::vector<StateRange> state_ranges(bool to_write) = 0;
  virtual void begin_state_access() {}
  virtual void open_group(int /*group*/) {}
  virtual void close_group(int /*group*/, bool /*changed*/) {}
  virtual void end_state_access(bool changed) = 0;
  std::vector<ShardStep*> steps() { return shard_steps(); }

  virtual size_t num_groups() const = 0;
  virtual GroupBytes bytes() const = 0;
  virtual int64_t num_elements() const = 0;
  virtual int stage() const = 0;
  // Bytes of state in swap files (offload_optimizer.device nvme; stage 3's offload_param.device
  // nvme adds its parameter shards).
  virtual int64_t offload_disk_bytes() {
    int64_t n = 0;
    for (ShardStep* s : shard_steps()) n += s->disk_bytes();
    return n;
  }
  // NVMe offload: the next step's first windows of optimizer state start coming in (ShardStep::
  // prefetch_state); called as the backward that completes the gradients begins.
  void prefetch_step_state() {
    for (ShardStep* s : shard_steps()) s->prefetch_state();
  }
  int64_t optimizer_windows_read_ahead() {
    int64_t n = 0;
    for (ShardStep* s : shard_steps()) n += s->windows_read_ahead();
    return n;
  }

 protected:
  explicit Sharding(Communicator& comm) : comm_(comm) {}
  // The steps over what this rank owns (one per group, or one for all stage-3 units).
  virtual std::vector<ShardStep*> shard_steps() = 0;
  // Whether ranks hold different gradients (the norm then needs an all-reduce).
  virtual bool sharded_grads() const = 0;
  // Runs every update at its learning rate and makes the new values visible to the model.
  virtual void apply(double inv_scale, const std::vector<double>& lrs) = 0;
  // Clears the gradients (after a step, or a skipped one).
  virtual void clear_grads() = 0;
  // Forgets this step's norm and clipping (a new step begins).
  void reset_norm();
  // A backward pass ended with an error: the next step is skipped and the gradients cleared.
  void abandon_step(std::string why) { abandoned_ = std::move(why); }

  Communicator& comm_;

 protected:
  // Where the gradients are (the engine's device): the norm's sums are reduced there, whatever
  // device a partition's master weights and optimizer state live on (offload).
  at::Device device_ = at::kCPU;

 private:
  std::string abandoned_;
  bool have_norm_ = false, clipped_ = false, overflow_ = false;
  double sumsq_ = 0, norm_before_clip_ = 0;
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
  bool backward_pending() const override;
  int64_t backward_passes() const override;
  void notice_abandoned() override;
  at::Tensor full_grad(const at::Tensor& param, double inv_scale) override;
  std::vector<StateRange> state_ranges(bool to_write) override {
    std::vector<StateRange> out;
    for (auto& g : groups_) g->state_ranges(to_write, out);
    return out;
  }
  void end_state_access(bool changed) override {
    if (changed)
      for (auto& g : groups_) g->regather();
  }

  size_t num_groups() const override { return groups_.size(); }
  FlatGroup& group(size_t g) { return *groups_[g]; }
  GroupBytes bytes() const override;
  int64_t num_elements() const override;
  int stage() const override { return options_.stage; }

 protected:
  std::vector<ShardStep*> shard_steps() override;
  bool sharded_grads() const override;
  void apply(double inv_scale, const std::vector<double>& lrs) override;
  void clear_grads() override;

 private:
  GroupOptions options_;
  std::vector<std::unique_ptr<FlatGroup>> groups_;
};

}  // namespace zeal::zero
