// Dynamic loss scaling, step by step, against the behaviour DeepSpeed documents: hysteresis,
// halving, doubling after a window of good steps, the floor, and static scales.
#include <gtest/gtest.h>

#include "engine/config/config.h"
#include "engine/error.h"
#include "engine/optim/loss_scale.h"

namespace zeal {
namespace {

TEST(LossScaler, FromConfigDefaults) {
  Config c = Config::parse(R"({"fp16": {"enabled": true}})", "ds.json");
  LossScaler s(c.fp16);
  EXPECT_TRUE(s.dynamic());
  EXPECT_DOUBLE_EQ(s.scale(), 65536.0);  // 2^16
}

TEST(LossScaler, HysteresisThenHalvingThenDoublingAfterTheWindow) {
  LossScaler s(1024.0, true, /*window=*/4, /*hysteresis=*/2, /*min=*/1.0, false);
  s.update(true);  // first overflow: uses up one hysteresis, scale kept
  EXPECT_DOUBLE_EQ(s.scale(), 1024.0);
  s.update(true);  // second: halves
  EXPECT_DOUBLE_EQ(s.scale(), 512.0);
  s.update(true);  // hysteresis is not refilled until a doubling: halves again
  EXPECT_DOUBLE_EQ(s.scale(), 256.0);
  for (int i = 0; i < 3; ++i) {
    s.update(false);
    EXPECT_DOUBLE_EQ(s.scale(), 256.0) << "good step " << i + 1 << " of the window";
  }
  s.update(false);  // the 4th good step since the overflow doubles
  EXPECT_DOUBLE_EQ(s.scale(), 512.0);
  s.update(true);  // hysteresis was refilled by the doubling
  EXPECT_DOUBLE_EQ(s.scale(), 512.0);
  EXPECT_EQ(s.skipped_steps(), 4);
  EXPECT_EQ(s.iteration(), 8);
}

TEST(LossScaler, FirstDoublingAfterAWindowOfGoodSteps) {
  LossScaler s(8.0, true, 3, 1, 1.0, false);
  s.update(false);
  s.update(false);
  EXPECT_DOUBLE_EQ(s.scale(), 8.0);
  s.update(false);
  EXPECT_DOUBLE_EQ(s.scale(), 16.0);
}

TEST(LossScaler, ConsecutiveHysteresisRefillsOnEveryGoodStep) {
  LossScaler s(64.0, true, 100, 2, 1.0, true);
  s.update(true);
  s.update(false);  // refills
  s.update(true);   // only one used again: kept
  EXPECT_DOUBLE_EQ(s.scale(), 64.0);
  s.update(true);
  EXPECT_DOUBLE_EQ(s.scale(), 32.0);
}

TEST(LossScaler, FloorAndOverflowAtTheFloor) {
  LossScaler s(4.0, true, 10, 1, 2.0, false);
  s.update(true);
  EXPECT_DOUBLE_EQ(s.scale(), 2.0);
  try {
    s.update(true);
    FAIL() << "overflow at the minimum scale must stop training";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp16.min_loss_scale"), std::string::npos) << e.what();
  }
}

TEST(LossScaler, StaticScaleNeverMoves) {
  Config c = Config::parse(R"({"fp16": {"enabled": true, "loss_scale": 128}})", "ds.json");
  LossScaler s(c.fp16);
  EXPECT_FALSE(s.dynamic());
  for (int i = 0; i < 5; ++i) s.update(i % 2 == 0);
  EXPECT_DOUBLE_EQ(s.scale(), 128.0);
  EXPECT_EQ(s.skipped_steps(), 3);
}

}  // namespace
}  // namespace zeal
