// The optimizer step with its state on NVMe (ShardStep::offload_to_nvme) against the same step in
// memory, step after step with nothing in between: apply() returns while its last window is still
// being written, so the next apply, and every read of the state, must wait for that write first.
// Partitions of 6 Mi elements (a write-back of 72 MiB takes milliseconds), in one window and in
// three.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <vector>

#include <ATen/ATen.h>

#include "engine/optim/optimizer.h"
#include "engine/zero/shard_step.h"
#include "offload/host_arena.h"
#include "offload/io.h"
#include "offload/swap_dir.h"

namespace zeal::zero {
namespace {

namespace fs = std::filesystem;

TEST(ShardStepNvme, BackToBackStepsAndStateReadsSeeEveryWriteBack) {
  constexpr int64_t n = 6 << 20;
  const std::string dir = (fs::temp_directory_path() / ("zeal_shard_step_nvme_" + std::to_string(::getpid()))).string();
  fs::create_directories(dir);
  optim::Hyper h;
  h.weight_decay = 0.01;
  for (int64_t window : {n, n / 3}) {
    SCOPED_TRACE("window " + std::to_string(window));
    at::manual_seed(3);
    const at::Tensor init = at::randn({n});
    at::Tensor grad_ref = at::zeros({n}), grad = at::zeros({n});
    at::Tensor out_ref = init.clone(), out = init.clone();
    ShardStep ref(init.clone(), optim::make_fused_adamw(h), {{0, grad_ref, out_ref}});
    ShardStep step(init.clone(), optim::make_fused_adamw(h), {{0, grad, out}});
    auto sdir = std::make_shared<offload::SwapDir>(dir, offload::new_run_id(), 0);
    offload::IoOptions o;
    std::shared_ptr<offload::IoEngine> io = offload::make_io_engine(o);
    step.offload_to_nvme(std::make_shared<offload::HostArena>(false),
                         std::make_shared<offload::SwapFile>(sdir, io, "optimizer.swp"), window);
    for (int s = 0; s < 4; ++s) {
      const at::Tensor g = at::randn({n}) * 1e-2;
      grad_ref.copy_(g), grad.copy_(g);
      ref.apply(1e-3, 1.0);
      step.apply(1e-3, 1.0);  // the previous step's last window may still be going out
      ASSERT_TRUE(at::equal(out, out_ref)) << "step " << s;
    }
    // The state as a checkpoint reads it, at once (the last window still going out).
    std::vector<float> got(n);
    for (const char* what : {"master", "exp_avg", "exp_avg_sq"}) {
      step.read_state(what, 0, n, got.data());
      const float* want = ref.host_state(what, 0, n);
      ASSERT_NE(want, nullptr) << what;
      EXPECT_TRUE(at::equal(at::from_blob(got.data(), {n}), at::from_blob(const_cast<float*>(want), {n}))) << what;
    }
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace zeal::zero
