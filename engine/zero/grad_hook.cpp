#include "engine/zero/grad_hook.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include "engine/error.h"

#include <mutex>
#include <vector>

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
  int task = -1;  // the graph task that queued the callback (or will: a deferred request)
};

namespace {

// The pass that owns every backward pass while a NestedBackward lives (-1: none), how many live,
// and the requests made inside nested passes, queued on that pass when the last one closes. Process
// wide: a nested pass's nodes may run on other devices' threads (a checkpointed function that spans
// GPUs) or on autograd's reentrant pool; one training backward runs at a time in a process.
std::mutex g_mutex;
int g_outer_task = -1;
int g_depth = 0;
std::vector<std::weak_ptr<EndOfBackward::State>> g_deferred;

void queue_end(const std::weak_ptr<EndOfBackward::State>& weak) {
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    auto st = weak.lock();
    if (!st || !st->pending) return;
    st->pending = false;
    st->end();
  });
}

}  // namespace

EndOfBackward::EndOfBackward(std::function<void()> end, std::function<void()> abandoned)
    : state_(std::make_shared<State>()) {
  state_->end = std::move(end);
  state_->abandoned = std::move(abandoned);
}

EndOfBackward::~EndOfBackward() = default;

void EndOfBackward::request() {
  State& s = *state_;
  const int current = torch::autograd::get_current_graph_task_id();
  ZEAL_CHECK(current >= 0) << "EndOfBackward::request outside a backward pass";
  std::unique_lock<std::mutex> lock(g_mutex);
  const bool nested = g_outer_task >= 0;
  const int task = nested ? g_outer_task : current;
  if (!nested) lock.unlock();
  if (s.pending && s.task == task) return;
  if (s.pending) {
    // An earlier pass requested the callback and never ran it: it ended with an error.
    s.pending = false;
    s.abandoned();
  }
  s.pending = true;
  s.task = task;
  if (nested) {
    g_deferred.push_back(state_);  // queued on the outer pass once the nested ones are over
  } else {
    queue_end(state_);
  }
}

NestedBackward::NestedBackward() {
  const int current = torch::autograd::get_current_graph_task_id();
  ZEAL_CHECK(current >= 0) << "NestedBackward outside a backward pass";
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_depth++ == 0) g_outer_task = current;
}

NestedBackward::~NestedBackward() {
  std::vector<std::weak_ptr<EndOfBackward::State>> deferred;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (--g_depth > 0) return;  // a scope still open queues them
    g_outer_task = -1;
    deferred = std::move(g_deferred);
    g_deferred.clear();
  }
  // Back in the outer pass (this thread's current graph task again): its end runs them.
  for (const auto& weak : deferred) {
    if (auto st = weak.lock(); st && st->pending) queue_end(weak);
  }
}

void EndOfBackward::check() {
  State& s = *state_;
  if (!s.pending || torch::autograd::get_current_graph_task_id() >= 0) return;
  s.pending = false;
  s.abandoned();
}

bool EndOfBackward::pending() const { return state_->pending; }

}  // namespace zeal::zero
