#include "engine/zero/fetch_coordinator.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "engine/zero/stage3.h"
#include "engine/zero/unit.h"

namespace zeal::zero {

FetchCoordinator::FetchCoordinator(const Stage3Options& options, const std::vector<std::unique_ptr<Unit>>& units)
    : opts_(options), units_(units) {}

void FetchCoordinator::add_gathered(int64_t bytes) {
  gathered_ += bytes;
  peak_ = std::max(peak_, gathered_);
}

void FetchCoordinator::sub_gathered(int64_t bytes) { gathered_ -= bytes; }

int64_t FetchCoordinator::bound() const {
  int64_t largest = 0;
  for (const auto& u : units_)
    if (!u->persistent()) largest = std::max(largest, u->train_.bytes() + u->frozen_.bytes());
  return opts_.max_live_elems * static_cast<int64_t>(at::elementSize(opts_.compute_dtype)) + largest +
         persistent_bytes_;
}

void FetchCoordinator::wait_all() {
  for (const auto& v : units_) v->wait_gather();
}

void FetchCoordinator::on_fetch(Unit& u, Pass pass) {
  if (!opts_.prefetch || u.persistent()) return;
  Order& o = pass == Pass::kTraining ? training_ : no_grad_;
  if (pass == Pass::kNoGrad && o.recording.size() > 1 && o.recording.front() == u.index()) {
    // A no-grad pass repeats: the recording since its first unit is the whole order.
    o.trace = o.recording;
    o.valid = true;
    o.pos = 0;
    o.recording.clear();
  }
  o.recording.push_back(u.index());
  if (!o.valid) return;
  if (o.pos >= o.trace.size() || o.trace[o.pos] != u.index()) {
    // The order changed: finish every prefetch in flight (all ranks issued the same ones), fetch on
    // demand from here and record the order again.
    wait_all();
    // Frozen parts kept for the old order may never be used in the new one.
    for (const auto& v : units_)
      if (v.get() != &u) v->drop_kept();
    o.valid = false;
    if (pass == Pass::kNoGrad) o.recording = {u.index()};
    ++retraced_;
    return;
  }
  ++o.pos;
  prefetch_after(u, o, o.pos, pass == Pass::kNoGrad);
}

// Prefetches along `o` from position `from` (a no-grad order wraps around to its start).
void FetchCoordinator::prefetch_after(const Unit& u, const Order& o, size_t from, bool cyclic) {
  int64_t budget = opts_.prefetch_elems;
  const int64_t elem = at::elementSize(opts_.compute_dtype);
  // Live beyond the unit being fetched and the persistent ones: at most max_live_parameters.
  const int64_t base = persistent_bytes_ + u.gathered_bytes();
  const size_t n = o.trace.size();
  const size_t count = cyclic ? n - 1 : (from < n ? n - from : 0);
  size_t k = 0;
  for (; k < count && budget > 0; ++k) {
    Unit& v = *units_[o.trace[cyclic ? (from + k) % n : from + k]];
    if (&v == &u) {
      if (cyclic) break;  // around the cycle: the next use of this very unit
      continue;
    }
    if (v.state() != Unit::State::kReleased || v.persistent()) continue;
    if (gathered_ - base + v.missing_elems() * elem > opts_.max_live_elems * elem) break;
    const int64_t elems = v.missing_elems();
    budget -= elems;
    v.gather(false, "prefetch");
    if (elems > 0) ++prefetched_;
  }
  if (!opts_.param_swap) return;
  // offload_param nvme: the units after those, read from disk while this one computes, as far as
  // the read-ahead buffers go.
  for (; k < count; ++k) {
    Unit& v = *units_[o.trace[cyclic ? (from + k) % n : from + k]];
    if (&v == &u) {
      if (cyclic) break;
      continue;
    }
    if (v.state() != Unit::State::kReleased || v.persistent() || !v.shards_on_disk()) continue;
    if (v.read_ahead() < 0) break;
  }
}

int64_t FetchCoordinator::reuse_distance(const Unit& u, bool cyclic, int64_t cap) const {
  const Order& o = training_;
  const size_t n = o.trace.size(), count = cyclic ? n : (o.pos < n ? n - o.pos : 0);
  int64_t distance = 0;
  for (size_t k = 0; k < count && distance < cap; ++k) {
    const Unit& v = *units_[o.trace[(o.pos + k) % n]];
    if (&v == &u) return distance;
    if (!v.persistent()) distance += v.numel();
  }
  return cap;
}

bool FetchCoordinator::reused_soon(const Unit& u) const {
  const Order& o = training_;
  if (!opts_.prefetch || !o.valid || u.persistent()) return false;
  const int64_t elem = at::elementSize(opts_.compute_dtype);
  if (gathered_ - persistent_bytes_ > opts_.max_live_elems * elem) return false;
  return reuse_distance(u, /*cyclic=*/false, opts_.max_reuse_elems) < opts_.max_reuse_elems;  // 0: never kept
}

bool FetchCoordinator::frozen_reused(const Unit& u) const {
  const Order& o = training_;
  if (!opts_.prefetch || !o.valid || u.persistent() || !u.frozen_.layout || o.trace.empty()) return false;
  const int64_t elem = at::elementSize(opts_.compute_dtype);
  if (gathered_ - persistent_bytes_ - u.train_.bytes() > opts_.max_live_elems * elem) return false;
  // Within max_live elements of other units too: where the budget does not hold them all, the units
  // used again soonest keep theirs, not the first ones a backward reaches.
  const int64_t cap = std::min(opts_.max_reuse_elems, opts_.max_live_elems);
  return reuse_distance(u, /*cyclic=*/true, cap) < cap;
}

void FetchCoordinator::end_training_pass() {
  Order& o = training_;
  if (opts_.prefetch && (!o.valid || o.pos != o.trace.size())) {
    o.trace = o.recording;
    o.valid = !o.trace.empty();
  }
  o.recording.clear();
  o.pos = 0;
}

}  // namespace zeal::zero
