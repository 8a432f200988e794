// The NCCL backend: NCCL's C API on a stream of its own. Each collective is ordered after the work
// queued on the device's *current* stream when it is issued; Work::wait() makes the then-current
// stream wait for it through an event, without blocking the host. A watchdog thread keeps the
// deadline: a collective still running when comm_timeout passes, or an asynchronous NCCL error,
// aborts the communicator (ncclCommAbort; never ncclCommDestroy after it), and every later call
// on it throws the CommError that names the collective and the ranks that had not reached it.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <string_view>
#include <vector>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "engine/comm/backends.h"
#include "engine/comm/monitor.h"
#include "engine/runtime/device_choice.h"

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
    case at::kBool: return ncclUint8;  // moved, never reduced (checked before)
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

// A collective in flight. Its event completes when the collective has; until then `keep` holds
// the temporaries it reads or writes.
struct NcclOp {
  OpInfo info;
  cudaEvent_t done = nullptr;  // destroyed with the last owner (the watchdog or a Work)
  std::chrono::steady_clock::time_point deadline;
  std::vector<at::Tensor> keep;
  std::atomic<bool> retired{false};  // the watchdog saw it complete
  bool blocking = false;             // wait() holds the host (barrier)
  ~NcclOp() {
    if (done) cudaEventDestroy(done);
  }
};

// The store keys of one communicator: the k-th NCCL communicator a rank creates on a store is
// "zeal/nccl/<k>/" on every rank (ranks create them in the same order), so a second communicator
// never reads the first one's unique id.
std::string communicator_prefix(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                std::chrono::milliseconds timeout) {
  auto s = store;
  const int64_t k = bounded<int64_t>([s, rank] { return s->add(fmt::format("zeal/nccl/created/{}", rank), 1); },
                                     timeout, "creating the NCCL communicator:");
  return fmt::format("zeal/nccl/{}/", k);
}

