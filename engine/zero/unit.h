// One ZeRO stage-3 sharding unit: a zeal::Sharded member's own parameters, or the root's (those
// outside every Sharded member). Internal to engine/zero.
//
// The unit's trainable parameters (ordered by optimizer group) and its frozen ones are two flat
// buffers (FlatLayout, padded to equal shards); each rank keeps one shard of each. Every parameter is,
// for good, a view into its part's full buffer, whose storage exists only while the unit is gathered.
//
// Its parameters' life (State), each transition at a named moment:
//   kReleased    only this rank's shards; the parameters keep their shapes without storage
//   kGathering   the all-gather is in flight (a prefetch, or a fetch not yet waited for)
//   kGathered    the full parameters are present (during and after a forward)
//   kInBackward  present for the unit's backward: from pre_backward to post_backward
// and the lifecycle points, named after the moment they run:
//   pre_forward    the block's forward is about to run: gather (or take the prefetch) and wait
//   post_forward   its forward returned: release, unless the unit is persistent, reused soon, or
//                  inside its own backward (a recomputation); in a training pass its frozen part
//                  may stay (kept, as below)
//   pre_backward   the gradient of its output is ready: its backward is next, gather again
//   post_backward  every op of its backward has run (the identity on its inputs fired, or the
//                  backward ended for a unit whose inputs need no gradient): release; the frozen
//                  part stays (kept) when the recorded order uses the unit again, the next pass
//                  included, within stage3_max_reuse_distance (and within
//                  stage3_max_live_parameters elements of other units) while the gathered bytes
//                  stay within stage3_max_live_parameters: no step changes frozen values, so the
//                  next gather brings only the trainable part (a LoRA unit: its adapters). Kept
//                  through the step and the backward's end; dropped by any other release (an
//                  eval pass, engine.gathered()), when the recorded order changes, and when a
//                  state load changes the shards. Units by type name (unit_names) have no hooks:
//                  Stage3 releases them, keeping the same way, when the thread moves on in a
//                  training pass and at the backward's end.
// Its gradients in one backward (Grads): kIdle → kArriving (some arrived, staged) → kComplete (all
// arrived, or the backward ended) → kReduced (reduce-scattered into this rank's gradient shard).
// Reductions run in one fixed order on every rank (Stage3), not in arrival order.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/comm/communicator.h"
#include "engine/zero/layout.h"
#include "engine/zero/offload_state.h"

namespace zeal::zero {

class Stage3;

class Unit {
 public:
  enum class State { kReleased, kGathering, kGathered, kInBackward };
  enum class Grads { kIdle, kArriving, kComplete, kReduced };

  // One flat buffer: the trainable or the frozen parameters.
  struct Part {
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
    std::vector<int> groups;             // optimizer group of each (trainable part)
    std::unique_ptr<FlatLayout> layout;  // null when the part is empty
    at::Tensor shard;                    // compute dtype, this rank's slice
    at::Tensor full;                     // compute dtype, the padded buffer; storage only while gathered
    int64_t swap_offset = -1;            // offload_param nvme: the shard's region in the swap file
    ParamSwap::Reading reading;          // offload_param nvme: its read ahead, while one runs
    int64_t bytes() const;               // of `full` while gathered
  };

  Unit(Stage3& owner, int index, std::string name);
  Unit(const Unit&) = delete;
  Unit& operator=(const Unit&) = delete;

  const std::string& name() const { return name_; }
  int index() const { return index_; }
  State state() const { return state_; }
  Grads grads() const { return grads_; }
  bool gathered() const { return state_ == State::kGathered || state_ == State::kInBackward; }
  bool persistent() const { return persistent_; }
  int64_t numel() const { return numel_; }         // elements of all its parameters
  int64_t gathered_bytes() const;                   // its full buffers while gathered
  bool has_trainable() const { return static_cast<bool>(train_.layout); }
  // offload_param nvme: its shards live on disk while it is not being gathered.
  bool shards_on_disk() const { return train_.swap_offset >= 0 || frozen_.swap_offset >= 0; }

  // The lifecycle points (see above).
  void pre_forward();
  void post_forward();
  void pre_backward();
  void post_backward();

 private:
  friend class Stage3;
  friend class FetchCoordinator;

  // Lays the part out, takes its values (rank 0's unless `same_everywhere`), keeps this rank's
  // shard and points the parameters into the full buffer (left gathered). Returns the float32
  // values it laid out (the master weights come from them, before any cast).
  at::Tensor build(Part& part, bool same_everywhere);
  // All-gathers the shards into the full buffers (issues only, unless `wait`).
  void gather(bool wait, const char* phase);
  void wait_gather();
  // Frees the full buffers. keep_frozen: the frozen part's stays, with its values (kept), or a
  // kept one stays; otherwise a kept one goes too.
  void release(bool keep_frozen = false);
  // Bytes a gather would add now, and the elements it would bring (the frozen part's none while
  // kept).
  int64_t missing_bytes() const;
  int64_t missing_elems() const;
  bool frozen_kept() const { return frozen_kept_; }
  // Frees a kept frozen part (a persistent unit's too: the root keeps its own through a step).
  void drop_kept();
  // offload_param nvme (and cpu on a GPU). shards_to_disk: after build, each part's shard gets a
  // region in the swap file (or, with `in_host`, the store's host memory), is written there and freed. load_shards: the shards on disk without storage are read
  // back (of the trainable part only, when `trainable_only`). store_shards: writes the trainable
  // shard (changed by a step) to its region. drop_shards: frees the storage of shards on disk.
  void shards_to_disk(bool in_host = false);
  void load_shards(bool trainable_only = false);
  void store_shards(bool trainable_only);
  void drop_shards();
  // offload_param nvme: starts reading ahead the shards on disk that have no storage, if the swap's
  // buffers have room for all of them: 1 started, 0 nothing to read, -1 no room.
  int read_ahead();
  // A trainable parameter's gradient arrived (its accumulator's post hook): staged.
  void on_grad_ready(int param);
  // Reduce-scatters the staged gradients (zeros for those that never arrived) and adds this rank's
  // part into the gradient shard; returns the collective, finished by finish_reduction().
  Work reduce(bool wait);
  void finish_reduction();
  // Ends one backward for this unit (the engine's end-of-backward, or an aborted backward).
  void reset_backward();

  Stage3& owner_;
  const int index_;
  const std::string name_;
  Part train_, frozen_;
  State state_ = State::kGathered;  // build() leaves it gathered; Stage3 releases it
  Grads grads_ = Grads::kIdle;
  bool persistent_ = false;  // set once at construction (persistence threshold)
  bool frozen_kept_ = false;  // released, but frozen_.full kept with its values (see post_backward)
  int64_t numel_ = 0, frozen_numel_ = 0;
  int arrived_ = 0;
  int open_backwards_ = 0;  // uses whose backward began and has not ended (a unit used twice)
  int holds_ = 0;           // engine.gathered() guards holding it gathered
  at::Tensor grad_shard_;    // accumulation dtype, train_ shard size: reduced gradients, summed over micro-steps
  at::Tensor grad_staging_;  // communication dtype, train_ padded total: this backward's gradients
  std::vector<Work> pending_;  // all-gathers in flight
  std::vector<std::pair<int, size_t>> master_pieces_;  // (group, piece of its ShardStep) of this unit
  std::vector<int64_t> master_piece_shard_;           // where each of them starts in train_.shard
  std::vector<std::shared_ptr<void>> accumulators_;  // keep the gradient hooks alive
};

}  // namespace zeal::zero
