#include "engine/zero/stage3.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <iostream>
#include <map>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "engine/error.h"
#include "engine/zero/grad_hook.h"
#include "engine/zero/sharded.h"
#include "kernels/cpu/adam.h"

namespace zeal {
namespace zero {
namespace {

// The storage of a unit's full buffer exists only while the unit is gathered (free_storage on
// release, alloc_storage on gather); the parameter views into it keep their shapes throughout.
// Gathered units and gradient staging buffers come and go every step. On the CPU, buffers of a
// MiB and more are mapped directly: malloc would keep freed blocks under its (dynamic, up to 32 MiB)
// mmap threshold in its heap, so releasing a unit would not lower the process's memory.
constexpr size_t kMapBytes = size_t{1} << 20;

struct Mapping {
  void* p;
  size_t n;
  static void unmap(void* ctx) {
    auto* m = static_cast<Mapping*>(ctx);
    munmap(m->p, m->n);
    delete m;
  }
};

c10::DataPtr map_bytes(size_t bytes, at::Device device) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw Error(fmt::format("stage 3: cannot map {} bytes for a gathered unit", bytes));
  return {p, new Mapping{p, bytes}, &Mapping::unmap, device};
}

void alloc_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (s->nbytes() == bytes) return;
  s->set_data_ptr_noswap(t.device().is_cpu() && bytes >= kMapBytes ? map_bytes(bytes, t.device())
                                                                   : s->allocator()->allocate(bytes));
  s->set_nbytes(bytes);
}

// Zeros, mapped on the CPU from a MiB up (fresh mappings are zero already).
at::Tensor staging_zeros(int64_t n, const at::TensorOptions& o) {
  const size_t bytes = static_cast<size_t>(n) * o.dtype().itemsize();
  if (!o.device().is_cpu() || bytes < kMapBytes) return at::zeros({n}, o);
  c10::Storage st(c10::Storage::use_byte_size_t(), bytes, map_bytes(bytes, o.device()), nullptr, false);
  return at::empty({0}, o).set_(st, 0, {n}, {1});
}

// Identity whose backward runs just before the unit's own backward: the point to gather it again.
struct PreBackward : public torch::autograd::Function<PreBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t unit) {
    ctx->saved_data["unit"] = unit;
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    reinterpret_cast<Unit*>(ctx->saved_data["unit"].toInt())->on_pre_backward();
    return {grads[0], at::Tensor()};
  }
};

}  // namespace

// --- Unit ---------------------------------------------------------------------------------------

Unit::Unit(Stage3& owner, int index, std::string name) : owner_(owner), index_(index), name_(std::move(name)) {}

int64_t Unit::Part::bytes() const { return full.defined() ? full.numel() * full.element_size() : 0; }

int64_t Unit::gathered_bytes() const { return train_.bytes() + frozen_.bytes(); }

// Lays the part's parameters end to end, takes rank 0's values (unless every rank has them
// already), keeps this rank's shard (and, for trainable parameters, its fp32 master) and points the
// parameters into the full buffer.
void Unit::build(Part& part, bool trainable, at::Tensor* master_out, bool same_everywhere) {
  if (part.params.empty()) return;
  for (const auto& p : part.params) numel_ += p.numel();
  Communicator& comm = owner_.comm_;
  const auto& o = owner_.opts_;
  std::vector<int64_t> numels;
  for (auto& p : part.params) numels.push_back(p.numel());
  part.layout = std::make_unique<FlatLayout>(numels, comm.world_size(), o.align);
  const FlatLayout& l = *part.layout;
  const auto device = part.params[0].device();
  at::Tensor init = at::zeros({l.padded_total()}, at::TensorOptions().dtype(at::kFloat).device(device));
  for (size_t i = 0; i < part.params.size(); ++i) {
    init.narrow(0, l.offset(static_cast<int>(i)), numels[i]).copy_(part.params[i].detach().reshape({-1}));
  }
  if (comm.world_size() > 1 && !same_everywhere) comm.broadcast(init, 0).wait();
  at::Tensor mine = init.narrow(0, l.shard_begin(comm.rank()), l.shard_size());
  if (trainable && master_out) *master_out = mine.clone();
  const at::ScalarType dtype = trainable || at::isFloatingType(part.params[0].scalar_type())
                                   ? o.compute_dtype
                                   : part.params[0].scalar_type();
  part.shard = mine.to(dtype).clone();
  part.full = init.to(dtype);  // init itself when already in that dtype
  for (size_t i = 0; i < part.params.size(); ++i) {
    at::Tensor& p = part.params[i];
    p.set_data(part.full.narrow(0, l.offset(static_cast<int>(i)), numels[i]).view(p.sizes()));
    p.mutable_grad() = at::Tensor();
  }
}

