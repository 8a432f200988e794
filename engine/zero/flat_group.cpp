#include "engine/zero/flat_group.h"
#include "engine/wait_clock.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <fmt/format.h>

#include "engine/error.h"
#include "engine/zero/flat_params.h"
#include "engine/zero/grad_hook.h"

namespace zeal::zero {

// What a parameter's hook reaches: cleared when the group goes, so a hook that outlives it (the
// model lives on after the engine) does nothing.
struct FlatGroup::HookState {
  FlatGroup* group = nullptr;
};

namespace {

// Buckets of whole parameters, in order, of at most `limit` elements (a larger parameter alone).
std::vector<std::vector<int>> cut_buckets(const std::vector<at::Tensor>& params, int64_t limit) {
  std::vector<std::vector<int>> out;
  int64_t filled = 0;
  for (int i = 0; i < static_cast<int>(params.size()); ++i) {
    const int64_t n = params[i].numel();
    if (out.empty() || (filled > 0 && filled + n > limit)) {
      out.emplace_back();
      filled = 0;
    }
    out.back().push_back(i);
    filled += n;
  }
  return out;
}

}  // namespace

FlatGroup::FlatGroup(Communicator& comm, std::vector<at::Tensor> params, std::vector<std::string> names,
                     std::unique_ptr<optim::Optimizer> optimizer, const GroupOptions& options)
    : comm_(comm), opts_(options), params_(std::move(params)), names_(std::move(names)),
      end_([this] { end_backward(); }, [this] { abandon(); }) {
  ZEAL_CHECK(names_.size() == params_.size()) << names_.size() << " names for " << params_.size() << " parameters";
  if (opts_.stage < 0 || opts_.stage > 2) throw Error(fmt::format("FlatGroup handles stages 0-2, not {}", opts_.stage));
  const int world = comm_.world_size(), rank = comm_.rank();
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    if (!p.requires_grad()) throw Error(fmt::format("parameter '{}' does not require grad", names_[i]));
    if (!at::isFloatingType(p.scalar_type())) {
      throw Error(fmt::format("parameter '{}' is {}; trainable parameters must be floating point", names_[i],
                              c10::toString(p.scalar_type())));
    }
  }
  c10::NoGradGuard no_grad;
  const auto device = params_.empty() ? at::Device(at::kCPU) : params_[0].device();

  // Buckets and where everything sits.
  bucket_of_.resize(params_.size());
  flat_offset_.resize(params_.size());
  for (auto& members : cut_buckets(params_, std::max<int64_t>(opts_.bucket_elems, 1))) {
    std::vector<int64_t> numels;
    for (int i : members) numels.push_back(params_[i].numel());
    Bucket b{.layout = FlatLayout(numels, world, opts_.align), .params = members};
    b.offset = padded_;
    const bool whole = opts_.stage == 0;
    b.owned_begin = whole ? 0 : b.layout.shard_begin(rank);
    b.owned_len = whole ? b.layout.padded_total() : b.layout.shard_size();
    b.master_offset = owned_total_;
    for (size_t k = 0; k < members.size(); ++k) {
      bucket_of_[members[k]] = static_cast<int>(buckets_.size());
      flat_offset_[members[k]] = b.offset + b.layout.offset(static_cast<int>(k));
    }
    padded_ += b.layout.padded_total();
    owned_total_ += b.owned_len;
    total_elems_ += b.layout.total();
    buckets_.push_back(std::move(b));
  }

