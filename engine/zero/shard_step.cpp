#include "engine/zero/shard_step.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <future>

#include "engine/error.h"
#include "engine/wait_clock.h"
#include "engine/optim/cuda_stream.h"
#include "engine/zero/offload_state.h"
#ifdef ZEAL_HAVE_CUDA
#include "kernels/cuda/adam.h"
#endif

namespace zeal::zero {

cpu::DType kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return cpu::DType::kFp32;
    case at::kBFloat16: return cpu::DType::kBf16;
    case at::kHalf: return cpu::DType::kFp16;
    default: throw Error(fmt::format("no fused kernel for {} tensors", c10::toString(t)));
  }
}

cpu::GradStats stats_of(const at::Tensor& t) { return stats_from(t, {}); }

cpu::GradStats stats_from(const at::Tensor& t, cpu::GradStats acc) {
  if (t.numel() == 0) return acc;
  if (t.is_cpu() && t.is_contiguous()) {
    // Blocks of kStatsBlock elements in parallel, their sums folded in order: the same bits for any
    // thread count, and for a tensor taken whole or a multiple of kStatsBlock at a time.
    const int64_t n = t.numel(), blocks = (n + kStatsBlock - 1) / kStatsBlock;
    const cpu::DType type = kernel_dtype(t.scalar_type());
    const cpu::Simd simd = cpu::active_simd();
    const auto* base = static_cast<const char*>(t.data_ptr());
    const int64_t esize = static_cast<int64_t>(t.element_size());
    std::vector<cpu::GradStats> parts(static_cast<size_t>(blocks));
    at::parallel_for(0, blocks, 64, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t begin = b * kStatsBlock;
        parts[b] = cpu::grad_stats(base + begin * esize, type, std::min(kStatsBlock, n - begin), simd, 1);
      }
    });
    for (const auto& p : parts) acc = cpu::combine(acc, p);
    return acc;
  }
  const double norm = at::linalg_vector_norm(t, 2, std::nullopt, false, at::kDouble).item<double>();
  return cpu::combine(acc, {norm * norm, t.abs().max().item<float>()});
}

ShardStep::ShardStep(at::Tensor master, std::unique_ptr<optim::Optimizer> optimizer, std::vector<Piece> pieces,
                     at::Tensor grad32_alias)
    : master_(std::move(master)), optimizer_(std::move(optimizer)), pieces_(std::move(pieces)),
      grad32_(grad32_alias), alias_(std::move(grad32_alias)) {
  if (master_.defined()) {
    total_ = master_.numel();
    state_options_ = master_.options();
    if (master_.is_meta()) {  // already in the NVMe swap file (offload_to_nvme follows)
      state_options_ = at::TensorOptions().dtype(at::kFloat).device(pieces_.empty() ? at::Device(at::kCPU)
                                                                                     : pieces_[0].out.device());
    }
  } else {
    for (const Piece& p : pieces_) {
      ZEAL_CHECK(can_alias(*optimizer_, p.out.scalar_type(), p.out.device()) && p.out.is_contiguous())
          << "parameters that are their own master weights must be contiguous fp32 with a fused optimizer";
      total_ = std::max(total_, p.offset + p.out.numel());
    }
    state_options_ = at::TensorOptions().dtype(at::kFloat).device(pieces_.empty() ? at::Device(at::kCPU)
                                                                                   : pieces_[0].out.device());
  }
  for (const Piece& p : pieces_) {
    ZEAL_CHECK(p.offset >= 0 && p.offset + p.grad.numel() <= total_ && p.out.numel() == p.grad.numel())
        << "a piece outside the master partition";
  }
  fused_ = optimizer_->fused() && (state_options_.device().is_cpu() || state_options_.device().is_cuda());
}

bool ShardStep::can_alias(const optim::Optimizer& optimizer, at::ScalarType compute, at::Device device) {
  return optimizer.fused() && compute == at::kFloat && (device.is_cpu() || device.is_cuda());
}

cpu::GradStats ShardStep::stats(double inv_scale) {
  c10::NoGradGuard no_grad;
  cpu::GradStats s;
  double scale = 1.0;
  if (grad32_ready_) {
    s = stats_of(grad32_);
  } else if (gswap_) {
    finish_grad_writes();  // a failed gradient write fails the statistics (and so the step) here
    for (size_t k = 0; k < pieces_.size(); ++k)
      if (gswap_written_[k]) s = cpu::combine(s, gswap_stats_[k]);
    scale = inv_scale * pending_scale_;
  } else {
    for (const Piece& p : pieces_) s = cpu::combine(s, stats_of(p.grad));
    scale = inv_scale * pending_scale_;
  }
  s.sumsq *= scale * scale;
  s.amax = static_cast<float>(s.amax * scale);
  return s;
}

std::vector<at::Tensor> ShardStep::current_grads(double inv_scale, double* scale) const {
  std::vector<at::Tensor> grads;
  *scale = 1.0;
  if (grad32_ready_) {
    grads.push_back(grad32_);
  } else {
    for (const Piece& p : pieces_)
      if (p.grad.numel() > 0) grads.push_back(p.grad);
    *scale = inv_scale * pending_scale_;
  }
  return grads;
}