void Unit::gather(bool wait) {
  if (!gathered_) {
    Communicator& comm = owner_.comm_;
    for (Part* part : {&train_, &frozen_}) {
      if (!part->layout) continue;
      alloc_storage(part->full);
      if (comm.world_size() > 1) {
        pending_.push_back(comm.all_gather(part->shard, part->full));
      } else {
        part->full.copy_(part->shard);
      }
    }
    gathered_ = true;
    ++owner_.gathers_;
    owner_.gathered_now_ += gathered_bytes();
    owner_.gathered_peak_ = std::max(owner_.gathered_peak_, owner_.gathered_now_);
  }
  if (wait) wait_gather();
}

void Unit::wait_gather() {
  for (auto& w : pending_) w.wait();
  pending_.clear();
}

void Unit::release() {
  if (persistent_ || !gathered_) return;
  wait_gather();
  for (Part* part : {&train_, &frozen_}) {
    if (part->layout) free_storage(part->full);
  }
  gathered_ = false;
  owner_.gathered_now_ -= train_.bytes() + frozen_.bytes();
}

void Unit::fetch() {
  const bool trace = at::GradMode::is_enabled();  // eval forwards neither record nor prefetch
  c10::NoGradGuard no_grad;
  gather(false);  // first, so the prefetches issued next follow it in every rank's order
  if (trace) owner_.note_fetch(*this);
  wait_gather();
}

void Unit::after_forward() {
  if (!in_backward_ && !owner_.reused_soon(*this)) release();
}

at::Tensor Unit::mark_for_backward(const at::Tensor& out) {
  return PreBackward::apply(out, reinterpret_cast<int64_t>(this));
}

void Unit::on_pre_backward() {
  c10::NoGradGuard no_grad;
  owner_.release_idle_frozen(this);
  in_backward_ = true;
  gather(false);
  owner_.note_fetch(*this);
  wait_gather();
}

void Unit::on_grad_ready(int i) {
  c10::NoGradGuard no_grad;
  at::Tensor& p = train_.params[i];
  if (reduced_) {
    throw Error(fmt::format("the gradient of '{}' arrived after its unit '{}' was reduced: call engine.backward once "
                            "per micro-step (add the losses first)",
                            train_.names[i], name_));
  }
  if (!grad_staging_.defined()) grad_staging_ = staging_zeros(train_.layout->padded_total(), grad_shard_.options());
  if (p.grad().defined()) {
    grad_staging_.narrow(0, train_.layout->offset(i), p.numel()).add_(p.grad().reshape({-1}));
    p.mutable_grad() = at::Tensor();
  }
  if (++arrived_ == static_cast<int>(train_.params.size())) owner_.launch_ready_reductions();
}

void Unit::reduce() {
  c10::NoGradGuard no_grad;
  reduced_ = true;
  if (!train_.layout) return;
  if (!grad_staging_.defined()) grad_staging_ = staging_zeros(train_.layout->padded_total(), grad_shard_.options());
  Communicator& comm = owner_.comm_;
  const FlatLayout& l = *train_.layout;
  at::Tensor mine = grad_staging_.narrow(0, l.shard_begin(comm.rank()), l.shard_size());
  if (comm.world_size() > 1) comm.reduce_scatter(grad_staging_, mine, ReduceOp::kAvg).wait();
  grad_shard_.add_(mine);
  grad_staging_ = at::Tensor();
}

// --- ShardedBase --------------------------------------------------------------------------------

}  // namespace zero

at::Tensor ShardedBase::around(const std::function<at::Tensor()>& fn) {
  if (!unit_) return fn();
  unit_->fetch();
  at::Tensor out;
  try {
    out = fn();
  } catch (...) {
    unit_->after_forward();
    throw;
  }
  if (at::GradMode::is_enabled() && out.requires_grad()) out = unit_->mark_for_backward(out);
  unit_->after_forward();
  return out;
}