  // Every rank starts from rank 0's values, in fp32; the master is taken before the cast. fp32
  // parameters are their own master weights (no copy) when the optimizer is fused.
  at::Tensor init = initial_flat_values(params_, flat_offset_, padded_, comm_, /*same_everywhere=*/false);
  at::Tensor master;
  // Offloaded: the state is made in the arena (ShardStep::offload_to).
  if (!opts_.offload) optimizer->allocate_state(owned_total_, init.options());
  // Offloaded from a GPU, the master is a host copy; on the CPU the host is where the parameters are.
  const bool offload_elsewhere = opts_.offload && !init.device().is_cpu();
  if (offload_elsewhere || !ShardStep::can_alias(*optimizer, opts_.compute_dtype, init.device())) {
    master = at::empty({owned_total_}, init.options().device(opts_.offload ? at::Device(at::kCPU) : init.device()));
    for (int b = 0; b < num_buckets(); ++b) {
      master.narrow(0, buckets_[b].master_offset, buckets_[b].owned_len).copy_(owned_view(init, b));
    }
  }
  param_flat_ = opts_.compute_dtype == at::kFloat ? init : init.to(opts_.compute_dtype);
  init = at::Tensor();
  view_params_into(params_, param_flat_, flat_offset_);
  auto accum = at::TensorOptions().dtype(opts_.grad_accum_dtype).device(device);
  if (opts_.stage < 2) {
    grad_flat_ = at::zeros({padded_}, accum);
    if (grads_in_place()) {
      for (size_t i = 0; i < params_.size(); ++i) reattach_grad(static_cast<int>(i), false);
    }
  } else {
    grad_part_ = at::zeros({owned_total_}, accum);
  }
  // The step works bucket by bucket on the owned regions. An fp32 copy of the owned gradients is
  // needed only off the fused path (or to clip by value), and where they already are fp32 laid out
  // like the master it is that buffer, not a copy.
  std::vector<ShardStep::Piece> pieces;
  for (int b = 0; b < num_buckets(); ++b) {
    pieces.push_back({buckets_[b].master_offset, owned_grad_view(b), owned_view(param_flat_, b)});
  }
  at::Tensor alias;
  if (opts_.grad_accum_dtype == at::kFloat) {
    alias = opts_.stage == 2 ? grad_part_ : opts_.stage == 0 ? grad_flat_ : at::Tensor();
  }
  step_ = ShardStep(std::move(master), std::move(optimizer), std::move(pieces), alias);
  if (opts_.offload) step_.offload_to(opts_.offload);

  // A post hook on each parameter's gradient accumulator tells the group its gradient arrived.
  hook_state_ = std::make_shared<HookState>();
  hook_state_->group = this;
  for (size_t i = 0; i < params_.size(); ++i) {
    std::weak_ptr<HookState> weak = hook_state_;
    accumulators_.push_back(zero::on_grad_ready(params_[i], names_[i], [weak, i] {
      if (auto s = weak.lock()) s->group->on_grad_ready(static_cast<int>(i));
    }));
  }
  next_launch_ = num_buckets() - 1;
}

FlatGroup::~FlatGroup() {
  hook_state_.reset();
  // Every issued collective is waited for before its buffers go.
  for (auto& f : in_flight_) {
    try {
      f.work.wait();
    } catch (...) {
    }
  }
}

at::Tensor FlatGroup::owned_view(const at::Tensor& flat, int b) const {
  const Bucket& k = buckets_[b];
  return flat.narrow(0, k.offset + k.owned_begin, k.owned_len);
}

// Points the parameter's .grad back at its slot in the gradient buffer (stage 0, 1). When
// autograd or the user replaced it (a set_to_none zero_grad), the slot takes its value
// (`overwrite`) or is cleared.
void FlatGroup::reattach_grad(int i, bool overwrite) {
  at::Tensor& p = params_[i];
  at::Tensor slot = grad_flat_.narrow(0, flat_offset_[i], p.numel()).view(p.sizes());
  const at::Tensor& g = p.grad();
  if (g.defined() && g.data_ptr() == slot.data_ptr()) return;
  if (g.defined() && overwrite) {
    slot.copy_(g);
  } else {
    slot.zero_();
  }
  p.mutable_grad() = slot;
}

