// ZeRO stage 3: parameters, gradients, fp32 master weights and optimizer state all sharded.
//
// The model's parameters are cut into units: one per zeal::Sharded member (its parameters minus
// those of Sharded members inside it) and the root unit (everything else). Each unit keeps, per
// rank, one shard of a flat buffer of its trainable parameters and one of its frozen parameters
// (FlatLayout, padded to equal shards). Parameters are views into the unit's full buffers, whose
// storage is allocated only while the unit is gathered: forward and the block's backward gather
// (all-gather of the shards), release frees the storage again (tensor shapes stay; autograd's saved
// parameters see the data again when the unit is re-gathered before its backward).
//
// Gradients: a post hook on each trainable parameter's gradient accumulator adds its .grad into
// the unit's staging buffer; when all of a unit's gradients are in (or at the end of backward, for
// parameters that got none) the staging buffer is reduce-scattered into the rank's gradient shard
// (in arrival order, which every rank running the same backward shares) and the unit is released. The step
// runs the fused optimizer over every unit's shard and writes the compute-precision shard in the
// same pass; the next forward gathers the new values.
//
// Prefetch: the order of unit fetches in the first forward and backward is recorded; afterwards,
// fetching the unit at position k of that trace starts asynchronous all-gathers for the units
// that follow, up to stage3_prefetch_bucket_size elements and stage3_max_live_parameters gathered.
// A fetch that does not match the trace waits for every prefetch in flight, fetches on demand and
// records the trace again, so a changed order costs speed, never correctness.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/comm/communicator.h"
#include "engine/optim/optimizer.h"
#include "engine/zero/init.h"
#include "engine/zero/layout.h"
#include "engine/zero/shard_step.h"
#include "engine/zero/zero_optimizer.h"

namespace torch::nn {
class Module;
}

namespace zeal {
class ShardedBase;

namespace zero {

class Stage3;

struct Stage3Options {
  at::ScalarType compute_dtype = at::kFloat;
  int64_t prefetch_elems = 50'000'000;        // stage3_prefetch_bucket_size
  int64_t max_live_elems = 1'000'000'000;     // stage3_max_live_parameters
  int64_t persistence_threshold = 100'000;    // units this small stay gathered
  bool prefetch = true;
  // Keep a unit gathered after its forward when the recorded order uses it again after fewer than
  // this many elements of other units' fetches (stage3_max_reuse_distance; 0: never), within
  // max_live_elems.
  int64_t max_reuse_elems = 1'000'000'000;
  int64_t align = 16;
  at::Device device = at::kCPU;
};

class Unit {
 public:
  Unit(Stage3& owner, int index, std::string name);
  Unit(const Unit&) = delete;
  Unit& operator=(const Unit&) = delete;

  const std::string& name() const { return name_; }
  int index() const { return index_; }
  bool gathered() const { return gathered_; }
  bool persistent() const { return persistent_; }
  int64_t numel() const { return numel_; }  // elements of all its parameters
  int64_t gathered_bytes() const;  // bytes its full buffers take while gathered

  // Called by Sharded<M>: before the block's forward, after it, and from the pre-backward point.
  void fetch();
  void after_forward();
  at::Tensor mark_for_backward(const at::Tensor& out);
  void on_pre_backward();

 private:
  friend class Stage3;
  struct Part {
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
    std::unique_ptr<FlatLayout> layout;
    at::Tensor shard;  // compute dtype, this rank's slice
    at::Tensor full;   // compute dtype, padded_total elements; storage freed while released
    int64_t bytes() const;
  };

  // same_everywhere: the values are already identical on every rank (gathered from init slices).
  void build(Part& part, bool trainable, at::Tensor* master_out, bool same_everywhere);
  void gather(bool wait);
  void wait_gather();
  void release();
  void on_grad_ready(int param);
  void reduce();  // reduce-scatter the staging buffer into the gradient shard

