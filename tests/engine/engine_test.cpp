// zeal::Engine against references: ZeRO stages 0-2 on 1-4 ranks vs one process of plain
// LibTorch (torch::optim::AdamW, clip_grad_norm_) on the same global batches; stages 1, 2 vs
// stage 0; bf16 vs fp32; fp16 overflow handling; frozen parameters; memory accounting.
#include "tests/engine/engine_harness.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

namespace zeal_test {
namespace {

struct Case {
  int world, stage, accumulation;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return fmt::format("world{}_stage{}_accum{}", info.param.world, info.param.stage, info.param.accumulation);
}

class Equivalence : public ::testing::TestWithParam<Case> {};

// fp32, clipping on (it bites: the first norms are above the limit), 10 optimizer steps, a
// LibTorch StepLR on the optimizer: final parameters within 1e-5 of the one-process run, and
// every rank holding the same parameters bit for bit.
TEST_P(Equivalence, MatchesOneProcessLibTorch) {
  const Case c = GetParam();
  RunSpec s;
  s.world = c.world;
  s.stage = c.stage;
  s.accumulation = c.accumulation;
  s.step_lr = true;
  const RunResult ref = run_reference(s);
  const RunResult got = run_engine(s, case_name({c, 0}));
  ASSERT_EQ(got.params.size(), static_cast<size_t>(c.world));
  for (int r = 1; r < c.world; ++r) EXPECT_TRUE(at::equal(got.params[r], got.params[0])) << "rank " << r;
  const double err = rel_diff(got.params[0], ref.params[0]);
  std::printf("[ metric ] world %d stage %d accumulation %d: max relative parameter difference vs LibTorch %.3g\n",
              c.world, c.stage, c.accumulation, err);
  EXPECT_LE(err, 1e-5);
  // The floor set by summation order alone: LibTorch in one process, the same global batch in
  // world × accumulation micro-batches.
  const RunResult split = run_reference(s, c.world * c.accumulation);
  std::printf("[ metric ] ... LibTorch split into %d micro-batches vs one batch: %.3g\n", c.world * c.accumulation,
              rel_diff(split.params[0], ref.params[0]));
  EXPECT_GT(ref.norms[0].item<double>(), s.clip) << "clipping should be active";
  EXPECT_LE(((got.norms - ref.norms).abs() / ref.norms).max().item<double>(), 1e-5);
  EXPECT_LE(((got.losses - ref.losses).abs() / ref.losses).max().item<double>(), 1e-5);
  // The parameters moved: the comparison is not between two untouched models.
  at::manual_seed(s.seed);
  TinyGpt init(model_options());
  EXPECT_GT(rel_diff(flat_params(*init), ref.params[0]), 1e-2);
}

INSTANTIATE_TEST_SUITE_P(Zero, Equivalence,
                         ::testing::Values(Case{1, 0, 1}, Case{2, 0, 1}, Case{2, 1, 1}, Case{2, 2, 1}, Case{3, 2, 1},
                                           Case{1, 2, 3}, Case{2, 0, 3}, Case{2, 1, 3}, Case{2, 2, 3},
                                           Case{3, 0, 3}, Case{3, 1, 3}, Case{3, 2, 3}, Case{4, 0, 3},
                                           Case{4, 1, 3}, Case{4, 2, 3}, Case{1, 3, 1}, Case{2, 3, 1},
                                           Case{3, 3, 1}, Case{2, 3, 3}, Case{3, 3, 3}, Case{4, 3, 3}),
                         case_name);

// Sharded stages against stage 0 at the same world size: 1e-6.
class StagesAgree : public ::testing::TestWithParam<int> {};

TEST_P(StagesAgree, ShardedStagesMatchStageZero) {
  RunSpec s;
  s.world = GetParam();
  s.accumulation = 3;
  s.stage = 0;
  const RunResult zero = run_engine(s, "stage0");
  for (int stage : {1, 2, 3}) {
    s.stage = stage;
    s.overlap = stage == 2;
    const RunResult got = run_engine(s, "stage" + std::to_string(stage));
    const double err = rel_diff(got.params[0], zero.params[0]);
    std::printf("[ metric ] world %d: stage %d vs stage 0 max relative parameter difference %.3g\n", s.world, stage,
                err);
    EXPECT_LE(err, 1e-6) << "stage " << stage;
  }
}

INSTANTIATE_TEST_SUITE_P(World, StagesAgree, ::testing::Values(2, 3, 4));

// One bucket for everything, and no overlap: the same numbers.
TEST(Buckets, OneBucketWithoutOverlapMatchesManySmallOnes) {
  RunSpec s;
  s.world = 3;
  s.stage = 2;
  s.accumulation = 2;
  s.bucket = 1000;
  const RunResult small = run_engine(s, "small_buckets");
  s.bucket = 1'000'000;
  s.overlap = false;
  const RunResult one = run_engine(s, "one_bucket");
  EXPECT_LE(rel_diff(one.params[0], small.params[0]), 1e-6);
}

}  // namespace
}  // namespace zeal_test
