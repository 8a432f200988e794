// DeepSpeed's learning-rate schedules against their formulas evaluated here in float64, and the
// shape properties a user relies on (warm-up endpoints, decay to the floor, resuming).
#include <gtest/gtest.h>

#include <cmath>

#include "engine/config/config.h"
#include "engine/error.h"
#include "engine/optim/schedule.h"

namespace zeal::optim {
namespace {

TEST(Schedule, WarmupLRLogAndLinear) {
  WarmupLR log(1e-5, 1e-3, 100, Warmup::kLog);
  EXPECT_DOUBLE_EQ(log.lr_at(0), 1e-5);  // ln 1 = 0
  for (int64_t t : {1, 10, 50, 99}) {
    EXPECT_NEAR(log.lr_at(t), 1e-5 + (1e-3 - 1e-5) * std::log(t + 1.0) / std::log(100.0), 1e-18) << t;
  }
  EXPECT_DOUBLE_EQ(log.lr_at(100), 1e-3);
  EXPECT_DOUBLE_EQ(log.lr_at(100000), 1e-3);
  WarmupLR lin(0.0, 2e-3, 8, Warmup::kLinear);
  EXPECT_DOUBLE_EQ(lin.lr_at(4), 1e-3);
  EXPECT_DOUBLE_EQ(lin.lr_at(8), 2e-3);
  WarmupLR tiny(0.0, 1.0, 0, Warmup::kLinear);  // DeepSpeed raises warm-up to at least 2 steps
  EXPECT_DOUBLE_EQ(tiny.lr_at(1), 0.5);
}

TEST(Schedule, WarmupDecayLRReachesZeroAtTotal) {
  WarmupDecayLR s(1000, 0.0, 1e-3, 100, Warmup::kLinear);
  EXPECT_DOUBLE_EQ(s.lr_at(50), 0.5e-3);
  EXPECT_DOUBLE_EQ(s.lr_at(100), 1e-3);
  EXPECT_NEAR(s.lr_at(550), 1e-3 * (1000 - 550) / 900.0, 1e-18);
  EXPECT_DOUBLE_EQ(s.lr_at(1000), 0.0);
  EXPECT_DOUBLE_EQ(s.lr_at(5000), 0.0);
  for (int64_t t = 101; t < 1000; ++t) EXPECT_LT(s.lr_at(t), s.lr_at(t - 1)) << t;
}

TEST(Schedule, WarmupCosineLRScalesTheOptimizerLr) {
  WarmupCosineLR s(3e-4, 1100, 0.1, 100, 0.01, Warmup::kLinear);
  EXPECT_DOUBLE_EQ(s.lr_at(0), 3e-4 * 0.1);
  EXPECT_NEAR(s.lr_at(50), 3e-4 * (0.1 + 0.9 * 0.5), 1e-18);
  // First step after warm-up: one step into the half cosine.
  EXPECT_NEAR(s.lr_at(100), 3e-4 * (0.01 + 0.99 * (1 + std::cos(M_PI * 1 / 1000.0)) / 2), 1e-18);
  EXPECT_NEAR(s.lr_at(599), 3e-4 * (0.01 + 0.99 * 0.5), 1e-15);
  EXPECT_NEAR(s.lr_at(1099), 3e-4 * 0.01, 1e-18);
  EXPECT_NEAR(s.lr_at(4000), 3e-4 * 0.01, 1e-18);  // stays at the floor
}

TEST(Schedule, StepAdvancesAndResumes) {
  WarmupLR s(0.0, 1.0, 10, Warmup::kLinear);
  EXPECT_EQ(s.last_iteration(), -1);
  EXPECT_DOUBLE_EQ(s.step(), 0.0);
  EXPECT_DOUBLE_EQ(s.step(), 0.1);
  WarmupLR resumed(0.0, 1.0, 10, Warmup::kLinear);
  resumed.set_last_iteration(s.last_iteration());
  EXPECT_DOUBLE_EQ(resumed.step(), s.step());
}

TEST(Schedule, FromConfig) {
  Config c = Config::parse(R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.002}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 200, "warmup_num_steps": 20,
                                                        "warmup_type": "linear"}}})", "ds.json");
  auto s = make_schedule(c.scheduler, c.optimizer.lr.value);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->name(), "WarmupCosineLR");
  EXPECT_DOUBLE_EQ(s->lr_at(10), 0.002 * 0.5);
  Config none = Config::defaults(false);
  EXPECT_EQ(make_schedule(none.scheduler, 1e-3), nullptr);
  Config autos = Config::parse(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}})",
                               "ds.json");
  try {
    make_schedule(autos.scheduler, 1e-3);
    FAIL() << "an unresolved auto was used";
  } catch (const zeal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("scheduler.params.total_num_steps is \"auto\""), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace zeal::optim
