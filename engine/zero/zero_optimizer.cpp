#include "engine/zero/zero_optimizer.h"

#include <optional>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "engine/error.h"

namespace zeal::zero {

// --- Sharding: the step, for every stage ----------------------------------------------------

void Sharding::reset_norm() {
  have_norm_ = false;
  clipped_ = false;
  overflow_ = false;
}


double Sharding::grad_norm(double inv_scale, double norm_type) {
  if (norm_type != 2.0 && !std::isinf(norm_type)) {
    throw Error(fmt::format("gradient norms of type {} are not supported (2 or inf)", norm_type));
  }
  c10::NoGradGuard no_grad;
  const bool sharded = sharded_grads();
  if (!have_norm_) {
    // Sums of squares in double, one all-reduce over ranks: an inf or nan anywhere makes it
    // non-finite on every rank.
    double local = 0;
    const auto steps = shard_steps();
    if (!device_.is_cpu()) {
      // On the gradients' device, each partition's sum without a host wait, reduced there: the
      // step's one synchronisation is reading the global sum.
      at::Tensor t = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device_));
      for (ShardStep* s : steps) t.add_(s->sumsq_on_device(inv_scale, device_));
      if (sharded) comm_.all_reduce(t, ReduceOp::kSum).wait();
      local = t.item<double>();
    } else {
      for (ShardStep* s : steps) local += s->stats(inv_scale).sumsq;
      if (sharded) {
        at::Tensor t = at::full({1}, local, at::TensorOptions().dtype(at::kDouble));
        comm_.all_reduce(t, ReduceOp::kSum).wait();
        local = t.item<double>();
      }
    }
    sumsq_ = local;
    have_norm_ = true;
    if (!std::isfinite(local)) overflow_ = true;
  }
  if (!std::isinf(norm_type)) return std::sqrt(sumsq_);
  if (!std::isfinite(sumsq_)) return std::numeric_limits<double>::infinity();
  double m = 0;
  const auto steps = shard_steps();
  if (!device_.is_cpu()) {
    at::Tensor t = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device_));
    for (ShardStep* s : steps) t = at::maximum(t, s->amax_on_device(inv_scale, device_));
    if (sharded) comm_.all_reduce(t, ReduceOp::kMax).wait();
    return t.item<double>();
  }
  for (ShardStep* s : steps) m = std::max(m, static_cast<double>(s->stats(inv_scale).amax));
  if (sharded) {
    at::Tensor t = at::full({1}, m, at::TensorOptions().dtype(at::kDouble));
    comm_.all_reduce(t, ReduceOp::kMax).wait();
    m = t.item<double>();
  }
  return m;
}

double Sharding::clip_grad_norm(double max_norm, double norm_type, double inv_scale) {
  const double norm = grad_norm(inv_scale, norm_type);
  clipped_ = true;
  norm_before_clip_ = norm;
  if (!std::isfinite(norm)) return norm;  // the step will be skipped
  // torch.nn.utils.clip_grad_norm_'s coefficient.
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (ShardStep* s : shard_steps()) s->scale(coef);
    sumsq_ *= coef * coef;
  }
  return norm;
}

void Sharding::clip_grad_value(double value, double inv_scale) {
  if (!(value > 0)) throw Error(fmt::format("clip_grad_value_: the clip value must be positive, got {}", value));
  grad_norm(inv_scale);  // an inf would survive clamping as ±value: look for it first
  c10::NoGradGuard no_grad;
  for (ShardStep* s : shard_steps()) s->fp32_grads(inv_scale).clamp_(-value, value);
  have_norm_ = false;
}

Sharding::StepResult Sharding::step(double inv_scale, double clip, const std::vector<double>& lrs) {
  ZEAL_CHECK(lrs.size() == num_groups()) << lrs.size() << " learning rates for " << num_groups() << " groups";
  StepResult r;
  notice_abandoned();
  // Every rank must be at its step with the same collectives behind it before any weight changes.
  comm_.check_agreement("optimizer step");
  if (!abandoned_.empty()) {
    r.abandoned = std::exchange(abandoned_, {});
    zero_grad();
    return r;
  }
  r.grad_norm = clipped_ ? norm_before_clip_ : grad_norm(inv_scale);
  if (overflow_) {
    zero_grad();
    return r;
  }
  if (clip > 0 && !clipped_) clip_grad_norm(clip, 2.0, inv_scale);
  apply(inv_scale, lrs);
  r.stepped = true;
  zero_grad();
  return r;
}

void Sharding::zero_grad() {
  clear_grads();
  reset_norm();
}

// --- ZeroOptimizer ------------------------------------------------------------------------------

ZeroOptimizer::ZeroOptimizer(Communicator& comm, std::vector<Group> groups, const GroupOptions& options)
    : Sharding(comm), options_(options) {
  for (auto& g : groups)
    if (!g.params.empty()) device_ = g.params[0].device();
  for (auto& g : groups) {
    groups_.push_back(std::make_unique<FlatGroup>(comm_, std::move(g.params), std::move(g.names),
                                                  std::move(g.optimizer), options_));
  }
}

void ZeroOptimizer::begin_micro_step(bool sync) {
  notice_abandoned();
  for (auto& g : groups_) g->begin_micro_step(sync);
  reset_norm();
}

void ZeroOptimizer::notice_abandoned() {
  for (auto& g : groups_) {
    g->check_abandoned();
    if (g->take_abandoned()) abandon_step("a backward pass ended with an error, so this step's gradients are incomplete");
  }
}

void ZeroOptimizer::end_backward() {
  for (auto& g : groups_) g->end_backward_if_no_pass();
}

int64_t ZeroOptimizer::backward_passes() const {
  int64_t n = 0;
  for (auto& g : groups_) n += g->backward_passes();
  return n;
}

bool ZeroOptimizer::backward_pending() const {
  for (auto& g : groups_)
    if (g->backward_pending()) return true;
  return false;
}

at::Tensor ZeroOptimizer::full_grad(const at::Tensor& param, double inv_scale) {
  for (auto& g : groups_) {
    const int i = g->index_of(param);
    if (i >= 0) return g->full_grad(i, inv_scale);
  }
  throw Error("engine.full_grad: the tensor is not a trainable parameter of the prepared model");
}

std::vector<ShardStep*> ZeroOptimizer::shard_steps() {
  std::vector<ShardStep*> out;
  for (auto& g : groups_) out.push_back(&g->shard_step());
  return out;
}

bool ZeroOptimizer::sharded_grads() const { return options_.stage > 0 && comm_.world_size() > 1; }

void ZeroOptimizer::apply(double inv_scale, const std::vector<double>& lrs) {
  for (size_t g = 0; g < groups_.size(); ++g) groups_[g]->apply_step(lrs[g], inv_scale);
}

void ZeroOptimizer::clear_grads() {
  for (auto& g : groups_) g->zero_grad();
}

GroupBytes ZeroOptimizer::bytes() const {
  GroupBytes out;
  for (auto& g : groups_) {
    const GroupBytes b = g->bytes();
    out.params += b.params;
    out.grads += b.grads;
    out.master += b.master;
    out.optimizer += b.optimizer;
    out.workspace += b.workspace;
  }
  return out;
}

int64_t ZeroOptimizer::num_elements() const {
  int64_t n = 0;
  for (auto& g : groups_) n += g->num_elements();
  return n;
}

}  // namespace zeal::zero