std::vector<uint8_t> to_bytes(const std::string& v) { return {v.begin(), v.end()}; }
std::string from_bytes(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

class NcclCommunicator;

class NcclWork final : public Work::Impl {
 public:
  NcclWork(NcclCommunicator* comm, std::shared_ptr<NcclOp> op) : comm_(comm), op_(std::move(op)) {}
  void wait() override;
  bool done() override;

 private:
  NcclCommunicator* comm_;
  std::shared_ptr<NcclOp> op_;
  bool waited_ = false;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world, int device,
                   std::chrono::milliseconds timeout, bool debug)
      : rank_(rank),
        world_(world),
        device_(device),
        prefix_(communicator_prefix(store, rank, timeout)),
        monitor_(store, prefix_, rank, world, timeout, debug) {
    cuda_check(cudaSetDevice(device), "cudaSetDevice");
    check_one_gpu_per_rank(store, timeout);
    init_communicator(store, timeout);
    {  // a stream of LibTorch's pool, so its caching allocator can record memory on it
      c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
      side_ = impl.getStreamFromGlobalPool(c10::Device(c10::DeviceType::CUDA, device), /*isHighPriority=*/true);
      stream_ = static_cast<cudaStream_t>(side_.native_handle());
    }
    cuda_check(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreate");
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclCommunicator() override {
    {
      // Let the watchdog retire what is in flight, or abort it at its deadline: never a wait
      // without one.
      std::unique_lock<std::mutex> lock(mu_);
      drained_.wait(lock, [this] { return in_flight_.empty() || failure_ || aborted_.load(); });
      stop_ = true;
    }
    cv_.notify_all();
    watchdog_.join();
    cudaSetDevice(device_);
    // ncclCommAbort freed the communicator; destroying it again is undefined. A non-blocking
    // communicator is finalized (waiting for NCCL's background work, under the deadline) first.
    if (!aborted_.load()) {
      ncclResult_t r = ncclCommFinalize(comm_);
      const auto deadline = std::chrono::steady_clock::now() + monitor_.timeout();
      while (r == ncclInProgress && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        if (ncclCommGetAsyncError(comm_, &r) != ncclSuccess) break;
      }
      if (r == ncclSuccess) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    }
    in_flight_.clear();
    cudaEventDestroy(ready_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend() const override { return "nccl"; }
  uint64_t sequence() const override { return monitor_.sequence(); }
  void set_progress(int64_t step, int64_t micro_step) override { monitor_.set_progress(step, micro_step); }
  void check_agreement(const std::string& where) override {
    rethrow_failure();
    monitor_.check_agreement(where);
  }
  void set_timeout(double seconds) override {
    monitor_.set_timeout(std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0)));
  }

  Work all_gather(const at::Tensor& shard, const at::Tensor& output) override {
    std::lock_guard<std::mutex> issuing(issue_mu_);  // no abort between the check and the enqueue
    check(shard, "all_gather", "shard");
    check(output, "all_gather", "output");
    const int64_t s = shard_size(output.numel());
    if (shard.numel() != s) throw Error(fmt::format("all_gather: the shard needs {} elements, has {}", s, shard.numel()));
    auto op = start("all_gather", output);
    at::Tensor target = s * world_ == output.numel() ? output : at::empty({s * world_}, output.options());
    uses(*op, shard);
    uses(*op, target);
    settle(ncclAllGather(shard.data_ptr(), target.data_ptr(), s, nccl_type(output), comm_, stream_), "ncclAllGather",
           *op);
    if (!target.is_same(output)) {
      uses(*op, output);
      cuda_check(cudaMemcpyAsync(output.data_ptr(), target.data_ptr(), output.nbytes(), cudaMemcpyDeviceToDevice, stream_),
                 "cudaMemcpyAsync");
    }
    return finish(op);
  }

  Work reduce_scatter(const at::Tensor& input, const at::Tensor& shard, ReduceOp op_kind) override {
    std::lock_guard<std::mutex> issuing(issue_mu_);  // no abort between the check and the enqueue
    check(input, "reduce_scatter", "input");
    check(shard, "reduce_scatter", "shard");
    const int64_t s = shard_size(input.numel());
    if (shard.numel() != s) throw Error(fmt::format("reduce_scatter: the shard needs {} elements, has {}", s, shard.numel()));
    auto op = start(fmt::format("reduce_scatter({})", to_string(op_kind)), input);
    at::Tensor source = input;
    uses(*op, input);
    uses(*op, shard);
    if (world_ == 1) {
      // One rank: its shard is its input, whatever the operation. NCCL is not asked: through it,
      // reduce_scatter(avg) of 100,003 float32 on one H200 rank left the last two elements of the
      // shard unwritten (NCCL 2.28.9; the cause is not known, torch's own call did not show it).
      if (!input.is_same(shard)) {
        cuda_check(cudaMemcpyAsync(shard.data_ptr(), input.data_ptr(), input.nbytes(), cudaMemcpyDeviceToDevice, stream_),
                   "cudaMemcpyAsync");
      }
      return finish(op);
    }
    if (s * world_ != input.numel()) {
      source = at::empty({s * world_}, input.options());
      uses(*op, source);
      cuda_check(cudaMemsetAsync(source.data_ptr(), 0, source.nbytes(), stream_), "cudaMemsetAsync");
      cuda_check(cudaMemcpyAsync(source.data_ptr(), input.data_ptr(), input.nbytes(), cudaMemcpyDeviceToDevice, stream_),
                 "cudaMemcpyAsync");
    }
    settle(ncclReduceScatter(source.data_ptr(), shard.data_ptr(), s, nccl_type(input), nccl_op(op_kind), comm_,
                             stream_),
           "ncclReduceScatter", *op);
    return finish(op);
  }

  Work all_reduce(const at::Tensor& tensor, ReduceOp op_kind) override {
    std::lock_guard<std::mutex> issuing(issue_mu_);  // no abort between the check and the enqueue
    check(tensor, "all_reduce", "tensor");
    auto op = start(fmt::format("all_reduce({})", to_string(op_kind)), tensor);
    uses(*op, tensor);
    if (world_ == 1) return finish(op);  // one rank: the sum, average and maximum of one value is that value
    settle(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), nccl_type(tensor), nccl_op(op_kind),
                         comm_, stream_),
           "ncclAllReduce", *op);
    return finish(op);
  }

  Work broadcast(const at::Tensor& tensor, int root) override {
    std::lock_guard<std::mutex> issuing(issue_mu_);  // no abort between the check and the enqueue
    check(tensor, "broadcast", "tensor");
    if (root < 0 || root >= world_) throw Error(fmt::format("broadcast: root {} is not a rank of {}", root, world_));
    auto op = start(fmt::format("broadcast(root {})", root), tensor);
    uses(*op, tensor);
    settle(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), nccl_type(tensor), root, comm_,
                         stream_),
           "ncclBroadcast", *op);
    return finish(op);
  }

  // A barrier holds the host: its wait() returns once every rank has reached it (or throws).
  Work barrier() override {
    std::lock_guard<std::mutex> issuing(issue_mu_);
    if (!barrier_buf_.defined()) {
      barrier_buf_ = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(at::Device(at::kCUDA, device_)));
    }
    check(barrier_buf_, "barrier", "flag");
    auto op = start("barrier", barrier_buf_);
    op->blocking = true;
    uses(*op, barrier_buf_);
    settle(ncclAllReduce(barrier_buf_.data_ptr(), barrier_buf_.data_ptr(), 1, ncclFloat32, ncclSum, comm_, stream_),
           "ncclAllReduce", *op);
    return finish(op);
  }

  // NcclWork::wait: the current stream waits for the collective; the host does not (a barrier's
  // host waits, the watchdog keeping the deadline).
  void wait(NcclOp& op) {
    rethrow_failure();
    if (op.blocking) {
      std::unique_lock<std::mutex> lock(mu_);
      drained_.wait(lock, [&] { return op.retired.load() || failure_ != nullptr; });
      if (failure_) std::rethrow_exception(failure_);
      return;
    }
    if (op.retired.load()) return;  // complete: nothing to order after
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    cuda_check(cudaStreamWaitEvent(current_stream(), op.done, 0), "cudaStreamWaitEvent");
  }
  bool completed(const NcclOp& op) {
    rethrow_failure();
    return op.retired.load() || cudaEventQuery(op.done) == cudaSuccess;
  }

 private:
  // NCCL needs one GPU per rank. Ranks on one machine that see the same GPU (CUDA_VISIBLE_DEVICES=0
  // given to every rank, a process count above the GPU count) are named before NCCL would fail or
  // hang on them: each rank posts its host and the GPU's PCI bus id.
  void check_one_gpu_per_rank(const c10::intrusive_ptr<c10d::Store>& store, std::chrono::milliseconds timeout) {
    char bus[32] = {0};
    cuda_check(cudaDeviceGetPCIBusId(bus, sizeof bus - 1, device_), "cudaDeviceGetPCIBusId");
    char host[256] = {0};
    gethostname(host, sizeof host - 1);
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    const GpuOfRank mine{host, this_host_id(), bus, device_, visible ? visible : "(unset)"};
    auto s = store;
    const std::string key = prefix_ + "gpu/";
    run_bounded([s, k = key + std::to_string(rank_), v = to_bytes(mine.encode())] { s->set(k, v); }, timeout,
                "exchanging the ranks' GPUs:");
    std::vector<GpuOfRank> all;
    for (int r = 0; r < world_; ++r) {
      const std::string k = key + std::to_string(r);
      all.push_back(GpuOfRank::decode(from_bytes(bounded<std::vector<uint8_t>>(
          [s, k, timeout] {
            s->wait({k}, timeout);
            return s->get(k);
          },
          timeout + std::chrono::seconds(5), "exchanging the ranks' GPUs:"))));
    }
    const std::string shared = describe_shared_gpu(all);
    if (!shared.empty()) throw Error(shared);
  }

  // ncclCommInitRankConfig without blocking, under comm_timeout: a peer that stopped after the id
  // exchange (or never arrived) is named instead of hanging every rank in NCCL's bootstrap.
  void init_communicator(const c10::intrusive_ptr<c10d::Store>& store, std::chrono::milliseconds timeout) {
    ncclUniqueId id;
    auto s = store;
    const std::string key = prefix_ + "unique_id";
    if (rank_ == 0) {
      nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
      const std::vector<uint8_t> value(reinterpret_cast<uint8_t*>(&id), reinterpret_cast<uint8_t*>(&id) + sizeof id);
      run_bounded([s, key, value] { s->set(key, value); }, timeout, "publishing the NCCL unique id:");
    } else {
      // Every store call under the deadline of the collectives (a stopped store host is named).
      const auto bytes = bounded<std::vector<uint8_t>>(
          [s, key, timeout] {
            s->wait({key}, timeout);
            return s->get(key);
          },
          timeout + std::chrono::seconds(5), "waiting for rank 0's NCCL unique id:");
      if (bytes.size() != sizeof id) throw Error("the NCCL unique id in the store has the wrong size");
      std::memcpy(&id, bytes.data(), sizeof id);
    }
    run_bounded([s, k = prefix_ + "init/" + std::to_string(rank_)] { s->set(k, std::vector<uint8_t>{1}); }, timeout,
                "creating the NCCL communicator:");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t started = ncclCommInitRankConfig(&comm_, world_, id, rank_, &config);
    if (started != ncclSuccess && started != ncclInProgress) {
      if (comm_) ncclCommAbort(comm_);
      comm_ = nullptr;
      nccl_check(started, "ncclCommInitRankConfig");
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      ncclResult_t state = ncclInProgress;
      const ncclResult_t asked = ncclCommGetAsyncError(comm_, &state);
      if (asked != ncclSuccess) {
        ncclCommAbort(comm_);  // its bootstrap threads stop with it
        comm_ = nullptr;
        nccl_check(asked, "ncclCommGetAsyncError");
      }
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
        nccl_check(state, "ncclCommInitRankConfig");
      }
      if (std::chrono::steady_clock::now() > deadline) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
        std::vector<int> missing;
        for (int r = 0; r < world_; ++r) {
          const std::string k = prefix_ + "init/" + std::to_string(r);
          if (!bounded<bool>([s, k] { return s->check({k}); }, std::chrono::seconds(5), "creating the NCCL communicator:"))
            missing.push_back(r);
        }
        throw Error(fmt::format(
            "rank {}: creating the NCCL communicator timed out after {:g} s (comm_timeout){}", rank_,
            timeout.count() / 1000.0,
            missing.empty() ? std::string(": every rank started it, so a rank stopped or lost its network during NCCL's "
                                          "set-up (NCCL_DEBUG=INFO shows where)")
                            : fmt::format("; rank{} {} never started it", missing.size() == 1 ? "" : "s",
                                          fmt::join(missing, ", "))));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  // A collective enqueued on the non-blocking communicator may still be in progress when its call
  // returns (NCCL connects lazily); the next NCCL call must wait until it is not. A call that fails,
  // or stays in progress past comm_timeout, aborts the communicator and is reported like a collective
  // that timed out: the ranks that had not reached it are named. The caller holds issue_mu_.
  void settle(ncclResult_t r, const char* what, const NcclOp& op) {
    if (r == ncclInProgress) {
      const auto deadline = std::chrono::steady_clock::now() + monitor_.timeout();
      do {
        if (std::chrono::steady_clock::now() > deadline) {
          fail_issuing(op.info, fmt::format("{} still in progress after {:g} s (comm_timeout)", what,
                                            monitor_.timeout().count() / 1000.0));
        }
        std::this_thread::yield();
        if (ncclCommGetAsyncError(comm_, &r) != ncclSuccess) break;
      } while (r == ncclInProgress);
    }
    if (r != ncclSuccess) fail_issuing(op.info, fmt::format("{}: {}", what, ncclGetErrorString(r)));
  }

  // Aborts the communicator from a thread that holds issue_mu_ (the watchdog's lock order: issue_mu_,
  // then mu_), keeps the report naming the ranks that had not reached `info` for every later call,
  // and throws it.
  [[noreturn]] void fail_issuing(const OpInfo& info, const std::string& cause) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!aborted_.load()) {
        aborted_.store(true);
        ncclCommAbort(comm_);
      }
    }
    std::exception_ptr error;
    try {
      monitor_.fail(info, cause);  // asks the store which ranks had not reached it
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failure_) failure_ = error;
      drained_.notify_all();
    }
    std::rethrow_exception(error);
  }

  cudaStream_t current_stream() const {
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    return static_cast<cudaStream_t>(impl.getStream(c10::Device(c10::DeviceType::CUDA, device_)).native_handle());
  }

  std::shared_ptr<NcclOp> start(std::string name, const at::Tensor& t) {
    rethrow_failure();
    auto op = std::make_shared<NcclOp>();
    op->info = monitor_.begin(std::move(name), label(), t.numel(), dtype_name(c10::toString(t.scalar_type())));
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    // After everything queued so far on the stream the program computes on now.
    cuda_check(cudaEventRecord(ready_, current_stream()), "cudaEventRecord");
    cuda_check(cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent");
    cuda_check(cudaEventCreateWithFlags(&op->done, cudaEventDisableTiming), "cudaEventCreate");
    return op;
  }

  // The caching allocator must not hand `t`'s memory to another tensor before this stream is done.
  void uses(NcclOp& op, const at::Tensor& t) {
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    impl.recordDataPtrOnStream(t.storage().data_ptr(), side_);
    op.keep.push_back(t);
  }

  Work finish(const std::shared_ptr<NcclOp>& op) {
    cuda_check(cudaEventRecord(op->done, stream_), "cudaEventRecord");
    op->deadline = std::chrono::steady_clock::now() + monitor_.timeout();
    {
      std::lock_guard<std::mutex> lock(mu_);
      in_flight_.push_back(op);
    }
    cv_.notify_all();
    return Work(std::make_shared<NcclWork>(this, op));
  }

  // Throws the stored failure; once the communicator is aborted, waits for the watchdog's report
  // (it is being written) rather than touching the aborted communicator.
  void rethrow_failure() {
    std::unique_lock<std::mutex> lock(mu_);
    if (aborted_.load()) drained_.wait(lock, [this] { return failure_ != nullptr; });
    if (failure_) std::rethrow_exception(failure_);
  }

  // The watchdog: retires completed collectives in order; aborts the communicator on an
  // asynchronous error or when the oldest one passes its deadline.
  void watch() {
    cudaSetDevice(device_);  // this thread's CUDA calls on the rank's GPU, not GPU 0
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (in_flight_.empty()) {
        cv_.wait(lock, [this] { return stop_ || !in_flight_.empty(); });
      } else {
        cv_.wait_for(lock, std::chrono::microseconds(200));  // polling the oldest collective's event
      }
      if (stop_) return;
      bool retired = false;
      cudaError_t query = cudaSuccess;
      while (!in_flight_.empty() && (query = cudaEventQuery(in_flight_.front()->done)) == cudaSuccess) {
        in_flight_.front()->keep.clear();
        in_flight_.front()->retired.store(true);
        in_flight_.pop_front();
        retired = true;
      }
      if (retired) drained_.notify_all();
      if (in_flight_.empty() || failure_ || aborted_.load()) continue;
      std::string cause;
      ncclResult_t async_error = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async_error);
      if (query != cudaSuccess && query != cudaErrorNotReady) {
        cause = fmt::format("CUDA error: {}", cudaGetErrorString(query));
      } else if (async_error != ncclSuccess && async_error != ncclInProgress) {
        cause = fmt::format("NCCL error: {}", ncclGetErrorString(async_error));
      } else if (std::chrono::steady_clock::now() > in_flight_.front()->deadline) {
        cause = fmt::format("timed out after {:g} s (comm_timeout)", monitor_.timeout().count() / 1000.0);
      }
      if (cause.empty()) continue;
      const OpInfo info = in_flight_.front()->info;
      // Abort only between two collectives' enqueues: the issue lock first (lock order: issue_mu_,
      // then mu_), so no call is inside NCCL with the communicator being freed.
      lock.unlock();
      {
        std::lock_guard<std::mutex> issuing(issue_mu_);
        lock.lock();
        aborted_.store(true);
        ncclCommAbort(comm_);  // the stuck kernels return; the streams waiting on them move on
      }
      lock.unlock();
      std::exception_ptr error;
      try {
        monitor_.fail(info, cause);  // asks the store which ranks had not reached it
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      failure_ = error;
      drained_.notify_all();
    }
  }

  void check(const at::Tensor& t, const char* op, const char* what) const {
    if (!t.defined()) throw Error(fmt::format("{}: the {} tensor is undefined", op, what));
    if (!t.is_cuda() || t.device().index() != device_) {
      throw Error(fmt::format("{}: the {} tensor is on {}; this rank's NCCL communicator works on cuda:{}", op, what,
                              t.device().str(), device_));
    }
    if (!t.is_contiguous()) throw Error(fmt::format("{}: the {} tensor must be contiguous", op, what));
    (void)nccl_type(t);  // an unsupported dtype fails here, before the collective is counted
    const bool reduces = std::string_view(op) == "all_reduce" || std::string_view(op) == "reduce_scatter";
    if (reduces && t.scalar_type() == at::kBool) {
      throw Error(fmt::format("{}: NCCL does not reduce bool tensors (the {} tensor)", op, what));
    }
  }

  int rank_, world_, device_;
  std::string prefix_;  // this communicator's store keys
  Monitor monitor_;
  ncclComm_t comm_ = nullptr;
  c10::Stream side_{c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CUDA, 0)};
  cudaStream_t stream_ = nullptr;  // side_'s
  cudaEvent_t ready_ = nullptr;
  at::Tensor barrier_buf_;
  std::mutex issue_mu_;  // held while a collective is checked and enqueued, and while aborting
  std::mutex mu_;
  std::condition_variable cv_, drained_;
  std::deque<std::shared_ptr<NcclOp>> in_flight_;
  std::exception_ptr failure_;
  std::atomic<bool> aborted_{false};
  bool stop_ = false;
  std::thread watchdog_;
};

void NcclWork::wait() {
  if (waited_) return;
  comm_->wait(*op_);
  waited_ = true;
}

bool NcclWork::done() { return comm_->completed(*op_); }

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                                     int device, std::chrono::milliseconds timeout, bool debug) {
  return std::make_unique<NcclCommunicator>(store, rank, world, device, timeout, debug);
}

}  // namespace zeal::detail
