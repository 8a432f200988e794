// DeepSpeed's learning-rate schedules (the config's `scheduler` section): WarmupLR,
// WarmupDecayLR and WarmupCosineLR, with DeepSpeed's formulas.
//
// Iterations count optimizer steps from 0: lr_at(t) is the rate for optimizer step t. (DeepSpeed
// steps its scheduler after each optimizer step, so its first step still runs at the
// optimizer's own lr — 0 for WarmupCosineLR — and its step t+1 runs at lr_at(t). zeal starts the
// schedule at the first step.)
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace zeal {

struct SchedulerConfig;

namespace optim {

class LrSchedule {
 public:
  virtual ~LrSchedule() = default;
  virtual double lr_at(int64_t iteration) const = 0;
  virtual std::string name() const = 0;
  // A schedule of PyTorch's LambdaLR kind (Hugging Face's): the factor of each parameter group's own
  // rate at `iteration`; lr_at is then group 0's rate. nullopt for DeepSpeed's absolute rates.
  virtual std::optional<double> factor(int64_t) const { return std::nullopt; }

  // Advances to the next optimizer step and returns its rate.
  double step() { return lr_at(++last_); }
  int64_t last_iteration() const { return last_; }
  void set_last_iteration(int64_t t) { last_ = t; }  // for resuming

 private:
  int64_t last_ = -1;
};

enum class Warmup { kLog, kLinear };

// min_lr → max_lr over warmup_steps (at least 2): log: min + (max-min)·ln(t+1)/ln(warmup_steps),
// linear: min + (max-min)·t/warmup_steps; then max_lr.
class WarmupLR : public LrSchedule {
 public:
  WarmupLR(double min_lr, double max_lr, int64_t warmup_steps, Warmup type);
  double lr_at(int64_t t) const override;
  std::string name() const override { return "WarmupLR"; }

 protected:
  double warmup_fraction(int64_t t) const;  // in [0, 1) during the warm-up
  double min_lr_, max_lr_;
  int64_t warmup_steps_;
  Warmup type_;
};

// WarmupLR, then linear decay to 0 at total_steps: max_lr·(total - t)/(total - warmup).
class WarmupDecayLR : public WarmupLR {
 public:
  WarmupDecayLR(int64_t total_steps, double min_lr, double max_lr, int64_t warmup_steps, Warmup type);
  double lr_at(int64_t t) const override;
  std::string name() const override { return "WarmupDecayLR"; }

 private:
  int64_t total_steps_;
};

// Ratios of the optimizer's lr: warm-up from warmup_min_ratio to 1, then a half cosine from 1
// to cos_min_ratio at total_steps.
class WarmupCosineLR : public LrSchedule {
 public:
  WarmupCosineLR(double base_lr, int64_t total_steps, double warmup_min_ratio, int64_t warmup_steps,
                 double cos_min_ratio, Warmup type);
  double lr_at(int64_t t) const override;
  std::string name() const override { return "WarmupCosineLR"; }

 private:
  double base_lr_;
  int64_t total_steps_;
  double warmup_min_ratio_;
  int64_t warmup_steps_;
  double cos_min_ratio_;
  Warmup type_;
};

// Hugging Face's get_scheduler(name, optimizer, num_warmup_steps, num_training_steps) with
// transformers' formulas: a factor of each group's rate (base_lr: group 0's, and polynomial's
// lr_init). "linear", "cosine" (half a cycle), "polynomial" (to lr_end 1e-7, power 1),
// "constant", "constant_with_warmup". zeal::Error for another name, or polynomial with
// base_lr <= lr_end.
class HfSchedule : public LrSchedule {
 public:
  HfSchedule(std::string type, double base_lr, int64_t warmup_steps, int64_t total_steps, double lr_end = 1e-7,
             double power = 1.0);
  double lr_at(int64_t t) const override { return base_lr_ * *factor(t); }
  std::optional<double> factor(int64_t t) const override;
  std::string name() const override { return type_; }

 private:
  std::string type_;
  double base_lr_;
  int64_t warmup_, total_;
  double lr_end_, power_;
};

// The schedule the config names (nullptr when it names none). `optimizer_lr` is the optimizer's
// resolved lr (WarmupCosineLR scales it). Throws zeal::Error for an unresolved "auto".
// `group`: the parameter group, which takes its own entry of a per-group list of rates (DeepSpeed's
// warmup_min_lr / warmup_max_lr lists; the caller checks their length against the groups).
std::unique_ptr<LrSchedule> make_schedule(const SchedulerConfig& config, double optimizer_lr, size_t group = 0);

}  // namespace optim
}  // namespace zeal