at::Tensor ShardStep::sumsq_on_device(double inv_scale, at::Device where) {
  c10::NoGradGuard no_grad;
  if (gswap_) return at::full({1}, stats(inv_scale).sumsq, at::TensorOptions().dtype(at::kDouble).device(where));
  double scale = 1.0;
  const std::vector<at::Tensor> grads = current_grads(inv_scale, &scale);
  if (grads.empty()) return at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(where));
  const auto opts = at::TensorOptions().dtype(at::kDouble).device(grads[0].device());
  at::Tensor out = at::zeros({1}, opts);
#ifdef ZEAL_HAVE_CUDA
  bool one_type = true;
  for (const at::Tensor& g : grads) one_type = one_type && g.scalar_type() == grads[0].scalar_type() && g.is_contiguous();
  const at::Device device = grads[0].device();
  if (device.is_cuda() && one_type) {
    std::vector<const void*> ptrs;
    std::vector<int64_t> sizes;
    for (const at::Tensor& g : grads) {
      ptrs.push_back(g.data_ptr());
      sizes.push_back(g.numel());
    }
    at::Tensor workspace = at::empty({std::max<int64_t>(cuda::sumsq_workspace(sizes), 1)}, opts);
    optim::CudaDeviceScope scope(device);
    cuda::multi_tensor_sumsq(ptrs, sizes, kernel_dtype(grads[0].scalar_type()), out.data_ptr<double>(),
                             workspace.data_ptr<double>(), optim::current_stream(device));
    if (scale != 1.0) out.mul_(scale * scale);
    return out.to(where);
  }
#endif
  for (const at::Tensor& g : grads) out.add_(at::linalg_vector_norm(g, 2, std::nullopt, false, at::kDouble).square());
  if (scale != 1.0) out.mul_(scale * scale);
  return out.to(where);
}

at::Tensor ShardStep::amax_on_device(double inv_scale, at::Device where) {
  c10::NoGradGuard no_grad;
  if (gswap_) {
    const cpu::GradStats s = stats(inv_scale);  // a non-finite sum makes the amax non-finite too
    const double amax = s.finite() ? static_cast<double>(s.amax) : s.sumsq;
    return at::full({1}, amax, at::TensorOptions().dtype(at::kDouble).device(where));
  }
  at::Tensor out = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(where));
  double scale = 1.0;
  const std::vector<at::Tensor> grads = current_grads(inv_scale, &scale);
  for (const at::Tensor& g : grads) out = at::maximum(out, g.abs().max().to(at::kDouble).reshape({1}).to(where));
  if (scale != 1.0) out.mul_(std::abs(scale));
  return out;
}

void ShardStep::scale(double c) {
  c10::NoGradGuard no_grad;
  if (grad32_ready_) grad32_.mul_(c);
  else pending_scale_ *= c;
}

const at::Tensor& ShardStep::fp32_grads(double inv_scale) {
  if (grad32_ready_) return grad32_;
  if (gswap_) {
    throw Error("the gradients are offloaded to nvme with the optimizer state (offload_optimizer.device nvme), where "
                "they are never whole in memory: clip_grad_value is not available; gradient_clipping (the norm) is");
  }
  c10::NoGradGuard no_grad;
  if (!grad32_.defined()) grad32_ = at::empty({total_}, state_options_);
  if (!grad32_.is_same(alias_)) {
    for (const Piece& p : pieces_) grad32_.narrow(0, p.offset, p.grad.numel()).copy_(p.grad);
  }
  const double scale = inv_scale * pending_scale_;
  if (scale != 1.0) {
#ifdef ZEAL_HAVE_CUDA
    if (grad32_.is_cuda()) {  // the multi-tensor unscale kernel, on the current stream
      at::Tensor found_inf = at::zeros({1}, grad32_.options().dtype(at::kInt));
      optim::CudaDeviceScope scope(grad32_.device());
      cuda::multi_tensor_unscale({grad32_.data_ptr<float>()}, {grad32_.numel()}, static_cast<float>(scale),
                                 found_inf.data_ptr<int>(), optim::current_stream(grad32_.device()));
    } else {
      grad32_.mul_(scale);
    }
#else
    grad32_.mul_(scale);
#endif
  }
  pending_scale_ = 1.0;
  grad32_ready_ = true;
  return grad32_;
}

