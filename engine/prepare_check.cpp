#include "engine/prepare_check.h"

#include <torch/nn/module.h>

#include <sys/stat.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <fmt/format.h>

#include "engine/config/config.h"
#include "engine/estimate.h"
#include "engine/memory.h"
#include "engine/memory_tracker.h"
#include "engine/zero/init.h"
#include "engine/zero/sharded.h"
#include "engine/zero/touch.h"

namespace zeal::detail {
namespace {

namespace fs = std::filesystem;

estimate::Offload offload_of(OffloadDevice d) {
  return d == OffloadDevice::kCpu ? estimate::Offload::kCpu
         : d == OffloadDevice::kNvme ? estimate::Offload::kNvme
                                     : estimate::Offload::kNone;
}

std::string gib(int64_t b) { return format_bytes(static_cast<double>(b)); }

}  // namespace

estimate::RunShape run_shape_of(const Config& c, int world, bool on_gpu) {
  estimate::RunShape r;
  r.stage = static_cast<int>(c.zero.stage);
  r.offload_optimizer = offload_of(c.zero.offload_optimizer.device);
  r.offload_param = r.stage == 3 ? offload_of(c.zero.offload_param.device) : estimate::Offload::kNone;
  r.world = std::max(1, world);
  r.nodes = static_cast<int>(std::max<int64_t>(1, c.launch.num_machines));
  r.precision = c.mixed_precision == "no" || c.mixed_precision.empty() ? "fp32" : c.mixed_precision;
  r.on_gpu = on_gpu;
  r.sub_group_size = c.zero.sub_group_size;
  r.max_live_parameters = c.zero.stage3_max_live_parameters;
  r.max_reuse_distance = c.zero.stage3_max_reuse_distance;
  r.max_in_cpu = c.zero.offload_param.max_in_cpu;
  // The engine has filled "auto" by now (with DeepSpeed's default, as it does not know the hidden size).
  if (!c.zero.stage3_param_persistence_threshold.is_auto) {
    r.persistence_threshold = c.zero.stage3_param_persistence_threshold.value;
  }
  r.buffer_count = static_cast<int>(c.zero.offload_optimizer.buffer_count);
  r.param_buffer_count = static_cast<int>(c.zero.offload_param.buffer_count);
  r.activation_checkpointing = c.activation_checkpointing.enabled;
  r.checkpoint_interval = std::max<int64_t>(1, c.activation_checkpointing.unit_interval);
  return r;
}

PreparedShape prepared_model_shape(torch::nn::Module& module, zero::InitShards* shards, const Config& c) {
  // The model as the estimator sees it: every parameter once (tied ones under their first name),
  // at its full size even when engine.init keeps only this rank's slice of it.
  PreparedShape out;
  estimate::ModelShape& m = out.model;
  std::unordered_map<const void*, int64_t> full;  // parameter → elements
  std::unordered_map<const void*, int> seen;
  m.name = "the prepared model";
  for (auto& item : module.named_parameters(true)) {
    const at::Tensor& p = item.value();
    const void* key = p.unsafeGetTensorImpl();
    if (++seen[key] > 1) {  // tied: an embedding that is also the head
      m.tied_head = std::max(m.tied_head, full[key]);
      m.largest_param_grads = 2;
      continue;
    }
    const zero::InitShards::Slice* s = shards ? shards->find(p) : nullptr;
    const int64_t n = s ? s->numel : p.numel();
    full[key] = n;
    m.params += n;
    m.largest_param = std::max(m.largest_param, n);
    if (p.requires_grad()) out.trainable += n;
    const at::Tensor& held = s ? s->data : p;
    if (held.defined() && held.device().is_cpu()) out.present += held.numel() * static_cast<int64_t>(held.element_size());
  }
  for (const auto& b : module.buffers(true)) {
    if (b.defined() && b.device().is_cpu()) out.present += b.numel() * static_cast<int64_t>(b.element_size());
  }
  // DeepSpeed's "largest layer": a module's own parameters.
  for (const auto& sub : module.modules(/*include_self=*/true)) {
    int64_t own = 0;
    for (const auto& p : sub->parameters(/*recurse=*/false)) {
      auto it = full.find(p.unsafeGetTensorImpl());
      if (it != full.end()) own += it->second;
    }
    m.largest_layer = std::max(m.largest_layer, own);
  }
  // Stage 3's units as the engine forms them (engine/zero/stage3.cpp): the root, then each Sharded
  // member and each module whose type zero_optimization.unit_names names (a Sharded member's own
  // block is its member's unit already), in pre-order. A parameter belongs to the innermost unit
  // holding it; those the root uses directly (a head tied to the embedding) stay in the root.
  const auto all = module.named_modules("", /*include_self=*/false);
  std::unordered_set<const torch::nn::Module*> sharded_blocks;
  for (const auto& item : all) {
    if (auto* s = dynamic_cast<ShardedBase*>(item.value().get())) sharded_blocks.insert(s->block().get());
  }
  const std::unordered_set<const void*> in_root = zero::root_parameters(module, c.zero.unit_names);
  std::unordered_map<const void*, int> owner;
  int count = 0;
  for (const auto& item : all) {
    torch::nn::Module* sub = item.value().get();
    const bool sharded = dynamic_cast<ShardedBase*>(sub) != nullptr;
    if (!sharded && (sharded_blocks.count(sub) || !zero::unit_name_matches(sub->name(), c.zero.unit_names))) continue;
    ++count;
    for (const auto& p : sub->parameters(true)) owner[p.unsafeGetTensorImpl()] = count;  // inner ones come later
  }
  std::vector<int64_t> sizes(static_cast<size_t>(count) + 1, 0);
  for (const auto& [key, n] : full) {
    auto it = owner.find(key);
    sizes[it == owner.end() || in_root.count(key) ? 0 : static_cast<size_t>(it->second)] += n;
  }
  m.units.push_back(sizes[0]);
  for (size_t i = 1; i < sizes.size(); ++i) {
    if (sizes[i] > 0) m.units.push_back(sizes[i]);
  }
  return out;
}

PrepareMemory predict_prepare_memory(torch::nn::Module& module, zero::InitShards* shards, const Config& c, int world,
                                     int local_world, bool on_gpu) {
  const PreparedShape shape = prepared_model_shape(module, shards, c);
  const estimate::ModelShape& m = shape.model;
  const int64_t trainable = shape.trainable, present = shape.present;
  estimate::RunShape r = run_shape_of(c, world, on_gpu);
  r.trainable_params = trainable;
  // The runtime: what the process holds beyond the model's own tensors.
  const int64_t resident = resident_bytes();
  r.runtime_bytes = std::max<int64_t>(0, resident - present);

  PrepareMemory out;
  const estimate::Prediction p = estimate::predict(m, r);
  out.predicted = p.host_peak;
  for (const auto& part : p.parts) {
    if (part.where != "disk") continue;
    (part.name == "parameters on disk" ? out.disk_params : out.disk_optimizer) += part.bytes;
  }
  std::vector<estimate::Part> parts;
  for (const auto& part : p.parts) {
    if (part.where == "host") parts.push_back(part);
  }
  std::sort(parts.begin(), parts.end(), [](const auto& a, const auto& b) { return a.bytes > b.bytes; });
  for (size_t i = 0; i < parts.size() && i < 4; ++i) {
    out.parts += fmt::format("{}{} {}", i ? ", " : "", parts[i].name, gib(parts[i].bytes));
  }
  out.budget = rank_memory_budget(local_world, resident);
  if (out.fits()) return out;

  // What would lower it, each with the peak it predicts (cumulative, in the order a user would try).
  auto try_change = [&](const std::string& what, auto&& change) {
    estimate::RunShape alt = r;
    change(alt);
    const int64_t peak = estimate::predict(m, alt).host_peak;
    if (peak < out.predicted) out.remedies += fmt::format("{}{} ({})", out.remedies.empty() ? "" : "; ", what, gib(peak));
  };
  if (r.stage < 3) try_change("zero_optimization.stage 3", [](estimate::RunShape& a) { a.stage = 3; });
  if (r.offload_optimizer != estimate::Offload::kNvme) {
    try_change("stage 3 with offload_optimizer.device nvme", [](estimate::RunShape& a) {
      a.stage = 3;
      a.offload_optimizer = estimate::Offload::kNvme;
    });
  }
  if (r.offload_param != estimate::Offload::kNvme) {
    try_change("stage 3 with offload_optimizer and offload_param on nvme", [](estimate::RunShape& a) {
      a.stage = 3;
      a.offload_optimizer = estimate::Offload::kNvme;
      a.offload_param = estimate::Offload::kNvme;
    });
  }
  if (local_world > 1) {
    out.remedies += fmt::format("{}fewer ranks on this machine ({} now share its memory)",
                                out.remedies.empty() ? "" : "; ", local_world);
  }
  return out;
}

BatchMemory predict_batch_memory(const estimate::ModelShape& m, const estimate::RunShape& batch, const Config& c,
                                 int world, int64_t trainable, int64_t prepared_peak, int64_t budget) {
  estimate::RunShape r = run_shape_of(c, world, /*on_gpu=*/false);
  r.trainable_params = trainable;
  r.chunked_loss = batch.chunked_loss;
  r.loss_chunk = batch.loss_chunk;
  // The growth of the prediction from one token to the batch: what the batch's tensors add, the
  // model's own parts cancelling (prepare predicted those from the prepared module itself).
  auto one_token = [&](const estimate::RunShape& shape) {
    estimate::RunShape one = shape;
    one.micro_batch = 1;
    one.seq_len = 1;
    return estimate::predict(m, one).host_peak;
  };
  const int64_t base = one_token(r);  // once, not at every step of the bisection below
  auto grows = [&](const estimate::RunShape& shape, int64_t micro, int64_t from) {
    estimate::RunShape big = shape;
    big.micro_batch = micro;
    big.seq_len = batch.seq_len;
    return std::max<int64_t>(0, estimate::predict(m, big).host_peak - from);
  };
  BatchMemory out;
  out.activations = grows(r, batch.micro_batch, base);
  if (budget >= 0) {
    // The largest micro-batch that fits with 10 % of the budget to spare (the prediction's error is a
    // few per cent), by bisection.
    const int64_t spare = budget - budget / 10;
    int64_t lo = 0, hi = batch.micro_batch;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (prepared_peak + grows(r, mid, base) <= spare) lo = mid;
      else hi = mid - 1;
    }
    out.largest_micro_batch = lo;
  }
  if (!r.activation_checkpointing) {
    estimate::RunShape ck = r;
    ck.activation_checkpointing = true;
    ck.checkpoint_interval = 1;
    out.with_checkpointing = prepared_peak + grows(ck, batch.micro_batch, one_token(ck));
  }
  return out;
}

