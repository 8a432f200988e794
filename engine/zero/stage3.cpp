#include "engine/zero/stage3.h"
#include "engine/wait_clock.h"
#include "engine/log.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <map>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "engine/error.h"
#include "engine/zero/host_memory.h"
#include "engine/zero/sharded.h"
#include "engine/memory.h"
#include "offload/io.h"
#include "offload/swap_dir.h"

namespace zeal {
namespace zero {

Stage3::Stage3(Communicator& comm, torch::nn::Module& model, std::vector<Group> groups, const Stage3Options& options,
               std::shared_ptr<InitShards> init)
    : Sharding(comm), opts_(options), end_of_backward_([this] { end_of_backward(); }, [this] { abandon_backward(); }) {
  device_ = opts_.device;
  link_->stage = this;
  c10::NoGradGuard no_grad;
  TouchPause pause;
  build_units(model, groups, init);
}

Stage3::~Stage3() {
  touch_.reset();
  TouchPause pause;
  link_->stage = nullptr;
  link_.reset();
  for (auto& [m, i] : modules_) m->attach(nullptr, {});
  // Leave the model usable: every unit gathered. A collective, so only on an orderly shutdown; a
  // rank that cannot gather exits non-zero instead of leaving a model without values behind.
  if (std::uncaught_exceptions() == 0) {
    try {
      c10::NoGradGuard no_grad;
      for (auto& [u, w] : in_flight_) w.wait();
      if (gather_at_shutdown_)
        for (auto& u : units_) u->gather(true, "shutdown");
    } catch (const std::exception& e) {
      log::rank_error("stage 3 could not gather the model at shutdown, exiting: {}", e.what());
      std::_Exit(EXIT_FAILURE);
    }
  } else {
    for (auto& u : units_) {
      try {
        u->wait_gather();
      } catch (...) {
      }
    }
  }
}

void Stage3::build_units(torch::nn::Module& model, std::vector<Group>& groups, const std::shared_ptr<InitShards>& init) {
  // Units: the root, then every Sharded member and every module named by type, in the model's
  // (pre-)order. A Sharded member's block is its member's unit already, whatever its type.
  units_.push_back(std::make_unique<Unit>(*this, 0, "(root)"));
  std::vector<std::shared_ptr<torch::nn::Module>> members;
  std::vector<char> by_type;
  std::unordered_set<const torch::nn::Module*> blocks;
  const auto all = model.named_modules("", /*include_self=*/false);
  for (const auto& item : all)
    if (auto s = std::dynamic_pointer_cast<ShardedBase>(item.value())) blocks.insert(s->block().get());
  std::vector<std::string> unmatched = opts_.unit_names;
  auto matched = [&](const torch::nn::Module& m) {
    if (!unit_name_matches(m.name(), opts_.unit_names)) return false;
    std::erase_if(unmatched, [&](const std::string& n) { return unit_name_matches(m.name(), {n}); });
    return true;
  };
  matched(model);  // the model's own type: the root unit
  for (const auto& item : all) {
    const auto& m = item.value();
    auto s = std::dynamic_pointer_cast<ShardedBase>(m);
    const bool named = matched(*m) && !blocks.count(m.get());
    if (!s && !named) continue;
    if (s) modules_.push_back({s.get(), static_cast<int>(units_.size())});
    members.push_back(m);
    by_type.push_back(s ? 0 : 1);
    units_.push_back(std::make_unique<Unit>(*this, static_cast<int>(units_.size()), item.key()));
  }
  if (!unmatched.empty()) {
    std::vector<std::string> types;
    for (const auto& item : all) {
      if (std::find(types.begin(), types.end(), item.value()->name()) == types.end()) types.push_back(item.value()->name());
    }
    throw Error(fmt::format("zero_optimization.unit_names (fsdp_transformer_layer_cls_to_wrap): {} names no module of "
                            "the model; its module types are: {}",
                            fmt::join(unmatched, ", "), fmt::join(types, ", ")));
  }
  if (members.empty()) {
    log::warning("stage 3 found no zeal::Sharded member in the model and zero_optimization.unit_names names none of "
                 "its modules: it trains as one unit that stays gathered, which saves optimizer and gradient memory "
                 "but no parameter memory");
  }
  // Each parameter belongs to the innermost unit holding it; one held by two units neither of which
  // contains the other (tied across units) is refused. A parameter the root uses directly as well
  // (an LM head tied to the embedding) stays in the root: the root runs outside every unit's forward.
  const std::unordered_set<const void*> in_root = root_parameters(model, opts_.unit_names);
  std::unordered_map<const void*, int> owner;
  std::vector<std::vector<int>> inside(members.size());  // units nested in each
  for (size_t u = 0; u < members.size(); ++u) {
    for (const auto& m : members[u]->modules(false)) {
      for (size_t v = 0; v < members.size(); ++v)
        if (members[v].get() == m.get()) inside[u].push_back(static_cast<int>(v));
    }
  }
  for (size_t u = 0; u < members.size(); ++u) {
    for (const auto& item : members[u]->named_parameters(true)) {
      const void* key = item.value().unsafeGetTensorImpl();
      auto it = owner.find(key);
      if (it != owner.end() && !in_root.count(key)) {
        const int prev = it->second - 1;
        const bool nested = std::find(inside[prev].begin(), inside[prev].end(), static_cast<int>(u)) != inside[prev].end();
        if (!nested) {
          throw Error(fmt::format("stage 3: parameter '{}' is used by the units '{}' and '{}'; a parameter shared by two "
                                  "units (tied weights) must live outside both, in the root unit",
                                  item.key(), units_[prev + 1]->name(), units_[u + 1]->name()));
        }
      }
      owner[key] = static_cast<int>(u) + 1;
    }
  }
  // The optimizer group of every trainable parameter.
  std::unordered_map<const void*, int> group_of;
  for (size_t g = 0; g < groups.size(); ++g)
    for (const auto& p : groups[g].params) group_of[p.unsafeGetTensorImpl()] = static_cast<int>(g);
  std::unordered_set<const void*> placed;  // a parameter registered under two names goes in once
  for (const auto& item : model.named_parameters(true)) {
    const void* key = item.value().unsafeGetTensorImpl();
    if (!placed.insert(key).second) continue;
    auto it = owner.find(key);
    Unit& u = *units_[it == owner.end() || in_root.count(key) ? 0 : it->second];
    auto g = group_of.find(key);
    if (item.value().requires_grad() && g == group_of.end()) {
      throw Error(fmt::format("parameter '{}' requires grad but is in none of the optimizer's groups", item.key()));
    }
    Unit::Part& part = item.value().requires_grad() ? u.train_ : u.frozen_;
    part.params.push_back(item.value());
    part.names.push_back(item.key());
    part.groups.push_back(item.value().requires_grad() ? g->second : -1);
  }
  // A unit's trainable parameters group by group (stable: model order inside a group), so each
  // group is one range of its flat buffer and one piece of each rank's shard.
  for (auto& u : units_) {
    Unit::Part& t = u->train_;
    std::vector<size_t> order(t.params.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return t.groups[a] < t.groups[b]; });
    Unit::Part sorted;
    for (size_t i : order) {
      sorted.params.push_back(t.params[i]);
      sorted.names.push_back(t.names[i]);
      sorted.groups.push_back(t.groups[i]);
    }
    t = std::move(sorted);
  }

