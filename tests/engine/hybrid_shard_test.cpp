// Hybrid sharding (zero_optimization.hybrid_shard, FSDP's HYBRID_SHARD): two simulated machines of
// two ranks each (zeal::spawn's ranks_per_machine: LOCAL_RANK, LOCAL_WORLD_SIZE and NODE_RANK as two
// launchers would set them). The state is sharded across a machine's ranks and replicated across
// machines, so training must match one LibTorch process over the whole global batch, every rank
// must end with the same parameters, and a checkpoint must hold each shard once, written by the first
// machine's ranks, each holding half of the state. tests/launch/machines.sh runs the same with two
// real launchers in two network namespaces.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "tests/engine/engine_harness.h"
#include "tests/engine/phase_harness.h"

namespace zeal_test {
namespace {

RunSpec hybrid(int stage, bool on = true) {
  RunSpec s;
  s.world = 4;
  s.ranks_per_machine = 2;
  s.stage = stage;
  s.steps = 6;
  s.hybrid = on;
  return s;
}

// The smallest movement of any parameter tensor between a and b, relative to b's scale.
double least_moved(const at::Tensor& a, const at::Tensor& b) {
  const auto d = rel_diffs(a, b);
  return *std::min_element(d.begin(), d.end());
}

TEST(HybridShard, TwoMachinesOfTwoRanksMatchOneLibTorchProcessAndFullSharding) {
  for (int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const RunSpec s = hybrid(stage);
    const RunResult h = run_engine(s, "hybrid" + std::to_string(stage));
    const RunResult full = run_engine(hybrid(stage, false), "full" + std::to_string(stage));
    const RunResult ref = run_reference(s);
    const Tolerances tol = tolerances(s);
    const double moved = least_moved(h.trajectory[0][0], ref.params[0]);
    for (int r = 0; r < s.world; ++r) {
      EXPECT_TRUE(at::equal(h.params[r], h.params[0])) << "rank " << r << " differs from rank 0: the replicas drifted";
    }
    const double vs_ref = rel_diff(h.params[0], ref.params[0]), vs_full = rel_diff(h.params[0], full.params[0]);
    std::printf("[ metric ] stage %d hybrid vs LibTorch %.3g (tolerance %.3g), vs full sharding %.3g (tolerance "
                "%.3g); training moved every parameter tensor by at least %.3g\n",
                stage, vs_ref, tol.zeal_vs_libtorch().params, vs_full, tol.zeal_vs_zeal().params, moved);
    EXPECT_LE(vs_ref, tol.zeal_vs_libtorch().params);
    EXPECT_LE(vs_full, tol.zeal_vs_zeal().params + tol.zeal_vs_zeal().params);
    // The comparison means something: the tolerance is far below how far training moves the weights.
    EXPECT_GT(moved, 100 * tol.zeal_vs_libtorch().params);
    EXPECT_LE(rel_diff_plain(h.losses, ref.losses), tol.zeal_vs_libtorch().losses);
  }
}

// Gradients reduced in bf16 are divided by the number of ranks before the sum (no overflow): under
// hybrid sharding that is every rank of every machine, not the machine's. The gradient norms (before
// clipping) show a wrong divisor at once, where Adam's steps would hide it.
TEST(HybridShard, SixteenBitReductionsDivideByEveryRank) {
  RunSpec s = hybrid(3);
  s.precision = "bf16";
  s.comm_dtype = "bf16";
  const RunResult h = run_engine(s, "hybrid_bf16");
  s.hybrid = false;
  const RunResult full = run_engine(s, "full_bf16");
  ASSERT_EQ(h.norms.numel(), full.norms.numel());
  const double d = rel_diff_plain(h.norms, full.norms);
  std::printf("[ metric ] bf16 reductions: gradient norms of hybrid against full sharding differ by %.3g (relative)\n", d);
  EXPECT_LT(d, 0.02);
}

// The manifest's pieces of the optimizer's master weights: which files hold them, and how many
// elements each file holds, per parameter.
TEST(HybridShard, TheFirstMachineWritesEachShardOnceAndAResumeIsBitIdentical) {
  for (int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const RunSpec s = hybrid(stage);
    const std::string ckpt = temp_dir("hybrid_ckpt" + std::to_string(stage));
    const auto whole = run_phase({s, 0, kPhaseSteps, "", ""}, "hybrid_whole");
    (void)run_phase({s, 0, kPhaseSteps / 2, "", ckpt}, "hybrid_first");
    nlohmann::json m = nlohmann::json::parse(std::ifstream(std::filesystem::path(ckpt) / "manifest.json"));
    std::map<std::string, int64_t> per_file, per_param;
    for (const auto& p : m["pieces"]) {
      if (p["kind"] != "master") continue;
      per_file[p["file"].get<std::string>()] += p["count"].get<int64_t>();
      per_param[p["name"].get<std::string>()] += p["count"].get<int64_t>();
    }
    TinyGpt shape(model_options());
    int64_t total = 0;
    for (const auto& item : shape->named_parameters()) {
      EXPECT_EQ(per_param[item.key()], item.value().numel()) << item.key() << " is not covered exactly once";
      total += item.value().numel();
    }
    EXPECT_EQ(per_file.size(), 2u) << "only the first machine's two ranks write shards";
    for (const auto& [file, n] : per_file) {
      EXPECT_TRUE(file == "rank0.safetensors" || file == "rank1.safetensors") << file;
      // Sharded over 2 ranks, not 4: each holds about half (padding to whole shards aside).
      EXPECT_GT(n, total * 4 / 10) << file;
      EXPECT_LT(n, total * 6 / 10) << file;
    }
    const auto resumed = run_phase({s, kPhaseSteps / 2, kPhaseSteps, ckpt, ""}, "hybrid_resumed");
    for (int r = 0; r < s.world; ++r) {
      EXPECT_TRUE(at::equal(whole[r], resumed[r])) << "rank " << r << ": largest difference "
                                                   << (whole[r] - resumed[r]).abs().max().item<double>();
    }
    // And another layout reads it: full sharding on 2 ranks of one machine continues within 1e-5.
    RunSpec two = s;
    two.world = 2;
    two.ranks_per_machine = 0;
    two.hybrid = false;
    two.micro_batch = 4;  // the same global batch
    const auto other = run_phase({two, kPhaseSteps / 2, kPhaseSteps, ckpt, ""}, "hybrid_to_full");
    EXPECT_LE(rel_diff(other[0], whole[0]), 1e-5);
    std::filesystem::remove_all(ckpt);
  }
}

// A model built partitioned (engine.init) reads its pretrained weights before prepare, each rank
// only its slices: under hybrid sharding the slices are cut over a machine's ranks, so the second
// machine's ranks read the same slices as the first's. Every rank must end with the file's values.
TEST(HybridShard, PretrainedWeightsReachEveryMachineOfAPartitionedModel) {
  const std::string dir = temp_dir("hybrid_pretrained");
  RunSpec one;
  one.world = 1;
  one.seed = 99;
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(make_config(one), rt);
        zeal_test::Setup u = make_setup(one);
        auto [m, o] = engine.prepare(u.model, *u.opt);
        engine.save_model(dir + "/pretrained");
        write_tensor(dir + "/reference", flat_params(*m));
      },
      1);
  ASSERT_EQ(zeal::describe_failures(results), "");
  RunSpec s = hybrid(3);
  s.init = true;
  zeal::SpawnOptions so;
  so.ranks_per_machine = s.ranks_per_machine;
  results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(make_config(s), rt);
        zeal_test::seed(7);  // another initialisation than the file's
        TinyGpt model = engine.init<TinyGpt>(model_options());
        zeal::load_checkpoint_in_model(*model, dir + "/pretrained");
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
        auto [m, o] = engine.prepare(model, opt);
        auto g = engine.gathered();
        write_tensor(dir + "/rank" + std::to_string(rt.rank()), flat_params(*m));
      },
      s.world, so);
  ASSERT_EQ(zeal::describe_failures(results), "");
  const at::Tensor want = read_tensor(dir + "/reference");
  for (int r = 0; r < s.world; ++r) {
    const at::Tensor got = read_tensor(dir + "/rank" + std::to_string(r));
    EXPECT_TRUE(at::equal(got, want)) << "rank " << r << ": largest difference "
                                      << (got - want).abs().max().item<double>();
  }
  std::filesystem::remove_all(dir);
}

std::string failures_of(const RunSpec& s) {
  zeal::SpawnOptions so;
  so.ranks_per_machine = s.ranks_per_machine;
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(make_config(s), rt);
        Setup u = make_setup(s);
        (void)engine.prepare(u.model, *u.opt);
      },
      s.world, so);
  return zeal::describe_failures(results);
}

TEST(HybridShard, MachinesOfOneRankOrOfUnequalSizesAreRefused) {
  RunSpec one = hybrid(3);
  one.world = 2;
  one.ranks_per_machine = 1;
  const std::string a = failures_of(one);
  EXPECT_NE(a.find("zero_optimization.hybrid_shard: each of the 2 machines runs one rank"), std::string::npos) << a;
  RunSpec uneven = hybrid(3);
  uneven.world = 3;
  const std::string b = failures_of(uneven);
  EXPECT_NE(b.find("hybrid_shard needs the same number of ranks on every machine: machine 0 has 2, machine 1 has 1"),
            std::string::npos)
      << b;
}

}  // namespace
}  // namespace zeal_test
