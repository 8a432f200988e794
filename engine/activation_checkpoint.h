// Activation checkpointing (torch.utils.checkpoint, FSDP's checkpoint_wrapper) for LibTorch C++.
//
// zeal::checkpoint(fn, args...) runs fn(args...) without keeping the activations inside it: only
// its tensor arguments are kept. When the backward reaches its outputs it runs fn again on those
// arguments with autograd on and backpropagates through the recomputation. The recomputation replays
// what the original forward saw: the CPU generator's state, that of the current GPU and of every GPU an
// input lives on (dropout draws the same masks) and the autocast state (the same casts), so the
// gradients are bit for bit those of the plain forward. It costs one more forward of fn. In a forward
// without autograd (evaluation, generation) fn simply runs once.
//
//   at::Tensor y = zeal::checkpoint([blk = blocks[i]](const at::Tensor& x, const at::Tensor& mask) {
//     return blk->forward(x, mask);
//   }, h, mask);
//
// Arguments and results: tensors, std::optional<at::Tensor>, std::vector<at::Tensor> and std::tuples
// of them are seen through: their tensors are the checkpoint's inputs (kept, version-checked) and its
// outputs (differentiable). Other arguments are copied for the recomputation; fn must not hide tensors
// that need a gradient inside other types, and captures by value (it runs again in the backward, after
// the caller's locals are gone). An argument changed in place after the forward makes the backward
// throw, as autograd does for the tensors it saves.
//
// The gradients reach fn's parameters through a nested backward, accumulated into their .grad as a
// plain backward would: use engine.backward()/loss.backward(). torch::autograd::grad, backward with
// `inputs` and create_graph (double backward) through a checkpoint are refused with zeal::Error.
//
// zeal::Sharded units checkpoint themselves when asked (Sharded::set_activation_checkpointing, or the
// config's activation_checkpointing section / fsdp_activation_checkpointing): in stage 3 the unit is
// gathered for its backward anyway, so the recomputation costs no second gather.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace zeal {

struct CheckpointOptions {
  // Keep the inputs in host memory (pinned) while the forward and the rest of the backward run, when
  // they live on a GPU (DeepSpeed's cpu_checkpointing); nothing changes for CPU tensors.
  bool offload_inputs = false;
  // Wait for the device at the checkpoint's boundaries (DeepSpeed's synchronize_checkpoint_boundary).
  bool synchronize = false;
};

namespace detail {

// fn on the flat list of the checkpoint's tensor inputs, returning the flat list of its outputs.
using FlatFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// The checkpoint over flat lists: fn runs once now without autograd and again in the backward. The
// inputs must be defined; outputs that are not floating point come back without autograd. When no
// input requires grad and `anchor` is set, the outputs still join the graph (fn's own parameters need
// their gradients: a frozen embedding before trainable blocks).
std::vector<at::Tensor> checkpoint_flat(FlatFn fn, const std::vector<at::Tensor>& inputs,
                                        const CheckpointOptions& options, bool anchor = true);

// Whether autograd records here (a no-grad forward runs fn plainly).
bool grad_mode_enabled();

template <class T>
constexpr bool is_tensor = std::is_same_v<std::remove_cvref_t<T>, at::Tensor>;

// Types whose tensors the checkpoint sees: a tensor, an optional or a vector of them, a tuple of any.
template <class T>
struct tensor_tree : std::false_type {};
template <>
struct tensor_tree<at::Tensor> : std::true_type {};
template <>
struct tensor_tree<std::optional<at::Tensor>> : std::true_type {};
template <>
struct tensor_tree<std::vector<at::Tensor>> : std::true_type {};
template <class... Ts>
struct tensor_tree<std::tuple<Ts...>> : std::true_type {};
template <class T>
constexpr bool is_tensor_tree = tensor_tree<std::remove_cvref_t<T>>::value;

// f(at::Tensor&) on every tensor of v, in order (an empty optional has none; undefined tensors are
// visited); other types hold none that the checkpoint sees.
template <class V, class F>
void for_each_tensor(V& v, F&& f) {
  using D = std::remove_cvref_t<V>;
  if constexpr (std::is_same_v<D, at::Tensor>) {
    f(v);
  } else if constexpr (std::is_same_v<D, std::optional<at::Tensor>>) {
    if (v) f(*v);
  } else if constexpr (std::is_same_v<D, std::vector<at::Tensor>>) {
    for (auto& t : v) f(t);
  } else if constexpr (tensor_tree<D>::value) {
    std::apply([&](auto&... e) { (for_each_tensor(e, f), ...); }, v);
  }
}

// The result of the checkpointed function's first run (kept for what is not a tensor); the
// recomputation in the backward does not overwrite it.
template <class R>
struct FirstResult {
  R value{};
  bool filled = false;
};

// fn(args...) under the checkpoint: the tensors of the arguments are its inputs (undefined ones pass
// as they are), the other arguments are copied for the recomputation.
template <class R, class F, class... Args>
R checkpoint_call(F fn, const CheckpointOptions& options, bool anchor, Args&&... args) {
  static_assert(is_tensor_tree<R>,
                "a checkpointed function returns a tensor, an optional or a vector of tensors, or a std::tuple");
  std::tuple<std::decay_t<Args>...> kept(std::forward<Args>(args)...);
  std::vector<at::Tensor> inputs;
  std::vector<int> slot;  // each visited tensor's position in `inputs`, -1 for an undefined one
  std::apply(
      [&](auto&... a) {
        (for_each_tensor(a,
                         [&](at::Tensor& t) {
                           slot.push_back(t.defined() ? static_cast<int>(inputs.size()) : -1);
                           if (t.defined()) inputs.push_back(std::move(t));
                           t = at::Tensor();  // held as the checkpoint's input, not by the copy
                         }),
         ...);
      },
      kept);
  auto first = std::make_shared<FirstResult<R>>();
  FlatFn flat = [fn = std::move(fn), kept = std::move(kept), slot = std::move(slot),
                 first](const std::vector<at::Tensor>& ins) mutable {
    auto call = kept;  // this run's arguments: the copies, the tensors put back
    size_t j = 0;
    std::apply(
        [&](auto&... a) {
          (for_each_tensor(a,
                           [&](at::Tensor& t) {
                             const int s = slot[j++];
                             t = s >= 0 ? ins[static_cast<size_t>(s)] : at::Tensor();
                           }),
           ...);
        },
        call);
    R r = std::apply([&](auto&... a) -> R { return fn(a...); }, call);
    std::vector<at::Tensor> out;
    for_each_tensor(r, [&](at::Tensor& t) { out.push_back(t); });
    if (!first->filled) {
      first->value = std::move(r);
      first->filled = true;
    }
    return out;
  };
  const std::vector<at::Tensor> outs = checkpoint_flat(std::move(flat), inputs, options, anchor);
  R r = std::exchange(first->value, R{});
  size_t i = 0;
  for_each_tensor(r, [&](at::Tensor& t) { t = outs[i++]; });
  return r;
}

}  // namespace detail

// fn(args...) under activation checkpointing (see above); returns what fn returns.
template <class F, class... Args>
auto checkpoint(F&& fn, Args&&... args) -> std::invoke_result_t<std::decay_t<F>&, std::decay_t<Args>&...> {
  using R = std::invoke_result_t<std::decay_t<F>&, std::decay_t<Args>&...>;
  if (!detail::grad_mode_enabled()) return fn(std::forward<Args>(args)...);
  return detail::checkpoint_call<R>(std::decay_t<F>(std::forward<F>(fn)), CheckpointOptions{}, /*anchor=*/true,
                                    std::forward<Args>(args)...);
}

}  // namespace zeal