void FlatGroup::begin_micro_step(bool sync) {
  end_.check();
  ZEAL_CHECK(in_flight_.empty()) << "a micro-step began with reductions in flight";
  sync_ = sync;
  pass_ended_ = false;
  step_.reset();
  for (auto& b : buckets_) {
    b.arrived = 0;
    b.launched = false;
  }
  next_launch_ = num_buckets() - 1;
}

void FlatGroup::on_grad_ready(int i) {
  end_.request();
  c10::NoGradGuard no_grad;
  Bucket& b = buckets_[bucket_of_[i]];
  if (b.launched) {
    throw Error(fmt::format("the gradient of '{}' arrived after its bucket was reduced in this backward pass",
                            names_[i]));
  }
  at::Tensor& p = params_[i];
  if (opts_.stage < 2) {
    if (grads_in_place()) {
      reattach_grad(i, true);
    } else if (p.grad().defined()) {
      grad_flat_.narrow(0, flat_offset_[i], p.numel()).add_(p.grad().reshape({-1}));
      p.mutable_grad() = at::Tensor();
    }
    if (!sync_) return;
  } else {
    if (!b.staging.defined()) {
      b.staging = at::zeros({b.layout.padded_total()}, p.options().dtype(opts_.comm_dtype));
      staging_now_ += b.staging.nbytes();
      staging_peak_ = std::max(staging_peak_, staging_now_);
    }
    if (p.grad().defined()) {
      b.staging.narrow(0, flat_offset_[i] - b.offset, p.numel()).add_(p.grad().reshape({-1}));
      p.mutable_grad() = at::Tensor();
    }
  }
  if (++b.arrived == static_cast<int>(b.params.size())) launch_ready_buckets();
}

// Launches, in the fixed order, every bucket whose gradients are all in.
void FlatGroup::launch_ready_buckets() {
  while (next_launch_ >= 0 && buckets_[next_launch_].arrived == static_cast<int>(buckets_[next_launch_].params.size())) {
    launch(next_launch_--);
  }
}

void FlatGroup::launch(int b) {
  Bucket& k = buckets_[b];
  k.launched = true;
  CollectiveLabel label(comm_, fmt::format("bucket {}", b));
  // In 16 bits every rank's part is divided first (no overflow in the sum); in fp32 after the sum.
  const bool predivide = at::elementSize(opts_.comm_dtype) < 4;
  const ReduceOp op = predivide ? ReduceOp::kSum : ReduceOp::kAvg;
  const int world = comm_.reduction_world();
  InFlight f{b, {}, {}};
  if (opts_.stage < 2) {
    at::Tensor region = grad_flat_.narrow(0, k.offset, k.layout.padded_total());
    at::Tensor buf = region;
    if (opts_.comm_dtype != opts_.grad_accum_dtype) {
      buf = predivide ? region.div(world).to(opts_.comm_dtype) : region.to(opts_.comm_dtype);
      f.comm = buf;
    } else if (predivide) {
      buf.div_(world);
    }
    f.work = opts_.stage == 0 ? comm_.all_reduce(buf, op)
                              : comm_.reduce_scatter(buf, buf.narrow(0, k.owned_begin, k.owned_len), op);
  } else {
    if (!k.staging.defined()) {
      k.staging = at::zeros({k.layout.padded_total()}, grad_part_.options().dtype(opts_.comm_dtype));
      staging_now_ += k.staging.nbytes();
      staging_peak_ = std::max(staging_peak_, staging_now_);
    }
    if (predivide) k.staging.div_(world);
    f.work = comm_.reduce_scatter(k.staging, k.staging.narrow(0, k.owned_begin, k.owned_len), op);
  }
  in_flight_.push_back(std::move(f));
  // Without overlap each reduction finishes before the backward goes on; with it, stage 2 keeps
  // at most two buckets' staging in flight.
  if (!opts_.overlap_comm) {
    complete_oldest();
  } else if (opts_.stage == 2 && in_flight_.size() > 2) {
    complete_oldest();
  }
}