namespace zero {

// --- Stage3 -------------------------------------------------------------------------------------

Stage3::Stage3(Communicator& comm, torch::nn::Module& model, std::unique_ptr<optim::Optimizer> optimizer,
               const Stage3Options& options, std::shared_ptr<InitShards> init)
    : Sharding(comm), opts_(options) {
  c10::NoGradGuard no_grad;
  // Units: the root, then every Sharded member in the model's (pre-)order.
  units_.push_back(std::make_unique<Unit>(*this, 0, "(root)"));
  std::vector<std::shared_ptr<ShardedBase>> sharded;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (auto s = std::dynamic_pointer_cast<ShardedBase>(item.value())) {
      sharded.push_back(s);
      modules_.push_back(s.get());
      units_.push_back(std::make_unique<Unit>(*this, static_cast<int>(units_.size()), item.key()));
    }
  }
  if (sharded.empty() && comm_.rank() == 0) {
    std::cerr << "zeal: stage 3 found no zeal::Sharded member in the model: it trains as one unit that stays "
                 "gathered, which saves optimizer and gradient memory but no parameter memory\n";
  }
  // Each parameter belongs to the innermost Sharded member holding it; one held by two members
  // neither of which contains the other (tied across units) is refused.
  // A parameter the root uses directly as well (an LM head tied to the embedding) stays in the
  // root: the root runs outside every unit's forward.
  const std::unordered_set<const void*> in_root = root_parameters(model);
  std::unordered_map<const void*, int> owner;
  std::vector<std::vector<int>> inside(sharded.size());  // Sharded members nested in each
  for (size_t u = 0; u < sharded.size(); ++u) {
    for (const auto& m : sharded[u]->modules(false)) {
      for (size_t v = 0; v < sharded.size(); ++v)
        if (sharded[v].get() == m.get()) inside[u].push_back(static_cast<int>(v));
    }
  }
  for (size_t u = 0; u < sharded.size(); ++u) {
    for (const auto& item : sharded[u]->named_parameters(true)) {
      const void* key = item.value().unsafeGetTensorImpl();
      auto it = owner.find(key);
      if (it != owner.end() && !in_root.count(key)) {
        const int prev = it->second - 1;
        const bool nested = std::find(inside[prev].begin(), inside[prev].end(), static_cast<int>(u)) != inside[prev].end();
        if (!nested) {
          throw Error(fmt::format("stage 3: parameter '{}' is used by the Sharded members '{}' and '{}'; a parameter "
                                  "shared by two units (tied weights) must live outside both, in the root unit",
                                  item.key(), units_[prev + 1]->name(), units_[u + 1]->name()));
        }
      }
      owner[key] = static_cast<int>(u) + 1;
    }
  }
  std::unordered_set<const void*> placed;  // a parameter registered under two names goes in once
  for (const auto& item : model.named_parameters(true)) {
    const void* key = item.value().unsafeGetTensorImpl();
    if (!placed.insert(key).second) continue;
    auto it = owner.find(key);
    Unit& u = *units_[it == owner.end() || in_root.count(key) ? 0 : it->second];
    Unit::Part& part = item.value().requires_grad() ? u.train_ : u.frozen_;
    part.params.push_back(item.value());
    part.names.push_back(item.key());
  }
  // Shards, master weights, gradient shards; one unit whole at a time (parameters partitioned by
  // engine.init are all-gathered just before their unit is built).
  std::vector<at::Tensor> masters;
  for (auto& u : units_) {
    // A part all of whose parameters were gathered from init slices needs no broadcast.
    bool from_init[2] = {false, false};
    for (int k = 0; k < 2; ++k) {
      Unit::Part& part = k == 0 ? u->train_ : u->frozen_;
      if (!init || init->empty() || part.params.empty()) continue;
      from_init[k] = true;
      for (auto& p : part.params) from_init[k] = init->materialize(p, comm_, opts_.device) && from_init[k];
    }
    at::Tensor master;
    u->build(u->train_, true, &master, from_init[0]);
    u->build(u->frozen_, false, nullptr, from_init[1]);
    if (u->train_.layout) {
      u->master_offset_ = trainable_elems_;
      trainable_elems_ += master.numel();
      masters.push_back(master);
      u->grad_shard_ = at::zeros_like(u->train_.shard);
    }
    u->persistent_ = u->index() == 0 || u->numel() <= opts_.persistence_threshold;
    if (u->persistent_) persistent_bytes_ += u->gathered_bytes();
    u->gathered_ = true;
    gathered_now_ += u->gathered_bytes();
    gathered_peak_ = std::max(gathered_peak_, gathered_now_);
    u->release();
  }
  at::Tensor master = masters.empty() ? at::empty({0}, at::kFloat) : at::cat(masters);
  optimizer->allocate_state(master);
  std::vector<ShardStep::Piece> pieces;
  for (auto& u : units_) {
    if (u->train_.layout) pieces.push_back({u->master_offset_, u->grad_shard_, u->train_.shard});
  }
  step_ = ShardStep(std::move(master), std::move(optimizer), std::move(pieces));
  gathered_peak_ = gathered_now_;

