// zeal::Sharded<M>: the sharding unit of ZeRO stage 3, the C++ counterpart of FSDP's
// `transformer_layer_cls_to_wrap` and of DeepSpeed's per-module hooks (LibTorch modules have no
// forward hooks, so a model names its units by holding its blocks as Sharded<Block>):
//
//   struct GptImpl : torch::nn::Module {
//     std::vector<zeal::Sharded<Block>> blocks;  // each block is gathered only while it runs
//     ...
//       x = blocks[i]->forward(x);
//
// Outside stage 3 (or before engine.prepare) a Sharded<M> is its block and nothing more. In stage 3
// its forward runs the unit's lifecycle (engine/zero/unit.h): pre_forward gathers the block's
// parameters (or finds them prefetched); the block runs with autograd recording, its tensor inputs
// passed through one identity whose backward fires once every op of the block has run its backward
// (post_backward: the unit is released; its frozen parameters may stay gathered until the next
// step's forward, docs/stage3.md "Frozen weights") and its tensor outputs through
// one identity whose backward fires before the block's (pre_backward: the unit is gathered again);
// post_forward releases it. Gradients are reduce-scattered into their owners once the block's
// backward has produced all of them. The block's forward may take any arguments (the tensors inside
// std::optional, std::vector and std::tuple arguments are seen too) and return a tensor, an optional
// or a vector of tensors, or a std::tuple of them (a hidden state and a cache, say). Under engine.init<M>()
// each Sharded member is partitioned as soon as its block is built.
//
// Activation checkpointing (engine/activation_checkpoint.h): a unit set to checkpoint
// (set_activation_checkpointing, or the config's activation_checkpointing section, which the engine
// applies to every unit or every unit_interval-th at prepare) keeps only its tensor arguments from
// the forward and runs the block's forward again in its backward, at every stage; in stage 3 the
// unit is gathered for its backward anyway, so the recomputation needs no second gather. The
// block's other arguments are kept by value for the recomputation.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "engine/activation_checkpoint.h"

#include <array>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace zeal {
namespace zero {
class Unit;
struct Stage3Link;
}  // namespace zero

// The part of Sharded<M> that does not depend on M.
class ShardedBase : public torch::nn::Module {
 public:
  // The engine's unit for this block (null outside stage 3).
  zero::Unit* unit() const { return unit_; }
  void attach(zero::Unit* unit, std::weak_ptr<zero::Stage3Link> link) {
    unit_ = unit;
    link_ = std::move(link);
  }
  // The wrapped block.
  virtual std::shared_ptr<torch::nn::Module> block() const = 0;

  // Activation checkpointing of this unit (see above). A unit that holds other Sharded members
  // cannot checkpoint (its recomputation would run their lifecycles inside the backward): the
  // engine refuses it at prepare; checkpoint the inner ones.
  void set_activation_checkpointing(bool on, CheckpointOptions options = {}) {
    checkpointing_ = on;
    checkpoint_options_ = options;
  }
  bool activation_checkpointing() const { return checkpointing_; }
  const CheckpointOptions& checkpoint_options() const { return checkpoint_options_; }

 protected:
  // The lifecycle around the block's forward (sharded.cpp). active: in stage 3, with a live engine.
  bool pre_forward();
  // The block's tensor inputs that require grad, through the post-backward identity (one node).
  std::vector<at::Tensor> mark_inputs(const std::vector<at::Tensor>& inputs);
  // The block's tensor outputs that require grad, through the pre-backward identity (one node).
  std::vector<at::Tensor> mark_outputs(const std::vector<at::Tensor>& outputs);
  void post_forward();
  // Called once the block exists: under engine.init it is partitioned right away.
  void constructed();

 private:
  zero::Unit* unit_ = nullptr;
  std::weak_ptr<zero::Stage3Link> link_;
  bool partitioned_ = false;  // engine.init kept only this rank's slices: unusable until prepared
  bool checkpointing_ = false;
  CheckpointOptions checkpoint_options_;
};

namespace detail {

// Tensors that take part in autograd here: defined, floating point, requiring grad.
inline bool differentiable(const at::Tensor& t) { return t.defined() && t.requires_grad(); }

}  // namespace detail

template <class M>
class ShardedImpl : public ShardedBase {
 public:
  template <class... Args>
  explicit ShardedImpl(Args&&... args) : inner(std::forward<Args>(args)...) {
    register_module("block", inner.ptr());
    constructed();
  }