void ShardStep::offload_to(std::shared_ptr<offload::HostArena> arena) {
  ZEAL_CHECK(!arena_) << "a partition offloaded twice";
  c10::NoGradGuard no_grad;
  arena_ = std::move(arena);
  // A partition that computes on the CPU is in host memory already: the optimizer state (and a
  // separate master, when there is one) moves into the arena, and the step runs where the
  // gradients and parameters are, with no copy of either (fp32 parameters stay their own master).
  local_ = pieces_.empty() || pieces_[0].out.device().is_cpu();  // (a GPU's master is on the host already)
  ZEAL_CHECK(local_ || master_.defined()) << "an offloaded partition keeps its master weights apart from the parameters";
  if (master_.defined()) {
    at::Tensor host = arena_tensor(arena_, total_, at::kFloat);
    if (total_ > 0) host.copy_(master_);
    master_ = host;
  }
  auto a = arena_;
  optimizer_->set_state_allocator([a](int64_t n, at::ScalarType dtype) { return arena_tensor(a, n, dtype); });
  optimizer_->allocate_state(total_, at::TensorOptions().dtype(at::kFloat).device(at::kCPU));
  if (local_) return;
  host_grad_ = arena_tensor(arena_, total_, at::kFloat);
  const at::ScalarType out_type = pieces_.empty() ? at::kFloat : pieces_[0].out.scalar_type();
  for (const Piece& p : pieces_) {
    ZEAL_CHECK(p.out.scalar_type() == out_type) << "the pieces of one partition compute in one dtype";
  }
  host_out_ = arena_tensor(arena_, total_, out_type);
  fused_ = optimizer_->fused();  // the CPU kernels now, whatever the device
}

namespace {
int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }
}  // namespace

void ShardStep::offload_to_nvme(std::shared_ptr<offload::HostArena> arena, std::shared_ptr<offload::SwapFile> file,
                                int64_t window, int buffer_sets) {
  ZEAL_CHECK(!arena_ && !swap_) << "a partition offloaded twice";
  ZEAL_CHECK(master_.defined()) << "an offloaded partition keeps its master weights apart from the parameters";
  if (!optimizer_->fused()) {
    throw Error(fmt::format("offload_optimizer.device nvme: {} has no fused step; NVMe offload updates Adam or AdamW "
                            "window by window",
                            optimizer_->name()));
  }
  c10::NoGradGuard no_grad;
  arena_ = std::move(arena);
  swap_ = std::move(file);
  constexpr int64_t kAlignElems = offload::kIoAlign / 4;
  window_ = round_up(std::max<int64_t>(1, std::min(window, total_)), kAlignElems);
  region_bytes_ = round_up(total_ * 4, offload::kIoAlign);
  swap_->dir().require(3 * region_bytes_, "the optimizer state offloaded to nvme");
  sets_ = std::clamp(buffer_sets, 1, 3);
  for (int k = 0; k < sets_; ++k) {
    win_master_[k] = arena_tensor(arena_, window_, at::kFloat);
    win_m_[k] = arena_tensor(arena_, window_, at::kFloat);
    win_v_[k] = arena_tensor(arena_, window_, at::kFloat);
    // Registered with the file's engine (a refusal leaves plain requests: same bytes, a little more CPU).
    for (const at::Tensor* t : {&win_master_[k], &win_m_[k], &win_v_[k]})
      swap_->io().register_buffer(t->data_ptr(), round_up(window_ * 4, offload::kIoAlign));
  }
  make_writer();
  host_grad_ = arena_tensor(arena_, window_, at::kFloat);
  const at::ScalarType out_type = pieces_.empty() ? at::kFloat : pieces_[0].out.scalar_type();
  host_out_ = arena_tensor(arena_, window_, out_type);
  // The master as it is (unless it is there already), m and v zero (the state's start), window by window.
  const bool master_written = master_.is_meta();
  win_m_[0].zero_();
  for (int64_t a = 0; a < total_; a += window_) {
    const int64_t len = std::min(window_, total_ - a), io_bytes = round_up(len * 4, offload::kIoAlign);
    if (!master_written) {
      win_master_[0].zero_();
      win_master_[0].narrow(0, 0, len).copy_(master_.narrow(0, a, len));
      swap_->write(win_master_[0].data_ptr(), io_bytes, a * 4);
    }
    swap_->write(win_m_[0].data_ptr(), io_bytes, region_bytes_ + a * 4);
    swap_->write(win_v_[0].data_ptr(), io_bytes, 2 * region_bytes_ + a * 4);
  }
  master_ = at::Tensor();
  fused_ = true;
}

ShardStep::~ShardStep() {
  if (prefetch_.valid()) prefetch_.wait();
  if (pending_write_.valid()) pending_write_.wait();  // its error, if any, has no one left to hear it
  gwriter_.reset();                                   // waits for the gradient writes, likewise
}

