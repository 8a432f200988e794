// The checkpoint's autograd function: the forward runs fn without autograd and keeps its inputs, the
// generator states and the autocast state; the backward restores them, runs fn again with autograd
// and backpropagates through it (a nested backward, as torch.utils.checkpoint's reentrant variant).
#include "engine/activation_checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/GradMode.h>
#include <c10/util/StringUtil.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <fmt/format.h>

#include "engine/error.h"
#include "engine/zero/grad_hook.h"

#include <algorithm>
#include <mutex>
#include <set>

namespace zeal {
namespace detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A generator's state, taken and put back under its lock.
struct GeneratorState {
  mutable at::Generator gen;  // a handle: restoring changes the generator, not the handle
  at::Tensor state;
  static GeneratorState of(at::Generator g) {
    std::lock_guard<std::mutex> lock(g.mutex());
    return {g, g.get_state()};
  }
  void restore() const {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }
};

// The autocast settings of the CPU and CUDA, as one thread sees them.
struct AutocastState {
  bool cpu = false, cuda = false, cache = true;
  at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;
  static AutocastState now() {
    AutocastState s;
    s.cpu = at::autocast::is_autocast_enabled(at::kCPU);
    s.cuda = at::autocast::is_autocast_enabled(at::kCUDA);
    s.cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
    s.cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
    s.cache = at::autocast::is_autocast_cache_enabled();
    return s;
  }
  bool any() const { return cpu || cuda; }
  void apply() const {
    at::autocast::set_autocast_enabled(at::kCPU, cpu);
    at::autocast::set_autocast_enabled(at::kCUDA, cuda);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
    at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
    at::autocast::set_autocast_cache_enabled(cache);
  }
};

// What the forward leaves for the backward (a capsule in the context).
struct Saved : torch::CustomClassHolder {
  FlatFn fn;
  CheckpointOptions options;
  size_t real = 0;        // the inputs fn takes
  bool anchored = false;  // one more input after them: the anchor (checkpoint_flat)
  std::vector<at::Tensor> inputs;  // detached; in pinned host memory when offloaded
  std::vector<at::Device> devices;  // each input's device
  std::vector<bool> requires_grad;
  std::vector<int64_t> versions;  // each input's version when the forward ran (-1: offloaded copy)
  std::vector<GeneratorState> generators;  // the CPU's, the current GPU's, each GPU's an input lives on
  AutocastState autocast;
  size_t outputs = 0;     // how many tensors the forward returned
  bool released = false;  // a backward without retain_graph ran: the inputs are gone
};

// The generators fn may draw from: the CPU's, the current GPU's where CUDA is in use, and those of
// the GPUs the inputs live on.
std::vector<GeneratorState> generators_for(at::TensorList inputs) {
  std::vector<GeneratorState> out{GeneratorState::of(at::detail::getDefaultCPUGenerator())};
  std::set<c10::DeviceIndex> gpus;
  const auto& cuda = at::detail::getCUDAHooks();
  if (cuda.hasCUDA()) {
    const c10::DeviceIndex current = cuda.current_device();
    if (current >= 0 && cuda.hasPrimaryContext(current)) gpus.insert(current);
  }
  for (const auto& t : inputs)
    if (t.is_cuda()) gpus.insert(t.device().index());
  for (c10::DeviceIndex g : gpus) {
    out.push_back(GeneratorState::of(at::globalContext().defaultGenerator(at::Device(at::kCUDA, g))));
  }
  return out;
}

// The forward's random state and autocast for the recomputation; what the backward thread had is put
// back after, whatever happens.
class Replay {
 public:
  explicit Replay(const Saved& saved) {
    for (const auto& g : saved.generators) current_.push_back(GeneratorState::of(g.gen));
    autocast_ = AutocastState::now();
    try {
      for (const auto& g : saved.generators) g.restore();
      saved.autocast.apply();
      if (saved.autocast.any()) {
        at::autocast::increment_nesting();
        nested_ = true;
      }
    } catch (...) {
      undo();
      throw;
    }
  }
  ~Replay() { undo(); }
  Replay(const Replay&) = delete;
  Replay& operator=(const Replay&) = delete;

