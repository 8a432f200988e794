// The parameter store's host regions (offload_param.device cpu on a GPU, and nvme's shards within
// max_in_cpu there; engine/zero/offload_state.h) on CPU tensors: every region gives back the bytes
// last stored at its offset, whatever the dtype and size, through a load or a read-ahead, beside
// regions in the swap file; host regions take no disk, and their memory goes with the store.
// On a GPU the same store copies to and from the device: tests/engine/cuda_engine_test.cpp.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "engine/zero/host_memory.h"
#include "engine/zero/offload_state.h"
#include "offload/host_arena.h"
#include "offload/io.h"
#include "offload/swap_dir.h"

namespace {

using zeal::zero::ParamSwap;

// Stores shards of several dtypes and sizes (around a page and odd ones) at regions in host memory
// (even indices, or all without a file) and in the file, frees them, and checks each comes back,
// also after one of them is stored again with new values.
void round_trip(ParamSwap& store) {
  at::manual_seed(3);
  std::vector<at::Tensor> shards{at::randn({1000}), at::randn({4097}).to(at::kBFloat16),
                                 at::randint(0, 1 << 30, {3}, at::kLong), at::randn({1}), at::randn({70'000}),
                                 at::randn({5000})};
  std::vector<int64_t> offsets;
  int64_t host = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    const bool in_host = !store.on_disk() || i % 2 == 0;
    offsets.push_back(store.reserve(shards[i].nbytes(), in_host));
    EXPECT_EQ(ParamSwap::in_host(offsets.back()), in_host) << "region " << i;
    if (in_host) host += static_cast<int64_t>(shards[i].nbytes());
  }
  EXPECT_GE(store.host_bytes(), host);
  EXPECT_LT(store.host_bytes(), host + 6 * 4096);
  std::vector<at::Tensor> want;
  for (size_t i = 0; i < shards.size(); ++i) {
    want.push_back(shards[i].clone());
    if (!ParamSwap::in_host(offsets[i])) {  // CPU shards go to the file from mapped storage, as Unit gives them
      zeal::zero::free_storage(shards[i]);
      zeal::zero::alloc_storage_mapped(shards[i]);
      shards[i].copy_(want[i]);
    }
    store.store(shards[i], offsets[i]);
    zeal::zero::free_storage(shards[i]);
    EXPECT_EQ(shards[i].storage().nbytes(), 0u);
  }
  // Back in another order than stored, by a load and by a read-ahead.
  for (size_t k = shards.size(); k-- > 0;) {
    if (k % 3 == 0) {
      store.load(shards[k], offsets[k]);
    } else {
      ASSERT_TRUE(store.has_room(shards[k].numel()));
      ParamSwap::Reading r = store.start_read(shards[k], offsets[k]);
      store.finish(r);
    }
    EXPECT_TRUE(at::equal(shards[k], want[k])) << "region " << k;
  }
  // New values over old ones: the next load gives the new ones, the other regions keep theirs.
  for (size_t changed : {size_t{1}, size_t{4}}) {
    shards[changed].mul_(-2);
    store.store(shards[changed], offsets[changed]);
    want[changed].mul_(-2);
  }
  for (auto& t : shards) zeal::zero::free_storage(t);
  for (size_t i = 0; i < shards.size(); ++i) {
    store.load(shards[i], offsets[i]);
    EXPECT_TRUE(at::equal(shards[i], want[i])) << "region " << i;
  }
}

TEST(ParamStore, HostRegionsGiveBackWhatWasLastStoredThere) {
  auto arena = std::make_shared<zeal::offload::HostArena>(/*pin=*/false);
  {
    ParamSwap store(arena);
    EXPECT_FALSE(store.on_disk());
    round_trip(store);
  }
  EXPECT_EQ(arena->bytes(), 0) << "the store's host memory outlived it";
}

TEST(ParamStore, HostRegionsBesideTheFileTakeNoDisk) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("zeal_param_store_" + std::to_string(::getpid()))).string();
  std::filesystem::create_directories(dir);
  auto arena = std::make_shared<zeal::offload::HostArena>(/*pin=*/false);
  {
    auto sdir = std::make_shared<zeal::offload::SwapDir>(dir, zeal::offload::new_run_id(), 0);
    std::shared_ptr<zeal::offload::IoEngine> io = zeal::offload::make_io_engine(zeal::offload::IoOptions{});
    ParamSwap store(sdir, io, {}, arena);
    EXPECT_TRUE(store.on_disk());
    round_trip(store);
    // The file holds the odd regions only: 4 KiB-rounded, nothing for the host ones.
    const int64_t odd = (4097 * 2 + 4095) / 4096 * 4096 + 4096 + 5000 * 4 / 4096 * 4096 + 4096;
    EXPECT_EQ(store.disk_bytes(), odd);
  }
  EXPECT_EQ(arena->bytes(), 0);
  std::filesystem::remove_all(dir);
}

}  // namespace
