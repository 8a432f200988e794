// zeal::Engine against references: ZeRO stages 0-3 on 1-4 ranks vs one process of plain
// LibTorch (torch::optim::AdamW, clip_grad_norm_) on the same global batches; the sharded stages
// vs stage 0; layouts; every CPU kernel path. Tolerances come from tests/engine/rounding.h:
// computed in the test from the run's own gradients, float32's unit roundoff and the number of
// summands, or bit-identity where the arithmetic is the same.
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
// LibTorch StepLR on the optimizer: final parameters, losses and norms within what summation
// order, optimizer rounding and the batch split allow (rounding.h), and every rank holding the
// same parameters bit for bit.
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
  const Spread tol = tolerances(s).zeal_vs_libtorch();
  const double err = rel_diff(got.params[0], ref.params[0]);
  std::printf("[ metric ] world %d stage %d accumulation %d: max relative parameter difference vs LibTorch %.3g "
              "(tolerance %.3g)\n",
              c.world, c.stage, c.accumulation, err, tol.params);
  EXPECT_LE(err, tol.params);
  EXPECT_GT(ref.norms[0].item<double>(), s.clip) << "clipping should be active";
  EXPECT_LE(curve_diff(got.norms, ref.norms), tol.norms);
  EXPECT_LE(curve_diff(got.losses, ref.losses), tol.losses);
  // The parameters moved: the comparison is not between two untouched models.
  zeal_test::seed(s.seed);
  TinyGpt init(model_options());
  EXPECT_GT(rel_diff(flat_params(*init), ref.params[0]), 100 * tol.params);
}

INSTANTIATE_TEST_SUITE_P(Zero, Equivalence,
                         ::testing::Values(Case{1, 0, 1}, Case{2, 0, 1}, Case{2, 1, 1}, Case{2, 2, 1}, Case{3, 2, 1},
                                           Case{1, 2, 3}, Case{2, 0, 3}, Case{2, 1, 3}, Case{2, 2, 3},
                                           Case{3, 0, 3}, Case{3, 1, 3}, Case{3, 2, 3}, Case{4, 0, 3},
                                           Case{4, 1, 3}, Case{4, 2, 3}, Case{1, 3, 1}, Case{2, 3, 1},
                                           Case{3, 3, 1}, Case{2, 3, 3}, Case{3, 3, 3}, Case{4, 3, 3}),
                         case_name);

// Whether stage `a` and stage `b` perform the same arithmetic in the same order at this world
// size and accumulation, so that their results must be bit-identical:
//  - one rank: no sum over ranks; every stage adds the micro-steps' gradients in order into zeros;
//  - two ranks: a + b = b + a, so any collective's order gives the same sum; stages 0 and 1 both
//    add a rank's micro-steps first, stages 2 and 3 both add each micro-step's two ranks first,
//    and with one micro-step the two orders are the same.
// The update is element-wise and identical in every layout. (The global norm is summed in
// float64 in layout order: its rounding reaches the float32 clip factor with a probability near
// 2⁻²⁹ a step.) From three ranks on, a ring's order depends on where an element lies in the flat
// buffer, so layouts differ in rounding.
bool same_arithmetic(int world, int accumulation, int a, int b) {
  if (world == 1 || a == b) return true;
  if (world != 2) return false;
  const bool rank_first_a = a <= 1, rank_first_b = b <= 1;
  return rank_first_a == rank_first_b || accumulation == 1;
}

class StagesAgree : public ::testing::TestWithParam<std::pair<int, int>> {};