  fetch_ = std::make_unique<FetchCoordinator>(opts_, units_);
  // Shards, master pieces and gradient shards, one unit whole at a time (parameters partitioned by
  // engine.init are all-gathered just before their unit is built).
  std::vector<std::vector<at::Tensor>> masters(groups.size());
  std::vector<std::vector<ShardStep::Piece>> pieces(groups.size());
  std::vector<int64_t> master_size(groups.size(), 0);
  // fp32 parameters are their own master weights (no copy) when the group's optimizer is fused.
  std::vector<bool> alias_master(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    alias_master[g] = (!opts_.offload || opts_.device.is_cpu()) && !opts_.nvme && !opts_.param_swap &&
                      ShardStep::can_alias(*groups[g].optimizer, opts_.compute_dtype, opts_.device);
  }
  // offload_param nvme: which units' shards go to disk. Units that are not persistent, in build
  // order, keep theirs in host memory while they fit max_in_cpu elements per rank; the rest go.
  // On a GPU the shards kept go to the store's host memory (they leave the GPU); offload_param cpu
  // is a store without a file, every such unit kept.
  const bool keep_in_host = !opts_.device.is_cpu();
  std::vector<char> to_disk(units_.size(), 0);  // 1: to the file; 2: to host memory
  if (opts_.param_swap) {
    int64_t need = 0, kept = 0, kept_units = 0, disk_units = 0;
    for (size_t i = 1; i < units_.size(); ++i) {
      int64_t n = 0, esize = c10::elementSize(opts_.compute_dtype);
      for (const Unit::Part* part : {&units_[i]->train_, &units_[i]->frozen_}) {
        for (const auto& p : part->params) {
          n += p.numel();
          esize = std::max<int64_t>(esize, p.element_size());
        }
      }
      if (n <= opts_.persistence_threshold) continue;
      const int64_t shard = (n + comm_.world_size() - 1) / comm_.world_size();
      if (kept + shard <= opts_.param_swap->options().max_in_cpu || !opts_.param_swap->on_disk()) {
        kept += shard;
        ++kept_units;
        if (keep_in_host) to_disk[i] = 2;
        continue;
      }
      to_disk[i] = 1;
      ++disk_units;
      need += shard * esize + 2 * 4096;  // the shards that will go to disk, before anything is written
    }
    if (opts_.param_swap->on_disk()) {
      opts_.param_swap->dir().require(need, "the parameters offloaded to nvme (offload_param)");
      log::info("offload_param nvme: {} units on disk, {} kept in host memory ({} elements per rank, max_in_cpu {})",
                disk_units, kept_units, kept, opts_.param_swap->options().max_in_cpu);
    } else {
      log::info("offload_param cpu: the shards of {} units in {} host memory; the root and {} persistent units stay on {}",
                kept_units,
                opts_.param_swap->pinned() ? "page-locked"
                                           : "pageable (offload_param.pin_memory: true lets copies back run without "
                                             "holding up the host)",
                units_.size() - 1 - static_cast<size_t>(kept_units), opts_.device.str());
    }
  }
  // offload_optimizer nvme: the master weights go to each group's swap file as they are made, a
  // window at a time, never whole in host memory; the gradient shards are never made in host memory
  // (swap_gradients below gives them files of their own).
  struct MasterSpool {
    std::shared_ptr<offload::SwapFile> file;
    std::unique_ptr<offload::AlignedBuffer> buf;
    int64_t cap = 0, fill = 0, written = 0;  // elements
    void append(const at::Tensor& v) {
      for (int64_t done = 0, n = v.numel(); done < n;) {
        const int64_t take = std::min(cap - fill, n - done);
        at::from_blob(buf->data() + fill * 4, {take}, at::kFloat).copy_(v.narrow(0, done, take));
        fill += take;
        done += take;
        if (fill == cap) flush();
      }
    }
    void flush() {
      if (fill == 0) return;
      const int64_t bytes = (fill * 4 + offload::kIoAlign - 1) / offload::kIoAlign * offload::kIoAlign;
      file->write(buf->data(), bytes, written * 4);
      written += fill;
      fill = 0;
    }
  };
  std::vector<MasterSpool> spools(opts_.nvme ? groups.size() : 0);
  for (size_t g = 0; g < spools.size(); ++g) {
    if (alias_master[g]) continue;
    spools[g].file = std::make_shared<offload::SwapFile>(opts_.nvme->dir, opts_.nvme->io,
                                                        "optimizer_group" + std::to_string(g) + ".swp");
    spools[g].cap = std::clamp<int64_t>(opts_.nvme->sub_group_elems, 1024, kDefaultNvmeWindowElems) / 1024 * 1024;
    spools[g].buf = std::make_unique<offload::AlignedBuffer>(spools[g].cap * 4);
  }
  int64_t persistent_bytes = 0;
  for (auto& u : units_) {
    bool from_init[2] = {false, false};  // a part gathered from init slices needs no broadcast
    for (int k = 0; k < 2; ++k) {
      Unit::Part& part = k == 0 ? u->train_ : u->frozen_;
      if (!init || init->empty() || part.params.empty()) continue;
      from_init[k] = true;
      for (auto& p : part.params) from_init[k] = init->materialize(p, comm_, opts_.device) && from_init[k];
    }
    const at::Tensor values = u->build(u->train_, from_init[0]);
    u->build(u->frozen_, from_init[1]);
    if (u->train_.layout) {
      const FlatLayout& l = *u->train_.layout;
      const auto grad_opts = u->train_.shard.options().dtype(opts_.grad_accum_dtype);
      u->grad_shard_ = opts_.nvme ? at::empty({l.shard_size()}, grad_opts.device(at::kMeta)) : at::zeros({l.shard_size()}, grad_opts);
      const int64_t shard_begin = l.shard_begin(comm_.rank()), shard_end = shard_begin + l.shard_size();
      // Each group's range of the flat buffer, cut by this rank's shard.
      for (size_t i = 0; i < u->train_.params.size();) {
        const int g = u->train_.groups[i];
        const int64_t begin = l.offset(static_cast<int>(i));
        size_t j = i;
        while (j < u->train_.params.size() && u->train_.groups[j] == g) ++j;
        const int64_t end = l.offset(static_cast<int>(j - 1)) + l.numel(static_cast<int>(j - 1));
        const int64_t a = std::max(begin, shard_begin), b = std::min(end, shard_end);
        if (a < b) {
          if (!alias_master[g] && opts_.nvme) {
            spools[g].append(values.narrow(0, a, b - a));
          } else if (!alias_master[g]) {  // offloaded: taken to the host now, never whole on the device
            masters[g].push_back(opts_.offload ? values.narrow(0, a, b - a).to(at::kCPU, /*non_blocking=*/false, /*copy=*/true)
                                               : values.narrow(0, a, b - a).clone());
          }
          u->master_pieces_.push_back({g, pieces[g].size()});
          u->master_piece_shard_.push_back(a - shard_begin);
          pieces[g].push_back({master_size[g], u->grad_shard_.narrow(0, a - shard_begin, b - a),
                               u->train_.shard.narrow(0, a - shard_begin, b - a)});
          master_size[g] += b - a;
        }
        trainable_elems_ += end - begin;
        i = j;
      }
    }
    u->persistent_ = u->index() == 0 || u->numel() <= opts_.persistence_threshold;
    if (u->persistent_) persistent_bytes += u->gathered_bytes();
    fetch_->add_gathered(u->gathered_bytes());
    u->release();
    if (to_disk[u->index()] && !u->persistent_) u->shards_to_disk(/*in_host=*/to_disk[u->index()] == 2);
  }
  root_released_in_step_ = units_[0]->numel() > opts_.persistence_threshold;
  fetch_->set_persistent_bytes(persistent_bytes);
  fetch_->reset_peak();
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(opts_.device);
    at::Tensor master;
    if (!alias_master[g] && opts_.nvme) {
      spools[g].flush();
      master = at::empty({master_size[g]}, fp32.device(at::kMeta));  // in the swap file already
    } else if (!alias_master[g]) {
      master = masters[g].empty() ? at::empty({0}, fp32) : at::cat(masters[g]);
    }
    masters[g].clear();
    if (!opts_.offload) groups[g].optimizer->allocate_state(master_size[g], fp32);
    steps_.emplace_back(std::move(master), std::move(groups[g].optimizer), std::move(pieces[g]));
    if (opts_.nvme) {
      steps_.back().offload_to_nvme(opts_.offload, spools[g].file, opts_.nvme->sub_group_elems, opts_.nvme->buffer_sets);
      steps_.back().swap_gradients(std::make_shared<offload::SwapFile>(
          opts_.nvme->dir, opts_.nvme->io, "gradients_group" + std::to_string(g) + ".swp"));
      gradients_swapped_ = true;
    } else if (opts_.offload) {
      steps_.back().offload_to(opts_.offload);
    }
  }
  if (opts_.nvme && log::enabled(log::Level::kInfo)) {  // what the disk now holds for rank 0, and what is left
    int64_t disk = opts_.param_swap ? opts_.param_swap->disk_bytes() : 0;
    for (const auto& s : steps_) disk += s.disk_bytes();
    log::info("nvme: rank 0's swap files take {:.2f} GiB in {}; {:.2f} GiB free there now",
              static_cast<double>(disk) / (1 << 30), opts_.nvme->dir->path(),
              static_cast<double>(opts_.nvme->dir->free_bytes()) / (1 << 30));
  }
  for (int i = static_cast<int>(units_.size()) - 1; i >= 0; --i)
    if (units_[i]->has_trainable()) reduce_order_.push_back(i);