  // Gradient arrival, per trainable parameter.
  for (auto& u : units_) {
    Unit* unit = u.get();
    for (size_t i = 0; i < unit->train_.params.size(); ++i) {
      std::weak_ptr<void> alive = alive_;
      unit->accumulators_.push_back(on_grad_ready(unit->train_.params[i], unit->train_.names[i], [alive, unit, i] {
        if (!alive.expired()) unit->on_grad_ready(static_cast<int>(i));
      }));
    }
  }
  for (size_t i = 0; i < modules_.size(); ++i) modules_[i]->attach(units_[i + 1].get());
}

Stage3::~Stage3() {
  alive_.reset();
  for (auto* m : modules_) m->attach(nullptr);
  // Leave the model usable: every unit gathered (a collective, so only on an orderly shutdown).
  if (std::uncaught_exceptions() == 0) {
    try {
      c10::NoGradGuard no_grad;
      for (auto& u : units_) u->gather(true);
    } catch (const std::exception& e) {
      std::cerr << "zeal: stage 3 could not gather the model at shutdown: " << e.what() << "\n";
    }
  } else {
    for (auto& u : units_) {
      try {
        u->wait_gather();
      } catch (...) {
      }
    }
  }
}

void Stage3::begin_micro_step(bool sync) { sync_ = sync; }

void Stage3::note_fetch(Unit& u) {
  if (!opts_.prefetch) return;
  recording_.push_back(u.index());
  if (!trace_valid_) return;
  if (trace_pos_ >= trace_.size() || trace_[trace_pos_] != u.index()) {
    // The order changed: finish every prefetch in flight (all ranks issued the same ones), fetch
    // on demand from here and record the order again.
    for (auto& v : units_) v->wait_gather();
    trace_valid_ = false;
    ++on_demand_;
    return;
  }
  ++trace_pos_;
  int64_t budget = opts_.prefetch_elems;
  const int64_t elem = at::elementSize(opts_.compute_dtype);
  // Live beyond the unit being fetched and the persistent ones: at most max_live_parameters.
  const int64_t base = persistent_bytes() + (u.persistent_ ? 0 : u.gathered_bytes());
  for (size_t k = trace_pos_; k < trace_.size() && budget > 0; ++k) {
    Unit& v = *units_[trace_[k]];
    if (v.gathered_) continue;
    if (gathered_now_ - base + v.numel() * elem > opts_.max_live_elems * elem) break;
    v.gather(false);
    ++prefetched_;
    budget -= v.numel();
  }
}

// The recorded order fetches `u` again after fewer than stage3_max_reuse_distance elements of other
// units' fetches (the last block's forward is followed by its own backward), and keeping it leaves the
// gathered units (persistent ones aside) within stage3_max_live_parameters.
bool Stage3::reused_soon(const Unit& u) const {
  if (!opts_.prefetch || !trace_valid_ || !at::GradMode::is_enabled() || u.persistent_) return false;
  const int64_t elem = at::elementSize(opts_.compute_dtype);
  if (gathered_now_ - persistent_bytes_ > opts_.max_live_elems * elem) return false;
  int64_t distance = 0;
  for (size_t k = trace_pos_; k < trace_.size(); ++k) {
    const Unit& v = *units_[trace_[k]];
    if (&v == &u) return distance < opts_.max_reuse_elems;  // 0: never kept
    if (!v.persistent_) distance += v.numel();
    if (distance >= opts_.max_reuse_elems) return false;
  }
  return false;
}

void Stage3::release_idle_frozen(Unit* except) {
  for (auto& u : units_) {
    if (u.get() != except && u->gathered_ && !u->persistent_ && !u->train_.layout && u->in_backward_) u->release();
  }
}

