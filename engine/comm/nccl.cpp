// The NCCL backend: NCCL's C API on a stream of its own. Each collective waits (on the GPU) for
// the work already queued on the compute stream, and Work::wait() polls its completion event
// against the deadline, so a hang becomes a CommError (after ncclCommAbort) instead of a stall.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "engine/comm/backends.h"
#include "engine/comm/monitor.h"

namespace zeal::detail {
namespace {

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(fmt::format("{}: {}", what, cudaGetErrorString(e)));
}

void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw Error(fmt::format("{}: {}", what, ncclGetErrorString(r)));
}

ncclDataType_t nccl_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ncclFloat32;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kLong: return ncclInt64;
    case at::kInt: return ncclInt32;
    case at::kDouble: return ncclFloat64;
    case at::kByte: return ncclUint8;
    case at::kChar: return ncclInt8;
    default: throw Error(fmt::format("NCCL does not reduce {}", c10::toString(t.scalar_type())));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
  }
  return ncclSum;
}

class NcclWork final : public Work::Impl {
 public:
  NcclWork(Monitor* monitor, OpInfo info, ncclComm_t comm, cudaEvent_t done, cudaStream_t compute)
      : monitor_(monitor), info_(std::move(info)), comm_(comm), done_event_(done), compute_(compute) {}
  ~NcclWork() override { cudaEventDestroy(done_event_); }

  std::vector<at::Tensor> keep;  // temporaries the collective reads or writes

  void wait() override {
    if (finished_) return;
    const auto deadline = std::chrono::steady_clock::now() + monitor_->timeout();
    for (;;) {
      const cudaError_t q = cudaEventQuery(done_event_);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) monitor_->fail(info_, fmt::format("CUDA error: {}", cudaGetErrorString(q)));
      ncclResult_t async_error = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async_error);
      if (async_error != ncclSuccess && async_error != ncclInProgress) {
        ncclCommAbort(comm_);
        monitor_->fail(info_, fmt::format("NCCL error: {}", ncclGetErrorString(async_error)));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        ncclCommAbort(comm_);
        monitor_->fail(info_, fmt::format("timed out after {:g} s (comm_timeout)", monitor_->timeout().count() / 1000.0));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    // Later work on the compute stream sees the result.
    cudaStreamWaitEvent(compute_, done_event_, 0);
    keep.clear();
    finished_ = true;
  }

  bool done() override { return finished_ || cudaEventQuery(done_event_) == cudaSuccess; }
  cudaEvent_t event() const { return done_event_; }