  bool every_unit_persistent = units_.size() > 1;
  for (size_t i = 1; i < units_.size(); ++i) every_unit_persistent = every_unit_persistent && units_[i]->persistent();
  if (every_unit_persistent) {
    log::info("stage 3: every unit has at most stage3_param_persistence_threshold ({}) elements, so every unit stays "
              "gathered: this saves gradient and optimizer memory but no parameter memory; lower the threshold to "
              "shard them",
              opts_.persistence_threshold);
  }

  // Gradient arrival, per trainable parameter; the hooks reach the unit only while Stage3 lives.
  for (auto& u : units_) {
    Unit* unit = u.get();
    for (size_t i = 0; i < unit->train_.params.size(); ++i) {
      std::weak_ptr<Stage3Link> weak = link_;
      unit->accumulators_.push_back(on_grad_ready(unit->train_.params[i], unit->train_.names[i], [weak, unit, i] {
        auto l = weak.lock();
        if (l && l->stage) unit->on_grad_ready(static_cast<int>(i));
      }));
    }
  }
  for (auto& [m, i] : modules_) m->attach(units_[i].get(), link_);

  // Units by type name are gathered when an op first reads them (touch.h); the persistent ones
  // never leave.
  std::vector<std::pair<const c10::StorageImpl*, Unit*>> watched;
  int named = 0;
  for (size_t i = 0; i < members.size(); ++i) {
    if (!by_type[i]) continue;
    ++named;
    Unit* u = units_[i + 1].get();
    if (u->persistent()) continue;
    for (const Unit::Part* part : {&u->train_, &u->frozen_})
      if (part->layout) watched.emplace_back(part->full.storage().unsafeGetStorageImpl(), u);
  }
  if (named > 0) {
    log::info("stage 3: {} units by type name ({}); each is gathered when an op first reads its parameters and "
              "released when the thread moves on to another",
              named, fmt::join(opts_.unit_names, ", "));
  }
  if (!watched.empty()) touch_ = std::make_unique<TouchWatch>(*this, std::move(watched));
}

