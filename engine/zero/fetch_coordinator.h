// Stage 3's fetch coordinator: the order units are used in, prefetch along it, and the bytes of
// gathered units. Internal to engine/zero.
//
// Two orders are recorded, one per kind of pass, because each repeats itself: a training pass (a
// forward and its backward: every unit's pre_forward and pre_backward, in order) and a no-grad pass
// (eval, generation: one forward, repeated — the order is complete when its first unit comes
// again). Once an order is known, fetching the unit at position k starts asynchronous all-gathers
// of the units that follow, up to stage3_prefetch_bucket_size elements and within
// stage3_max_live_parameters gathered beyond the unit being fetched and the persistent ones. A fetch
// that does not match the order waits for every prefetch in flight (all ranks issued the same
// ones), fetches on demand and records again: a changed order costs speed, never correctness.
// Every rank runs the same passes, so every rank prefetches the same units in the same order.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace zeal::zero {

class Unit;
struct Stage3Options;

class FetchCoordinator {
 public:
  enum class Pass { kTraining, kNoGrad };

  FetchCoordinator(const Stage3Options& options, const std::vector<std::unique_ptr<Unit>>& units);

  // `u` was just gathered (or found gathered) for a use in `pass`: recorded, and the units the
  // order says come next are prefetched.
  void on_fetch(Unit& u, Pass pass);
  // After u's training forward: whether the recorded order uses it again within
  // stage3_max_reuse_distance elements of other units (then it stays gathered), without lifting the
  // gathered bytes above stage3_max_live_parameters.
  bool reused_soon(const Unit& u) const;
  // After u's training use: whether its frozen part stays gathered (kept) — its next use, in this
  // pass or the next one (the order repeats), comes within stage3_max_reuse_distance and
  // stage3_max_live_parameters elements of other units, and the gathered bytes without its
  // trainable part stay within stage3_max_live_parameters.
  bool frozen_reused(const Unit& u) const;
  // A training pass (forward and backward) ended: its recording becomes the order if it changed.
  void end_training_pass();
  // Waits for every all-gather in flight.
  void wait_all();

  // Bytes of full unit buffers gathered now, and the most since the last reset.
  void add_gathered(int64_t bytes);
  void sub_gathered(int64_t bytes);
  int64_t gathered() const { return gathered_; }
  int64_t peak() const { return peak_; }
  void reset_peak() { peak_ = gathered_; }
  // What the settings allow: max_live + the largest unit + the persistent units.
  int64_t bound() const;
  void set_persistent_bytes(int64_t b) { persistent_bytes_ = b; }
  int64_t persistent_bytes() const { return persistent_bytes_; }

  int64_t gathers() const { return gathers_; }
  int64_t prefetched() const { return prefetched_; }
  int64_t retraced() const { return retraced_; }
  void count_gather() { ++gathers_; }

 private:
  struct Order {
    std::vector<int> trace, recording;
    size_t pos = 0;
    bool valid = false;
  };
  void prefetch_after(const Unit& u, const Order& order, size_t from, bool cyclic);
  // Elements of other units' uses before u's next one in the training order, from its position
  // (wrapping to the next pass when `cyclic`), counted up to `cap`; `cap` when there is none.
  int64_t reuse_distance(const Unit& u, bool cyclic, int64_t cap) const;

  const Stage3Options& opts_;
  const std::vector<std::unique_ptr<Unit>>& units_;
  Order training_, no_grad_;
  int64_t gathered_ = 0, peak_ = 0, persistent_bytes_ = 0;
  int64_t gathers_ = 0, prefetched_ = 0, retraced_ = 0;
};

}  // namespace zeal::zero
