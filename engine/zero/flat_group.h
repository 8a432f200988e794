// FlatGroup: one optimizer parameter group laid out for ZeRO stages 0, 1 and 2.
//
// The group's trainable parameters, in registration order, are cut into buckets of at most
// `bucket_elems` elements (whole parameters; a larger parameter is a bucket of its own). Each
// bucket is a FlatLayout padded to world_size equal shards, and the group's compute-precision
// parameter buffer is the buckets end to end; every parameter's data is, for good, a view into
// it. Rank r owns the r-th shard of every bucket: the concatenation of those shards is its
// partition, and the fp32 master weights and optimizer state hold exactly that partition
// (stage 1 and 2), or every bucket whole (stage 0).
//
// Gradients, summed across micro-steps in the accumulation dtype and reduced across ranks in the
// communication dtype (both fp32 unless the config says otherwise, also when computing in 16 bits):
//   stage 0, 1  one gradient buffer with the parameters' layout. When it has the compute dtype each
//               .grad is a view into it, so autograd accumulates micro-steps in place; otherwise
//               each arriving .grad is added into it and released. On the sync micro-step a bucket
//               is all-reduced (stage 0) or reduce-scattered in place (stage 1) as soon as its last
//               gradient arrives.
//   stage 2     only the owned partition of the gradients is kept. As each gradient arrives it is
//               added into its bucket's staging buffer and released; a full bucket is
//               reduce-scattered and its owned shard added to the partition, on every micro-step.
// In 16-bit communication every rank divides its part by the world size before the sum, so the sum
// cannot overflow where the average would not.
// Buckets are reduced in one fixed order (last bucket first, the order of a backward pass) on
// every rank, whatever order gradients arrive in, so collectives always match across ranks.
//
// Thread: hooks run on the thread that runs backward (on CPU, the caller's); nothing else touches
// a group concurrently.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/comm/communicator.h"
#include "engine/optim/optimizer.h"
#include "engine/zero/grad_hook.h"
#include "engine/zero/layout.h"
#include "engine/zero/shard_step.h"

namespace zeal::zero {

struct GroupOptions {
  int stage = 0;
  at::ScalarType compute_dtype = at::kFloat;
  at::ScalarType grad_accum_dtype = at::kFloat;  // gradients summed over micro-steps in this
  at::ScalarType comm_dtype = at::kFloat;        // gradients reduced across ranks in this
  int64_t bucket_elems = 500'000'000;
  bool overlap_comm = false;  // reduce buckets asynchronously behind the backward
  int64_t align = 16;         // shard sizes are a multiple of this many elements
  // offload_optimizer.device cpu: the master weights and optimizer state live in this host arena
  // and the step runs on the CPU (ShardStep::offload_to).
  std::shared_ptr<offload::HostArena> offload;
};

// Bytes a rank holds for one group.
struct GroupBytes {
  int64_t params = 0, grads = 0, master = 0, optimizer = 0, workspace = 0;
};

class FlatGroup {
 public:
  // `params` are the group's trainable parameters (requires_grad, on the compute device, in
  // registration order); `names` name them in errors. Rank 0's values are broadcast so every rank
  // starts equal; the fp32 master is taken from those values before they are cast to the
  // compute dtype.
  FlatGroup(Communicator& comm, std::vector<at::Tensor> params, std::vector<std::string> names,
            std::unique_ptr<optim::Optimizer> optimizer, const GroupOptions& options);
  ~FlatGroup();
  FlatGroup(const FlatGroup&) = delete;
  FlatGroup& operator=(const FlatGroup&) = delete;