void Stage3::begin_micro_step(bool /*sync*/) {
  // Stage 3 reduce-scatters every micro-step (as stage 2): keeping whole gradients until the sync
  // micro-step would take back the memory sharding saves.
  check_abandoned_backward();
  pass_ended_ = false;
}

// --- units by type name --------------------------------------------------------------------------

void Stage3::touched(const std::vector<Unit*>& units, const std::vector<Unit*>& written, const std::string& op,
                     bool in_backward) {
  std::lock_guard lock(touch_mu_);
  for (Unit* u : written) {
    if (u->holds_ > 0) continue;
    throw Error(fmt::format("{} writes the parameters of stage-3 unit '{}' (a unit by type name, unit_names) outside "
                            "engine.gathered(params, modifier_rank): the write would go into a gathered copy that the "
                            "next release drops; change parameters of a prepared stage-3 model inside "
                            "engine.gathered(params, /*modifier_rank=*/0) on every rank",
                            op, u->name()));
  }
  std::vector<Unit*> use;  // engine.gathered() holds the others; the persistent ones stay
  for (Unit* u : units)
    if (!u->persistent() && u->holds_ == 0) use.push_back(u);
  auto was_touched = [&](const Unit* u) { return std::find(touched_.begin(), touched_.end(), u) != touched_.end(); };
  bool changed = false;
  for (Unit* u : use) changed = changed || !was_touched(u) || u->state() == Unit::State::kReleased ||
                                u->state() == Unit::State::kGathering;
  if (!changed) return;
  const bool training = in_backward || at::GradMode::is_enabled();
  if (in_backward) {
    on_backward_event();  // the end of this backward releases every unit and reduces what is left
  } else {
    check_abandoned_backward();
  }
  c10::NoGradGuard no_grad;
  // The thread moved on: the units it used before and this op does not use go, unless a training
  // forward uses them again soon (stage3_max_reuse_distance); in a training pass a frozen part used
  // again within the budget stays (as a zeal::Sharded unit's does).
  for (Unit* prev : touched_) {
    if (std::find(use.begin(), use.end(), prev) != use.end()) continue;
    if (!in_backward && training && fetch_->reused_soon(*prev)) continue;
    prev->release(/*keep_frozen=*/training && fetch_->frozen_reused(*prev));
  }
  const char* phase = in_backward ? "gathered on touch in the backward" : "gathered on touch";
  std::vector<char> fresh(use.size());
  for (size_t i = 0; i < use.size(); ++i) fresh[i] = !was_touched(use[i]) || use[i]->state() == Unit::State::kReleased;
  // Recorded before they are gathered: a gather that fails (a peer gone, a swap read failing) leaves
  // them where the next touch or the pass's end releases them.
  touched_ = std::move(use);
  for (size_t i = 0; i < touched_.size(); ++i) {
    touched_[i]->gather(false, phase);
    if (fresh[i]) {
      fetch_->on_fetch(*touched_[i], training ? FetchCoordinator::Pass::kTraining : FetchCoordinator::Pass::kNoGrad);
    }
  }
  for (Unit* u : touched_) u->wait_gather();
}

