#include "engine/zero/grad_hook.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include "engine/error.h"

namespace zeal::zero {
namespace {

class GradReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  explicit GradReadyHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

}  // namespace

std::shared_ptr<void> on_grad_ready(const at::Tensor& param, const std::string& name, std::function<void()> fn) {
  auto acc = torch::autograd::impl::grad_accumulator(param);
  ZEAL_CHECK(acc) << "no gradient accumulator for " << name;
  acc->add_post_hook(std::make_unique<GradReadyHook>(std::move(fn)));
  return acc;
}

struct EndOfBackward::State {
  std::function<void()> end, abandoned;
  bool pending = false;
  int task = -1;  // the graph task that queued the callback
};

EndOfBackward::EndOfBackward(std::function<void()> end, std::function<void()> abandoned)
    : state_(std::make_shared<State>()) {
  state_->end = std::move(end);
  state_->abandoned = std::move(abandoned);
}

EndOfBackward::~EndOfBackward() = default;

void EndOfBackward::request() {
  State& s = *state_;
  const int task = torch::autograd::get_current_graph_task_id();
  ZEAL_CHECK(task >= 0) << "EndOfBackward::request outside a backward pass";
  if (s.pending && s.task == task) return;
  if (s.pending) {
    // An earlier pass requested the callback and never ran it: it ended with an error.
    s.pending = false;
    s.abandoned();
  }
  s.pending = true;
  s.task = task;
  std::weak_ptr<State> weak = state_;
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    auto st = weak.lock();
    if (!st || !st->pending) return;
    st->pending = false;
    st->end();
  });
}

void EndOfBackward::check() {
  State& s = *state_;
  if (!s.pending || torch::autograd::get_current_graph_task_id() >= 0) return;
  s.pending = false;
  s.abandoned();
}

bool EndOfBackward::pending() const { return state_->pending; }

}  // namespace zeal::zero
