// ZeRO stage 3: parameters, gradients, fp32 master weights and optimizer state all sharded.
//
// The model's parameters are cut into units (unit.h): one per zeal::Sharded member (its parameters
// minus those of Sharded members inside it) and the root (every parameter outside all of them,
// index 0). Each unit keeps one shard per rank and is gathered only while needed; the fetch
// coordinator (fetch_coordinator.h) prefetches along the recorded order of uses.
//
// Gradients: a post hook on each trainable parameter's gradient accumulator adds its .grad into
// the unit's staging buffer (the communication dtype); once all of a unit's gradients are in, it may
// be reduce-scattered into the rank's gradient shard (the accumulation dtype, summed over
// micro-steps) — in one fixed order on every rank (the last unit first, the root last), never in
// arrival order. The end of the backward pass, queued on the autograd engine, reduces what is left
// (zeros for gradients that never came), releases every unit and checks that all ranks agree.
//
// The step: one ShardStep per optimizer group over the pieces of every unit's shard that belong to
// the group (a unit's trainable parameters are laid out group by group), the fused update writing
// each unit's compute-precision shard; the next use gathers the new values.
//
// The root: LibTorch modules have no forward hooks, so the engine cannot see where the root's
// parameters are used. The root stays gathered from one optimizer step to the next (through
// forward, backward and any evaluation) and its trainable part is released while the optimizer
// step runs, as PyTorch FSDP2 keeps its root unit (a root under stage3_param_persistence_threshold
// stays gathered throughout); its frozen part, which no step changes, stays. A block held as a Sharded member is gathered only while it runs.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/comm/communicator.h"
#include "engine/optim/optimizer.h"
#include "engine/zero/fetch_coordinator.h"
#include "engine/zero/grad_hook.h"
#include "engine/zero/init.h"
#include "engine/zero/offload_state.h"
#include "engine/zero/shard_step.h"
#include "engine/zero/touch.h"
#include "engine/zero/unit.h"
#include "engine/zero/zero_optimizer.h"

namespace torch::nn {
class Module;
}

namespace zeal {
class ShardedBase;

namespace zero {

struct Stage3Options {
  at::ScalarType compute_dtype = at::kFloat;
  at::ScalarType grad_accum_dtype = at::kFloat;  // reduced gradients summed over micro-steps in this
  at::ScalarType comm_dtype = at::kFloat;        // gradients reduce-scattered in this
  int64_t prefetch_elems = 50'000'000;           // stage3_prefetch_bucket_size
  int64_t max_live_elems = 1'000'000'000;        // stage3_max_live_parameters
  int64_t persistence_threshold = 100'000;       // units this small stay gathered
  bool prefetch = true;
  // Keep a unit gathered after its forward when the recorded order uses it again after fewer than
  // this many elements of other units' fetches (stage3_max_reuse_distance; 0: never), within
  // max_live_elems.
  int64_t max_reuse_elems = 1'000'000'000;
  int64_t align = 16;
  at::Device device = at::kCPU;
  // offload_optimizer.device cpu: the master weights and optimizer state in this host arena.
  std::shared_ptr<offload::HostArena> offload;
  // offload_optimizer.device nvme (with `offload` for the window buffers): the state on disk.
  std::shared_ptr<NvmeOffload> nvme;
  // offload_param.device nvme: the shards of units that are not persistent on disk.
  std::shared_ptr<ParamSwap> param_swap;
  // zero_optimization.unit_names: modules of these types (touch.h's matching) are units too.
  std::vector<std::string> unit_names;
};

// What a Sharded member and the autograd nodes reach: cleared when Stage3 goes, so a graph or a
// module that outlives the engine does nothing to it.
struct Stage3Link {
  Stage3* stage = nullptr;
};

class Stage3 final : public Sharding {
 public:
  struct Group {
    std::vector<at::Tensor> params;  // trainable
    std::vector<std::string> names;
    std::unique_ptr<optim::Optimizer> optimizer;
  };

  // Units are the Sharded members of `model`, the modules whose type options.unit_names names (each
  // gathered when an op first reads its parameters: touch.h), plus the root. Every trainable parameter is in exactly
  // one group; the others of the model are frozen. Rank 0's values are taken (broadcast), except
  // for parameters partitioned by engine.init, taken from `init` one unit at a time.
  Stage3(Communicator& comm, torch::nn::Module& model, std::vector<Group> groups, const Stage3Options& options,
         std::shared_ptr<InitShards> init = nullptr);
  ~Stage3() override;