  Stage3& owner_;
  int index_;
  std::string name_;
  Part train_, frozen_;
  at::Tensor grad_shard_;    // compute dtype, train_ shard size: reduced gradients, accumulated
  at::Tensor grad_staging_;  // compute dtype, train_ padded_total: this backward's gradients
  int64_t master_offset_ = 0;
  int64_t numel_ = 0;
  int arrived_ = 0;
  bool reduced_ = false, gathered_ = false, persistent_ = false, in_backward_ = false;
  std::vector<Work> pending_;  // all-gathers in flight (prefetch)
  std::vector<std::shared_ptr<void>> accumulators_;
};

class Stage3 final : public Sharding {
 public:
  // Units are the Sharded members of `model` plus the root. `optimizer` is used for every
  // trainable parameter (one parameter group). Rank 0's values are broadcast first. Parameters
  // partitioned by engine.init are taken from `init` one unit at a time.
  Stage3(Communicator& comm, torch::nn::Module& model, std::unique_ptr<optim::Optimizer> optimizer,
         const Stage3Options& options, std::shared_ptr<InitShards> init = nullptr);
  ~Stage3() override;

  void begin_micro_step(bool sync) override;
  void end_backward() override;
  size_t num_groups() const override { return 1; }
  GroupBytes bytes() const override;
  int64_t num_elements() const override { return trainable_elems_; }
  int stage() const override { return 3; }

  // DeepSpeed's GatheredParameters: gathers the units holding `params` (all units when empty) and
  // returns their indices; release_units writes modifications back when modifier_rank >= 0 (the
  // full values are broadcast from that rank and become every rank's shards and master weights)
  // and releases them.
  std::vector<int> gather_units(const std::vector<at::Tensor>& params);
  void release_units(const std::vector<int>& units, int modifier_rank);

  // Units in index order (0 is the root).
  const std::vector<std::unique_ptr<Unit>>& units() const { return units_; }
  // Bytes of unit parameters gathered now, and the most seen since the last reset.
  int64_t gathered_bytes() const { return gathered_now_; }
  int64_t peak_gathered_bytes() const { return gathered_peak_; }
  void reset_peak() { gathered_peak_ = gathered_now_; }
  // Bytes persistent units (the root included) keep gathered.
  int64_t persistent_bytes() const { return persistent_bytes_; }
  // stage3_max_live_parameters (in bytes of the compute dtype) + the largest unit + persistent.
  int64_t gathered_bound() const;
  int64_t frozen_bytes() const;
  Communicator& comm() { return comm_; }
  const Stage3Options& options() const { return opts_; }
  // How many all-gathers were issued by prefetch and how many fetches had to wait on demand.
  int64_t prefetched() const { return prefetched_; }
  int64_t gathers() const { return gathers_; }
  int64_t on_demand() const { return on_demand_; }

 protected:
  std::vector<ShardStep*> shard_steps() override { return {&step_}; }
  bool sharded_grads() const override;
  void apply(double inv_scale, const std::vector<double>& lrs) override;
  void clear_grads() override;

 private:
  friend class Unit;
  void note_fetch(Unit& u);  // trace and prefetch
  void release_idle_frozen(Unit* except);
  bool reused_soon(const Unit& u) const;  // stage3_max_reuse_distance
  void launch_ready_reductions();

  Stage3Options opts_;
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);  // hooks outliving the engine do nothing
  std::vector<std::unique_ptr<Unit>> units_;
  std::vector<ShardedBase*> modules_;
  ShardStep step_;  // fp32 master: every unit's trainable shard end to end
  int64_t trainable_elems_ = 0;
  int64_t persistent_bytes_ = 0;  // fixed at construction
  int64_t gathered_now_ = 0, gathered_peak_ = 0;
  bool sync_ = true;
  // Prefetch: the recorded order of fetches, the position in it, whether it is being recorded.
  std::vector<int> trace_, recording_;
  size_t trace_pos_ = 0;
  bool trace_valid_ = false;
  int64_t prefetched_ = 0, on_demand_ = 0, gathers_ = 0;
};

}  // namespace zero
}  // namespace zeal
