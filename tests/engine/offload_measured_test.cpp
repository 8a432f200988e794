// Offload to nvme measured from outside the engine: the resident set of each rank (VmRSS, read from
// /proc) after training, against the same run without offload, and the bytes of the swap files on
// disk (the files' sizes), against what the model's shapes say the offloaded state is: fp32 master,
// Adam's two moments and the parameter shards of every block. Not the engine's count of its own
// tensors (engine.memory()), which the other offload tests compare.
#include <gtest/gtest.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <malloc.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/resident.h"
#include "engine/runtime/runtime.h"
#include "engine/runtime/spawn.h"
#include "tests/engine/linear_blocks.h"
#include "tests/test_device.h"

namespace {

namespace fs = std::filesystem;
using zeal_test::kBlocks;
constexpr int64_t kDim = zeal_test::kBlockDim;
constexpr int kWorld = 2;


constexpr double kParams = static_cast<double>(kBlocks) * kDim * (kDim + 1);

struct Measured {
  std::vector<double> resident;  // per rank, after the last step, bytes
  double disk = 0;               // every file under the swap folder, bytes (rank 0 reads them)
};

int64_t bytes_under(const fs::path& dir) {
  int64_t n = 0;
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec))
    if (e.is_regular_file(ec)) n += static_cast<int64_t>(e.file_size(ec));
  return n;
}

// swap: offload to nvme there; cpu: offload_optimizer and offload_param to cpu instead.
Measured run(const std::string& swap, bool cpu = false) {
  const fs::path out = fs::temp_directory_path() / ("zeal_offload_measured_" + std::to_string(::getpid()));
  fs::create_directories(out);
  zeal::SpawnOptions so;
  so.env = {{"ZEAL_HOST_CACHE", "0"}};  // freed blocks leave the resident set at once
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Config c = zeal_test::test_config("cpu");
        c.zero.stage = 3;
        c.zero.stage3_param_persistence_threshold = {0, false};
        c.zero.stage3_prefetch_bucket_size = {0, false};
        if (!swap.empty()) {
          c.zero.offload_optimizer.device = zeal::OffloadDevice::kNvme;
          c.zero.offload_optimizer.nvme_path = swap;
          c.zero.offload_param.device = zeal::OffloadDevice::kNvme;
          c.zero.offload_param.nvme_path = swap;
          c.zero.offload_param.max_in_cpu = 0;
          c.zero.sub_group_size = 1 << 18;  // windows of 256 Ki elements
        }
        if (cpu) {
          c.zero.offload_optimizer.device = zeal::OffloadDevice::kCpu;
          c.zero.offload_param.device = zeal::OffloadDevice::kCpu;
        }
        zeal::Engine engine(c, rt);
        torch::manual_seed(3);
        zeal_test::LinearStack net;
        torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-3));
        auto [m, o] = engine.prepare(net, opt);
        torch::manual_seed(9 + rt.rank());
        for (int step = 0; step < 3; ++step) {
          engine.backward(m->forward(at::randn({4, kDim})).pow(2).mean());
          o.step();
          o.zero_grad();
        }
        ::malloc_trim(0);  // what the allocator keeps of freed blocks is not state either run holds
        std::ofstream(out / std::to_string(rt.rank())) << zeal::detail::resident_bytes();
        if (rt.rank() == 0 && !swap.empty()) std::ofstream(out / "disk") << bytes_under(swap);
        engine.wait_for_everyone();
      },
      kWorld, so);
  EXPECT_EQ(zeal::describe_failures(results), "");
  Measured r;
  for (int k = 0; k < kWorld; ++k) {
    double v = 0;
    std::ifstream(out / std::to_string(k)) >> v;
    r.resident.push_back(v);
  }
  if (!swap.empty()) std::ifstream(out / "disk") >> r.disk;
  fs::remove_all(out);
  return r;
}

TEST(OffloadMeasured, NvmeMovesTheStateOutOfTheResidentSetAndOntoTheDisk) {
  const fs::path swap = fs::temp_directory_path() / ("zeal_offload_measured_swap_" + std::to_string(::getpid()));
  fs::create_directories(swap);
  const Measured plain = run(""), nvme = run(swap.string());
  // Per rank, from the shapes: without offload its half of the fp32 parameters (their own master),
  // of Adam's two moments and of the reduced gradients stays resident: 16 bytes per element. On
  // nvme the files hold the master, the two moments, the parameter shards and the gradient shards:
  // 20 bytes per element of each rank's half.
  const double state_per_rank = 16.0 * kParams / kWorld, disk_per_rank = 20.0 * kParams / kWorld;
  for (int r = 0; r < kWorld; ++r) {
    const double saved = plain.resident[r] - nvme.resident[r];
    std::printf("[ metric ] rank %d: resident set after training %.1f MiB without offload, %.1f MiB with nvme: %.1f "
                "MiB less (the offloaded state of a rank: %.1f MiB)\n",
                r, plain.resident[r] / (1 << 20), nvme.resident[r] / (1 << 20), saved / (1 << 20),
                state_per_rank / (1 << 20));
    // Less the windows the step streams through (sub_group_size elements, a few sets).
    EXPECT_GT(saved, 0.7 * state_per_rank) << "rank " << r << ": the offloaded state is still resident";
  }
  std::printf("[ metric ] swap files: %.1f MiB on disk; master, moments, parameters and gradients of both ranks: "
              "%.1f MiB\n",
              nvme.disk / (1 << 20), kWorld * disk_per_rank / (1 << 20));
  EXPECT_GE(nvme.disk, kWorld * disk_per_rank);
  EXPECT_LE(nvme.disk, 1.02 * kWorld * disk_per_rank + (4 << 20));  // 4 KiB blocks, padding to whole shards
  fs::remove_all(swap);
}

// On CPU ranks host memory is where they compute, so ds_zero3_cpu.yaml's offload to cpu must cost
// nothing: the master is the fp32 parameters themselves and the step needs no staging copy. The
// resident set after training equals the run without offload's, within the allocator's noise; a
// second fp32 copy of a rank's half of the parameters (24 MiB here) would show.
TEST(OffloadMeasured, CpuOffloadOnCpuRanksHoldsNoMoreThanNoOffload) {
  const Measured plain = run(""), cpu = run("", /*cpu=*/true);
  const double copy_per_rank = 4.0 * kParams / kWorld;  // one fp32 copy of a rank's half
  for (int r = 0; r < kWorld; ++r) {
    std::printf("[ metric ] rank %d: resident set after training %.1f MiB without offload, %.1f MiB with offload to "
                "cpu (one fp32 copy of a rank's half of the parameters: %.1f MiB)\n",
                r, plain.resident[r] / (1 << 20), cpu.resident[r] / (1 << 20), copy_per_rank / (1 << 20));
    EXPECT_LT(cpu.resident[r], plain.resident[r] + 0.25 * copy_per_rank) << "rank " << r << ": offload to cpu costs memory";
  }
}

}  // namespace