// Every stage against every other at the same world size and accumulation: bit-identical where
// the arithmetic is the same, else within the summation-order bound.
TEST_P(StagesAgree, ShardedStagesMatchStageZero) {
  RunSpec s;
  std::tie(s.world, s.accumulation) = GetParam();
  std::vector<RunResult> runs;
  for (int stage : {0, 1, 2, 3}) {
    s.stage = stage;
    s.overlap = stage == 2;
    runs.push_back(run_engine(s, "stage" + std::to_string(stage)));
  }
  const Spread tol = tolerances(s).zeal_vs_zeal();
  for (int a = 0; a < 4; ++a) {
    for (int b = a + 1; b < 4; ++b) {
      const double err = rel_diff(runs[b].params[0], runs[a].params[0]);
      const bool same = same_arithmetic(s.world, s.accumulation, a, b);
      std::printf("[ metric ] world %d accumulation %d: stage %d vs stage %d max relative parameter difference %.3g "
                  "(%s)\n",
                  s.world, s.accumulation, b, a, err,
                  same ? "same arithmetic: must be 0" : fmt::format("tolerance {:.3g}", tol.params).c_str());
      if (same) {
        EXPECT_TRUE(at::equal(runs[b].params[0], runs[a].params[0])) << "stage " << b << " vs " << a;
      } else {
        EXPECT_LE(err, tol.params) << "stage " << b << " vs " << a;
      }
      // The gradient norms too: Adam with active clipping barely sees a gradient off by a constant
      // factor in its parameters, the norm sees it at once.
      EXPECT_LE(curve_diff(runs[b].norms, runs[a].norms), tol.norms) << "stage " << b << " vs " << a;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(World, StagesAgree,
                         ::testing::Values(std::pair{1, 3}, std::pair{2, 1}, std::pair{2, 3}, std::pair{3, 3},
                                           std::pair{4, 3}),
                         [](const auto& info) {
                           return fmt::format("world{}_accum{}", info.param.first, info.param.second);
                         });

// One bucket for everything, and no overlap: the same numbers up to summation order (three ranks:
// each bucket's ring starts elsewhere).
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
  EXPECT_LE(rel_diff(one.params[0], small.params[0]), tolerances(s).zeal_vs_zeal().params);
  // Two ranks: the same sums whatever the layout.
  s.world = 2;
  s.bucket = 1000;
  s.overlap = true;
  const RunResult small2 = run_engine(s, "small_buckets2");
  s.bucket = 1'000'000;
  s.overlap = false;
  EXPECT_TRUE(at::equal(run_engine(s, "one_bucket2").params[0], small2.params[0]));
}

// Every CPU kernel path this machine has (ZEAL_CPU_ISA in the ranks) trains to the same bits: the
// paths evaluate the same expressions with the same roundings, so on an AVX-512 machine the
// AVX-512, AVX2 and scalar paths all run here and must agree exactly.
TEST(CpuIsa, EveryKernelPathTrainsToTheSameBits) {
  RunSpec s;
  s.world = 2;
  s.stage = 2;
  s.accumulation = 2;
  std::vector<std::string> paths;
  for (auto simd : {zeal::cpu::Simd::kScalar, zeal::cpu::Simd::kAvx2, zeal::cpu::Simd::kAvx512}) {
    if (zeal::cpu::simd_supported(simd)) paths.push_back(zeal::cpu::simd_name(simd));
  }
  s.isa = paths[0];
  const RunResult first = run_engine(s, "isa_" + s.isa);
  // The gradient norm's sum of squares runs in float64 with each path's own lane count: a sum of n
  // positive terms in any order is within (n − 1)·2⁻⁵³ of the exact one, relatively (the all-reduce
  // adds one term per rank), so two paths' sums are within twice that and their square roots, the
  // norms, within (n − 1)·2⁻⁵³.
  const double n = first.memory[0][5].item<double>() + s.world;
  std::string names = paths[0];
  for (size_t i = 1; i < paths.size(); ++i) {
    s.isa = paths[i];
    names += ", " + paths[i];
    const RunResult r = run_engine(s, "isa_" + s.isa);
    EXPECT_TRUE(at::equal(r.params[0], first.params[0])) << paths[i] << " vs " << paths[0];
    EXPECT_LE(curve_diff(r.norms, first.norms), (n - 1) * std::ldexp(1.0, -53)) << paths[i] << " vs " << paths[0];
  }
  std::printf("[ metric ] kernel paths trained to the same parameters: %s\n", names.c_str());
}

// A bad ZEAL_CPU_ISA is refused when the engine starts, naming the variable.
TEST(CpuIsa, AnUnknownPathIsRefusedByName) {
  const std::string msg = error_on_one_rank("isa_bad", [](zeal::Runtime& rt) {
    ::setenv("ZEAL_CPU_ISA", "avx9", 1);
    zeal::Engine engine(make_config(RunSpec{}), rt);
  });
  EXPECT_NE(msg.find("ZEAL_CPU_ISA=avx9"), std::string::npos) << msg;
  EXPECT_NE(msg.find("scalar, avx2 or avx512"), std::string::npos) << msg;
}

}  // namespace
}  // namespace zeal_test
