// The stage-3 side of zeal::Sharded: the lifecycle calls and the two identity functions that put
// a unit's pre-backward and post-backward points into the autograd graph.
#include "engine/zero/sharded.h"

#include <fmt/format.h>
#include <torch/csrc/autograd/custom_function.h>

#include "engine/error.h"
#include "engine/zero/stage3.h"
#include "engine/zero/unit.h"

namespace zeal {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What a node of the graph holds of its unit: the unit, reached only while the engine lives (the
// graph may outlive it).
struct UnitToken : torch::CustomClassHolder {
  UnitToken(std::weak_ptr<zero::Stage3Link> l, zero::Unit* u) : link(std::move(l)), unit(u) {}
  std::weak_ptr<zero::Stage3Link> link;
  zero::Unit* unit;
  zero::Unit* live() const {
    auto l = link.lock();
    return l && l->stage ? unit : nullptr;
  }
};

zero::Unit* unit_of(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<UnitToken>(ctx->saved_data["unit"].toCapsule())->live();
}

// Identity on the block's outputs: its backward runs once their gradients are ready, just before the
// block's own backward.
struct PreBackward : public torch::autograd::Function<PreBackward> {
  static variable_list forward(AutogradContext* ctx, at::TensorList xs, c10::intrusive_ptr<UnitToken> token) {
    ctx->saved_data["unit"] = c10::IValue::make_capsule(std::move(token));
    return xs.vec();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (zero::Unit* u = unit_of(ctx)) u->pre_backward();
    grads.emplace_back();  // the token
    return grads;
  }
};

// Identity on the block's inputs: autograd runs its backward only once the gradients of all of them
// are complete, that is once every op of the block that reads them has run its backward — the
// moment no op of this block needs its parameters any more (FSDP2's RegisterPostBackwardFunction).
struct PostBackward : public torch::autograd::Function<PostBackward> {
  static variable_list forward(AutogradContext* ctx, at::TensorList xs, c10::intrusive_ptr<UnitToken> token) {
    ctx->saved_data["unit"] = c10::IValue::make_capsule(std::move(token));
    return xs.vec();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (zero::Unit* u = unit_of(ctx)) u->post_backward();
    grads.emplace_back();
    return grads;
  }
};

}  // namespace

bool ShardedBase::pre_forward() {
  if (!unit_) {
    // Its parameters' storage went with the partitioning: running the block would read freed memory.
    if (partitioned_) {
      throw Error(fmt::format("a zeal::Sharded unit ({}) of a model engine.init built partitioned (stage 3, "
                              "zero3_init_flag) ran before engine.prepare: it holds only this rank's slices of its "
                              "parameters until the model is prepared with its optimizer",
                              block()->name()));
    }
    return false;
  }
  auto l = link_.lock();
  if (!l || !l->stage) return false;
  unit_->pre_forward();
  return true;
}

void ShardedBase::post_forward() {
  auto l = link_.lock();
  if (unit_ && l && l->stage) unit_->post_forward();
}

std::vector<at::Tensor> ShardedBase::mark_inputs(const std::vector<at::Tensor>& inputs) {
  return PostBackward::apply(at::TensorList(inputs), c10::make_intrusive<UnitToken>(link_, unit_));
}

std::vector<at::Tensor> ShardedBase::mark_outputs(const std::vector<at::Tensor>& outputs) {
  return PreBackward::apply(at::TensorList(outputs), c10::make_intrusive<UnitToken>(link_, unit_));
}

}  // namespace zeal
