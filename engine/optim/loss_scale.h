// Loss scaling for fp16 training with DeepSpeed's semantics (the config's `fp16` section).
//
// Dynamic: start at 2^initial_scale_power. A step whose gradients overflow is skipped; the scale is
// divided by 2 once `hysteresis` overflows have been seen (each overflow before that only uses
// one up), never below min_loss_scale; an overflow at the minimum is an error, as in DeepSpeed.
// After loss_scale_window steps without overflow since the last one, the scale doubles and the
// hysteresis is refilled (with consecutive_hysteresis, every good step refills it).
// Static: `loss_scale` > 0 fixes the scale; overflowing steps are still skipped.
#pragma once

#include <cstdint>

namespace zeal {

struct Fp16Config;

class LossScaler {
 public:
  explicit LossScaler(const Fp16Config& config);
  LossScaler(double initial_scale, bool dynamic, int64_t window, int64_t hysteresis, double min_scale,
             bool consecutive_hysteresis);

  double scale() const { return scale_; }
  bool dynamic() const { return dynamic_; }
  // Records the outcome of one optimizer step (true: inf/nan in the gradients, the step was
  // skipped) and adjusts the scale. Throws zeal::Error on an overflow at the minimum scale.
  void update(bool overflow);
  int64_t iteration() const { return iter_; }
  int64_t skipped_steps() const { return skipped_; }
  // Everything that changes as it runs (checkpoints).
  struct Snapshot {
    double scale = 0;
    int64_t left = 0, iter = 0, last_overflow = -1, skipped = 0;
  };
  Snapshot snapshot() const { return {scale_, left_, iter_, last_overflow_, skipped_}; }
  void restore(const Snapshot& s) {
    scale_ = s.scale;
    left_ = s.left;
    iter_ = s.iter;
    last_overflow_ = s.last_overflow;
    skipped_ = s.skipped;
  }

 private:
  double scale_;
  bool dynamic_;
  int64_t window_, hysteresis_, left_;
  double min_scale_;
  bool consecutive_;
  int64_t iter_ = 0, last_overflow_ = -1, skipped_ = 0;
};

}  // namespace zeal