void ShardStep::prefetch_state() {
  if (!swap_ || total_ == 0 || prefetch_.valid() || prefetched_ > 0 || !write_error_.empty()) return;
  // The last window's write-back goes out of one of the sets: only once it is done (its result is
  // left for finish_writes to collect).
  if (pending_write_.valid() && pending_write_.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return;
  const int64_t windows = (total_ + window_ - 1) / window_;
  const int count = static_cast<int>(std::min<int64_t>(sets_, windows));
  struct Slice {
    void* buf;
    int64_t bytes, off;
  };
  std::vector<Slice> slices;  // what the task needs, copied (this object may move)
  for (int i = 0; i < count; ++i) {
    const int64_t a = i * window_, bytes = round_up(std::min(window_, total_ - a) * 4, offload::kIoAlign);
    slices.push_back({win_master_[i].data_ptr(), bytes, a * 4});
    slices.push_back({win_m_[i].data_ptr(), bytes, region_bytes_ + a * 4});
    slices.push_back({win_v_[i].data_ptr(), bytes, 2 * region_bytes_ + a * 4});
  }
  prefetch_ = std::async(std::launch::async, [file = swap_, io = writer_.get(), slices, count] {
    try {
      for (const Slice& s : slices) file->read(*io, s.buf, s.bytes, s.off);
      return count;
    } catch (const std::exception&) {
      return -1;  // the step reads them again and reports what fails then
    }
  });
}

void ShardStep::finish_prefetch() {
  if (!prefetch_.valid()) return;
  prefetched_ = prefetch_.get();
  if (prefetched_ >= 0) return;
  // A failed read may have left requests of the writer's engine unfinished: the writes get an
  // engine of their own again, with the sets registered.
  prefetched_ = 0;
  make_writer();
}

void ShardStep::make_writer() {
  writer_ = offload::make_io_engine(swap_->io().options(), std::string(swap_->io().kind()) == "threads");
  for (int k = 0; k < sets_; ++k) {
    for (const at::Tensor* t : {&win_master_[k], &win_m_[k], &win_v_[k]})
      writer_->register_buffer(t->data_ptr(), round_up(window_ * 4, offload::kIoAlign));
  }
}

int ShardStep::prefetched_windows() {
  finish_prefetch();
  return prefetched_;
}

void ShardStep::finish_writes() {
  finish_prefetch();  // its reads use the writer's engine, and the state's files
  if (!write_error_.empty()) throw Error(write_error_);
  if (!pending_write_.valid()) return;
  detail::ScopedWait waiting(detail::WaitKind::kWrite);
  try {
    pending_write_.get();
  } catch (const std::exception& e) {
    // The file's last window is a step behind now: every later use of the state says so.
    write_error_ = fmt::format("the optimizer state offloaded to nvme is a step behind on disk: writing its last "
                               "window back failed: {}",
                               e.what());
    throw Error(write_error_);
  }
}

void ShardStep::apply_nvme(double inv_scale) {
  finish_writes();  // the previous step's last window, before its buffers and file regions are used again
  finish_grad_writes();  // this step's gradients, before their windows are read
  double scale = 1.0;
  if (!grad32_ready_) scale = inv_scale * pending_scale_;
  const auto out_type = kernel_dtype(host_out_.scalar_type());
  const int64_t out_size = static_cast<int64_t>(host_out_.element_size());
  // Window a's three slices in and out of buffer set k: reads through the file's engine, writes
  // through the writer's, each engine on one thread at a time.
  auto io_bytes = [&](int64_t a) { return round_up(std::min(window_, total_ - a) * 4, offload::kIoAlign); };
  // The first prefetched_ windows' master, m and v are in their sets already (prefetch_state).
  const int64_t ready = prefetched_;
  prefetched_ = 0;  // whatever happens below, the sets hold other windows afterwards
  windows_read_ahead_ += ready;
  auto read = [&](int64_t a, int k) {
    if (a / window_ >= ready) {
      swap_->read(win_master_[k].data_ptr(), io_bytes(a), a * 4);
      swap_->read(win_m_[k].data_ptr(), io_bytes(a), region_bytes_ + a * 4);
      swap_->read(win_v_[k].data_ptr(), io_bytes(a), 2 * region_bytes_ + a * 4);
    }
    if (gswap_) read_grad_window(a, std::min(window_, total_ - a), k);
  };
  auto write = [&](int64_t a, int k) {
    swap_->write(*writer_, win_master_[k].data_ptr(), io_bytes(a), a * 4);
    swap_->write(*writer_, win_m_[k].data_ptr(), io_bytes(a), region_bytes_ + a * 4);
    swap_->write(*writer_, win_v_[k].data_ptr(), io_bytes(a), 2 * region_bytes_ + a * 4);
  };
  std::future<void> reading, writing;  // window i+1 coming in, window i-1 going out
  struct Drain {                       // an exception in the update waits for the I/O before the buffers go
    std::future<void>& r;
    std::future<void>& w;
    ~Drain() {
      if (r.valid()) r.wait();
      if (w.valid()) w.wait();
    }
  } drain{reading, writing};
  const int S = sets_;
  if (total_ > 0) {
    detail::ScopedWait waiting(detail::WaitKind::kRead);  // the first window, before anything overlaps
    read(0, 0);
  }
  for (int64_t a = 0, i = 0; a < total_; a += window_, ++i) {
    const int k = static_cast<int>(i % S);
    const int64_t len = std::min(window_, total_ - a);
    const int64_t prev = a - window_, next = a + window_;
    // The hooks do I/O of their own (stage 3: parameter shards), maybe through the engine the
    // window reads use: called only while no read is in flight, entering before the next read
    // starts and leaving after it ends.
    if (hooks_.enter) {
      for (size_t pk = 0; pk < pieces_.size(); ++pk) {
        const Piece& p = pieces_[pk];
        if (p.grad.numel() > 0 && p.offset >= a && p.offset < a + len) hooks_.enter(pk);
      }
    }
    // Window i+1 comes into the next set while this one is updated (two sets or more); window i−1
    // leaves from the previous set (three sets; with fewer, each window is written after its update).
    if (S >= 2 && next < total_) {
      reading = std::async(std::launch::async, [&, next, i] { read(next, static_cast<int>((i + 1) % S)); });
    }
    if (S >= 3 && prev >= 0) {
      writing = std::async(std::launch::async, [&, prev, i] { write(prev, static_cast<int>((i + 2) % S)); });
    }
    std::vector<optim::FusedSegment> segments;
    struct Back {
      const Piece* piece;
      int64_t lo, n;
    };
    std::vector<Back> back;
    for (size_t pk = 0; pk < pieces_.size(); ++pk) {
      const Piece& p = pieces_[pk];
      const int64_t lo = std::max(a, p.offset), hi = std::min(a + len, p.offset + p.grad.numel());
      if (lo >= hi) continue;
      const int64_t n = hi - lo;
      float* grad = nullptr;
      if (gswap_) {
        grad = win_grad_[k].data_ptr<float>() + (lo - a);  // read with the window
      } else {
        grad = host_grad_.data_ptr<float>() + (lo - a);
        host_grad_.narrow(0, lo - a, n)
            .copy_(grad32_ready_ ? grad32_.narrow(0, lo, n) : p.grad.narrow(0, lo - p.offset, n));
      }
      optim::FusedSegment seg;
      seg.offset = lo;
      seg.n = n;
      seg.grad = grad;
      seg.grad_type = cpu::DType::kFp32;
      seg.master = win_master_[k].data_ptr<float>() + (lo - a);
      seg.m = win_m_[k].data_ptr<float>() + (lo - a);
      seg.v = win_v_[k].data_ptr<float>() + (lo - a);
      seg.copy = static_cast<char*>(host_out_.data_ptr()) + (lo - a) * out_size;
      seg.copy_type = out_type;
      segments.push_back(seg);
      back.push_back({&p, lo, n});
    }
    // One optimizer step over all windows: the step count advances with the first.
    optimizer_->fused_update(total_, at::kCPU, segments, scale, /*new_step=*/a == 0);
    for (const Back& b : back) b.piece->out.narrow(0, b.lo - b.piece->offset, b.n).copy_(host_out_.narrow(0, b.lo - a, b.n));
    if (writing.valid()) {
      detail::ScopedWait waiting(detail::WaitKind::kWrite);
      writing.get();  // rethrows an I/O error
    }
    if (reading.valid()) {
      detail::ScopedWait waiting(detail::WaitKind::kRead);
      reading.get();
    }
    if (hooks_.leave) {
      for (const Back& b : back)
        if (b.lo + b.n == b.piece->offset + b.piece->grad.numel()) hooks_.leave(static_cast<size_t>(b.piece - pieces_.data()));
    }
    if (next >= total_) {
      // The last window goes out while the training goes on: the next apply, a checkpoint's access
      // to the state, or the destructor waits for it. What it needs is copied (this object may move).
      struct Slice {
        void* buf;
        int64_t off;
      };
      const int64_t bytes = io_bytes(a);
      const std::vector<Slice> slices{{win_master_[k].data_ptr(), a * 4},
                                      {win_m_[k].data_ptr(), region_bytes_ + a * 4},
                                      {win_v_[k].data_ptr(), 2 * region_bytes_ + a * 4}};
      pending_write_ = std::async(std::launch::async, [file = swap_, io = writer_.get(), slices, bytes] {
        for (const Slice& s : slices) file->write(*io, s.buf, bytes, s.off);
      });
    } else if (S < 3) {
      detail::ScopedWait waiting(detail::WaitKind::kWrite);
      write(a, k);
    }
    if (S == 1 && next < total_) {
      detail::ScopedWait waiting(detail::WaitKind::kRead);
      read(next, 0);
    }
  }
  if (!grad32_.is_same(alias_)) grad32_ = alias_;
  grad32_ready_ = false;
}

void ShardStep::apply_offloaded(double lr, double inv_scale) {
  (void)lr;  // set on the optimizer by apply()
  // The gradients into the host buffer (from the device on a GPU), as the step without offload
  // would read them: the fp32 copy when one was made, else the reduced gradients as they are.
  double scale = 1.0;
  if (grad32_ready_) {
    host_grad_.copy_(grad32_);
  } else {
    for (const Piece& p : pieces_)
      if (p.grad.numel() > 0) host_grad_.narrow(0, p.offset, p.grad.numel()).copy_(p.grad);
    scale = inv_scale * pending_scale_;
  }
  if (!fused_) {
    if (scale != 1.0) host_grad_.mul_(scale);
    optimizer_->step(master_, host_grad_);
    each_out([&](const Piece& p) { p.out.copy_(master_.narrow(0, p.offset, p.out.numel())); });
  } else {
    std::vector<optim::FusedSegment> segments;
    const auto out_type = kernel_dtype(host_out_.scalar_type());
    auto* out_bytes = static_cast<char*>(host_out_.data_ptr());
    for (const Piece& p : pieces_) {
      if (p.grad.numel() == 0) continue;
      optim::FusedSegment seg;
      seg.offset = p.offset;
      seg.n = p.grad.numel();
      seg.grad = host_grad_.data_ptr<float>() + p.offset;
      seg.grad_type = cpu::DType::kFp32;
      seg.master = master_.data_ptr<float>() + p.offset;
      seg.copy = out_bytes + p.offset * static_cast<int64_t>(host_out_.element_size());
      seg.copy_type = out_type;
      segments.push_back(seg);
    }
    optimizer_->fused_update(total_, at::kCPU, segments, scale);
    each_out([&](const Piece& p) { p.out.copy_(host_out_.narrow(0, p.offset, p.out.numel())); });
  }
  if (!grad32_.is_same(alias_)) grad32_ = alias_;
  grad32_ready_ = false;
}

void ShardStep::each_out(const std::function<void(const Piece&)>& f) {
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const Piece& p = pieces_[k];
    if (p.out.numel() == 0) continue;
    if (hooks_.enter) hooks_.enter(k);
    f(p);
    if (hooks_.leave) hooks_.leave(k);
  }
}

