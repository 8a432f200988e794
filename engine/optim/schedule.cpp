#include "engine/optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include <fmt/format.h>

#include "engine/config/config.h"
#include "engine/error.h"

namespace zeal::optim {

namespace {
constexpr double kPi = 3.14159265358979323846;
}

HfSchedule::HfSchedule(std::string type, double base_lr, int64_t warmup_steps, int64_t total_steps, double lr_end,
                       double power)
    : type_(std::move(type)), base_lr_(base_lr), warmup_(std::max<int64_t>(0, warmup_steps)),
      total_(std::max<int64_t>(0, total_steps)), lr_end_(lr_end), power_(power) {
  if (type_ != "linear" && type_ != "cosine" && type_ != "polynomial" && type_ != "constant" &&
      type_ != "constant_with_warmup") {
    throw Error(fmt::format("lr_scheduler_type: unknown schedule '{}' (linear, cosine, polynomial, constant, "
                            "constant_with_warmup)",
                            type_));
  }
  if (type_ == "polynomial" && !(base_lr_ > lr_end_)) {
    throw Error(fmt::format("lr_scheduler_type polynomial: the learning rate ({}) must be above lr_end ({})", base_lr_,
                            lr_end_));
  }
}

// transformers' lambdas (optimization.py), operation for operation, so the factors are the same doubles.
std::optional<double> HfSchedule::factor(int64_t t) const {
  const double step = static_cast<double>(t), warm = static_cast<double>(warmup_), total = static_cast<double>(total_);
  if (type_ == "constant") return 1.0;
  if (t < warmup_) return step / std::max(1.0, warm);
  if (type_ == "constant_with_warmup") return 1.0;
  if (type_ == "linear") return std::max(0.0, (total - step) / static_cast<double>(std::max<int64_t>(1, total_ - warmup_)));
  if (type_ == "cosine") {
    const double progress = (step - warm) / static_cast<double>(std::max<int64_t>(1, total_ - warmup_));
    return std::max(0.0, 0.5 * (1.0 + std::cos(kPi * 0.5 * 2.0 * progress)));
  }
  // polynomial
  if (t > total_ || total_ == warmup_) return lr_end_ / base_lr_;
  const double range = base_lr_ - lr_end_;
  const double decay_steps = static_cast<double>(total_ - warmup_);
  const double remaining = 1.0 - (step - warm) / decay_steps;
  return (range * std::pow(remaining, power_) + lr_end_) / base_lr_;
}

WarmupLR::WarmupLR(double min_lr, double max_lr, int64_t warmup_steps, Warmup type)
    : min_lr_(min_lr), max_lr_(max_lr), warmup_steps_(std::max<int64_t>(2, warmup_steps)), type_(type) {}

double WarmupLR::warmup_fraction(int64_t t) const {
  if (type_ == Warmup::kLog) return std::log(static_cast<double>(t + 1)) / std::log(static_cast<double>(warmup_steps_));
  return static_cast<double>(t) / static_cast<double>(warmup_steps_);
}

double WarmupLR::lr_at(int64_t t) const {
  if (t < 0) return 0.0;
  if (t < warmup_steps_) return min_lr_ + (max_lr_ - min_lr_) * warmup_fraction(t);
  return max_lr_;
}

WarmupDecayLR::WarmupDecayLR(int64_t total_steps, double min_lr, double max_lr, int64_t warmup_steps, Warmup type)
    : WarmupLR(min_lr, max_lr, warmup_steps, type), total_steps_(total_steps) {}

double WarmupDecayLR::lr_at(int64_t t) const {
  if (t < 0) return 0.0;
  if (t < warmup_steps_) return WarmupLR::lr_at(t);
  const double gamma = std::max(0.0, static_cast<double>(total_steps_ - t) /
                                         std::max(1.0, static_cast<double>(total_steps_ - warmup_steps_)));
  return min_lr_ + (max_lr_ - min_lr_) * gamma;
}

WarmupCosineLR::WarmupCosineLR(double base_lr, int64_t total_steps, double warmup_min_ratio, int64_t warmup_steps,
                               double cos_min_ratio, Warmup type)
    : base_lr_(base_lr), total_steps_(total_steps), warmup_min_ratio_(warmup_min_ratio),
      warmup_steps_(std::max<int64_t>(2, warmup_steps)), cos_min_ratio_(cos_min_ratio), type_(type) {}

double WarmupCosineLR::lr_at(int64_t t) const {
  if (t < 0) return 0.0;
  double ratio;
  if (t < warmup_steps_) {
    const double f = type_ == Warmup::kLog
                         ? std::log(static_cast<double>(t + 1)) / std::log(static_cast<double>(warmup_steps_))
                         : static_cast<double>(t) / static_cast<double>(warmup_steps_);
    ratio = warmup_min_ratio_ + (1.0 - warmup_min_ratio_) * f;
  } else {
    const double done = static_cast<double>(t - warmup_steps_ + 1);
    const double span = static_cast<double>(std::max<int64_t>(1, total_steps_ - warmup_steps_));
    const double cosine = (1.0 + std::cos(kPi * std::min(1.0, done / span))) / 2.0;
    ratio = std::max(0.0, cos_min_ratio_ + (1.0 - cos_min_ratio_) * cosine);
  }
  return base_lr_ * ratio;
}

std::unique_ptr<LrSchedule> make_schedule(const SchedulerConfig& c, double optimizer_lr, size_t group) {
  if (c.type.empty()) return nullptr;
  auto need = [&](const auto& v, const char* key) {
    if (v.is_auto) throw Error(fmt::format("scheduler.params.{} is \"auto\" and was not resolved (call Config::resolve_auto)", key));
    return v.value;
  };
  auto rate = [&](const Auto<double>& scalar, const std::vector<double>& list, const char* key) {
    if (list.empty()) return need(scalar, key);
    if (group >= list.size()) {
      throw Error(fmt::format("scheduler.params.{}: expected a value for parameter group {}, got {} values", key,
                              group, list.size()));
    }
    return list[group];
  };
  const Warmup type = c.warmup_type == "linear" ? Warmup::kLinear : Warmup::kLog;
  const int64_t warmup = need(c.warmup_num_steps, "warmup_num_steps");
  if (c.type == "WarmupLR") {
    return std::make_unique<WarmupLR>(rate(c.warmup_min_lr, c.warmup_min_lrs, "warmup_min_lr"),
                                      rate(c.warmup_max_lr, c.warmup_max_lrs, "warmup_max_lr"), warmup, type);
  }
  if (c.type == "WarmupDecayLR") {
    return std::make_unique<WarmupDecayLR>(need(c.total_num_steps, "total_num_steps"),
                                           rate(c.warmup_min_lr, c.warmup_min_lrs, "warmup_min_lr"),
                                           rate(c.warmup_max_lr, c.warmup_max_lrs, "warmup_max_lr"), warmup, type);
  }
  if (c.type == "WarmupCosineLR") {
    return std::make_unique<WarmupCosineLR>(optimizer_lr, need(c.total_num_steps, "total_num_steps"), c.warmup_min_ratio,
                                            warmup, c.cos_min_ratio, type);
  }
  throw Error(fmt::format("scheduler.type {} is not one zeal knows (WarmupLR, WarmupDecayLR, WarmupCosineLR)", c.type));
}

}  // namespace zeal::optim
