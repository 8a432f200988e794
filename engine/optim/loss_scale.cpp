#include "engine/optim/loss_scale.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "engine/config/config.h"
#include "engine/error.h"

namespace zeal {

LossScaler::LossScaler(const Fp16Config& c)
    : LossScaler(c.loss_scale > 0 ? c.loss_scale : std::ldexp(1.0, static_cast<int>(c.initial_scale_power)),
                 c.loss_scale <= 0, c.loss_scale_window, c.hysteresis, c.min_loss_scale, c.consecutive_hysteresis) {}

LossScaler::LossScaler(double initial_scale, bool dynamic, int64_t window, int64_t hysteresis, double min_scale,
                       bool consecutive_hysteresis)
    : scale_(initial_scale), dynamic_(dynamic), window_(std::max<int64_t>(1, window)),
      hysteresis_(std::max<int64_t>(1, hysteresis)), left_(hysteresis_), min_scale_(min_scale),
      consecutive_(consecutive_hysteresis) {}

void LossScaler::update(bool overflow) {
  if (overflow) ++skipped_;
  if (!dynamic_) {
    ++iter_;
    return;
  }
  if (overflow) {
    if (hysteresis_ == 1 || left_ == 1) {
      if (scale_ <= min_scale_) {
        throw Error(fmt::format("fp16: the gradients overflowed at the minimum loss scale {} (fp16.min_loss_scale) on "
                                "step {}: the loss cannot be scaled down further. Lower the learning rate, clip "
                                "gradients, or train in bf16",
                                min_scale_, iter_));
      }
      scale_ = std::max(scale_ / 2.0, min_scale_);
    } else {
      --left_;
    }
    last_overflow_ = iter_;
  } else {
    if (consecutive_) left_ = hysteresis_;
    if ((iter_ - last_overflow_) % window_ == 0) {
      if (!consecutive_) left_ = hysteresis_;
      scale_ *= 2.0;
    }
  }
  ++iter_;
}

}  // namespace zeal