void ShardStep::apply(double lr, double inv_scale) {
  c10::NoGradGuard no_grad;
  state_touched_ = true;
  optimizer_->set_lr(lr);
  if (total_ == 0) return;
  if (swap_) return apply_nvme(inv_scale);
  if (arena_ && !local_) return apply_offloaded(lr, inv_scale);
  if (!fused_) {
    optimizer_->step(master_, fp32_grads(inv_scale));
    each_out([&](const Piece& p) { p.out.copy_(master_.narrow(0, p.offset, p.out.numel())); });
    // The fp32 copy lives from its first use to the update, not between steps.
    if (!grad32_.is_same(alias_)) grad32_ = alias_;
    grad32_ready_ = false;
    return;
  }
  // One pass per piece: gradients (unscaled and clipped by the multiplier), the update, the copy.
  const double scale = grad32_ready_ ? 1.0 : inv_scale * pending_scale_;
  std::vector<optim::FusedSegment> segments;
  auto segment = [&](const Piece& p) {
    const at::Tensor g = grad32_ready_ ? grad32_.narrow(0, p.offset, p.grad.numel()) : p.grad;
    optim::FusedSegment seg;
    seg.offset = p.offset;
    seg.n = p.grad.numel();
    seg.grad = g.data_ptr();
    seg.grad_type = kernel_dtype(g.scalar_type());
    if (aliased()) {
      seg.master = p.out.data_ptr<float>();  // the parameters are the master: updated in place
    } else {
      seg.master = master_.data_ptr<float>() + p.offset;
      seg.copy = p.out.data_ptr();
      seg.copy_type = kernel_dtype(p.out.scalar_type());
    }
    return seg;
  };
  if (hooks_.enter) {  // each piece's `out` present only around its own update: one at a time
    bool first = true;
    each_out([&](const Piece& p) {
      optimizer_->fused_update(total_, state_options_.device(), {segment(p)}, scale, first);
      first = false;
    });
    return;
  }
  for (const Piece& p : pieces_)
    if (p.grad.numel() > 0) segments.push_back(segment(p));
  optimizer_->fused_update(total_, state_options_.device(), segments, scale);
}