// --- reductions ----------------------------------------------------------------------------------

// Launches, in the fixed order, every reduction whose gradients are complete; at most two in flight
// (their staging buffers are the memory this costs).
void Stage3::gradients_complete(const Unit& u) {
  completed_.push_back(u.index());
  launch_ready_reductions();
}

void Stage3::launch_ready_reductions() {
  while (next_reduction_ < reduce_order_.size()) {
    Unit& u = *units_[reduce_order_[next_reduction_]];
    if (u.grads() != Unit::Grads::kComplete) return;
    ++next_reduction_;
    in_flight_.emplace_back(u.index(), u.reduce(false));
    if (in_flight_.size() > 2) complete_oldest_reduction();
  }
}

// After the first backward pass: its completion order becomes the reduction order. Every rank takes
// rank 0's (one small broadcast, once), so the ranks launch the same collectives in the same order
// even where their passes completed units differently; a unit that is not complete yet when its
// turn comes only delays the ones after it.
void Stage3::record_reduce_order() {
  std::vector<int> mine = std::exchange(completed_, {});
  if (order_recorded_) return;
  order_recorded_ = true;
  std::vector<int64_t> order(reduce_order_.size(), -1);
  if (std::is_permutation(mine.begin(), mine.end(), reduce_order_.begin(), reduce_order_.end())) {
    std::copy(mine.begin(), mine.end(), order.begin());
  }
  at::Tensor t = at::tensor(order, at::kLong);
  if (comm_.world_size() > 1 || comm_.reduction_world() > 1) {
    t = t.to(opts_.device);
    comm_.broadcast(t, 0).wait();
    t = t.cpu();
  }
  if (t[0].item<int64_t>() < 0) return;  // rank 0 saw an incomplete pass: keep the fixed order
  for (size_t i = 0; i < reduce_order_.size(); ++i) reduce_order_[i] = static_cast<int>(t[i].item<int64_t>());
}

void Stage3::complete_oldest_reduction() {
  auto [index, work] = std::move(in_flight_.front());
  in_flight_.pop_front();
  {
    detail::ScopedWait waiting(detail::WaitKind::kReduction);
    work.wait();
  }
  units_[index]->finish_reduction();
}

void Stage3::end_backward() {
  // engine.backward calls this after the backward: a pass in which no unit and no trainable
  // parameter took part queued no callback, and its (zero) reductions still have to happen.
  if (!pass_ended_ && !end_of_backward_.pending()) end_of_backward();
  pass_ended_ = false;
}

void Stage3::end_of_backward() {
  // Units by type name the backward touched last: their frozen parts stay where they are used again
  // soon; what else they hold goes with every unit's below.
  for (Unit* u : touched_) {
    if (u->state() == Unit::State::kGathered && u->holds_ == 0 && !u->persistent()) {
      u->release(/*keep_frozen=*/fetch_->frozen_reused(*u));
    }
  }
  touched_.clear();
  TouchPause pause;
  c10::NoGradGuard no_grad;
  // Units whose inputs needed no gradient (no identity on their inputs fired) end their backward
  // now; units whose gradients did not all come are complete with zeros for the rest.
  for (auto& u : units_) {
    while (u->state() == Unit::State::kInBackward) u->post_backward();
    if (u->has_trainable() && u->grads() != Unit::Grads::kReduced) u->grads_ = Unit::Grads::kComplete;
  }
  // Units completed only now (no gradient came through their hooks) keep their place in the order
  // reductions use now (the last first, the root last), after those the pass completed.
  for (int i : reduce_order_) {
    if (std::find(completed_.begin(), completed_.end(), i) == completed_.end()) completed_.push_back(i);
  }
  launch_ready_reductions();
  while (!in_flight_.empty()) complete_oldest_reduction();
  next_reduction_ = 0;
  record_reduce_order();
  fetch_->end_training_pass();
  for (auto& u : units_) u->reset_backward();
  pass_ended_ = true;
  ++passes_;
  comm_.check_agreement("end of backward");
}