 private:
  void undo() {
    // The autocast cache holds casts of this recomputation's weights: not for the next forward.
    if (nested_ && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    nested_ = false;
    for (const auto& g : current_) g.restore();
    autocast_.apply();
  }

  std::vector<GeneratorState> current_;
  AutocastState autocast_;
  bool nested_ = false;
};

void synchronize_devices(at::TensorList tensors) {
  std::set<c10::DeviceIndex> done;
  for (const auto& t : tensors) {
    if (t.is_cuda() && done.insert(t.device().index()).second) {
      c10::impl::VirtualGuardImpl(at::kCUDA).synchronizeDevice(t.device().index());
    }
  }
}

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs, c10::intrusive_ptr<Saved> saved) {
    // Autograd is off here (custom functions run their forward without it): fn keeps nothing.
    const auto real = inputs.slice(0, saved->real);
    saved->generators = generators_for(real);
    saved->autocast = AutocastState::now();
    if (saved->options.synchronize) synchronize_devices(real);
    // The inputs as fn gets them, before it runs (an in-place op inside fn must not change them).
    for (const auto& t : real) {
      saved->devices.push_back(t.device());
      saved->requires_grad.push_back(t.requires_grad());
      at::Tensor kept = t.detach();  // shares the version counter: a later in-place change is seen
      int64_t version = static_cast<int64_t>(kept._version());
      if (saved->options.offload_inputs && kept.is_cuda()) {
        kept = kept.to(at::TensorOptions().device(at::kCPU).pinned_memory(true), /*non_blocking=*/true);
        version = -1;
      }
      saved->inputs.push_back(std::move(kept));
      saved->versions.push_back(version);
    }
    std::vector<at::Tensor> outputs = saved->fn(real.vec());
    saved->outputs = outputs.size();
    if (saved->options.synchronize) synchronize_devices(real);
    std::vector<at::Tensor> non_diff;
    for (const auto& o : outputs) {
      if (o.defined() && !at::isFloatingType(o.scalar_type()) && !at::isComplexType(o.scalar_type())) {
        non_diff.push_back(o);
      }
    }
    if (!non_diff.empty()) ctx->mark_non_differentiable(non_diff);
    ctx->set_materialize_grads(false);
    ctx->saved_data["checkpoint"] = c10::IValue::make_capsule(std::move(saved));
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = c10::static_intrusive_pointer_cast<Saved>(ctx->saved_data["checkpoint"].toCapsule());
    if (!torch::autograd::Engine::get_default_engine().is_checkpoint_valid()) {
      throw Error(
          "zeal::checkpoint: torch::autograd::grad and backward with `inputs` cannot pass through an activation "
          "checkpoint (its recomputation accumulates every parameter's .grad); use loss.backward() / "
          "engine.backward(), or run that function without checkpointing");
    }
    if (c10::GradMode::is_enabled()) {
      throw Error(
          "zeal::checkpoint: create_graph (a double backward) cannot pass through an activation checkpoint: "
          "run that function without checkpointing");
    }
    if (saved->released) {
      throw Error(
          "zeal::checkpoint: a second backward through an activation checkpoint whose inputs the first one "
          "freed; pass retain_graph to the first backward");
    }
    for (size_t i = 0; i < saved->inputs.size(); ++i) {
      if (saved->versions[i] >= 0 && static_cast<int64_t>(saved->inputs[i]._version()) != saved->versions[i]) {
        throw Error(fmt::format(
            "zeal::checkpoint: input {} of an activation checkpoint ({}, {}) was modified by an in-place operation "
            "after the forward used it (version {}, now {}); its recomputation would not be the forward",
            i, c10::str(saved->inputs[i].sizes()), c10::toString(saved->inputs[i].scalar_type()), saved->versions[i],
            saved->inputs[i]._version()));
      }
    }
    // The inputs again, as leaves that ask for their gradient where the originals did.
    std::vector<at::Tensor> leaves;
    for (size_t i = 0; i < saved->inputs.size(); ++i) {
      at::Tensor x = saved->inputs[i];
      if (x.device() != saved->devices[i]) x = x.to(saved->devices[i], /*non_blocking=*/true);
      x = x.detach();
      x.set_requires_grad(saved->requires_grad[i]);
      leaves.push_back(x);
    }
    std::vector<at::Tensor> outputs;
    {
      Replay replay(*saved);  // the same random draws and casts as the forward
      at::AutoGradMode grad(true);
      if (saved->options.synchronize) synchronize_devices(leaves);
      outputs = saved->fn(leaves);
    }
    if (outputs.size() != saved->outputs) {
      throw Error(fmt::format("zeal::checkpoint: the recomputation returned {} tensors where the forward returned {}: "
                              "a checkpointed function must return the same tensors each time it runs",
                              outputs.size(), saved->outputs));
    }
    // Backpropagate through the outputs that had a gradient; the parameters' gradients accumulate
    // into their .grad as in the plain backward.
    std::vector<at::Tensor> outs, out_grads;
    for (size_t i = 0; i < outputs.size() && i < grads.size(); ++i) {
      if (!grads[i].defined()) continue;
      if (!outputs[i].defined() || outputs[i].sizes() != grads[i].sizes()) {
        throw Error(fmt::format("zeal::checkpoint: output {} of the recomputation is {} where the forward's was {}: a "
                                "checkpointed function must return the same tensors each time it runs",
                                i, outputs[i].defined() ? c10::str(outputs[i].sizes()) : std::string("undefined"),
                                c10::str(grads[i].sizes())));
      }
      if (outputs[i].requires_grad()) {
        outs.push_back(outputs[i]);
        out_grads.push_back(grads[i]);
      }
    }
    if (!outs.empty()) {
      // Part of the backward running now: what waits for its end (ZeRO's reductions) waits for that.
      zero::NestedBackward nested;
      torch::autograd::backward(outs, out_grads);
    }
    if (saved->options.synchronize) synchronize_devices(leaves);
    variable_list input_grads;
    for (const auto& x : leaves) input_grads.push_back(x.requires_grad() ? x.grad() : at::Tensor());
    if (saved->anchored) input_grads.emplace_back();  // the anchor
    input_grads.emplace_back();                       // the capsule
    if (!torch::autograd::get_current_graph_task_keep_graph()) {
      // As autograd frees what a node saved once its backward ran: the inputs, fn and what it holds.
      saved->inputs.clear();
      saved->fn = nullptr;
      saved->generators.clear();
      saved->released = true;
    }
    return input_grads;
  }
};

}  // namespace

bool grad_mode_enabled() { return c10::GradMode::is_enabled(); }

std::vector<at::Tensor> checkpoint_flat(FlatFn fn, const std::vector<at::Tensor>& inputs,
                                        const CheckpointOptions& options, bool anchor) {
  if (!c10::GradMode::is_enabled()) return fn(inputs);
  auto saved = c10::make_intrusive<Saved>();
  saved->fn = std::move(fn);
  saved->options = options;
  saved->real = inputs.size();
  // Autograd reaches a function's backward only through an input that asks for a gradient. When
  // none does (a frozen embedding before LoRA blocks) the parameters inside fn still need theirs:
  // an anchor input that asks for one makes the outputs part of the graph.
  std::vector<at::Tensor> args = inputs;
  if (std::none_of(inputs.begin(), inputs.end(), [](const at::Tensor& t) { return t.requires_grad(); })) {
    if (!anchor) return fn(inputs);  // nothing inside needs a gradient: no recomputation either
    args.push_back(at::zeros({}, at::kFloat).requires_grad_(true));
    saved->anchored = true;
  }
  return CheckpointFunction::apply(at::TensorList(args), std::move(saved));
}

}  // namespace detail
}  // namespace zeal