void FlatGroup::complete_oldest() {
  InFlight f = std::move(in_flight_.front());
  in_flight_.erase(in_flight_.begin());
  {
    detail::ScopedWait waiting(detail::WaitKind::kReduction);
    f.work.wait();
  }
  Bucket& k = buckets_[f.bucket];
  c10::NoGradGuard no_grad;
  if (opts_.stage < 2) {
    if (f.comm.defined()) {
      // Back into the accumulation dtype: the whole bucket (stage 0) or the owned shard (stage 1).
      at::Tensor region = grad_flat_.narrow(0, k.offset, k.layout.padded_total());
      if (opts_.stage == 0) region.copy_(f.comm);
      else region.narrow(0, k.owned_begin, k.owned_len).copy_(f.comm.narrow(0, k.owned_begin, k.owned_len));
    }
  } else {
    const at::Tensor mine = k.staging.narrow(0, k.owned_begin, k.owned_len);
    grad_part_.narrow(0, k.master_offset, k.owned_len).add_(mine.scalar_type() == grad_part_.scalar_type() ? mine : mine.to(grad_part_.scalar_type()));
    staging_now_ -= k.staging.nbytes();
    k.staging = at::Tensor();
  }
}

void FlatGroup::end_backward() {
  c10::NoGradGuard no_grad;
  pass_ended_ = true;
  ++passes_;
  if (opts_.stage < 2) {
    // A parameter that got no gradient this backward after a set_to_none zero_grad: its slot is 0.
    if (grads_in_place()) {
      for (size_t i = 0; i < params_.size(); ++i) reattach_grad(static_cast<int>(i), true);
    }
    if (!sync_) return;
  }
  // Buckets with a parameter that got no gradient (unused this step) are reduced now, with
  // zeros for it, still in the fixed order.
  for (auto& b : buckets_) b.arrived = static_cast<int>(b.params.size());
  launch_ready_buckets();
  while (!in_flight_.empty()) complete_oldest();
  if (opts_.stage == 2) {
    // Stage 2 reduces each pass's own gradients: another pass in this micro-step starts afresh.
    for (auto& b : buckets_) b.arrived = 0, b.launched = false;
    next_launch_ = num_buckets() - 1;
  }
}

void FlatGroup::end_backward_if_no_pass() {
  if (!pass_ended_ && !end_.pending()) end_backward();
}

// A backward pass ended with an error: finish what is in flight (every rank issued it), drop the
// staged gradients; the engine skips the step.
void FlatGroup::abandon() {
  for (auto& f : in_flight_) {
    try {
      f.work.wait();
    } catch (...) {
    }
  }
  in_flight_.clear();
  for (auto& b : buckets_) {
    if (b.staging.defined()) staging_now_ -= b.staging.nbytes();
    b.staging = at::Tensor();
    b.arrived = 0;
    b.launched = false;
  }
  next_launch_ = num_buckets() - 1;
  for (auto& p : params_)
    if (!grads_in_place()) p.mutable_grad() = at::Tensor();
  abandoned_ = true;
}

int FlatGroup::index_of(const at::Tensor& param) const {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].unsafeGetTensorImpl() == param.unsafeGetTensorImpl()) return static_cast<int>(i);
  return -1;
}

at::Tensor FlatGroup::full_grad(int i, double inv_scale) {
  c10::NoGradGuard no_grad;
  const Bucket& k = buckets_[bucket_of_[i]];
  const int64_t at = flat_offset_[i] - k.offset, n = params_[i].numel();
  at::Tensor g;
  if (opts_.stage == 0) {
    g = grad_flat_.narrow(0, flat_offset_[i], n);
  } else {
    // The owned shards of the bucket, from every rank.
    CollectiveLabel label(comm_, fmt::format("bucket {}, full_grad", bucket_of_[i]));
    at::Tensor full = at::empty({k.layout.padded_total()}, owned_grad_view(bucket_of_[i]).options());
    if (comm_.world_size() > 1) {
      comm_.all_gather(owned_grad_view(bucket_of_[i]).contiguous(), full).wait();
    } else {
      full.copy_(owned_grad_view(bucket_of_[i]));
    }
    g = full.narrow(0, at, n);
  }
  return (inv_scale == 1.0 ? g : g * inv_scale).view(params_[i].sizes()).clone();
}