  // The block's forward, inside the unit's lifecycle (stage 3) or as is (other stages).
  template <class... Args>
  auto forward(Args&&... args) {
    if (!pre_forward()) return run_block(std::forward<Args>(args)...);
    struct Release {
      ShardedImpl* self;
      ~Release() { self->post_forward(); }
    } release{this};
    // The differentiable tensors of the arguments (tensors, optionals, vectors and tuples of them,
    // copied) go through the post-backward identity together; every other argument is passed on
    // untouched.
    std::tuple<tree_copy_t<Args>...> trees(tree_copy<Args>(args)...);
    std::vector<at::Tensor*> live;
    std::apply(
        [&](auto&... t) {
          (detail::for_each_tensor(t,
                                   [&](at::Tensor& x) {
                                     if (detail::differentiable(x)) live.push_back(&x);
                                   }),
           ...);
        },
        trees);
    if (!live.empty()) {
      std::vector<at::Tensor> inputs;
      for (auto* x : live) inputs.push_back(*x);
      const std::vector<at::Tensor> marked = mark_inputs(inputs);
      for (size_t i = 0; i < live.size(); ++i) *live[i] = marked[i];
    }
    return [&]<size_t... I>(std::index_sequence<I...>) {
      return mark_result(run_block(pick<I, Args>(trees, std::forward<Args>(args))...));
    }(std::index_sequence_for<Args...>{});
  }

  std::shared_ptr<torch::nn::Module> block() const override { return inner.ptr(); }

  M inner;

 private:
  template <class A>
  using tree_copy_t = std::conditional_t<detail::is_tensor_tree<A>, std::decay_t<A>, std::monostate>;

  template <class A>
  static tree_copy_t<A> tree_copy(const std::remove_reference_t<A>& a) {
    if constexpr (detail::is_tensor_tree<A>) {
      return a;
    } else {
      return {};
    }
  }

  // Argument I: the copy with its marked tensors, or the caller's argument as it came.
  template <size_t I, class A, class Trees>
  static decltype(auto) pick(Trees& trees, A&& a) {
    if constexpr (detail::is_tensor_tree<A>) {
      return std::decay_t<A>(std::move(std::get<I>(trees)));
    } else {
      return static_cast<A&&>(a);
    }
  }

  // The block's forward, under activation checkpointing when this unit asks for it and autograd
  // records (activation_checkpoint.h: the arguments' tensors are the checkpoint's inputs, the other
  // arguments are copied for the recomputation). A block without trainable parameters whose inputs
  // need no gradient stays out of the graph.
  template <class... Args>
  auto run_block(Args&&... args) {
    using R = decltype(inner->forward(std::forward<Args>(args)...));
    if (!activation_checkpointing() || !detail::grad_mode_enabled()) {
      return inner->forward(std::forward<Args>(args)...);
    }
    bool trainable = false;
    for (const auto& p : inner->parameters()) trainable = trainable || p.requires_grad();
    return detail::checkpoint_call<R>([block = inner](auto&... a) mutable -> R { return block->forward(a...); },
                                      checkpoint_options(), trainable, std::forward<Args>(args)...);
  }

  // The differentiable tensors of the result through the pre-backward identity, in place.
  template <class R>
  R mark_result(R out) {
    static_assert(detail::is_tensor_tree<R>,
                  "a zeal::Sharded block's forward returns a tensor, an optional or a vector of tensors, or a "
                  "std::tuple of them");
    std::vector<at::Tensor*> live;
    detail::for_each_tensor(out, [&](at::Tensor& t) {
      if (detail::differentiable(t)) live.push_back(&t);
    });
    if (live.empty()) return out;
    std::vector<at::Tensor> outputs;
    for (auto* t : live) outputs.push_back(*t);
    const std::vector<at::Tensor> marked = mark_outputs(outputs);
    for (size_t i = 0; i < live.size(); ++i) *live[i] = marked[i];
    return out;
  }
};

// A ModuleHolder, used like the block's own holder: Sharded<Block> b(args...); b->forward(x);
// b->inner is the block.
template <class M>
class Sharded : public torch::nn::ModuleHolder<ShardedImpl<M>> {
 public:
  using torch::nn::ModuleHolder<ShardedImpl<M>>::ModuleHolder;
};

}  // namespace zeal
