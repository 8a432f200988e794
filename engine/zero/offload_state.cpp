#include "engine/zero/offload_state.h"

#include <ATen/ATen.h>

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
                     ParamSwapOptions options)
    : options_(options), file_(std::move(dir), std::move(io), "parameters.swp") {
  reader_io_ = offload::make_io_engine(file_.io().options(), std::string(file_.io().kind()) == "threads");
  reader_ = std::thread([this] { reader_loop(); });
}

ParamSwap::~ParamSwap() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  reader_.join();  // runs what was started: the tensors it reads into are its own references
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
  free_storage(t);
  alloc_storage_mapped(t);
  std::packaged_task<void()> job([this, t, offset, bytes] {
    file_.read(*reader_io_, t.data_ptr(), round_up(bytes, offload::kIoAlign), offset);
  });
  Reading r;
  r.done = job.get_future().share();
  r.elems = t.numel();
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
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

int64_t ParamSwap::reserve(int64_t bytes) {
  const int64_t at = end_;
  end_ += round_up(std::max<int64_t>(bytes, 1), offload::kIoAlign);
  return at;
}

void ParamSwap::store(const at::Tensor& t, int64_t offset) {
  const int64_t bytes = t.numel() * t.element_size();
  if (t.device().is_cpu()) {
    // Mapped storage (alloc_storage_mapped): page-aligned whole pages, the tail past the tensor's
    // bytes zero, so it goes to disk as it is.
    ZEAL_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % offload::kIoAlign == 0)
        << "a parameter shard stored from storage that is not mapped";
    detail::ScopedWait waiting(detail::WaitKind::kWrite);
    file_.write(t.data_ptr(), round_up(bytes, offload::kIoAlign), offset);
    return;
  }
  offload::AlignedBuffer buf(bytes);  // whole 4 KiB blocks, the tail zero
  at::from_blob(buf.data(), {t.numel()}, t.options().device(at::kCPU)).copy_(t);
  detail::ScopedWait waiting(detail::WaitKind::kWrite);
  file_.write(buf.data(), buf.size(), offset);
}

void ParamSwap::load(const at::Tensor& t, int64_t offset) {
  const int64_t bytes = t.numel() * t.element_size();
  if (t.device().is_cpu()) {
    free_storage(t);
    alloc_storage_mapped(t);  // page-aligned whole pages: read straight into the shard
    detail::ScopedWait waiting(detail::WaitKind::kRead);
    file_.read(t.data_ptr(), round_up(bytes, offload::kIoAlign), offset);
    return;
  }
  offload::AlignedBuffer buf(bytes);
  {
    detail::ScopedWait waiting(detail::WaitKind::kRead);
    file_.read(buf.data(), buf.size(), offset);
  }
  alloc_storage(t);
  t.copy_(at::from_blob(buf.data(), {t.numel()}, t.options().device(at::kCPU)));
}

}  // namespace zeal::zero