at::Tensor FlatGroup::owned_grad_view(int b) const {
  const Bucket& k = buckets_[b];
  return opts_.stage == 2 ? grad_part_.narrow(0, k.master_offset, k.owned_len) : owned_view(grad_flat_, b);
}

void FlatGroup::apply_step(double lr, double inv_scale) {
  step_.apply(lr, inv_scale);
  if (opts_.stage > 0 && comm_.world_size() > 1) {
    std::vector<Work> gathers;
    for (int b = 0; b < num_buckets(); ++b) {
      const Bucket& k = buckets_[b];
      gathers.push_back(comm_.all_gather(owned_view(param_flat_, b), param_flat_.narrow(0, k.offset, k.layout.padded_total())));
    }
    detail::ScopedWait waiting(detail::WaitKind::kGather);
    for (auto& w : gathers) w.wait();
  }
}

void FlatGroup::zero_grad() {
  c10::NoGradGuard no_grad;
  if (opts_.stage < 2) {
    grad_flat_.zero_();
    for (size_t i = 0; i < params_.size(); ++i) {
      if (grads_in_place()) reattach_grad(static_cast<int>(i), false);
      else params_[i].mutable_grad() = at::Tensor();
    }
  } else {
    grad_part_.zero_();
    for (auto& p : params_) p.mutable_grad() = at::Tensor();
  }
  step_.reset();
}

GroupBytes FlatGroup::bytes() const {
  GroupBytes out;
  out.params = param_flat_.nbytes();
  out.grads = grad_flat_.defined() ? grad_flat_.nbytes() : grad_part_.nbytes();
  out.master = step_.master_bytes();
  out.optimizer = step_.optimizer().state_bytes();
  out.workspace = step_.workspace_bytes() + staging_peak_;
  return out;
}

void FlatGroup::state_ranges(bool to_write, std::vector<StateRange>& out) {
  const int rank = comm_.rank();
  for (const Bucket& b : buckets_) {
    if (opts_.stage == 0 && !to_write) {  // every rank keeps every element
      for (int k = 0; k < b.layout.num_params(); ++k) {
        const int i = b.params[k];
        out.push_back({names_[i], params_[i].sizes().vec(), 0, b.layout.numel(k),
                       param_flat_.narrow(0, b.offset + b.layout.offset(k), b.layout.numel(k)), &step_,
                       b.master_offset + b.layout.offset(k)});
      }
      continue;
    }
    // Stage 0 writes the slice stage 1 would own; stages 1, 2 own it.
    const int64_t shard0 = opts_.stage == 0 ? b.layout.shard_begin(rank) : 0;
    for (const Piece& pc : b.layout.pieces(rank)) {
      const int i = b.params[pc.param];
      out.push_back({names_[i], params_[i].sizes().vec(), pc.param_begin, pc.count,
                     param_flat_.narrow(0, b.offset + b.owned_begin + shard0 + pc.shard_begin, pc.count), &step_,
                     b.master_offset + shard0 + pc.shard_begin});
    }
  }
}

void FlatGroup::regather() {
  if (opts_.stage == 0 || comm_.world_size() == 1) return;
  for (int b = 0; b < num_buckets(); ++b) {
    comm_.all_gather(owned_view(param_flat_, b), param_flat_.narrow(0, buckets_[b].offset, buckets_[b].layout.padded_total()))
        .wait();
  }
}

}  // namespace zeal::zero