// A backward pass ended with an error: nothing of it may reach the weights. Finish the collectives
// in flight (every rank issued them), drop the staged gradients, release the units and make the next
// optimizer step a skipped one.
void Stage3::abandon_backward() {
  touched_.clear();
  TouchPause pause;
  c10::NoGradGuard no_grad;
  for (auto& [u, w] : in_flight_) {
    try {
      w.wait();
    } catch (...) {
    }
  }
  in_flight_.clear();
  next_reduction_ = 0;
  completed_.clear();
  try {
    fetch_->wait_all();
  } catch (...) {
  }
  for (auto& u : units_) u->reset_backward();
  fetch_->end_training_pass();
  abandon_step("a backward pass ended with an error, so this step's gradients are incomplete");
}

// --- the step ------------------------------------------------------------------------------------

std::vector<ShardStep*> Stage3::shard_steps() {
  std::vector<ShardStep*> out;
  for (auto& s : steps_) out.push_back(&s);
  return out;
}

bool Stage3::sharded_grads() const { return comm_.world_size() > 1; }

void Stage3::apply(double inv_scale, const std::vector<double>& lrs) {
  touched_.clear();
  TouchPause pause;
  c10::NoGradGuard no_grad;
  // A unit gathered now (a prefetch for the next eval pass, say) would hold the old values after
  // the update: release it; its next fetch gathers the new ones. A kept frozen part stays: the
  // step changes no frozen value.
  fetch_->wait_all();
  for (auto& u : units_)
    if (!u->persistent() && u->holds_ == 0) u->release(/*keep_frozen=*/u->frozen_kept());
  Unit& root = *units_[0];
  if (root_released_in_step_ && root.state() != Unit::State::kReleased && root.holds_ == 0) {
    // The root is released while the optimizer runs (see stage3.h), then gathered with its new
    // values; its frozen part, which no step changes, stays (a LoRA model's embeddings).
    root.persistent_ = false;
    root.release(/*keep_frozen=*/true);
    root.persistent_ = true;
  }
  // offload_param nvme: the trainable shards the step writes come back from disk for it, and go
  // back to disk before anything reads them again, one unit at a time: its shards come in as the
  // step reaches its first piece (with the optimizer state on NVMe, as the windows do) and go back
  // (and leave memory) after its last, so max_in_cpu bounds the step as it bounds the forward.
  bool per_unit = false;
  for (auto& u : units_) per_unit = per_unit || u->shards_on_disk();
  if (!per_unit) {
    for (auto& u : units_) u->load_shards(/*trainable_only=*/true);
    for (size_t g = 0; g < steps_.size(); ++g) steps_[g].apply(lrs.at(g), inv_scale);  // writes every unit's shard
    for (auto& u : units_)
      if (u->shards_on_disk()) u->store_shards(/*trainable_only=*/true);
  } else {
    for (size_t g = 0; g < steps_.size(); ++g) {
      std::vector<Unit*> owner(steps_[g].num_pieces(), nullptr);
      std::map<Unit*, int> left;  // pieces of each unit this group's step has still to write
      for (auto& u : units_) {
        for (const auto& [pg, k] : u->master_pieces_) {
          if (pg != static_cast<int>(g) || steps_[g].piece(k).grad.numel() == 0) continue;
          owner[k] = u.get();
          ++left[u.get()];
        }
      }
      ShardStep::PieceHooks hooks;
      hooks.enter = [&](size_t k) {
        if (owner[k]) owner[k]->load_shards(/*trainable_only=*/true);
      };
      hooks.leave = [&](size_t k) {
        Unit* u = owner[k];
        if (!u || --left[u] > 0 || !u->shards_on_disk()) return;
        u->store_shards(/*trainable_only=*/true);
        // Kept when the all-gather below reads it (a unit that stays gathered).
        if (!u->persistent() && u->holds_ == 0 && u->pending_.empty()) u->drop_shards();
      };
      steps_[g].set_piece_hooks(std::move(hooks));
      struct Unhook {
        ShardStep& s;
        ~Unhook() { s.set_piece_hooks({}); }
      } unhook{steps_[g]};
      steps_[g].apply(lrs.at(g), inv_scale);
    }
  }
  // Units that stay gathered take their new values now; the others at their next fetch.
  CollectiveLabel label(comm_, "after step");
  for (auto& u : units_) {
    if (!u->persistent() && u->holds_ == 0) continue;  // persistent, or held by engine.gathered()
    if (u->state() == Unit::State::kReleased) {
      u->gather(true, "after step");
      continue;
    }
    if (!u->train_.layout) continue;
    // (its shard comes back if the step did not need it here: a rank that owns none of it)
    if (u->shards_on_disk()) u->load_shards(/*trainable_only=*/true);
    if (comm_.world_size() > 1) {
      comm_.all_gather(u->train_.shard, u->train_.full).wait();
    } else {
      u->train_.full.copy_(u->train_.shard);
    }
  }
  for (auto& u : units_)
    if (u->shards_on_disk() && u->pending_.empty()) u->drop_shards();
}