  // Lifecycle of one micro-step: begin (sync: this micro-step's gradients are reduced), the
  // backward runs (hooks call on_grad_ready), end waits for every reduction of this micro-step. The
  // end runs by itself at the end of each backward pass that touched the group (a callback on the
  // autograd engine); end_backward_if_no_pass runs it when none did since begin_micro_step.
  void begin_micro_step(bool sync);
  void end_backward();
  void end_backward_if_no_pass();
  bool backward_pending() const { return end_.pending(); }
  int64_t backward_passes() const { return passes_; }
  // Outside a backward: notices a pass that ended with an error (its reductions are finished, its
  // gradients dropped); take_abandoned() reports it once.
  void check_abandoned() { end_.check(); }
  bool take_abandoned() { return std::exchange(abandoned_, false); }
  // The full reduced gradient of parameter i (× inv_scale). Collective from stage 1 on.
  at::Tensor full_grad(int param, double inv_scale);
  // The index of `param` in this group, or -1.
  int index_of(const at::Tensor& param) const;

  // The step over this rank's owned regions (statistics, clipping, the fused update).
  ShardStep& shard_step() { return step_; }
  // Updates the master partition from the gradients, writes it into the compute parameters and
  // all-gathers them (stage 1, 2).
  void apply_step(double lr, double inv_scale);
  void zero_grad();

  // Whether this rank's partition holds a replica of every gradient (stage 0): then norms need
  // no all-reduce.
  bool replicated() const { return opts_.stage == 0; }
  optim::Optimizer& optimizer() { return step_.optimizer(); }
  GroupBytes bytes() const;
  int64_t num_elements() const { return total_elems_; }
  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  const std::vector<std::string>& names() const { return names_; }
  // Checkpoints (Sharding::state_ranges): the pieces of this group's parameters this rank holds.
  void state_ranges(bool to_write, std::vector<StateRange>& out);
  // After a load: the owned regions of the parameter buffer to every rank (stages 1, 2; collective).
  void regather();

 private:
  struct Bucket {
    FlatLayout layout;
    std::vector<int> params;  // indices into params_
    int64_t offset = 0;       // in the group's flat buffers
    int64_t owned_begin = 0;  // owned region, relative to offset
    int64_t owned_len = 0;
    int64_t master_offset = 0;  // of the owned region in the partition
    int arrived = 0;            // gradients seen this micro-step
    bool launched = false;
    at::Tensor staging{};  // stage 2: the bucket's gradients while it is being reduced
  };
  struct InFlight {
    int bucket;
    Work work;
    at::Tensor comm;  // the buffer reduced in the communication dtype, when it differs
  };
  struct HookState;

  void on_grad_ready(int param);
  void abandon();
  // Whether .grad is a view of the gradient buffer (stage 0, 1 with the compute dtype).
  bool grads_in_place() const { return opts_.stage < 2 && opts_.grad_accum_dtype == opts_.compute_dtype; }
  void launch_ready_buckets();
  void launch(int b);
  void complete_oldest();
  void reattach_grad(int param, bool overwrite);
  at::Tensor owned_view(const at::Tensor& flat, int b) const;
  // The owned region of bucket b's gradients in the compute dtype (stage 2: its slice of the partition).
  at::Tensor owned_grad_view(int b) const;

  Communicator& comm_;
  GroupOptions opts_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_;        // param → bucket
  std::vector<int64_t> flat_offset_;  // param → offset in the group's flat buffers
  int64_t total_elems_ = 0, padded_ = 0, owned_total_ = 0;

  at::Tensor param_flat_;  // compute dtype, padded_ elements: every parameter's storage
  at::Tensor grad_flat_;   // stage 0, 1: accumulation dtype, padded_ elements
  at::Tensor grad_part_;   // stage 2: accumulation dtype, owned_total_ elements
  ShardStep step_;         // fp32 master (owned_total_ elements), optimizer, the update

  bool sync_ = true;
  int next_launch_ = -1;  // the next bucket to launch, counting down
  std::vector<InFlight> in_flight_;
  int64_t staging_peak_ = 0, staging_now_ = 0;

  std::shared_ptr<HookState> hook_state_;
  std::vector<std::shared_ptr<void>> accumulators_;  // keeps each parameter's hook alive
  EndOfBackward end_;
  bool pass_ended_ = false, abandoned_ = false;
  int64_t passes_ = 0;
};

}  // namespace zeal::zero