 private:
  Monitor* monitor_;
  OpInfo info_;
  ncclComm_t comm_;
  cudaEvent_t done_event_;
  cudaStream_t compute_;
  bool finished_ = false;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world, int device,
                   std::chrono::milliseconds timeout, bool debug)
      : rank_(rank), world_(world), device_(device), monitor_(store, "zeal/nccl/", rank, world, timeout, debug) {
    cuda_check(cudaSetDevice(device), "cudaSetDevice");
    ncclUniqueId id;
    const std::string key = "zeal/nccl/unique_id";
    if (rank == 0) {
      nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
      store->set(key, std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&id), reinterpret_cast<uint8_t*>(&id) + sizeof id));
    } else {
      store->wait({key}, timeout);
      auto bytes = store->get(key);
      if (bytes.size() != sizeof id) throw Error("the NCCL unique id in the store has the wrong size");
      std::memcpy(&id, bytes.data(), sizeof id);
    }
    nccl_check(ncclCommInitRank(&comm_, world, id, rank), "ncclCommInitRank");
    cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    cuda_check(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreate");
  }

  ~NcclCommunicator() override {
    cudaStreamSynchronize(stream_);
    ncclCommDestroy(comm_);
    cudaEventDestroy(ready_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend() const override { return "nccl"; }
  uint64_t sequence() const override { return monitor_.sequence(); }
  void set_progress(int64_t step, int64_t micro_step) override { monitor_.set_progress(step, micro_step); }
  void check_agreement(const std::string& where) override { monitor_.check_agreement(where); }
  void set_timeout(double seconds) override {
    monitor_.set_timeout(std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0)));
  }

  Work all_gather(const at::Tensor& shard, const at::Tensor& output) override {
    check(shard, "all_gather");
    check(output, "all_gather");
    const int64_t s = shard_size(output.numel());
    if (shard.numel() != s) throw Error(fmt::format("all_gather: the shard needs {} elements, has {}", s, shard.numel()));
    auto work = start("all_gather", output);
    at::Tensor target = s * world_ == output.numel() ? output : at::empty({s * world_}, output.options());
    nccl_check(ncclAllGather(shard.data_ptr(), target.data_ptr(), s, nccl_type(output), comm_, stream_), "ncclAllGather");
    if (!target.is_same(output)) {
      cuda_check(cudaMemcpyAsync(output.data_ptr(), target.data_ptr(), output.nbytes(), cudaMemcpyDeviceToDevice, stream_),
                 "cudaMemcpyAsync");
      work->keep.push_back(target);
    }
    return finish(work);
  }

  Work reduce_scatter(const at::Tensor& input, const at::Tensor& shard, ReduceOp op) override {
    check(input, "reduce_scatter");
    check(shard, "reduce_scatter");
    const int64_t s = shard_size(input.numel());
    if (shard.numel() != s) throw Error(fmt::format("reduce_scatter: the shard needs {} elements, has {}", s, shard.numel()));
    auto work = start(fmt::format("reduce_scatter({})", to_string(op)), input);
    at::Tensor source = input;
    if (s * world_ != input.numel()) {
      source = at::empty({s * world_}, input.options());
      cuda_check(cudaMemsetAsync(source.data_ptr(), 0, source.nbytes(), stream_), "cudaMemsetAsync");
      cuda_check(cudaMemcpyAsync(source.data_ptr(), input.data_ptr(), input.nbytes(), cudaMemcpyDeviceToDevice, stream_),
                 "cudaMemcpyAsync");
      work->keep.push_back(source);
    }
    nccl_check(ncclReduceScatter(source.data_ptr(), shard.data_ptr(), s, nccl_type(input), nccl_op(op), comm_, stream_),
               "ncclReduceScatter");
    return finish(work);
  }

  Work all_reduce(const at::Tensor& tensor, ReduceOp op) override {
    check(tensor, "all_reduce");
    auto work = start(fmt::format("all_reduce({})", to_string(op)), tensor);
    nccl_check(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), nccl_type(tensor), nccl_op(op), comm_,
                             stream_),
               "ncclAllReduce");
    return finish(work);
  }

  Work broadcast(const at::Tensor& tensor, int root) override {
    check(tensor, "broadcast");
    if (root < 0 || root >= world_) throw Error(fmt::format("broadcast: root {} is not a rank of {}", root, world_));
    auto work = start(fmt::format("broadcast(root {})", root), tensor);
    nccl_check(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), nccl_type(tensor), root, comm_, stream_),
               "ncclBroadcast");
    return finish(work);
  }

  Work barrier() override {
    if (!barrier_buf_.defined()) {
      barrier_buf_ = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(at::Device(at::kCUDA, device_)));
    }
    return all_reduce(barrier_buf_, ReduceOp::kSum);
  }

  // The stream whose queued work collectives wait for; the legacy default stream unless set.
  void set_compute_stream(cudaStream_t s) { compute_ = s; }

 private:
  std::shared_ptr<NcclWork> start(std::string name, const at::Tensor& t) {
    OpInfo info = monitor_.begin(std::move(name), label(), t.numel(), dtype_name(c10::toString(t.scalar_type())));
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    cuda_check(cudaEventRecord(ready_, compute_), "cudaEventRecord");
    cuda_check(cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent");
    cudaEvent_t done;
    cuda_check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
    return std::make_shared<NcclWork>(&monitor_, info, comm_, done, compute_);
  }

  Work finish(const std::shared_ptr<NcclWork>& work) {
    // The event was created in start(); record it after the collective.
    cuda_check(cudaEventRecord(work->event(), stream_), "cudaEventRecord");
    return Work(work);
  }

  void check(const at::Tensor& t, const char* op) const {
    if (!t.defined() || !t.is_cuda()) throw Error(fmt::format("{}: the NCCL communicator takes CUDA tensors", op));
    if (!t.is_contiguous()) throw Error(fmt::format("{}: tensors must be contiguous", op));
  }

  int rank_, world_, device_;
  Monitor monitor_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaStream_t compute_ = nullptr;  // legacy default stream
  cudaEvent_t ready_ = nullptr;
  at::Tensor barrier_buf_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                                     int device, std::chrono::milliseconds timeout, bool debug) {
  return std::make_unique<NcclCommunicator>(store, rank, world, device, timeout, debug);
}

}  // namespace zeal::detail