void ShardStep::reset() {
  grad32_ready_ = false;
  pending_scale_ = 1.0;
}

void ShardStep::refresh_master(size_t k) {
  c10::NoGradGuard no_grad;
  if (swap_) {
    throw Error("engine.gathered with a modifier rank: the master weights are offloaded to nvme, where they cannot be "
                "changed from outside the step");
  }
  const Piece& p = pieces_.at(k);
  if (aliased()) return;  // the parameters are the master weights
  master_.narrow(0, p.offset, p.out.numel()).copy_(p.out);
}

int64_t ShardStep::workspace_bytes() const {
  return grad32_.defined() && !grad32_.is_same(alias_) ? grad32_.nbytes() : 0;
}

}  // namespace zeal::zero

namespace zeal::zero {

std::vector<std::string> ShardStep::state_names() const {
  if (swap_) return {"exp_avg", "exp_avg_sq"};
  std::vector<std::string> names;
  for (const auto& [k, v] : optimizer_->state())
    if (v.defined()) names.push_back(k);
  return names;
}

const float* ShardStep::host_state(const std::string& what, int64_t index, int64_t n) const {
  if (swap_ || n <= 0 || index < 0 || index + n > total_) return nullptr;
  auto at = [&](const at::Tensor& t, int64_t i) -> const float* {
    if (!t.defined() || !t.device().is_cpu() || t.scalar_type() != at::kFloat || !t.is_contiguous()) return nullptr;
    return i >= 0 && i + n <= t.numel() ? t.data_ptr<float>() + i : nullptr;
  };
  if (what == "master") {
    if (master_.defined()) return at(master_, index);
    for (const Piece& p : pieces_)
      if (index >= p.offset && index + n <= p.offset + p.out.numel()) return at(p.out, index - p.offset);
    return nullptr;
  }
  const auto st = optimizer_->state();
  const auto it = st.find(what);
  return it == st.end() ? nullptr : at(it->second, index);
}

void ShardStep::zero_state() {
  ZEAL_CHECK(!swap_) << "zero_state of an NVMe-offloaded optimizer state";
  c10::NoGradGuard no_grad;
  for (const auto& [k, v] : optimizer_->state())
    if (v.defined()) v.zero_();
  state_touched_ = false;
}

void ShardStep::state_io(const std::string& what, int64_t index, int64_t n, float* buf, bool write) {
  if (n <= 0) return;
  finish_writes();
  if (write && what != "master") state_touched_ = true;
  ZEAL_CHECK(index >= 0 && index + n <= total_) << "state range [" << index << ", " << index + n
                                                  << ") outside a partition of " << total_;
  c10::NoGradGuard no_grad;
  auto move = [&](const at::Tensor& t, float* p) {  // t: fp32 elements anywhere, p: host
    if (t.device().is_cpu() && t.is_contiguous()) {
      // One thread's memcpy: a load calls this a MiB at a time while its reader threads read, and
      // the intra-op threads a parallel copy_ wakes would take the cores from them.
      const size_t bytes = static_cast<size_t>(t.numel()) * sizeof(float);
      write ? std::memcpy(t.data_ptr<float>(), p, bytes) : std::memcpy(p, t.data_ptr<float>(), bytes);
      return;
    }
    at::Tensor h = at::from_blob(p, {t.numel()}, at::kFloat);
    if (write) {
      t.copy_(h);
    } else {
      h.copy_(t);
    }
  };
  if (swap_) {
    prefetched_ = 0;  // the bounce buffer below is a set's: a prefetched window goes
    const int r = what == "master" ? 0 : what == "exp_avg" ? 1 : what == "exp_avg_sq" ? 2 : -1;
    if (r < 0) throw Error("checkpoint: NVMe-offloaded optimizer state has no '" + what + "'");
    // Through one window buffer (no step runs: any is free), whole pages of the region at a time:
    // only the pages [index, index + n) touches move, and a write that covers its pages whole
    // reads nothing first, so a checkpoint streamed in a piece at a time costs what it writes.
    const at::Tensor& win = win_master_[0];
    const int64_t align = offload::kIoAlign, cap = round_up(window_ * 4, align), end = index + n;
    for (int64_t a = index; a < end;) {
      const int64_t b0 = a * 4 / align * align, b1 = std::min(b0 + cap, round_up(end * 4, align));
      const int64_t hi = std::min(end, b1 / 4), off = r * region_bytes_ + b0;
      if (!write || a * 4 != b0 || hi * 4 != b1) swap_->read(win.data_ptr(), b1 - b0, off);
      move(win.narrow(0, (a * 4 - b0) / 4, hi - a), buf + (a - index));
      if (write) swap_->write(win.data_ptr(), b1 - b0, off);
      a = hi;
    }
    return;
  }
  if (what == "master") {
    if (master_.defined()) {
      move(master_.narrow(0, index, n), buf);
      return;
    }
    for (const Piece& p : pieces_) {  // aliased: the parameters are the master weights
      const int64_t lo = std::max(index, p.offset), hi = std::min(index + n, p.offset + p.out.numel());
      if (lo < hi) move(p.out.narrow(0, lo - p.offset, hi - lo), buf + (lo - index));
    }
    return;
  }
  const auto st = optimizer_->state();
  const auto it = st.find(what);
  if (it == st.end() || !it->second.defined()) {
    throw Error("checkpoint: the optimizer " + optimizer_->name() + " has no state '" + what + "'");
  }
  move(it->second.narrow(0, index, n), buf);
}

}  // namespace zeal::zero