  void begin_micro_step(bool sync) override;
  void end_backward() override;
  bool backward_pending() const override { return end_of_backward_.pending(); }
  void notice_abandoned() override { check_abandoned_backward(); }
  int64_t backward_passes() const override { return passes_; }
  size_t num_groups() const override { return steps_.size(); }
  GroupBytes bytes() const override;
  int64_t num_elements() const override { return trainable_elems_; }
  int stage() const override { return 3; }
  at::Tensor full_grad(const at::Tensor& param, double inv_scale) override;
  std::vector<StateRange> state_ranges(bool to_write) override;
  void begin_state_access() override;
  void open_group(int group) override;
  void close_group(int group, bool changed) override;
  void end_state_access(bool changed) override;
  int64_t offload_disk_bytes() override;

  // DeepSpeed's GatheredParameters: gathers the units holding `params` (all units when empty) and
  // returns their indices; release_units writes modifications back when modifier_rank >= 0 (the
  // full values are broadcast from that rank and become every rank's shards and master weights)
  // and releases them. Both are collective, and checked to be called by every rank.
  std::vector<int> gather_units(const std::vector<at::Tensor>& params);
  void release_units(const std::vector<int>& units, int modifier_rank);

  // Units in index order (0 is the root).
  const std::vector<std::unique_ptr<Unit>>& units() const { return units_; }
  FetchCoordinator& fetch() { return *fetch_; }
  const FetchCoordinator& fetch() const { return *fetch_; }
  int64_t frozen_bytes() const;
  Communicator& comm() { return comm_; }
  const Stage3Options& options() const { return opts_; }
  const std::shared_ptr<Stage3Link>& link() const { return link_; }

  // An op (`op`) read the parameters of `units` (units by type name; touch.h): they are gathered,
  // and the units the thread touched before that this op does not use are released. An op that
  // writes the parameters of a unit in `written` that engine.gathered() does not hold is refused.
  void touched(const std::vector<Unit*>& units, const std::vector<Unit*>& written, const std::string& op,
               bool in_backward);

  // From the units and the autograd hooks.
  void on_backward_event() { end_of_backward_.request(); }
  // Outside any backward: notices a backward that ended with an error.
  void check_abandoned_backward() { end_of_backward_.check(); }
  void launch_ready_reductions();
  void gradients_complete(const Unit& u);  // a unit's gradients all arrived: noted, then launched in order
  // offload_optimizer nvme: the reduced gradients live in the optimizer's swap files, not in the units.
  bool gradients_swapped() const { return gradients_swapped_; }
  // Nobody holds the model any more (the engine goes with the last handle): the destructor need not
  // gather every unit to leave it usable — the whole model at once, which may not fit where shards do.
  void skip_gather_at_shutdown() { gather_at_shutdown_ = false; }
  // Adds one micro-step's reduced gradients of a unit's shard (`mine`) into the swapped pieces.
  void accumulate_swapped(const Unit& u, const at::Tensor& mine);

 protected:
  std::vector<ShardStep*> shard_steps() override;
  bool sharded_grads() const override;
  void apply(double inv_scale, const std::vector<double>& lrs) override;
  void clear_grads() override;

 private:
  void build_units(torch::nn::Module& model, std::vector<Group>& groups, const std::shared_ptr<InitShards>& init);
  void end_of_backward();
  void abandon_backward();
  void complete_oldest_reduction();
  void record_reduce_order();

  Stage3Options opts_;
  std::shared_ptr<Stage3Link> link_ = std::make_shared<Stage3Link>();
  std::vector<std::unique_ptr<Unit>> units_;
  int open_ = -1;  // the state group open now (open_group)
  std::vector<std::pair<ShardedBase*, int>> modules_;  // each Sharded member and its unit
  std::unique_ptr<TouchWatch> touch_;                   // units by type name that are not persistent
  std::vector<Unit*> touched_;                          // the units by type name the last touch used
  std::mutex touch_mu_;  // touches from autograd's threads and the training thread, one at a time
  std::unique_ptr<FetchCoordinator> fetch_;
  std::vector<ShardStep> steps_;  // one per optimizer group
  // Units with trainable parameters in the order their reductions are launched: the last first, the
  // root last, until the first backward pass has recorded the order its units' gradients completed
  // in (rank 0's, agreed by every rank), then that order.
  std::vector<int> reduce_order_;
  std::vector<int> completed_;  // this pass's units, in the order their gradients completed
  bool order_recorded_ = false;
  size_t next_reduction_ = 0;
  std::deque<std::pair<int, Work>> in_flight_;
  EndOfBackward end_of_backward_;
  int64_t trainable_elems_ = 0;
  bool root_released_in_step_ = false;  // the root is above the persistence threshold
  bool gradients_swapped_ = false;
  bool gather_at_shutdown_ = true;
  bool pass_ended_ = false;             // a backward pass ended since the micro-step began
  int64_t passes_ = 0;
};

}  // namespace zero
}  // namespace zeal