// A unit is reduced as soon as all its gradients are in: every rank runs the same backward, so the
// arrival order is the same everywhere (units whose gradients never come are reduced, with zeros,
// at the end of the backward in index order).
void Stage3::launch_ready_reductions() {
  for (auto& u : units_) {
    if (u->reduced_ || u->arrived_ < static_cast<int>(u->train_.params.size()) || u->train_.params.empty()) continue;
    u->reduce();
    u->in_backward_ = false;
    u->release();
  }
}

void Stage3::end_backward() {
  c10::NoGradGuard no_grad;
  // Units whose parameters got no gradient this backward are reduced with zeros, in index order.
  for (auto& u : units_) {
    if (u->reduced_ || u->train_.params.empty()) continue;
    u->reduce();
  }
  for (auto& u : units_) {
    u->in_backward_ = false;
    u->reduced_ = false;
    u->arrived_ = 0;
    u->release();
  }
  // The trace for the next step: what this forward and backward fetched.
  if (opts_.prefetch && (!trace_valid_ || trace_pos_ != trace_.size())) {
    trace_ = recording_;
    trace_valid_ = !trace_.empty();
  }
  recording_.clear();
  trace_pos_ = 0;
}

bool Stage3::sharded_grads() const { return comm_.world_size() > 1; }

void Stage3::apply(double inv_scale, const std::vector<double>& lrs) {
  step_.apply(lrs.at(0), inv_scale);  // writes every unit's compute-precision shard
  // Units that stay gathered take their new values now; the others at their next fetch.
  c10::NoGradGuard no_grad;
  for (auto& u : units_) {
    if (!u->persistent_ || !u->train_.layout) continue;
    if (comm_.world_size() > 1) {
      comm_.all_gather(u->train_.shard, u->train_.full).wait();
    } else {
      u->train_.full.copy_(u->train_.shard);
    }
  }
}

void Stage3::clear_grads() {
  c10::NoGradGuard no_grad;
  for (auto& u : units_)
    if (u->grad_shard_.defined()) u->grad_shard_.zero_();
  step_.reset();
}

std::vector<int> Stage3::gather_units(const std::vector<at::Tensor>& params) {
  c10::NoGradGuard no_grad;
  std::vector<int> out;
  for (auto& u : units_) {
    bool wanted = params.empty();
    for (const Unit::Part* part : {&u->train_, &u->frozen_}) {
      for (const auto& p : part->params)
        for (const auto& q : params) wanted = wanted || p.unsafeGetTensorImpl() == q.unsafeGetTensorImpl();
    }
    if (!wanted) continue;
    out.push_back(u->index());
    u->gather(true);
  }
  return out;
}

void Stage3::release_units(const std::vector<int>& units, int modifier_rank) {
  c10::NoGradGuard no_grad;
  for (int i : units) {
    Unit& u = *units_[i];
    if (modifier_rank >= 0) {
      for (Unit::Part* part : {&u.train_, &u.frozen_}) {
        if (!part->layout) continue;
        if (comm_.world_size() > 1) comm_.broadcast(part->full, modifier_rank).wait();
        const FlatLayout& l = *part->layout;
        part->shard.copy_(part->full.narrow(0, l.shard_begin(comm_.rank()), l.shard_size()));
        if (part == &u.train_) step_.master().narrow(0, u.master_offset_, l.shard_size()).copy_(part->shard);
      }
    }
    u.release();
  }
}

GroupBytes Stage3::bytes() const {
  GroupBytes out;
  for (auto& u : units_) {
    if (u->train_.layout) out.params += u->train_.shard.nbytes();
    if (u->grad_shard_.defined()) out.grads += u->grad_shard_.nbytes();
    if (u->grad_staging_.defined()) out.workspace += u->grad_staging_.nbytes();
  }
  out.master = step_.master().nbytes();
  out.optimizer = step_.optimizer().state_bytes();
  out.workspace += gathered_now_ + step_.workspace_bytes();
  return out;
}

int64_t Stage3::gathered_bound() const {
  int64_t largest = 0;
  for (auto& u : units_)
    if (!u->persistent_) largest = std::max(largest, u->train_.bytes() + u->frozen_.bytes());
  return opts_.max_live_elems * static_cast<int64_t>(at::elementSize(opts_.compute_dtype)) + largest +
         persistent_bytes();
}

int64_t Stage3::frozen_bytes() const {
  int64_t n = 0;
  for (auto& u : units_)
    if (u->frozen_.layout) n += u->frozen_.shard.nbytes();
  return n;
}

}  // namespace zero
}  // namespace zeal
