#include "engine/zero/init.h"
#include "engine/zero/touch.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_set>

#include "engine/comm/communicator.h"
#include "engine/memory_counter.h"
#include "engine/zero/host_memory.h"
#include "engine/zero/sharded.h"

namespace zeal {
namespace zero {
namespace {

thread_local InitContext* g_current = nullptr;

int64_t bytes_of(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

void collect_root(torch::nn::Module& m, const std::vector<std::string>& unit_names, std::unordered_set<const void*>& out) {
  for (const auto& p : m.named_parameters(/*recurse=*/false)) out.insert(p.value().unsafeGetTensorImpl());
  for (const auto& child : m.children()) {
    if (!dynamic_cast<ShardedBase*>(child.get()) && !unit_name_matches(child->name(), unit_names))
      collect_root(*child, unit_names, out);
  }
}

}  // namespace

std::unordered_set<const void*> root_parameters(torch::nn::Module& model, const std::vector<std::string>& unit_names) {
  std::unordered_set<const void*> out;
  collect_root(model, unit_names, out);
  return out;
}

bool InitShards::materialize(at::Tensor& p, Communicator& comm, at::Device device) {
  auto it = slices_.find(p.unsafeGetTensorImpl());
  if (it == slices_.end()) return false;
  c10::NoGradGuard no_grad;
  const Slice& s = it->second;
  at::Tensor slice = s.data.to(device);
  at::Tensor full = at::empty({slice.numel() * comm.world_size()}, slice.options());
  comm.all_gather(slice, full).wait();
  p.set_data(full.narrow(0, 0, s.numel).view(p.sizes()));
  slices_.erase(it);
  return true;
}

int64_t InitShards::bytes() const {
  int64_t n = 0;
  for (const auto& [k, s] : slices_) n += bytes_of(s.data);
  return n;
}

InitContext::InitContext(Communicator& comm, bool partition, at::Device device)
    : comm_(comm), partition_(partition && comm.world_size() > 1), prev_(g_current) {
  if (partition_) {
    // Every rank builds with rank 0's generator states: the same values everywhere, those one
    // process seeded like rank 0 builds. The states travel on the engine's device (NCCL takes
    // only tensors there); on a GPU, that GPU's generator too.
    std::vector<at::Generator> gens{at::detail::getDefaultCPUGenerator()};
    if (!device.is_cpu()) gens.push_back(at::globalContext().defaultGenerator(device));
    for (auto& gen : gens) {
      at::Tensor state;
      {
        std::lock_guard<std::mutex> lock(gen.mutex());
        state = gen.get_state();
      }
      at::Tensor travelling = state.to(device).contiguous();
      comm_.broadcast(travelling, 0).wait();
      state = travelling.to(at::kCPU);
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  }
  counter_ = std::make_unique<CpuMemoryCounter>();
  g_current = this;
}

InitContext::~InitContext() {
  if (g_current == this) g_current = prev_;
}

InitContext* InitContext::current() { return g_current; }

bool InitContext::partition(ShardedBase& unit) {
  c10::NoGradGuard no_grad;
  const int world = comm_.world_size();
  const int rank = comm_.rank();
  int64_t bytes = 0;
  for (const auto& item : unit.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    const void* key = p.unsafeGetTensorImpl();
    if (shards_->slices_.count(key)) continue;  // a nested unit's, already partitioned
    bytes += bytes_of(p);
    if (!partition_ || p.numel() == 0) continue;  // on any device: the slice stays where p is
    const int64_t per = (p.numel() + world - 1) / world;
    at::Tensor flat = p.detach().reshape({-1});
    at::Tensor slice = at::zeros({per}, p.options().requires_grad(false));
    const int64_t begin = std::min<int64_t>(rank * per, p.numel());
    const int64_t n = std::min<int64_t>(per, p.numel() - begin);
    if (n > 0) slice.narrow(0, 0, n).copy_(flat.narrow(0, begin, n));
    shards_->slices_[key] = {slice, p.numel()};
    free_storage(p);
  }
  largest_unit_ = std::max(largest_unit_, bytes);
  return partition_;
}

std::shared_ptr<InitShards> InitContext::finish(torch::nn::Module& model, InitReport* report) {
  if (report) {
    InitReport r;
    r.partitioned = partition_;
    r.peak = counter_->peak();
    const auto root = root_parameters(model);
    std::unordered_set<const void*> seen;
    for (const auto& p : model.parameters(true)) {
      const void* key = p.unsafeGetTensorImpl();
      if (!seen.insert(key).second) continue;
      r.model_bytes += bytes_of(p);
      if (root.count(key)) r.root_bytes += bytes_of(p);
    }
    for (const auto& b : model.buffers(true)) {
      r.model_bytes += bytes_of(b);
      r.root_bytes += bytes_of(b);
    }
    r.largest_unit = largest_unit_;
    r.shard_bytes = shards_->bytes();
    *report = r;
  }
  if (g_current == this) g_current = prev_;
  counter_.reset();
  return std::move(shards_);
}

}  // namespace zero

void ShardedBase::constructed() {
  if (auto* c = zero::InitContext::current()) partitioned_ = c->partition(*this);
}

}  // namespace zeal
