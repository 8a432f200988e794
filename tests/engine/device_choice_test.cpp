// Which GPU a rank takes and which communicator carries its CUDA tensors: the numbers the engine and
// the NCCL communicator both decide from (engine/runtime/device_choice.h). Runs without a GPU.
#include <gtest/gtest.h>

#include <string>

#include "engine/error.h"
#include "engine/runtime/device_choice.h"

namespace zeal {
namespace {

std::string error_of(int local_rank, int local_world, int gpus, const std::string& backend, bool nccl,
                     bool per_rank = false) {
  try {
    (void)choose_cuda_device(local_rank, local_world, gpus, backend, nccl, per_rank);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(DeviceChoice, OneGpuPerRankWithNccl) {
  for (int gpus : {1, 2, 8}) {
    for (int local_world = 1; local_world <= gpus; ++local_world) {
      for (int r = 0; r < local_world; ++r) {
        const DeviceChoice c = choose_cuda_device(r, local_world, gpus, "", /*have_nccl=*/true);
        EXPECT_EQ(c.device, r);
        EXPECT_EQ(c.backend, CudaBackend::kNccl);
      }
    }
  }
}

TEST(DeviceChoice, MoreRanksThanGpusNamesBothNumbers) {
  for (const auto& [ranks, gpus] : {std::pair{4, 2}, std::pair{3, 1}, std::pair{9, 8}}) {
    for (const std::string backend : {"", "nccl"}) {
      const std::string e = error_of(0, ranks, gpus, backend, true);
      EXPECT_NE(e.find(std::to_string(ranks) + " ranks run on this machine"), std::string::npos) << e;
      EXPECT_NE(e.find("sees " + std::to_string(gpus) + " GPU"), std::string::npos) << e;
      EXPECT_NE(e.find("ZEAL_COMM_BACKEND=gloo"), std::string::npos) << e;
    }
  }
}

TEST(DeviceChoice, GlooLetsRanksShareGpus) {
  for (int r = 0; r < 5; ++r) {
    const DeviceChoice c = choose_cuda_device(r, 5, 2, "gloo", true);
    EXPECT_EQ(c.device, r % 2);
    EXPECT_EQ(c.backend, CudaBackend::kGloo);
  }
  // Without NCCL in the build, Gloo is the default and NCCL cannot be asked for.
  EXPECT_EQ(choose_cuda_device(3, 4, 1, "", false).backend, CudaBackend::kGloo);
  EXPECT_NE(error_of(0, 1, 1, "nccl", false).find("built without NCCL"), std::string::npos);
}

TEST(DeviceChoice, OneGpuGivenToEachRankIsNoShortage) {
  // CUDA_VISIBLE_DEVICES=<one id> per rank (schedulers do this): every rank trains on its GPU 0.
  for (int r = 0; r < 4; ++r) {
    const DeviceChoice c = choose_cuda_device(r, 4, 1, "", true, /*per_rank_visible=*/true);
    EXPECT_EQ(c.device, 0);
    EXPECT_EQ(c.backend, CudaBackend::kNccl);
  }
}

TEST(DeviceChoice, BadValuesAreNamed) {
  EXPECT_NE(error_of(0, 1, 1, "mpi", true).find("ZEAL_COMM_BACKEND is 'mpi'"), std::string::npos);
  EXPECT_NE(error_of(2, 2, 2, "", true).find("LOCAL_RANK 2 does not fit LOCAL_WORLD_SIZE 2"), std::string::npos);
  EXPECT_NE(error_of(0, 1, 0, "", true).find("no CUDA device"), std::string::npos);
}

}  // namespace
}  // namespace zeal