// --- gradient swap ---------------------------------------------------------------------------------

namespace zeal::zero {

void ShardStep::swap_gradients(std::shared_ptr<offload::SwapFile> file) {
  ZEAL_CHECK(swap_ && !gswap_) << "gradients swap beside an NVMe-offloaded optimizer state, once";
  c10::NoGradGuard no_grad;
  gswap_ = std::move(file);
  int64_t off = 0;
  for (Piece& p : pieces_) {
    gswap_off_.push_back(off);
    off += round_up(p.grad.numel() * static_cast<int64_t>(p.grad.element_size()), offload::kIoAlign);
    p.grad = at::empty(p.grad.sizes(), p.grad.options().device(at::kMeta));
  }
  gswap_bytes_ = off;
  gswap_->dir().require(gswap_bytes_, "the gradients offloaded to nvme (offload_optimizer)");
  gswap_written_.assign(pieces_.size(), 0);
  gswap_stats_.assign(pieces_.size(), {});
  for (int k = 0; k < sets_; ++k) {
    gbounce_[k] = arena_tensor(arena_, window_ + 2 * offload::kIoAlign / 4, at::kFloat);
    win_grad_[k] = arena_tensor(arena_, window_, at::kFloat);
  }
  gwriter_ = std::make_unique<offload::WriteBehind>(
      gswap_, offload::make_io_engine(gswap_->io().options(), std::string(gswap_->io().kind()) == "threads"), sets_);
  host_grad_ = at::Tensor();  // the gradient windows take its place
}

namespace {
// f(), a failed gradient write in it rethrown as what it means to the user.
template <class F>
void grad_write_io(F&& f) {
  try {
    f();
  } catch (const offload::IoError& e) {
    throw Error(fmt::format("the gradients offloaded to nvme (offload_optimizer) could not be written: {}", e.what()));
  }
}
}  // namespace

void ShardStep::finish_grad_writes() {
  if (!gwriter_) return;
  detail::ScopedWait waiting(detail::WaitKind::kWrite);
  grad_write_io([&] { gwriter_->drain(); });
}

void ShardStep::clear_grads() {
  finish_grad_writes();  // nothing in flight may land on what the next accumulation starts from
  std::fill(gswap_written_.begin(), gswap_written_.end(), 0);
  std::fill(gswap_stats_.begin(), gswap_stats_.end(), cpu::GradStats{});
}

void ShardStep::accumulate_grad(size_t k, const at::Tensor& g) {
  ZEAL_CHECK(gswap_ && k < pieces_.size()) << "accumulate_grad without gradient swap";
  c10::NoGradGuard no_grad;
  const Piece& p = pieces_[k];
  const int64_t n = p.grad.numel(), esize = static_cast<int64_t>(p.grad.element_size());
  ZEAL_CHECK(g.numel() == n) << "a piece's gradients of " << g.numel() << " elements for " << n;
  const at::ScalarType dtype = p.grad.scalar_type();
  // A window's worth of elements at a time through the sets' bounce buffers in turn (no step runs
  // now); each chunk's write goes on behind while the next is made and the backward goes on.
  const int64_t chunk = window_ * 4 / esize;
  // Adding to what an earlier micro-step wrote: those writes are done before it is read back.
  if (gswap_written_[k]) finish_grad_writes();
  cpu::GradStats s;
  for (int64_t c = 0; c < n; c += chunk) {
    const int64_t len = std::min(chunk, n - c), bytes = round_up(len * esize, offload::kIoAlign);
    const int64_t off = gswap_off_[k] + c * esize;
    const int slot = next_gslot_;
    next_gslot_ = (next_gslot_ + 1) % sets_;
    grad_write_io([&] {
      detail::ScopedWait waiting(detail::WaitKind::kWrite);
      gwriter_->wait_slot(slot);
    });
    at::Tensor buf = at::from_blob(gbounce_[slot].data_ptr(), {len}, at::TensorOptions().dtype(dtype));
    const at::Tensor part = g.narrow(0, c, len);
    if (gswap_written_[k]) {
      {
        detail::ScopedWait waiting(detail::WaitKind::kRead);
        gswap_->read(buf.data_ptr(), bytes, off);
      }
      buf.add_(part.scalar_type() == dtype ? part : part.to(dtype));  // as grad_shard_.add_ does
    } else {
      buf.copy_(part);
    }
    s = stats_from(buf, s);  // chunks are whole kStatsBlocks: the bits of the piece taken whole
    grad_write_io([&] { gwriter_->submit(slot, buf.data_ptr(), bytes, off); });
  }
  gswap_stats_[k] = s;
  gswap_written_[k] = 1;
}

at::Tensor ShardStep::read_grad(size_t k) {
  ZEAL_CHECK(gswap_ && k < pieces_.size()) << "read_grad without gradient swap";
  c10::NoGradGuard no_grad;
  const Piece& p = pieces_[k];
  const int64_t n = p.grad.numel(), esize = static_cast<int64_t>(p.grad.element_size());
  at::Tensor out = at::zeros({n}, p.grad.options().device(at::kCPU));
  if (!gswap_written_[k]) return out;
  finish_grad_writes();
  const int64_t chunk = window_ * 4 / esize;
  for (int64_t c = 0; c < n; c += chunk) {
    const int64_t len = std::min(chunk, n - c);
    {
      detail::ScopedWait waiting(detail::WaitKind::kRead);
      gswap_->read(gbounce_[0].data_ptr(), round_up(len * esize, offload::kIoAlign), gswap_off_[k] + c * esize);
    }
    out.narrow(0, c, len).copy_(at::from_blob(gbounce_[0].data_ptr(), {len}, out.options()));
  }
  return out;
}

// Elements [a, a + len) of the partition's gradients into win_grad_[k] as fp32: for each piece there,
// the aligned bytes around its part through set k's bounce buffer (zeros for a piece with none).
void ShardStep::read_grad_window(int64_t a, int64_t len, int k) {
  c10::NoGradGuard no_grad;
  for (size_t j = 0; j < pieces_.size(); ++j) {
    const Piece& p = pieces_[j];
    const int64_t lo = std::max(a, p.offset), hi = std::min(a + len, p.offset + p.grad.numel());
    if (lo >= hi) continue;
    at::Tensor dst = win_grad_[k].narrow(0, lo - a, hi - lo);
    if (!gswap_written_[j]) {
      dst.zero_();
      continue;
    }
    const int64_t esize = static_cast<int64_t>(p.grad.element_size());
    const int64_t first = gswap_off_[j] + (lo - p.offset) * esize, last = gswap_off_[j] + (hi - p.offset) * esize;
    const int64_t begin = first / offload::kIoAlign * offload::kIoAlign, end = round_up(last, offload::kIoAlign);
    gswap_->read(gbounce_[k].data_ptr(), end - begin, begin);
    dst.copy_(at::from_blob(static_cast<char*>(gbounce_[k].data_ptr()) + (first - begin), {hi - lo},
                            at::TensorOptions().dtype(p.grad.scalar_type())));
  }
}

}  // namespace zeal::zero