std::string check_swap_space(const PrepareMemory& pm, const Config& c, int local_world) {
  struct Use {
    std::string path, what;
    int64_t bytes;
  };
  std::vector<Use> uses;
  if (c.zero.offload_optimizer.device == OffloadDevice::kNvme && pm.disk_optimizer > 0) {
    uses.push_back({c.zero.offload_optimizer.nvme_path, "the optimizer's", pm.disk_optimizer});
  }
  if (c.zero.stage == 3 && c.zero.offload_param.device == OffloadDevice::kNvme && pm.disk_params > 0) {
    uses.push_back({c.zero.offload_param.nvme_path, "the parameters'", pm.disk_params});
  }
  // One file system may hold both: the sums per file system count.
  struct Fs {
    std::string path, parts;
    int64_t bytes = 0, free = -1;
  };
  std::map<uint64_t, Fs> by_fs;
  for (const auto& u : uses) {
    std::error_code ec;
    fs::path at = fs::absolute(u.path, ec);
    while (!at.empty() && !fs::exists(at, ec) && at != at.parent_path()) at = at.parent_path();
    struct stat st {};
    struct statvfs vs {};
    if (::stat(at.c_str(), &st) != 0 || ::statvfs(at.c_str(), &vs) != 0) continue;  // the swap's own checks say why
    Fs& f = by_fs[static_cast<uint64_t>(st.st_dev)];
    if (f.path != u.path) f.path += (f.path.empty() ? "" : " and ") + u.path;
    f.parts += fmt::format("{}{} {}", f.parts.empty() ? "" : " + ", u.what, gib(u.bytes));
    f.bytes += u.bytes;
    f.free = static_cast<int64_t>(vs.f_bavail) * static_cast<int64_t>(vs.f_frsize);
  }
  std::string out;
  const int n = std::max(1, local_world);
  for (const auto& [dev, f] : by_fs) {
    const int64_t need = f.bytes * n;
    if (need <= f.free) continue;
    out += fmt::format("{}offload: the swap files need about {} in {} ({} per rank{}), but its file system has {} "
                       "free; free some space there or set nvme_path to a larger disk",
                       out.empty() ? "" : "; ", gib(need), f.path, f.parts,
                       n == 1 ? "" : fmt::format(", {} ranks on this machine", n), gib(f.free));
  }
  return out;
}

}  // namespace zeal::detail