void Stage3::clear_grads() {
  c10::NoGradGuard no_grad;
  for (auto& u : units_)
    if (u->grad_shard_.defined() && !u->grad_shard_.is_meta()) u->grad_shard_.zero_();
  for (auto& s : steps_) {
    s.reset();
    if (s.gradients_swapped()) s.clear_grads();
  }
}

void Stage3::accumulate_swapped(const Unit& u, const at::Tensor& mine) {
  for (size_t j = 0; j < u.master_pieces_.size(); ++j) {
    const auto [g, k] = u.master_pieces_[j];
    ShardStep& s = steps_[g];
    s.accumulate_grad(k, mine.narrow(0, u.master_piece_shard_[j], s.piece(k).grad.numel()));
  }
}

// --- gathered(), full gradients ------------------------------------------------------------------

std::vector<int> Stage3::gather_units(const std::vector<at::Tensor>& params) {
  TouchPause pause;
  check_abandoned_backward();
  comm_.check_agreement("engine.gathered()");
  c10::NoGradGuard no_grad;
  std::vector<int> out;
  for (auto& u : units_) {
    bool wanted = params.empty();
    for (const Unit::Part* part : {&u->train_, &u->frozen_}) {
      for (const auto& p : part->params)
        for (const auto& q : params) wanted = wanted || p.unsafeGetTensorImpl() == q.unsafeGetTensorImpl();
    }
    if (!wanted) continue;
    out.push_back(u->index());
    u->gather(true, "gathered");
    ++u->holds_;
  }
  return out;
}

namespace {
bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  const at::ScalarType bits = a.element_size() == 8 ? at::kLong : a.element_size() == 4 ? at::kInt
                              : a.element_size() == 2                                    ? at::kShort
                                                                                         : at::kByte;
  return at::equal(a.contiguous().view(bits), b.contiguous().view(bits));
}
}  // namespace

void Stage3::release_units(const std::vector<int>& units, int modifier_rank) {
  TouchPause pause;
  c10::NoGradGuard no_grad;
  for (int i : units) {
    Unit& u = *units_[i];
    if (modifier_rank >= 0) {
      CollectiveLabel label(comm_, fmt::format("{}, gathered modified by rank {}", u.name(), modifier_rank));
      u.load_shards();  // offload_param nvme: the shards the new values go into
      bool trainable_changed = false;
      for (Unit::Part* part : {&u.train_, &u.frozen_}) {
        if (!part->layout) continue;
        if (comm_.world_size() > 1) comm_.broadcast(part->full, modifier_rank).wait();
        const FlatLayout& l = *part->layout;
        const at::Tensor fresh = part->full.narrow(0, l.shard_begin(comm_.rank()), l.shard_size());
        // Bit for bit (a NaN that stayed is no change; -0 for +0 is one).
        if (part == &u.train_ && !u.master_pieces_.empty()) trainable_changed = !bitwise_equal(fresh, part->shard);
        part->shard.copy_(fresh);
      }
      // The master weights of the unit's trainable parameters take the new values too, when they
      // changed on any rank (merging LoRA adapters changes only the frozen weights beside them, so it
      // works with the master weights on nvme, where they cannot be changed from outside the step).
      // Every rank with a trainable part joins (a rank whose shard is padding only has no master piece
      // and says "unchanged"): the same collectives on every rank.
      if (u.train_.layout && comm_.world_size() > 1) {
        at::Tensor flag = at::full({1}, trainable_changed ? 1 : 0, at::TensorOptions().dtype(at::kInt).device(opts_.device));
        comm_.all_reduce(flag, ReduceOp::kMax).wait();
        trainable_changed = flag.item<int>() != 0;
      }
      if (trainable_changed)
        for (const auto& [g, k] : u.master_pieces_) steps_[g].refresh_master(k);
      if (u.shards_on_disk()) {
        u.store_shards(/*trainable_only=*/false);
        u.drop_shards();
      }
    }
    --u.holds_;
    u.release();
  }
}

at::Tensor Stage3::full_grad(const at::Tensor& param, double inv_scale) {
  TouchPause pause;
  comm_.check_agreement("engine.full_grad()");
  c10::NoGradGuard no_grad;
  for (auto& u : units_) {
    const Unit::Part& t = u->train_;
    for (size_t i = 0; i < t.params.size(); ++i) {
      if (t.params[i].unsafeGetTensorImpl() != param.unsafeGetTensorImpl()) continue;
      const FlatLayout& l = *t.layout;
      at::Tensor shard = u->grad_shard_;
      if (gradients_swapped_) {  // this unit's pieces, read back from the swap files
        shard = at::zeros({l.shard_size()}, u->grad_shard_.options().device(u->train_.shard.device()));
        for (size_t j = 0; j < u->master_pieces_.size(); ++j) {
          const auto [g, k] = u->master_pieces_[j];
          const at::Tensor piece = steps_[g].read_grad(k);
          shard.narrow(0, u->master_piece_shard_[j], piece.numel()).copy_(piece);
        }
      }
      at::Tensor full = at::empty({l.padded_total()}, shard.options());
      CollectiveLabel label(comm_, fmt::format("{}, full_grad", u->name()));
      if (comm_.world_size() > 1) {
        comm_.all_gather(shard, full).wait();
      } else {
        full.copy_(shard);
      }
      at::Tensor g = full.narrow(0, l.offset(static_cast<int>(i)), t.params[i].numel()).view(t.params[i].sizes());
      return (inv_scale == 1.0 ? g : g * inv_scale).clone();
    }
    for (const auto& p : u->frozen_.params) {
      if (p.unsafeGetTensorImpl() == param.unsafeGetTensorImpl()) {
        throw Error(fmt::format("engine.full_grad: the parameter is frozen (in unit '{}'); it has no gradient", u->name()));
      }
    }
  }
  throw Error("engine.full_grad: the tensor is not a parameter of the prepared model");
}

