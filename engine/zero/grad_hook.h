// Gradient arrival and the end of a backward pass, as every ZeRO stage sees them.
//
// A post hook on a parameter's gradient accumulator runs after autograd has added this backward's
// contribution to its .grad. The end of the whole pass is a callback queued on LibTorch's autograd
// engine from inside the pass (a hook or a node): it runs once the pass is done, whoever started
// it — engine.backward, loss.backward() or torch::autograd::backward({l1, l2}).
#pragma once

#include <ATen/Tensor.h>

#include <functional>
#include <memory>
#include <string>

namespace zeal::zero {

// Calls `fn` each time `param`'s gradient accumulator has run. Returns the accumulator, which the
// caller keeps alive (autograd holds it only while a graph uses the parameter). `name` is for the
// error when the tensor has no accumulator (it does not require grad).
std::shared_ptr<void> on_grad_ready(const at::Tensor& param, const std::string& name, std::function<void()> fn);

// Runs `end` once at the end of each backward pass that requested it (request() from inside the
// pass, as often as convenient). A pass that ended with an error never runs its callback: the next
// request() from another pass, or check() outside any pass, notices and runs `abandoned` first.
// The queued callback holds the owner weakly: it does nothing once this object is gone.
// A backward run from inside another's node (an activation checkpoint's recomputation, under a
// NestedBackward) belongs to the outer pass: its requests are queued on the outer pass when the
// nested one returns, never at the nested pass's own end.
class EndOfBackward {
 public:
  EndOfBackward(std::function<void()> end, std::function<void()> abandoned);
  ~EndOfBackward();
  EndOfBackward(const EndOfBackward&) = delete;
  EndOfBackward& operator=(const EndOfBackward&) = delete;

  void request();
  // Outside a backward pass: runs `abandoned` if a pass requested the callback and ended without it.
  void check();
  // Whether a pass requested the callback and it has not run yet.
  bool pending() const;

  struct State;  // grad_hook.cpp's

 private:
  std::shared_ptr<State> state_;
};

// While one lives, every backward pass in the process is part of the pass that was running when the
// first was made (this thread's current graph task, which must exist), on whatever thread its nodes
// run: zeal::checkpoint's backward holds one around its recomputation's backward. Nests; the scope
// that closes last queues the deferred requests on the outer pass from the thread that made it.
class NestedBackward {
 public:
  NestedBackward();
  ~NestedBackward();
  NestedBackward(const NestedBackward&) = delete;
  NestedBackward& operator=(const NestedBackward&) = delete;
};

}  // namespace zeal::zero
