// The checkpoint's autograd function: the forward runs fn without autograd and keeps its inputs, the
// generator states and the autocast state; the backward restores them, runs fn again with autograd
// and backpropagates through it (a nested backward, as torch.utils.checkpoint's reentrant variant).
#include "engine/activation_checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

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
  std::vector<GeneratorState> generators;  // the CPU's, then each GPU's the inputs live on
  AutocastState autocast;
};

void synchronize_devices(const std::vector<at::Device>& devices) {
  std::set<c10::DeviceIndex> done;
  for (const auto& d : devices) {
    if (d.is_cuda() && done.insert(d.index()).second) {
      c10::impl::VirtualGuardImpl(d.type()).synchronizeDevice(d.index());
    }
  }
}

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs, c10::intrusive_ptr<Saved> saved) {
    // Autograd is off here (custom functions run their forward without it): fn keeps nothing.
    std::set<c10::DeviceIndex> gpus;
    const auto real = inputs.slice(0, saved->real);
    saved->generators.push_back(GeneratorState::of(at::detail::getDefaultCPUGenerator()));
    for (const auto& t : real) {
      saved->devices.push_back(t.device());
      saved->requires_grad.push_back(t.requires_grad());
      if (t.is_cuda() && gpus.insert(t.device().index()).second) {
        saved->generators.push_back(GeneratorState::of(at::globalContext().defaultGenerator(t.device())));
      }
    }
    saved->autocast = AutocastState::now();
    if (saved->options.synchronize) synchronize_devices(saved->devices);
    std::vector<at::Tensor> outputs = saved->fn(real.vec());
    for (const auto& t : real) {
      at::Tensor kept = t.detach();
      if (saved->options.offload_inputs && kept.is_cuda()) {
        kept = kept.to(at::TensorOptions().device(at::kCPU).pinned_memory(true), /*non_blocking=*/true);
      }
      saved->inputs.push_back(kept);
    }
    if (saved->options.synchronize) synchronize_devices(saved->devices);
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
      // The forward as it ran: the same random draws and casts; what the backward thread had is put
      // back after.
      std::vector<GeneratorState> current;
      for (const auto& g : saved->generators) current.push_back(GeneratorState::of(g.gen));
      const AutocastState autocast_now = AutocastState::now();
      for (const auto& g : saved->generators) g.restore();
      saved->autocast.apply();
      struct Restore {
        std::vector<GeneratorState>& gens;
        const AutocastState& autocast;
        ~Restore() {
          for (const auto& g : gens) g.restore();
          autocast.apply();
        }
      } restore{current, autocast_now};
      at::AutoGradMode grad(true);
      if (saved->options.synchronize) synchronize_devices(saved->devices);
      outputs = saved->fn(leaves);
    }
    // Backpropagate through the outputs that had a gradient; the parameters' gradients accumulate
    // into their .grad as in the plain backward.
    std::vector<at::Tensor> outs, out_grads;
    for (size_t i = 0; i < outputs.size() && i < grads.size(); ++i) {
      if (grads[i].defined() && outputs[i].defined() && outputs[i].requires_grad()) {
        outs.push_back(outputs[i]);
        out_grads.push_back(grads[i]);
      }
    }
    if (!outs.empty()) {
      // Part of the backward running now: what waits for its end (ZeRO's reductions) waits for that.
      zero::NestedBackward nested;
      torch::autograd::backward(outs, out_grads);
    }
    if (saved->options.synchronize) synchronize_devices(saved->devices);
    variable_list input_grads;
    for (const auto& x : leaves) input_grads.push_back(x.requires_grad() ? x.grad() : at::Tensor());
    if (saved->anchored) input_grads.emplace_back();  // the anchor
    input_grads.emplace_back();                       // the capsule
    return input_grads;
  }
};

}  // namespace

bool grad_mode_enabled() { return c10::GradMode::is_enabled(); }

std::vector<at::Tensor> checkpoint_flat(FlatFn fn, const std::vector<at::Tensor>& inputs,
                                        const CheckpointOptions& options) {
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
    args.push_back(at::zeros({}, at::kFloat).requires_grad_(true));
    saved->anchored = true;
  }
  return CheckpointFunction::apply(at::TensorList(args), std::move(saved));
}

}  // namespace detail
}  // namespace zeal