GroupBytes Stage3::bytes() const {
  GroupBytes out;
  for (auto& u : units_) {
    if (u->train_.layout) out.params += u->train_.shard.storage().nbytes();  // 0 while on disk
    if (u->grad_shard_.defined() && !u->grad_shard_.is_meta()) out.grads += u->grad_shard_.nbytes();
    if (u->grad_staging_.defined()) out.workspace += u->grad_staging_.nbytes();
  }
  for (auto& s : steps_) {
    out.master += s.master_bytes();
    out.optimizer += s.optimizer().state_bytes();
    out.workspace += s.workspace_bytes();
  }
  out.workspace += fetch_->gathered();
  return out;
}

int64_t Stage3::frozen_bytes() const {
  int64_t n = 0;
  for (auto& u : units_)
    if (u->frozen_.layout) n += u->frozen_.shard.storage().nbytes();  // 0 while on disk
  return n;
}

int64_t Stage3::offload_disk_bytes() {
  return Sharding::offload_disk_bytes() + (opts_.param_swap ? opts_.param_swap->disk_bytes() : 0);
}

std::vector<StateRange> Stage3::state_ranges(bool /*to_write: shards are disjoint either way*/) {
  std::vector<StateRange> out;
  const int rank = comm_.rank();
  for (size_t ui = 0; ui < units_.size(); ++ui) {
    auto& u = units_[ui];
    for (Unit::Part* part : {&u->train_, &u->frozen_}) {
      if (!part->layout) continue;
      for (const Piece& pc : part->layout->pieces(rank)) {
        StateRange r{part->names[pc.param], part->params[pc.param].sizes().vec(), pc.param_begin, pc.count,
                     storage_slice(part->shard, pc.shard_begin, pc.count)};  // shards on disk: freed now
        if (u->shards_on_disk()) r.group = static_cast<int>(ui);
        if (part == &u->train_) {
          const int g = part->groups[pc.param];
          for (size_t j = 0; j < u->master_pieces_.size(); ++j) {
            const auto [pg, k] = u->master_pieces_[j];
            const ShardStep::Piece& mp = steps_[pg].piece(k);
            const int64_t at = u->master_piece_shard_[j];
            if (pg != g || pc.shard_begin < at || pc.shard_begin + pc.count > at + mp.out.numel()) continue;
            r.step = &steps_[g];
            r.index = mp.offset + (pc.shard_begin - at);
          }
          ZEAL_CHECK(r.step) << "no master piece holds " << r.name << " in " << u->name();
        }
        out.push_back(std::move(r));
      }
    }
  }
  return out;
}

void Stage3::begin_state_access() {
  fetch_->wait_all();
  open_ = -1;
}

void Stage3::open_group(int group) {
  TouchPause pause;
  ZEAL_CHECK(open_ < 0 && group >= 0 && group < static_cast<int>(units_.size()))
      << "open_group(" << group << ") while group " << open_ << " is open";
  open_ = group;
  units_[group]->load_shards();
}

void Stage3::close_group(int group, bool changed) {
  TouchPause pause;
  ZEAL_CHECK(open_ == group) << "close_group(" << group << "): group " << open_ << " is open";
  open_ = -1;
  Unit& u = *units_[group];
  try {
    if (changed) {
      c10::NoGradGuard no_grad;
      u.store_shards(/*trainable_only=*/false);
    }
  } catch (...) {
    if (u.pending_.empty()) u.drop_shards();  // never kept as if it were what the disk holds
    throw;
  }
  if (u.pending_.empty()) u.drop_shards();
}

void Stage3::end_state_access(bool changed) {
  TouchPause pause;
  if (open_ >= 0) close_group(open_, /*changed=*/false);  // an error left it open: it was not changed
  if (changed) {
    c10::NoGradGuard no_grad;
    // Frozen parts kept since the last backward hold the old values: they go.
    for (auto& u : units_) u->drop_kept();
    // Units gathered now (the persistent ones, those engine.gathered holds) take the new values,
    // one at a time (shards on disk read in for the gather and freed again).
    CollectiveLabel label(comm_, "after load_state");
    for (auto& u : units_) {
      if (u->state() == Unit::State::kReleased) continue;
      u->wait_gather();
      if (u->shards_on_disk()) u->load_shards();
      for (Unit::Part* part : {&u->train_, &u->frozen_}) {
        if (!part->layout) continue;
        if (comm_.world_size() > 1) {
          comm_.all_gather(part->shard, part->full).wait();
        } else {
          part->full.copy_(part->shard);
        }
      }
      if (u->shards_on_disk() && u->pending_.empty()) u->drop_shards();
    }
  }
}

}  // namespace zero
}  // namespace zeal
