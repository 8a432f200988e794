// zeal::Sharded<M>: the sharding unit of ZeRO stage 3, the C++ counterpart of FSDP's
// `transformer_layer_cls_to_wrap` and of DeepSpeed's per-module hooks (LibTorch modules have no
// forward hooks, so a model names its units by holding its blocks as Sharded<Block>):
//
//   struct GptImpl : torch::nn::Module {
//     std::vector<zeal::Sharded<Block>> blocks;  // each block is gathered only while it runs
//     ...
//       x = blocks[i]->forward(x);
//
// Outside stage 3 (or before engine.prepare) a Sharded<M> is its block and nothing more. In
// stage 3 its forward gathers the block's parameters (or finds them prefetched), runs the block
// with autograd recording, marks the output so the block is gathered again just before its own
// backward, and releases the parameters. Gradients are reduce-scattered into their owners as soon
// as the block's backward has produced all of them. Parameters outside every Sharded member form
// the root unit, which stays gathered (as do parameters a Sharded member shares with the root, such
// as an LM head tied to the embedding). Under engine.init<M>() each Sharded member is partitioned
// as soon as its block is built.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <utility>

namespace zeal {
namespace zero {
class Unit;
}

// The part of Sharded<M> that does not depend on M.
class ShardedBase : public torch::nn::Module {
 public:
  // The engine's unit for this block (null outside stage 3).
  zero::Unit* unit() const { return unit_; }
  void attach(zero::Unit* unit) { unit_ = unit; }
  // The wrapped block.
  virtual std::shared_ptr<torch::nn::Module> block() const = 0;

 protected:
  // Gathers, runs `fn`, marks its output for the pre-backward gather, releases.
  at::Tensor around(const std::function<at::Tensor()>& fn);
  // Called once the block exists: under engine.init it is partitioned right away.
  void constructed();

 private:
  zero::Unit* unit_ = nullptr;
};

template <class M>
class ShardedImpl : public ShardedBase {
 public:
  template <class... Args>
  explicit ShardedImpl(Args&&... args) : inner(std::forward<Args>(args)...) {
    register_module("block", inner.ptr());
    constructed();
  }
  // Forwards to the block's forward; the block's output must be one tensor.
  template <class... Args>
  at::Tensor forward(Args&&... args) {
    return around([&] { return inner->forward(std::forward<Args>(args)...); });
  }
  std::shared_ptr<torch::nn::Module> block() const override { return inner.ptr(); }

  M inner;
};

// A ModuleHolder, used like the block's own holder: Sharded<Block> b(args...); b->forward(x);
// b->inner is the block.
template <class M>
class Sharded : public torch::nn::ModuleHolder<ShardedImpl<M>> {
 public:
  using torch::nn::ModuleHolder<ShardedImpl<M>>::ModuleHolder;
};

}  // namespace zeal
