// Partitioned construction (DeepSpeed's zero.Init, Accelerate's zero3_init_flag): engine.init<M>()
// builds the model under an InitContext. Each zeal::Sharded member, as soon as its constructor has
// built the block, hands its parameters to the context, which keeps this rank's 1/world slice of
// each and frees the rest: the whole model never exists on a rank. Every rank builds with rank 0's
// random generator state, so the values are those one process seeded like rank 0 would build.
// Stage3 takes the slices over at prepare (InitShards::materialize, one unit at a time).
//
// The context also measures construction: every CPU allocation made while it is open is counted
// (CpuMemoryCounter), so `peak` is what construction really held at most.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <unordered_set>

namespace torch::nn {
class Module;
}

namespace zeal {
class Communicator;
class CpuMemoryCounter;
class ShardedBase;

namespace zero {

// Parameters (by TensorImpl) reachable from `model` without entering a Sharded member or a module
// whose type `unit_names` names: the root unit's, including any a unit shares with the root.
std::unordered_set<const void*> root_parameters(torch::nn::Module& model, const std::vector<std::string>& unit_names = {});


// The slices kept for partitioned parameters, by parameter.
class InitShards {
 public:
  struct Slice {
    at::Tensor data;  // numel_padded / world elements, the parameter's dtype and device
    int64_t numel = 0;
  };
  bool contains(const at::Tensor& p) const { return slices_.count(p.unsafeGetTensorImpl()) > 0; }
  // This rank's slice of `p` (elements [rank·per, rank·per + per) of its flat values), or null.
  Slice* find(const at::Tensor& p) {
    auto it = slices_.find(p.unsafeGetTensorImpl());
    return it == slices_.end() ? nullptr : &it->second;
  }
  bool empty() const { return slices_.empty(); }
  // Gives `p` its full values again (all-gather of the slices, on `device`) and returns true; a
  // no-op returning false for a parameter that was not partitioned. Collective: every rank calls
  // it for the same parameters.
  bool materialize(at::Tensor& p, Communicator& comm, at::Device device);
  int64_t bytes() const;

 private:
  friend class InitContext;
  std::unordered_map<const void*, Slice> slices_;
};

// What engine.init measured.
struct InitReport {
  bool partitioned = false;
  int64_t peak = 0;           // most bytes of CPU memory allocated during construction at once
  int64_t model_bytes = 0;    // all parameters and buffers, whole
  int64_t largest_unit = 0;   // the largest Sharded member's own parameters
  int64_t root_bytes = 0;     // parameters outside every Sharded member, and buffers
  int64_t shard_bytes = 0;    // slices kept
  // What construction may hold: the largest unit + the root + the slices kept.
  int64_t bound() const { return largest_unit + root_bytes + shard_bytes; }
};

class InitContext {
 public:
  // partition: keep slices (stage 3 with zero3_init_flag and more than one rank); otherwise the
  // context only measures. device: the engine's; the generator states go through `comm` there, and
  // on a CUDA device that device's generator is made rank 0's too (a block built on the GPU).
  InitContext(Communicator& comm, bool partition, at::Device device = at::kCPU);
  ~InitContext();
  InitContext(const InitContext&) = delete;
  InitContext& operator=(const InitContext&) = delete;

  // The context open on this thread (null when none).
  static InitContext* current();
  // Called by a Sharded member's constructor once its block exists.
  // Returns whether the unit's parameters now hold only this rank's slices.
  bool partition(ShardedBase& unit);
  // Closes the context over the built model; returns the slices (empty unless partitioned).
  std::shared_ptr<InitShards> finish(torch::nn::Module& model, InitReport* report);

 private:
  Communicator& comm_;
  bool partition_;
  std::shared_ptr<InitShards> shards_ = std::make_shared<InitShards>();
  int64_t largest_unit_ = 0;
  InitContext* prev_;
  std::unique_ptr<CpuMemoryCounter> counter_;  // what construction allocates
};

}  // namespace zero
}  // namespace zeal
