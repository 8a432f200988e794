// Which GPU a rank takes and which communicator carries its CUDA tensors: the numbers the engine and
// the NCCL communicator both decide from (engine/runtime/device_choice.h). Runs without a GPU.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine/config/config.h"

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
      EXPECT_NE(e.find(" but " + std::to_string(gpus) + " GPU"), std::string::npos) << e;
      EXPECT_NE(e.find("visible to this process"), std::string::npos) << e;
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

// gpu_ids (Accelerate's key): local rank r trains on the r-th listed GPU; NCCL needs as many listed
// GPUs as local ranks, Gloo shares them.
TEST(DeviceChoice, GpuIdsPickTheListedGpus) {
  EXPECT_EQ(choose_cuda_device(0, 2, 4, "", true, false, "2,3").device, 2);
  EXPECT_EQ(choose_cuda_device(1, 2, 4, "", true, false, "2,3").device, 3);
  EXPECT_EQ(choose_cuda_device(0, 1, 4, "", true, false, " 3 ").device, 3);
  EXPECT_EQ(choose_cuda_device(1, 2, 4, "", true, false, "all").device, 1);
  try {
    (void)choose_cuda_device(0, 3, 4, "", true, false, "2,3");
    FAIL() << "three ranks on two listed GPUs over NCCL";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("3 ranks run on this machine but 2 GPUs are listed in gpu_ids (2,3)"), std::string::npos) << m;
    EXPECT_NE(m.find("list more GPUs in gpu_ids"), std::string::npos) << m;
  }
  EXPECT_EQ(choose_cuda_device(2, 3, 4, "gloo", true, false, "2,3").device, 2);
  // A listed GPU must exist, even when a process sees one GPU through CUDA_VISIBLE_DEVICES.
  try {
    (void)choose_cuda_device(0, 1, 4, "", true, false, "1,5");
    FAIL() << "GPU 5 of 4";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gpu_ids lists GPU 5, but this process sees 4 GPUs"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW((void)choose_cuda_device(0, 2, 1, "", true, true, "0,1"), Error);
}

TEST(DeviceChoice, GpuIdsThatAreNoListAreRefusedWithTheKey) {
  EXPECT_EQ(parse_gpu_ids("all"), std::vector<int>{});
  EXPECT_EQ(parse_gpu_ids(""), std::vector<int>{});
  EXPECT_EQ(parse_gpu_ids("0, 2,1"), (std::vector<int>{0, 2, 1}));
  for (const auto& [value, says] : {std::pair{"0,x", "'x' in \"0,x\" is not a GPU index"},
                                    std::pair{"1,1", "GPU 1 is listed twice"}, std::pair{"0,,1", "'' in"},
                                    std::pair{"-1", "'-1'"}, std::pair{"99999", "'99999'"}}) {
    try {
      (void)parse_gpu_ids(value);
      FAIL() << value;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).rfind("gpu_ids: ", 0), 0u) << e.what();
    }
  }
  // Through a config file: the key, where it came from and the bad entry.
  try {
    (void)Config::parse("gpu_ids: 0,a\nnum_processes: 2\n", "acc.yaml");
    FAIL() << "accepted gpu_ids: 0,a";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("gpu_ids (from"), std::string::npos) << m;
    EXPECT_NE(m.find("acc.yaml"), std::string::npos) << m;
    EXPECT_NE(m.find("'a' in \"0,a\""), std::string::npos) << m;
  }
}

// Two ranks on one machine that see the same GPU (CUDA_VISIBLE_DEVICES=0 exported to both) are named
// with the GPU and both values; the same bus id on two machines (even under one host name), or two
// GPUs of one machine, are fine.
TEST(DeviceChoice, TwoRanksOnOneGpuAreNamed) {
  const GpuOfRank a{"node-a", "boot-a", "0000:1A:00.0", 0, "0"}, b{"node-a", "boot-a", "0000:1B:00.0", 1, "(unset)"},
      c{"node-b", "boot-b", "0000:1A:00.0", 0, "0"}, d{"node-a", "boot-a", "0000:1A:00.0", 0, "0"},
      twin{"node-a", "boot-c", "0000:1A:00.0", 0, "0"};  // a container on another machine named alike
  EXPECT_EQ(describe_shared_gpu({a, b, c}), "");
  EXPECT_EQ(describe_shared_gpu({a, b, c, twin}), "");
  const std::string m = describe_shared_gpu({a, b, c, d});
  EXPECT_NE(m.find("ranks 0 and 3 both run on GPU 0000:1A:00.0 of node-a"), std::string::npos) << m;
  EXPECT_NE(m.find("CUDA_VISIBLE_DEVICES=0 in rank 0"), std::string::npos) << m;
  EXPECT_NE(m.find("CUDA_VISIBLE_DEVICES=0 in rank 3"), std::string::npos) << m;
  EXPECT_NE(m.find("ZEAL_COMM_BACKEND=gloo"), std::string::npos) << m;
  const GpuOfRank back = GpuOfRank::decode(b.encode());
  EXPECT_EQ(back.host, b.host);
  EXPECT_EQ(back.host_id, b.host_id);
  EXPECT_EQ(back.bus_id, b.bus_id);
  EXPECT_EQ(back.device, b.device);
  EXPECT_EQ(back.visible, b.visible);
}

TEST(DeviceChoice, BadValuesAreNamed) {
  EXPECT_NE(error_of(0, 1, 1, "mpi", true).find("ZEAL_COMM_BACKEND is 'mpi'"), std::string::npos);
  EXPECT_NE(error_of(2, 2, 2, "", true).find("LOCAL_RANK 2 does not fit LOCAL_WORLD_SIZE 2"), std::string::npos);
  EXPECT_NE(error_of(0, 1, 0, "", true).find("no CUDA device"), std::string::npos);
}

}  // namespace
}  // namespace zeal
