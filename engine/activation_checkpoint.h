// Activation checkpointing (torch.utils.checkpoint, FSDP's checkpoint_wrapper) for LibTorch C++.
//
// zeal::checkpoint(fn, inputs...) runs fn(inputs...) without keeping the activations inside it: only
// its tensor inputs are kept. When the backward reaches its outputs it runs fn again on those inputs
// with autograd on and backpropagates through the recomputation. The recomputation replays what the
// original forward saw: the CPU generator's state and that of every GPU an input lives on (dropout
// draws the same masks) and the autocast state (the same casts), so the gradients are bit for bit
// those of the plain forward. It costs one more forward of fn. In a forward without autograd
// (evaluation, generation) fn simply runs once.
//
//   at::Tensor y = zeal::checkpoint([&](const at::Tensor& x) { return block->forward(x); }, x);
//
// fn takes tensors and returns a tensor, a std::vector of tensors or a std::tuple holding tensors;
// anything else it needs it captures (by value: it runs again in the backward). The gradients reach
// fn's parameters through a nested backward (accumulated into their .grad as a plain backward would),
// so use engine.backward()/loss.backward(), not torch::autograd::grad, through a checkpoint.
//
// zeal::Sharded units checkpoint themselves when asked (Sharded::set_activation_checkpointing, or the
// config's activation_checkpointing section / fsdp_activation_checkpointing): in stage 3 the unit is
// gathered for its backward anyway, so the recomputation costs no second gather.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
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
// inputs must be defined; outputs that are not floating point come back without autograd.
std::vector<at::Tensor> checkpoint_flat(FlatFn fn, const std::vector<at::Tensor>& inputs,
                                        const CheckpointOptions& options);

// Whether autograd records here (a no-grad forward runs fn plainly).
bool grad_mode_enabled();

template <class T>
constexpr bool is_tensor = std::is_same_v<std::remove_cvref_t<T>, at::Tensor>;

// The tensors of a result (a tensor, a vector of them, a tuple holding some), in order, and the
// same result with its tensors replaced from a flat list.
template <class R>
void flatten_into(const R& r, std::vector<at::Tensor>& out) {
  if constexpr (is_tensor<R>) {
    out.push_back(r);
  } else if constexpr (std::is_same_v<R, std::vector<at::Tensor>>) {
    out.insert(out.end(), r.begin(), r.end());
  } else {
    std::apply(
        [&](const auto&... e) {
          (
              [&](const auto& x) {
                if constexpr (is_tensor<decltype(x)>) out.push_back(x);
              }(e),
              ...);
        },
        r);
  }
}

template <class R>
void replace_from(R& r, const std::vector<at::Tensor>& flat, size_t& i) {
  if constexpr (is_tensor<R>) {
    r = flat[i++];
  } else if constexpr (std::is_same_v<R, std::vector<at::Tensor>>) {
    for (auto& t : r) t = flat[i++];
  } else {
    std::apply(
        [&](auto&... e) {
          (
              [&](auto& x) {
                if constexpr (is_tensor<decltype(x)>) x = flat[i++];
              }(e),
              ...);
        },
        r);
  }
}

// The result of the checkpointed function's first run (kept for what is not a tensor); the
// recomputation in the backward does not overwrite it.
template <class R>
struct FirstResult {
  R value{};
  bool filled = false;
};

}  // namespace detail

// fn(tensors...) under activation checkpointing (see above); returns what fn returns. Undefined
// tensors are passed through as they are.
template <class F, class... T>
auto checkpoint(F&& fn, const T&... tensors) -> decltype(fn(tensors...)) {
  using R = decltype(fn(tensors...));
  if (!detail::grad_mode_enabled()) return fn(tensors...);
  const std::vector<at::Tensor> given{tensors...};
  std::vector<at::Tensor> inputs;
  std::vector<int> slot;  // position of each argument in `inputs`, -1 for an undefined tensor
  for (const auto& t : given) {
    slot.push_back(t.defined() ? static_cast<int>(inputs.size()) : -1);
    if (t.defined()) inputs.push_back(t);
  }
  auto first = std::make_shared<detail::FirstResult<R>>();
  detail::FlatFn flat = [fn = std::decay_t<F>(std::forward<F>(fn)), slot, first](const std::vector<at::Tensor>& ins) {
    auto arg = [&](size_t i) { return slot[i] >= 0 ? ins[static_cast<size_t>(slot[i])] : at::Tensor(); };
    R r = [&]<size_t... I>(std::index_sequence<I...>) { return fn(arg(I)...); }(std::index_sequence_for<T...>{});
    std::vector<at::Tensor> out;
    detail::flatten_into(r, out);
    if (!first->filled) {
      first->value = std::move(r);
      first->filled = true;
    }
    return out;
  };
  const std::vector<at::Tensor> outs = detail::checkpoint_flat(std::move(flat), inputs, {});
  R r = std::exchange(first->value, R{});
  size_t i = 0;
  detail::replace_from(r, outs, i);
  return r;
}

}  // namespace zeal
