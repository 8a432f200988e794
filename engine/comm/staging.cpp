#include "engine/comm/staging.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <map>
#include <mutex>

#include <fmt/format.h>

namespace zeal::detail {
namespace {

// Finishes the host collective, then brings its result back to the device.
class StagedWork final : public Work::Impl {
 public:
  StagedWork(Work host, std::function<void()> back) : host_(std::move(host)), back_(std::move(back)) {}

  void wait() override {
    host_.wait();
    std::lock_guard<std::mutex> lock(mu_);
    if (back_) {
      auto back = std::move(back_);
      back_ = nullptr;
      back();
    }
  }
  bool done() override { return host_.done(); }

 private:
  Work host_;
  std::mutex mu_;
  std::function<void()> back_;
};

class StagingCommunicator final : public Communicator {
 public:
  explicit StagingCommunicator(std::unique_ptr<Communicator> host) : host_(std::move(host)) {}

  int rank() const override { return host_->rank(); }
  int world_size() const override { return host_->world_size(); }
  std::string backend() const override { return host_->backend(); }
  uint64_t sequence() const override { return host_->sequence(); }
  void set_progress(int64_t step, int64_t micro_step) override { host_->set_progress(step, micro_step); }
  void check_agreement(const std::string& where) override { host_->check_agreement(where); }
  void set_timeout(double seconds) override { host_->set_timeout(seconds); }
  int64_t buffer_bytes() const override { return host_->buffer_bytes(); }

  Work all_gather(const at::Tensor& shard, const at::Tensor& output) override {
    const auto device = common_device("all_gather", {&shard, &output});
    if (!device) return labelled().all_gather(shard, output);
    at::Tensor host_shard = to_host(shard), host_out = host_like(output);
    return staged(labelled().all_gather(host_shard, host_out), output, host_out);
  }

  Work reduce_scatter(const at::Tensor& input, const at::Tensor& shard, ReduceOp op) override {
    const auto device = common_device("reduce_scatter", {&input, &shard});
    if (!device) return labelled().reduce_scatter(input, shard, op);
    at::Tensor host_in = to_host(input), host_shard = host_like(shard);
    return staged(labelled().reduce_scatter(host_in, host_shard, op), shard, host_shard);
  }

  Work all_reduce(const at::Tensor& tensor, ReduceOp op) override {
    if (!common_device("all_reduce", {&tensor})) return labelled().all_reduce(tensor, op);
    at::Tensor host = to_host(tensor);
    return staged(labelled().all_reduce(host, op), tensor, host);
  }

  Work broadcast(const at::Tensor& tensor, int root) override {
    if (!common_device("broadcast", {&tensor})) return labelled().broadcast(tensor, root);
    at::Tensor host = to_host(tensor);
    return staged(labelled().broadcast(host, root), tensor, host);
  }

  Work barrier() override { return labelled().barrier(); }

 private:
  // The host communicator, describing its next collective with this one's label.
  Communicator& labelled() {
    host_->set_label(label());
    return *host_;
  }

  // nullopt when every tensor is on the CPU, else their common CUDA device.
  std::optional<at::Device> common_device(const char* op, std::initializer_list<const at::Tensor*> ts) const {
    std::optional<at::Device> device;
    bool any_cpu = false;
    for (const at::Tensor* t : ts) {
      if (!t->defined()) return std::nullopt;  // the host communicator names it
      if (t->device().is_cpu()) {
        any_cpu = true;
        continue;
      }
      if (!t->device().is_cuda()) {
        throw Error(fmt::format("{}: a tensor is on {}; the {} communicator takes CPU and CUDA tensors", op,
                                t->device().str(), host_->backend()));
      }
      if (device && *device != t->device()) {
        throw Error(fmt::format("{}: the tensors are on {} and {}; a collective takes them on one device", op,
                                device->str(), t->device().str()));
      }
      device = t->device();
    }
    if (device && any_cpu) {
      throw Error(fmt::format("{}: one tensor is on the CPU and another on {}; a collective takes them on one device",
                              op, device->str()));
    }
    return device;
  }

  c10::Stream side_stream(const at::Device& device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = streams_.find(device.index());
    if (it == streams_.end()) {
      c10::impl::VirtualGuardImpl impl(device.type());
      it = streams_.emplace(device.index(), impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false)).first;
    }
    return it->second;
  }

  at::Tensor host_like(const at::Tensor& t) {
    return at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
  }

  // A pinned host copy of `t`, made on the side stream after the work queued on t's device's
  // current stream; returns once the copy is done (the host collective reads it next).
  at::Tensor to_host(const at::Tensor& t) {
    c10::impl::VirtualGuardImpl impl(t.device().type());
    const c10::Stream side = side_stream(t.device());
    c10::Event ready(t.device().type());
    ready.record(impl.getStream(t.device()));
    ready.block(side);
    at::Tensor host = host_like(t);
    {
      c10::StreamGuard guard(side);
      host.copy_(t, /*non_blocking=*/true);
    }
    impl.recordDataPtrOnStream(t.storage().data_ptr(), side);
    side.synchronize();
    return host;
  }

  // The work that finishes the host collective and then copies `host` into `dst` on the side stream;
  // the device's current stream at wait() waits for that copy.
  Work staged(Work host_work, at::Tensor dst, at::Tensor host) {
    const c10::Stream side = side_stream(dst.device());
    auto back = [side, dst, host] {
      c10::impl::VirtualGuardImpl impl(dst.device().type());
      c10::Event ready(dst.device().type());
      ready.record(impl.getStream(dst.device()));
      ready.block(side);  // nothing queued before wait() may still be writing dst
      {
        c10::StreamGuard guard(side);
        dst.copy_(host, /*non_blocking=*/true);
      }
      impl.recordDataPtrOnStream(dst.storage().data_ptr(), side);
      c10::Event done(dst.device().type());
      done.record(side);
      done.block(impl.getStream(dst.device()));
    };
    return Work(std::make_shared<StagedWork>(std::move(host_work), std::move(back)));
  }

  std::unique_ptr<Communicator> host_;
  std::mutex mu_;
  std::map<int, c10::Stream> streams_;
};

}  // namespace

std::unique_ptr<Communicator> make_staging_communicator(std::unique_ptr<Communicator> host) {
  return std::make_unique<StagingCommunicator>(std::move(host));
}

}  // namespace zeal::detail
