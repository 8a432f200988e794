#include "engine/zero/unit.h"

#include <cstdio>
#include <cstdlib>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <fmt/format.h>

#include "engine/error.h"
#include "engine/resident.h"
#include "engine/wait_clock.h"
#include "engine/zero/flat_params.h"
#include "engine/zero/host_memory.h"
#include "engine/zero/stage3.h"
#include "engine/zero/touch.h"

namespace zeal::zero {

namespace {

// ZEAL_MEMORY_TRACE=1: one line on stderr per unit event (gather, release, gradients, reductions)
// with the resident set and the gathered bytes at that moment, to see where a peak comes from.
bool memory_trace() {
  static const bool on = [] {
    const char* v = std::getenv("ZEAL_MEMORY_TRACE");
    return v != nullptr && *v != 0 && std::string(v) != "0";
  }();
  return on;
}

void trace_line(int rank, const char* event, const std::string& unit, int64_t gathered) {
  std::fprintf(stderr, "zeal trace: rank %d %s %s: resident %.1f MiB, gathered %.1f MiB\n", rank, event, unit.c_str(),
               static_cast<double>(detail::resident_bytes()) / (1 << 20), static_cast<double>(gathered) / (1 << 20));
}

}  // namespace

#define ZEAL_TRACE(event)                                                                   \
  do {                                                                                      \
    if (memory_trace()) trace_line(owner_.comm().rank(), event, name_, owner_.fetch().gathered()); \
  } while (0)

int64_t Unit::Part::bytes() const { return full.defined() ? full.numel() * full.element_size() : 0; }

Unit::Unit(Stage3& owner, int index, std::string name) : owner_(owner), index_(index), name_(std::move(name)) {}

int64_t Unit::gathered_bytes() const { return train_.bytes() + frozen_.bytes(); }

at::Tensor Unit::build(Part& part, bool same_everywhere) {
  if (part.params.empty()) return {};
  Communicator& comm = owner_.comm();
  const auto& o = owner_.options();
  std::vector<int64_t> numels, offsets;
  for (auto& p : part.params) numels.push_back(p.numel());
  part.layout = std::make_unique<FlatLayout>(numels, comm.world_size(), o.align);
  const FlatLayout& l = *part.layout;
  for (int i = 0; i < l.num_params(); ++i) offsets.push_back(l.offset(i));
  for (int64_t n : numels) numel_ += n;
  if (&part == &frozen_)
    for (int64_t n : numels) frozen_numel_ += n;
  // On the engine's device: the parameters may still be on the CPU (prepare moves a stage-3 model
  // unit by unit, here, never whole).
  at::Tensor init = initial_flat_values(part.params, offsets, l.padded_total(), comm, same_everywhere, o.device);
  // Frozen integer parameters keep their dtype; everything floating computes in the compute dtype.
  const at::ScalarType dtype = &part == &train_ || at::isFloatingType(part.params[0].scalar_type())
                                   ? o.compute_dtype
                                   : part.params[0].scalar_type();
  part.full = init.to(dtype);  // init itself when already in that dtype
  part.shard = part.full.narrow(0, l.shard_begin(comm.rank()), l.shard_size()).clone();
  view_params_into(part.params, part.full, offsets);
  return init;
}

void Unit::gather(bool wait, const char* phase) {
  TouchPause pause;
  if (state_ == State::kReleased) {
    Communicator& comm = owner_.comm();
    CollectiveLabel label(comm, fmt::format("{}, {}", name_, phase));
    const int64_t adds = missing_bytes();
    load_shards(/*trainable_only=*/frozen_kept_);
    for (Part* part : {&train_, &frozen_}) {
      if (!part->layout || (part == &frozen_ && frozen_kept_)) continue;
      alloc_storage(part->full);
      if (comm.world_size() > 1) {
        pending_.push_back(comm.all_gather(part->shard, part->full));
      } else {
        part->full.copy_(part->shard);
      }
    }
    if (pending_.empty()) drop_shards();
    state_ = State::kGathering;
    frozen_kept_ = false;
    if (!persistent_ && adds > 0) owner_.fetch().count_gather();
    owner_.fetch().add_gathered(adds);
  }
  if (state_ == State::kGathering) ZEAL_TRACE("gather");
  if (wait) wait_gather();
}

void Unit::wait_gather() {
  TouchPause pause;
  if (pending_.empty()) {
    if (state_ == State::kGathering) state_ = State::kGathered;
    return;
  }
  {
    detail::ScopedWait waiting(detail::WaitKind::kGather);
    for (auto& w : pending_) w.wait();
  }
  pending_.clear();
  drop_shards();  // the all-gathers read them
  if (state_ == State::kGathering) state_ = State::kGathered;
}

void Unit::shards_to_disk(bool in_host) {
  ParamSwap& swap = *owner_.options().param_swap;
  for (Part* part : {&train_, &frozen_}) {
    if (!part->layout) continue;
    part->swap_offset = swap.reserve(part->shard.nbytes(), in_host);
    if (part->shard.device().is_cpu() && !ParamSwap::in_host(part->swap_offset)) {
      // Into mapped storage, as every later load gives it, so stores need no bounce buffer.
      const at::Tensor values = part->shard.clone();
      free_storage(part->shard);
      alloc_storage_mapped(part->shard);
      part->shard.copy_(values);
    }
    swap.store(part->shard, part->swap_offset);
    free_storage(part->shard);
  }
}

void Unit::load_shards(bool trainable_only) {
  for (Part* part : {&train_, &frozen_}) {
    if (!part->layout || part->swap_offset < 0 || (trainable_only && part == &frozen_)) continue;
    if (part->reading.valid()) {  // read ahead: wait for it (rethrows its I/O error)
      owner_.options().param_swap->finish(part->reading);
      continue;
    }
    if (part->shard.storage().nbytes() == part->shard.nbytes()) continue;  // present, current
    owner_.options().param_swap->load(part->shard, part->swap_offset);
  }
}

int Unit::read_ahead() {
  ParamSwap& swap = *owner_.options().param_swap;
  auto wanted = [](const Part& p) {
    return p.layout && p.swap_offset >= 0 && !p.reading.valid() && p.shard.device().is_cpu() &&
           p.shard.storage().nbytes() != p.shard.nbytes();
  };
  const std::vector<Part*> parts = frozen_kept_ ? std::vector<Part*>{&train_} : std::vector<Part*>{&train_, &frozen_};
  int64_t elems = 0;
  for (const Part* part : parts)
    if (wanted(*part)) elems += part->shard.numel();
  if (elems == 0) return 0;
  if (!swap.has_room(elems)) return -1;
  for (Part* part : parts)
    if (wanted(*part)) part->reading = swap.start_read(part->shard, part->swap_offset);
  return 1;
}

void Unit::store_shards(bool trainable_only) {
  for (Part* part : {&train_, &frozen_}) {
    if (!part->layout || part->swap_offset < 0 || (trainable_only && part == &frozen_)) continue;
    owner_.options().param_swap->store(part->shard, part->swap_offset);
  }
}

void Unit::drop_shards() {
  for (Part* part : {&train_, &frozen_}) {
    if (!part->layout || part->swap_offset < 0) continue;
    if (part->reading.valid()) owner_.options().param_swap->finish(part->reading);  // its buffer is being read into
    free_storage(part->shard);
  }
}

int64_t Unit::missing_bytes() const {
  if (state_ != State::kReleased) return 0;
  return train_.bytes() + (frozen_kept_ ? 0 : frozen_.bytes());
}

int64_t Unit::missing_elems() const {
  if (state_ != State::kReleased) return 0;
  return numel_ - (frozen_kept_ ? frozen_numel_ : 0);
}

void Unit::drop_kept() {
  if (state_ != State::kReleased || !frozen_kept_) return;
  free_storage(frozen_.full);
  frozen_kept_ = false;
  owner_.fetch().sub_gathered(frozen_.bytes());
  ZEAL_TRACE("release (kept frozen part)");
}

void Unit::release(bool keep_frozen) {
  if (persistent_ || holds_ > 0) return;
  keep_frozen = keep_frozen && frozen_.layout;
  if (state_ == State::kReleased) {
    if (!keep_frozen) drop_kept();
    return;
  }
  wait_gather();
  int64_t freed = 0;
  for (Part* part : {&train_, &frozen_}) {
    if (!part->layout || (part == &frozen_ && keep_frozen)) continue;
    free_storage(part->full);
    freed += part->bytes();
  }
  state_ = State::kReleased;
  frozen_kept_ = keep_frozen;
  owner_.fetch().sub_gathered(freed);
  ZEAL_TRACE(keep_frozen ? "release (frozen part kept)" : "release");
}

// --- the lifecycle points ----------------------------------------------------------------------

void Unit::pre_forward() {
  owner_.check_abandoned_backward();
  const bool training = at::GradMode::is_enabled();
  c10::NoGradGuard no_grad;
  if (state_ == State::kInBackward) return;  // a recomputation inside its own backward
  gather(false, "pre_forward");  // first, so the prefetches issued next follow it in every rank's order
  owner_.fetch().on_fetch(*this, training ? FetchCoordinator::Pass::kTraining : FetchCoordinator::Pass::kNoGrad);
  wait_gather();
}

void Unit::post_forward() {
  if (state_ == State::kInBackward || persistent_) return;
  const bool training = at::GradMode::is_enabled();
  if (training && owner_.fetch().reused_soon(*this)) return;
  release(/*keep_frozen=*/training && owner_.fetch().frozen_reused(*this));
}

void Unit::pre_backward() {
  owner_.on_backward_event();
  c10::NoGradGuard no_grad;
  if (state_ != State::kInBackward) {
    gather(false, "pre_backward");
    owner_.fetch().on_fetch(*this, FetchCoordinator::Pass::kTraining);
    wait_gather();
    state_ = State::kInBackward;
  }
  ++open_backwards_;
}

void Unit::post_backward() {
  if (state_ != State::kInBackward || --open_backwards_ > 0) return;
  c10::NoGradGuard no_grad;
  state_ = State::kGathered;
  release(/*keep_frozen=*/owner_.fetch().frozen_reused(*this));
}

// --- gradients ---------------------------------------------------------------------------------

void Unit::on_grad_ready(int i) {
  owner_.on_backward_event();
  c10::NoGradGuard no_grad;
  at::Tensor& p = train_.params[i];
  if (grads_ == Grads::kReduced) {
    throw Error(fmt::format("the gradient of '{}' arrived after its unit '{}' was reduced in this backward pass",
                            train_.names[i], name_));
  }
  if (!grad_staging_.defined()) {
    grad_staging_ = staging_zeros(train_.layout->padded_total(), train_.shard.options().dtype(owner_.options().comm_dtype));
  }
  if (p.grad().defined()) {
    grad_staging_.narrow(0, train_.layout->offset(i), p.numel()).add_(p.grad().reshape({-1}));
    p.mutable_grad() = at::Tensor();
  }
  grads_ = ++arrived_ == static_cast<int>(train_.params.size()) ? Grads::kComplete : Grads::kArriving;
  ZEAL_TRACE(grads_ == Grads::kComplete ? "gradients complete" : "gradient");
  if (grads_ == Grads::kComplete) owner_.gradients_complete(*this);
}

Work Unit::reduce(bool wait) {
  c10::NoGradGuard no_grad;
  grads_ = Grads::kReduced;
  if (!train_.layout) return {};
  Communicator& comm = owner_.comm();
  const FlatLayout& l = *train_.layout;
  if (!grad_staging_.defined()) {
    grad_staging_ = staging_zeros(l.padded_total(), train_.shard.options().dtype(owner_.options().comm_dtype));
  }
  Work w;
  if (comm.world_size() > 1) {
    // In 16 bits each rank's part is divided first, so the sum cannot overflow where the average
    // would not (DeepSpeed's gradient pre-division); in fp32 the average is taken after the sum.
    const bool predivide = at::elementSize(grad_staging_.scalar_type()) < 4;
    if (predivide) grad_staging_.div_(comm.reduction_world());
    CollectiveLabel label(comm, fmt::format("{}, gradients", name_));
    at::Tensor mine = grad_staging_.narrow(0, l.shard_begin(comm.rank()), l.shard_size());
    w = comm.reduce_scatter(grad_staging_, mine, predivide ? ReduceOp::kSum : ReduceOp::kAvg);
  }
  ZEAL_TRACE("reduce-scatter launched");
  if (wait) {
    {
      detail::ScopedWait waiting(detail::WaitKind::kReduction);
      w.wait();
    }
    finish_reduction();
    return {};
  }
  return w;
}

void Unit::finish_reduction() {
  c10::NoGradGuard no_grad;
  if (!grad_staging_.defined()) return;
  ZEAL_TRACE("reduction finishing");
  const FlatLayout& l = *train_.layout;
  const at::Tensor mine = grad_staging_.narrow(0, l.shard_begin(owner_.comm().rank()), l.shard_size());
  if (owner_.gradients_swapped()) {  // offload_optimizer nvme: into the swap files
    owner_.accumulate_swapped(*this, mine);
    grad_staging_ = at::Tensor();
    return;
  }
  grad_shard_.add_(mine.scalar_type() == grad_shard_.scalar_type() ? mine : mine.to(grad_shard_.scalar_type()));
  grad_staging_ = at::Tensor();
}

void Unit::reset_backward() {
  c10::NoGradGuard no_grad;
  grads_ = Grads::kIdle;
  arrived_ = 0;
  open_backwards_ = 0;
  grad_staging_ = at::Tensor();
  for (auto& p : train_.params) p.mutable_grad() = at::Tensor();
  if (state_ == State::kInBackward) state_ = State::kGathered;
  release(/*keep_frozen=*/frozen_kept_);  // a kept frozen part stays
}

}  // namespace zeal::zero
