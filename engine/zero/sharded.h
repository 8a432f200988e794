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
// (post_backward: the unit is released, frozen parameters included) and its tensor outputs through
// one identity whose backward fires before the block's (pre_backward: the unit is gathered again);
// post_forward releases it. Gradients are reduce-scattered into their owners once the block's
// backward has produced all of them. The block's forward may take any arguments and return a tensor,
// a std::tuple (a hidden state and a cache, say) or a std::vector of tensors. Under engine.init<M>()
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
  bool checkpointing_ = false;
  CheckpointOptions checkpoint_options_;
};

namespace detail {

template <class T>
constexpr bool is_tensor_v = std::is_same_v<std::remove_cvref_t<T>, at::Tensor>;
template <class T>
struct is_tuple : std::false_type {};
template <class... Ts>
struct is_tuple<std::tuple<Ts...>> : std::true_type {};

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
    // The differentiable tensor arguments go through the post-backward identity together; every
    // other argument is passed on untouched.
    std::vector<at::Tensor> inputs;
    std::array<int, sizeof...(Args)> slot{};
    int k = 0;
    (
        [&](auto& a) {
          using A = decltype(a);
          if constexpr (detail::is_tensor_v<A>) {
            if (detail::differentiable(a)) {
              slot[k] = static_cast<int>(inputs.size());
              inputs.push_back(a);
            } else {
              slot[k] = -1;
            }
          } else {
            slot[k] = -1;
          }
          ++k;
        }(args),
        ...);
    const std::vector<at::Tensor> marked = inputs.empty() ? inputs : mark_inputs(inputs);
    auto out = call(marked, slot, std::index_sequence_for<Args...>{}, std::forward<Args>(args)...);
    return mark_result(std::move(out));
  }

  std::shared_ptr<torch::nn::Module> block() const override { return inner.ptr(); }

  M inner;

 private:
  template <class... Args, size_t... I>
  auto call(const std::vector<at::Tensor>& marked, const std::array<int, sizeof...(Args)>& slot,
            std::index_sequence<I...>, Args&&... args) {
    return run_block(pass<I>(marked, slot, std::forward<Args>(args))...);
  }

  // The block's forward, under activation checkpointing when this unit asks for it and autograd
  // records: the defined tensor arguments are the checkpoint's inputs (kept), the rest are copied for
  // the recomputation.
  template <class... Args>
  auto run_block(Args&&... args) {
    using R = decltype(inner->forward(std::forward<Args>(args)...));
    if (!activation_checkpointing() || !detail::grad_mode_enabled()) {
      return inner->forward(std::forward<Args>(args)...);
    }
    constexpr size_t N = sizeof...(Args);
    std::vector<at::Tensor> inputs;
    std::array<int, N> slot{};
    auto kept = std::make_tuple(std::decay_t<Args>(args)...);
    [&]<size_t... I>(std::index_sequence<I...>) {
      (
          [&](auto& a) {
            constexpr size_t i = I;
            if constexpr (detail::is_tensor_v<decltype(a)>) {
              slot[i] = a.defined() ? static_cast<int>(inputs.size()) : -1;
              if (a.defined()) inputs.push_back(a);
              a = at::Tensor();  // held as the checkpoint's input, not by the recomputation
            } else {
              slot[i] = -1;
            }
          }(std::get<I>(kept)),
          ...);
    }(std::index_sequence_for<Args...>{});
    auto first = std::make_shared<zeal::detail::FirstResult<R>>();
    zeal::detail::FlatFn flat = [block = inner, kept, slot, first](const std::vector<at::Tensor>& ins) mutable {
      R r = [&]<size_t... I>(std::index_sequence<I...>) {
        return block->forward(argument<I>(kept, slot, ins)...);
      }(std::index_sequence_for<Args...>{});
      std::vector<at::Tensor> out;
      zeal::detail::flatten_into(r, out);
      if (!first->filled) {
        first->value = std::move(r);
        first->filled = true;
      }
      return out;
    };
    const std::vector<at::Tensor> outs = zeal::detail::checkpoint_flat(std::move(flat), inputs, checkpoint_options());
    R r = std::exchange(first->value, R{});
    size_t k = 0;
    zeal::detail::replace_from(r, outs, k);
    return r;
  }

  // Argument I of a recomputation: the checkpoint's input in its slot, or the copy kept.
  template <size_t I, class Kept, size_t N>
  static decltype(auto) argument(const Kept& kept, const std::array<int, N>& slot, const std::vector<at::Tensor>& ins) {
    using A = std::tuple_element_t<I, Kept>;
    if constexpr (detail::is_tensor_v<A>) {
      return slot[I] >= 0 ? ins[static_cast<size_t>(slot[I])] : at::Tensor();
    } else {
      return static_cast<const A&>(std::get<I>(kept));
    }
  }

  template <size_t I, size_t N, class A>
  static decltype(auto) pass(const std::vector<at::Tensor>& marked, const std::array<int, N>& slot, A&& a) {
    if constexpr (detail::is_tensor_v<A>) {
      return slot[I] >= 0 ? at::Tensor(marked[static_cast<size_t>(slot[I])]) : at::Tensor(a);
    } else {
      return std::forward<A>(a);
    }
  }

  // The differentiable tensors of the result through the pre-backward identity, in place.
  template <class R>
  R mark_result(R out) {
    if constexpr (std::is_same_v<R, at::Tensor>) {
      if (!detail::differentiable(out)) return out;
      return mark_outputs({out})[0];
    } else if constexpr (std::is_same_v<R, std::vector<at::Tensor>>) {
      std::vector<at::Tensor> live;
      for (auto& t : out)
        if (detail::differentiable(t)) live.push_back(t);
      if (live.empty()) return out;
      const auto marked = mark_outputs(live);
      size_t j = 0;
      for (auto& t : out)
        if (detail::differentiable(t)) t = marked[j++];
      return out;
    } else if constexpr (detail::is_tuple<R>::value) {
      std::vector<at::Tensor> live;
      std::apply(
          [&](auto&... e) {
            (
                [&](auto& x) {
                  if constexpr (detail::is_tensor_v<decltype(x)>)
                    if (detail::differentiable(x)) live.push_back(x);
                }(e),
                ...);
          },
          out);
      if (live.empty()) return out;
      const auto marked = mark_outputs(live);
      size_t j = 0;
      std::apply(
          [&](auto&... e) {
            (
                [&](auto& x) {
                  if constexpr (detail::is_tensor_v<decltype(x)>)
                    if (detail::differentiable(x)) x = marked[j++];
                }(e),
                ...);
          },
          out);
      return out;
    } else {
      static_assert(std::is_same_v<R, at::Tensor>,
                    "a zeal::Sharded block's forward returns a tensor, a std::tuple or a std::vector of tensors");
      return out;
    }
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
