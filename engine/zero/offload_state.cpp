#include "engine/zero/offload_state.h"

#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>

#include <chrono>
#include <cstdint>

#include "engine/error.h"
#include "engine/wait_clock.h"
#include "engine/zero/host_memory.h"

namespace zeal::zero {

at::Tensor arena_tensor(const std::shared_ptr<offload::HostArena>& arena, int64_t n, at::ScalarType dtype) {
  const size_t bytes = static_cast<size_t>(n) * c10::elementSize(dtype);
  void* p = arena->allocate(bytes);
  return at::from_blob(
      p, {n}, [arena, bytes](void* q) { arena->release(q, bytes); }, at::TensorOptions().dtype(dtype).device(at::kCPU));
}

namespace {
int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }
}  // namespace

ParamSwap::ParamSwap(std::shared_ptr<offload::SwapDir> dir, std::shared_ptr<offload::IoEngine> io,
                     ParamSwapOptions options, std::shared_ptr<offload::HostArena> host)
    : options_(options),
      file_(std::make_unique<offload::SwapFile>(std::move(dir), std::move(io), "parameters.swp")),
      arena_(std::move(host)) {
  reader_io_ = offload::make_io_engine(file_->io().options(), std::string(file_->io().kind()) == "threads");
  reader_ = std::thread([this] { reader_loop(); });
}

ParamSwap::ParamSwap(std::shared_ptr<offload::HostArena> arena, ParamSwapOptions options)
    : options_(options), arena_(std::move(arena)) {
  ZEAL_CHECK(arena_) << "a parameter store in host memory without an arena";
}

ParamSwap::~ParamSwap() {
  // Copies to a GPU queued from the host regions (a last gather, at the engine's end) finish before
  // their memory goes.
  if (copy_device_ >= 0) {
    try {
      at::accelerator::synchronizeDevice(static_cast<c10::DeviceIndex>(copy_device_));
    } catch (...) {  // a destructor: a device already in error has nothing more to copy
    }
  }
  if (!reader_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  reader_.join();  // runs what was started: the tensors it reads into are its own references
}

int64_t ParamSwap::host_bytes() const { return arena_ ? arena_->bytes() : 0; }
int64_t ParamSwap::host_peak() const { return arena_ ? arena_->peak() : 0; }

at::Tensor ParamSwap::host_region(const at::Tensor& t, int64_t offset) const {
  const auto it = regions_.find(offset);
  ZEAL_CHECK(it != regions_.end() && it->second.numel() >= t.numel() * t.element_size())
      << "no host region of " << t.numel() * t.element_size() << " bytes at offset " << offset;
  return at::from_blob(it->second.data_ptr(), {t.numel()}, t.options().device(at::kCPU));
}

void ParamSwap::reader_loop() {
  for (;;) {
    std::packaged_task<void()> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();  // an I/O error is kept in the job's future
  }
}

bool ParamSwap::has_room(int64_t elems) const {
  return in_flight_ < options_.buffer_count && in_flight_elems_ + elems <= options_.buffer_count * options_.buffer_elems;
}

ParamSwap::Reading ParamSwap::start_read(const at::Tensor& t, int64_t offset) {
  ZEAL_CHECK(t.device().is_cpu()) << "a read-ahead of a shard that is not on the CPU";
  const int64_t bytes = t.numel() * t.element_size();
  Reading r;
  r.elems = t.numel();
  if (in_host(offset)) {  // a copy, done now
    load(t, offset);
    std::promise<void> done;
    done.set_value();
    r.done = done.get_future().share();
  } else {
    free_storage(t);
    alloc_storage_mapped(t);
    std::packaged_task<void()> job([this, t, offset, bytes] {
      file_->read(*reader_io_, t.data_ptr(), round_up(bytes, offload::kIoAlign), offset);
    });
    r.done = job.get_future().share();
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_one();
  }
  ++in_flight_;
  in_flight_elems_ += r.elems;
  ++read_ahead_count_;
  return r;
}

void ParamSwap::finish(Reading& r) {
  if (!r.valid()) return;
  if (r.done.wait_for(std::chrono::seconds(0)) != std::future_status::ready) ++waited_reads_;
  std::shared_future<void> done = std::move(r.done);
  r.done = {};
  --in_flight_;
  in_flight_elems_ -= r.elems;
  detail::ScopedWait waiting(detail::WaitKind::kRead);
  done.get();  // rethrows the reader's IoError
}

int64_t ParamSwap::reserve(int64_t bytes, bool host) {
  if (host || !file_) {
    ZEAL_CHECK(arena_) << "a shard kept in host memory by a parameter store without host memory";
    const int64_t at = kHostRegion | host_end_;
    host_end_ += round_up(std::max<int64_t>(bytes, 1), offload::kIoAlign);
    regions_.emplace(at, arena_tensor(arena_, std::max<int64_t>(bytes, 1), at::kByte));
    return at;
  }
  const int64_t at = end_;
  end_ += round_up(std::max<int64_t>(bytes, 1), offload::kIoAlign);
  return at;
}

void ParamSwap::store(const at::Tensor& t, int64_t offset) {
  const int64_t bytes = t.numel() * t.element_size();
  if (in_host(offset)) {
    host_region(t, offset).copy_(t);  // from a GPU: waits for the copy (the shard is freed or written next)
    return;
  }
  if (t.device().is_cpu()) {
    // Mapped storage (alloc_storage_mapped): page-aligned whole pages, the tail past the tensor's
    // bytes zero, so it goes to disk as it is.
    ZEAL_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % offload::kIoAlign == 0)
        << "a parameter shard stored from storage that is not mapped";
    detail::ScopedWait waiting(detail::WaitKind::kWrite);
    file_->write(t.data_ptr(), round_up(bytes, offload::kIoAlign), offset);
    return;
  }
  offload::AlignedBuffer buf(bytes);  // whole 4 KiB blocks, the tail zero
  at::from_blob(buf.data(), {t.numel()}, t.options().device(at::kCPU)).copy_(t);
  detail::ScopedWait waiting(detail::WaitKind::kWrite);
  file_->write(buf.data(), buf.size(), offset);
}

void ParamSwap::load(const at::Tensor& t, int64_t offset) {
  const int64_t bytes = t.numel() * t.element_size();
  if (in_host(offset)) {
    // To a GPU from page-locked memory: queued on the current stream, which the all-gather follows;
    // the region is written again only by a store, which waits for the copies before it.
    alloc_storage(t);
    const bool async = t.is_cuda() && arena_->pinned();
    t.copy_(host_region(t, offset), /*non_blocking=*/async);
    if (async) copy_device_ = t.device().index() < 0 ? 0 : t.device().index();
    return;
  }
  if (t.device().is_cpu()) {
    free_storage(t);
    alloc_storage_mapped(t);  // page-aligned whole pages: read straight into the shard
    detail::ScopedWait waiting(detail::WaitKind::kRead);
    file_->read(t.data_ptr(), round_up(bytes, offload::kIoAlign), offset);
    return;
  }
  offload::AlignedBuffer buf(bytes);
  {
    detail::ScopedWait waiting(detail::WaitKind::kRead);
    file_->read(buf.data(), buf.size(), offset);
  }
  alloc_storage(t);
  t.copy_(at::from_blob(buf.data(), {t.numel()}, t.options().device(at::kCPU)));
}

}  // namespace zeal::zero
