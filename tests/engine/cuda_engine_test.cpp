// The engine on a GPU (ctest label "cuda"): every stage and precision at one rank over NCCL against
// one LibTorch process on the same GPU; two ranks sharing the GPU through the Gloo-staged
// communicator, with the optimizer offloaded to pinned host memory; the parameters offloaded to host
// memory; a save and a resume; the layouts the engine refuses, named; the NCCL collectives;
// zeal::spawn after CUDA was initialised.
// Without a GPU every test skips (tests/test_device.h), unless ZEAL_TEST_REQUIRE_CUDA=1
// (scripts/gpu-check) makes that a failure.
//
// The tolerances are computed in the test (gpu_tolerance): the summation-order and optimizer spread of
// the run modelled in float64 on the CPU (rounding.h), the batch split as the GPU's own kernels move
// it, and how far two runs of the LibTorch reference on the GPU differ; never a fixed constant.
#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <map>

#include "engine/comm/selfcheck.h"
#include "tests/engine/engine_harness.h"
#include "tests/engine/fused_segments.h"
#include "tests/engine/phase_harness.h"

namespace zeal_test {
namespace {

RunSpec on_gpu(int stage, const std::string& precision = "no") {
  RunSpec s;
  s.device = "cuda";
  s.world = 1;
  s.stage = stage;
  s.precision = precision;
  s.step_lr = true;
  return s;
}

// The reference on the GPU: how much two runs of it differ (its kernels may add in varying order),
// and how much it moves when each step's batch is split into the micro-batches the ranks compute
// (cuBLAS chooses its kernels by shape).
struct GpuReference {
  RunResult run;
  Spread spread, split;
};

GpuReference gpu_reference(RunSpec s) {
  s.precision = "no";
  GpuReference r{run_reference(s), {}, {}};
  const auto diff = [&](const RunResult& a) {
    return Spread{rel_diff(a.params[0], r.run.params[0]), curve_diff(a.losses, r.run.losses),
                  s.clip > 0 ? curve_diff(a.norms, r.run.norms) : 0.0};
  };
  r.spread = diff(run_reference(s));
  const int parts = s.world * s.accumulation;
  if (parts > 1) r.split = diff(run_reference(s, parts));
  return r;
}

// zeal on the GPU against the GPU reference: summation order and the optimizer's rounding as
// modelled in float64 on the CPU (rounding.h), the batch split as the GPU's own kernels move it (or
// as the CPU's, whichever is larger), and twice the GPU's run-to-run spread.
Spread gpu_tolerance(const RunSpec& s, const GpuReference& ref) {
  RunSpec cpu = s;
  cpu.device = "cpu";
  cpu.precision = "no";
  const Tolerances t = tolerances(cpu);
  const Spread split{std::max(t.split.params, ref.split.params), std::max(t.split.losses, ref.split.losses),
                     std::max(t.split.norms, ref.split.norms)};
  return t.sum_order + t.optimizer + split + ref.spread + ref.spread;
}

struct Case {
  int stage;
  std::string precision;
};
void PrintTo(const Case& c, std::ostream* os) { *os << "stage " << c.stage << ", " << c.precision; }

class CudaStages : public ::testing::TestWithParam<Case> {};

// fp32: within the modelled tolerance of LibTorch on the GPU. bf16 and fp16: within twice the bf16
// bound of the fp32 reference (fp16's 11-bit significand rounds less than bf16's 8 bits, so the bf16
// bound holds it too), the loss falling, and not bit-identical to fp32 (the precision was used).
TEST_P(CudaStages, MatchOneLibTorchProcessOnTheGpu) {
  ZEAL_NEED_CUDA();
  const Case c = GetParam();
  RunSpec s = on_gpu(c.stage, c.precision);
  const RunResult got = run_engine(s, fmt::format("cuda_stage{}_{}", c.stage, c.precision));
  const GpuReference ref = gpu_reference(s);
  const double err = rel_diff(got.params[0], ref.run.params[0]);
  const double losses = curve_diff(got.losses, ref.run.losses);
  if (c.precision == "no") {
    const Spread tol = gpu_tolerance(s, ref);
    std::printf("[ metric ] GPU stage %d fp32 vs LibTorch on the GPU: parameters %.3g (tolerance %.3g, of which the "
                "GPU's own run-to-run spread %.3g), losses %.3g (tolerance %.3g)\n",
                c.stage, err, tol.params, ref.spread.params, losses, tol.losses);
    EXPECT_LE(err, tol.params);
    EXPECT_LE(losses, tol.losses);
  } else {
    RunSpec cpu = s;
    cpu.device = "cpu";
    cpu.precision = "no";
    const Spread bf16 = bf16_spread(cpu);
    const Spread tol = bf16 + bf16 + gpu_tolerance(s, ref);
    std::printf("[ metric ] GPU stage %d %s vs fp32 LibTorch on the GPU: parameters %.3g (tolerance %.3g), losses %.3g "
                "(tolerance %.3g)\n",
                c.stage, c.precision.c_str(), err, tol.params, losses, tol.losses);
    EXPECT_LE(err, tol.params);
    EXPECT_LE(losses, tol.losses);
    EXPECT_GT(err, 0.0) << c.precision << " should not train to fp32's bits: was it used?";
  }
  // The parameters moved, far more than the difference judged (rel_diff is at most 1 for a tensor
  // that starts at zero, so the low precisions' percent-sized differences get a factor of 5). The
  // losses are of a fresh random batch each step: they need not fall from one step to the next.
  zeal_test::seed(s.seed);
  TinyGpt init(model_options());
  const double factor = c.precision == "no" ? 100 : 5;
  EXPECT_GT(rel_diff(flat_params(*init), ref.run.params[0]), factor * std::max(err, 1e-7)) << "the parameters barely moved";
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaStages,
                         ::testing::Values(Case{0, "no"}, Case{1, "no"}, Case{2, "no"}, Case{3, "no"}, Case{0, "bf16"},
                                           Case{1, "bf16"}, Case{2, "bf16"}, Case{3, "bf16"}, Case{0, "fp16"},
                                           Case{1, "fp16"}, Case{2, "fp16"}, Case{3, "fp16"}),
                         [](const auto& info) { return fmt::format("stage{}_{}", info.param.stage, info.param.precision); });

// Two ranks on the one GPU through the Gloo communicator (CUDA tensors staged through pinned host
// memory): stage 2 with the optimizer in pinned host memory, stage 3 with units gathered on the GPU.
TEST(CudaEngine, TwoRanksShareTheGpuThroughGloo) {
  ZEAL_NEED_CUDA();
  // Every forked run first (the ranks and the GPU references): the tolerances are modelled in this
  // process, and what they touch may initialise CUDA here (pinned memory for the offloaded state),
  // after which zeal::spawn cannot fork ranks that use the GPU.
  const auto spec = [](int stage) {
    RunSpec s = on_gpu(stage);
    s.world = 2;
    s.accumulation = 2;
    s.env["ZEAL_COMM_BACKEND"] = "gloo";
    if (stage == 2) s.offload = true;  // offload_optimizer.device cpu, pinned
    return s;
  };
  std::map<int, RunResult> runs;
  std::map<int, GpuReference> refs;
  for (int stage : {2, 3}) {
    runs[stage] = run_engine(spec(stage), fmt::format("cuda_gloo_stage{}", stage));
    refs[stage] = gpu_reference(spec(stage));
  }
  for (int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    const RunSpec s = spec(stage);
    const RunResult& got = runs[stage];
    ASSERT_EQ(got.params.size(), 2u);
    EXPECT_TRUE(at::equal(got.params[1], got.params[0]));
    if (stage == 2) EXPECT_GT(got.memory[0][9].item<double>(), 0) << "no host memory held by the offloaded state";
    const GpuReference& ref = refs[stage];
    const Spread tol = gpu_tolerance(s, ref);
    const double err = rel_diff(got.params[0], ref.run.params[0]);
    std::printf("[ metric ] GPU, 2 ranks through Gloo, stage %d: parameters %.3g (tolerance %.3g), losses %.3g "
                "(tolerance %.3g)\n",
                stage, err, tol.params, curve_diff(got.losses, ref.run.losses), tol.losses);
    EXPECT_LE(err, tol.params);
    EXPECT_LE(curve_diff(got.losses, ref.run.losses), tol.losses);
  }
}

// Three steps, a save, a new process group that loads it and three more steps: the same bits as six
// steps in one run, on the GPU (stage 3 at one rank over NCCL; stage 2 on two ranks through Gloo),
// with the optimizer's state on the GPU and offloaded to pinned host memory (there the new engine's
// state is read in place during the load's first pass).
TEST(CudaEngine, SaveAndResumeGiveTheSameBits) {
  ZEAL_NEED_CUDA();
  for (bool offload : {false, true}) {
    for (int world : {1, 2}) {
      RunSpec s = on_gpu(world == 1 ? 3 : 2);
      s.world = world;
      s.offload = offload;
      if (world == 2) s.env["ZEAL_COMM_BACKEND"] = "gloo";
      const std::string ckpt = temp_dir(fmt::format("cuda_ckpt{}{}", world, offload ? "_offload" : ""));
      const auto whole = run_phase({s, 0, kPhaseSteps, "", ""}, "cuda_whole");
      (void)run_phase({s, 0, kPhaseSteps / 2, "", ckpt}, "cuda_first");
      ASSERT_TRUE(std::filesystem::exists(std::filesystem::path(ckpt) / "manifest.json"));
      const auto resumed = run_phase({s, kPhaseSteps / 2, kPhaseSteps, ckpt, ""}, "cuda_resumed");
      for (int r = 0; r < world; ++r)
        EXPECT_TRUE(at::equal(whole[r], resumed[r])) << "world " << world << " rank " << r << " offload " << offload;
      std::filesystem::remove_all(ckpt);
    }
  }
}

// Activation checkpointing on the GPU with the kept inputs in pinned host memory (cpu_checkpointing)
// and dropout: the same bits as without checkpointing, at stage 3 over NCCL and stage 2 with two
// ranks through Gloo; each checkpointed block ran twice per step.
TEST(CudaEngine, CheckpointedUnitsWithHostCopiesTrainToTheSameBits) {
  ZEAL_NEED_CUDA();
  // Without dropout, with it, and with the host copies besides: a failure names which one differs.
  for (int world : {1, 2}) {
    for (auto [dropout, host] : {std::pair{0.0, false}, std::pair{0.2, false}, std::pair{0.2, true}}) {
      SCOPED_TRACE(fmt::format("world {}, dropout {}, cpu_checkpointing {}", world, dropout, host));
      RunSpec s = on_gpu(world == 1 ? 3 : 2);
      s.world = world;
      s.layers = 3;
      s.dropout = dropout;
      if (world == 2) s.env["ZEAL_COMM_BACKEND"] = "gloo";
      const RunResult plain = run_engine(s, "cuda_plain");
      s.checkpointing = true;
      s.cpu_checkpointing = host;
      const RunResult ckpt = run_engine(s, "cuda_ckpt");
      for (int r = 0; r < world; ++r) {
        EXPECT_TRUE(at::equal(ckpt.params[r], plain.params[r]))
            << "rank " << r << ": largest difference " << (ckpt.params[r] - plain.params[r]).abs().max().item<double>()
            << "; losses " << (ckpt.losses - plain.losses).abs().max().item<double>() << " apart";
      }
      EXPECT_EQ(ckpt.forwards[0], 2 * plain.forwards[0]);
    }
  }
}

// Parameters offloaded from the GPU: with offload_param.device cpu (the seed's ds_zero3_cpu.yaml)
// each released unit's shards leave the GPU for host memory and come back for its gathers and the
// optimizer step; with nvme, the units within max_in_cpu do so and the rest go to the swap file.
// The bits are those of the optimizer offloaded alone (the copies change no value): cpu at one rank
// over NCCL (page-locked) and at two ranks through Gloo (pageable), nvme at one rank with half the
// blocks within max_in_cpu. The GPU holds less between steps by the blocks' shards, as its allocator
// measures (persistence threshold 0: every block is released; the root's embeddings and head stay),
// and host memory and the swap file hold them.
TEST(CudaEngine, ParametersOffloadedFromTheGpuTrainToTheSameBits) {
  ZEAL_NEED_CUDA();
  zeal_test::seed(7);
  TinyGpt model(model_options());
  int64_t block_elems = 0;
  for (const auto& p : model->named_parameters())
    if (p.key().rfind("block", 0) == 0) block_elems += p.value().numel();
  struct Offload {
    int world;
    bool nvme;
  };
  for (const Offload c : {Offload{1, false}, Offload{2, false}, Offload{1, true}}) {
    const std::string name = fmt::format("world {}, {}", c.world, c.nvme ? "nvme" : "cpu");
    SCOPED_TRACE(name);
    RunSpec s = on_gpu(3);
    s.world = c.world;
    s.offload = true;  // offload_optimizer cpu (and offload_param cpu)
    s.pin_memory = c.world == 1;
    if (c.world == 2) s.env["ZEAL_COMM_BACKEND"] = "gloo";
    RunSpec optimizer_only = s;
    optimizer_only.offload_params = false;
    std::string swap;
    if (c.nvme) {
      swap = temp_dir("cuda_param_nvme");
      s.offload_params = false;
      s.param_nvme_path = swap;
      s.param_max_in_cpu = block_elems / 2 / c.world + 1024;  // one block of two, with room for its padding
    }
    const RunResult off = run_engine(s, fmt::format("cuda_params_off{}{}", c.world, c.nvme ? "_nvme" : ""));
    const RunResult on = run_engine(optimizer_only, fmt::format("cuda_params_on{}", c.world));
    EXPECT_TRUE(at::equal(off.losses, on.losses));
    const double shards = 4.0 * static_cast<double>(block_elems) / c.world;  // fp32, unpadded
    for (int r = 0; r < c.world; ++r) {
      EXPECT_TRUE(at::equal(off.params[r], on.params[r])) << "rank " << r;
      const double left = on.memory[r][16].item<double>() - off.memory[r][16].item<double>();
      const double host = off.memory[r][9].item<double>() - on.memory[r][9].item<double>();
      const double disk = off.memory[r][13].item<double>();
      std::printf("[ metric ] %s, rank %d: the GPU holds %.0f bytes less at the end with the parameters offloaded "
                  "(the blocks' shards: %.0f bytes), host memory %.0f more, swap files %.0f bytes\n",
                  name.c_str(), r, left, shards, host, disk);
      EXPECT_GE(left, 0.95 * shards) << "rank " << r << ": the shards did not leave the GPU";
      EXPECT_LE(left, 1.05 * shards + 65536) << "rank " << r;
      EXPECT_GE(host + disk, 0.95 * shards) << "rank " << r << ": the shards are not held off the GPU";
      if (c.nvme) {
        EXPECT_GT(host, 0.3 * shards) << "rank " << r << ": max_in_cpu kept nothing in host memory";
        EXPECT_GT(disk, 0.3 * shards) << "rank " << r << ": nothing went to the swap file";
      }
    }
    if (!swap.empty()) std::filesystem::remove_all(swap);
  }
}

// What the engine refuses on a GPU, named: two NCCL ranks on one GPU, a gpu_ids entry that is no GPU.
TEST(CudaEngine, RefusedLayoutsAreNamed) {
  ZEAL_NEED_CUDA();
  {
    RunSpec s = on_gpu(2);
    s.world = zeal_test::cuda_devices() + 1;  // more ranks than GPUs, over NCCL
    // The first collective makes the NCCL communicator: with CUDA_VISIBLE_DEVICES=0 given to every
    // rank the choice accepts one GPU per process, and the communicator names the shared GPU.
    auto results = zeal::spawn(
        [&](zeal::Runtime& rt) {
          zeal::Engine engine(make_config(s), rt);
          engine.wait_for_everyone();
        },
        s.world);
    const std::string failures = zeal::describe_failures(results);
    EXPECT_NE(failures.find("NCCL needs one GPU per rank"), std::string::npos) << failures;
    EXPECT_NE(failures.find("ZEAL_COMM_BACKEND=gloo"), std::string::npos) << failures;
  }
  const std::string msg = error_on_one_rank("cuda_gpu_ids", [&](zeal::Runtime& rt) {
    zeal::Config c = make_config(on_gpu(0));
    c.launch.gpu_ids = "99";
    zeal::Engine engine(c, rt);
  });
  EXPECT_NE(msg.find("gpu_ids lists GPU 99"), std::string::npos) << msg;
}

// The NCCL backend on CUDA tensors: one rank per GPU, as many ranks as GPUs (at most 4); every
// collective, dtype and uneven size against values each rank computes itself.
TEST(NcclCollectives, EveryOpDtypeAndUnevenSizeMatchesLocalValues) {
  ZEAL_NEED_CUDA();
  const int gpus = std::min(4, zeal_test::cuda_devices());
  auto results = zeal::spawn(
      [](zeal::Runtime& rt) {
        if (rt.cuda_comm().backend() != "nccl") throw zeal::Error("cuda_comm() is " + rt.cuda_comm().backend());
        const auto checks = zeal::run_collective_checks(rt.cuda_comm(), /*cuda=*/true);
        std::string failed;
        for (const auto& c : checks) {
          if (!c.passed) failed += c.name + " " + c.detail + "\n";
        }
        if (!failed.empty()) throw zeal::Error(failed);
      },
      gpus);
  EXPECT_EQ(zeal::describe_failures(results), "");
}

// The fused Adam on a GPU: segments carrying their own m and v (NVMe windows, offloaded state) step
// as the optimizer's own state does. Runs in a child: the test process keeps CUDA uninitialised.
TEST(CudaOptimizer, FusedSegmentsWithTheirOwnStateStepAsTheOptimizersOwn) {
  ZEAL_NEED_CUDA();
  const std::string dir = temp_dir("cuda_segments");
  auto results = zeal::spawn(
      [&](zeal::Runtime&) {
        expect_segment_state_matches_own_state(at::Device(at::kCUDA, 0));
        if (::testing::Test::HasFailure()) throw zeal::Error("the GPU's segments differ (see above)");
      },
      1);
  EXPECT_EQ(zeal::describe_failures(results), "");
}

// A process that initialised CUDA cannot fork ranks that use it: zeal::spawn says so instead of
// letting every rank fail with CUDA's bare "initialization error".
TEST(CudaSpawn, RefusesAfterTheParentInitialisedCuda) {
  ZEAL_NEED_CUDA();
  EXPECT_FALSE(zeal::cuda_initialized_in_this_process());
  at::manual_seed(1);  // counts the GPUs: initialises the driver
  ASSERT_TRUE(zeal::cuda_initialized_in_this_process());
  try {
    (void)zeal::spawn([](zeal::Runtime&) {}, 1);
    FAIL() << "spawn forked ranks from a process that initialised CUDA";
  } catch (const zeal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA is already initialised in this process"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace zeal_test
