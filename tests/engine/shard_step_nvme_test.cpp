// The optimizer step with its state on NVMe (ShardStep::offload_to_nvme) against the same step in
// memory, step after step with nothing in between: apply() returns while its last window is still
// being written, so the next apply, and every read of the state, must wait for that write first.
// Partitions of 6 Mi elements (a write-back of 72 MiB takes milliseconds), in one window and in
// three. The swapped gradients likewise: their writes run behind accumulate_grad, and the step, the
// statistics and read_grad must wait for them.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>

#include <filesystem>
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "engine/optim/optimizer.h"
#include "engine/zero/shard_step.h"
#include "offload/host_arena.h"
#include "offload/io.h"
#include "offload/swap_dir.h"

namespace zeal::zero {
namespace {

namespace fs = std::filesystem;

// One piece of n elements stepped twice from the same random start (seed): `ref` in memory, `step`
// with its state on NVMe in `dir` (windows of `window` elements, `sets` buffer sets), both AdamW.
struct StepPair {
  at::Tensor grad_ref, grad, out_ref, out;
  std::unique_ptr<ShardStep> ref, step;
  std::shared_ptr<offload::IoEngine> io;  // the swap file's engine (apply's reads)
  offload::IoOptions options;
  StepPair(const std::string& dir, int64_t n, int64_t window, int sets, uint64_t seed) {
    optim::Hyper h;
    h.weight_decay = 0.01;
    at::manual_seed(seed);
    const at::Tensor init = at::randn({n});
    grad_ref = at::zeros({n}), grad = at::zeros({n});
    out_ref = init.clone(), out = init.clone();
    ref = std::make_unique<ShardStep>(init.clone(), optim::make_fused_adamw(h), std::vector<ShardStep::Piece>{{0, grad_ref, out_ref}});
    step = std::make_unique<ShardStep>(init.clone(), optim::make_fused_adamw(h), std::vector<ShardStep::Piece>{{0, grad, out}});
    auto sdir = std::make_shared<offload::SwapDir>(dir, offload::new_run_id(), 0);
    io = offload::make_io_engine(options);
    step->offload_to_nvme(std::make_shared<offload::HostArena>(false),
                          std::make_shared<offload::SwapFile>(sdir, io, "optimizer.swp"), window, sets);
  }
  // The same gradients into both.
  void set_grads(const at::Tensor& g) { grad_ref.copy_(g), grad.copy_(g); }
};

TEST(ShardStepNvme, BackToBackStepsAndStateReadsSeeEveryWriteBack) {
  constexpr int64_t n = 6 << 20;
  const std::string dir = (fs::temp_directory_path() / ("zeal_shard_step_nvme_" + std::to_string(::getpid()))).string();
  fs::create_directories(dir);
  for (int64_t window : {n, n / 3}) {
    SCOPED_TRACE("window " + std::to_string(window));
    StepPair pair(dir, n, window, 3, 3);
    ShardStep &ref = *pair.ref, &step = *pair.step;
    const at::Tensor &out = pair.out, &out_ref = pair.out_ref;
    for (int s = 0; s < 4; ++s) {
      pair.set_grads(at::randn({n}) * 1e-2);
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


// Gradients swapped to NVMe (swap_gradients), three micro-steps accumulated per step, over many
// windows: every step's results, statistics and gradients read back are the in-memory step's bits.
// The pieces come last to first, as a backward brings them: right after the last accumulate_grad,
// the first piece's writes are still in flight when apply() or read_grad() reads it. With one
// piece of two windows, every micro-step after the first reads back what the one before is still
// writing.
TEST(ShardStepNvme, SwappedGradientsAccumulateAndStepAsInMemory) {
  const std::string dir = (fs::temp_directory_path() / ("zeal_shard_step_gswap_" + std::to_string(::getpid()))).string();
  fs::create_directories(dir);
  optim::Hyper h;
  h.weight_decay = 0.01;
  const std::vector<std::vector<int64_t>> layouts{{3'000'000, 1, 5'000, 2'500'000}, {300'000}};
  for (const auto& sizes : layouts)
    for (int sets : {3, 1})
      for (const bool read_first : {false, true}) {
        SCOPED_TRACE(fmt::format("{} pieces, {} buffer sets, {} first", sizes.size(), sets, read_first ? "read_grad" : "apply"));
        int64_t n = 0;
        for (int64_t z : sizes) n += z;
        at::manual_seed(5);
        const at::Tensor init = at::randn({n});
        std::vector<ShardStep::Piece> ref_pieces, pieces;
        std::vector<at::Tensor> ref_grads, outs_ref, outs;
        int64_t off = 0;
        for (int64_t z : sizes) {
          ref_grads.push_back(at::zeros({z}));
          outs_ref.push_back(init.narrow(0, off, z).clone());
          outs.push_back(init.narrow(0, off, z).clone());
          ref_pieces.push_back({off, ref_grads.back(), outs_ref.back()});
          pieces.push_back({off, at::zeros({z}), outs.back()});
          off += z;
        }
        ShardStep ref(init.clone(), optim::make_fused_adamw(h), ref_pieces);
        ShardStep step(init.clone(), optim::make_fused_adamw(h), pieces);
        auto sdir = std::make_shared<offload::SwapDir>(dir, offload::new_run_id(), 0);
        std::shared_ptr<offload::IoEngine> io = offload::make_io_engine(offload::IoOptions{});
        step.offload_to_nvme(std::make_shared<offload::HostArena>(false),
                             std::make_shared<offload::SwapFile>(sdir, io, "optimizer.swp"), 1 << 18, sets);
        step.swap_gradients(std::make_shared<offload::SwapFile>(sdir, io, "gradients.swp"));
        auto same_grads = [&](int s) {
          for (size_t k = 0; k < sizes.size(); ++k)
            ASSERT_TRUE(at::equal(step.read_grad(k), ref_grads[k])) << "step " << s << ", piece " << k;
        };
        for (int s = 0; s < 2; ++s) {
          for (int micro = 0; micro < 3; ++micro) {
            for (size_t k = sizes.size(); k-- > 0;) {
              const at::Tensor g = at::randn({sizes[k]}) * 1e-2;
              ref_grads[k].add_(g);
              step.accumulate_grad(k, g);
            }
          }
          if (read_first) same_grads(s);
          ref.apply(1e-3, 1.0);
          step.apply(1e-3, 1.0);
          for (size_t k = 0; k < sizes.size(); ++k)
            ASSERT_TRUE(at::equal(outs[k], outs_ref[k])) << "step " << s << ", piece " << k;
          const cpu::GradStats a = ref.stats(1.0), b = step.stats(1.0);
          EXPECT_EQ(a.sumsq, b.sumsq) << "step " << s;
          EXPECT_EQ(a.amax, b.amax) << "step " << s;
          same_grads(s);
          ref.reset();
          for (auto& g : ref_grads) g.zero_();
          step.reset();
          step.clear_grads();
        }
      }
  fs::remove_all(dir);
}

// prefetch_state (the engine calls it as the last backward before a step begins): the first windows'
// master, m and v come into their buffer sets ahead of apply, which then reads only the windows after
// them through the file's engine (its request count shows it), and steps to the in-memory bits. A
// state access between the prefetch and the step (a checkpoint's read, through a set as its bounce
// buffer; a load's write, which changes the state) drops what was prefetched. One, two and three
// buffer sets; one window and five.
TEST(ShardStepNvme, PrefetchedWindowsStepToTheSameBitsAndAStateAccessDropsThem) {
  constexpr int64_t n = 5 << 20;
  const std::string dir = (fs::temp_directory_path() / ("zeal_shard_step_prefetch_" + std::to_string(::getpid()))).string();
  fs::create_directories(dir);
  for (const int64_t window : {n, n / 5})
    for (const int sets : {3, 2, 1}) {
      SCOPED_TRACE(fmt::format("window {}, {} buffer sets", window, sets));
      StepPair pair(dir, n, window, sets, 11);
      ShardStep &ref = *pair.ref, &step = *pair.step;
      const at::Tensor &out = pair.out, &out_ref = pair.out_ref;
      const offload::IoOptions& o = pair.options;
      const std::shared_ptr<offload::IoEngine>& io = pair.io;
      const int64_t windows = (n + window - 1) / window;
      const int expect = static_cast<int>(std::min<int64_t>(sets, windows));
      // Requests apply reads through the file's engine when the first `skip` windows are in already.
      auto reads_after = [&](int64_t skip) {
        int64_t r = 0;
        for (int64_t w = skip; w < windows; ++w) {
          const int64_t bytes = std::min(window, n - w * window) * 4;
          r += 3 * ((bytes + o.block_size - 1) / o.block_size);
        }
        return r;
      };
      std::vector<float> buf(n);
      for (int s = 0; s < 5; ++s) {
        pair.set_grads(at::randn({n}) * 1e-2);
        step.finish_writes();  // the last window's write-back done: the prefetch may start
        step.prefetch_state();
        if (s == 2) {  // a checkpoint reads the state between the prefetch and the step
          step.read_state("exp_avg", 0, n, buf.data());
        } else if (s == 3) {  // a load writes it: both steps take the same new master
          step.read_state("master", 0, n, buf.data());
          for (float& x : buf) x *= 0.5f;
          step.write_state("master", 0, n, buf.data());
          ref.write_state("master", 0, n, buf.data());
        }
        const int in = step.prefetched_windows();
        EXPECT_EQ(in, s == 2 || s == 3 ? 0 : expect) << "step " << s;
        const int64_t before = io->requests();
        ref.apply(1e-3, 1.0);
        step.apply(1e-3, 1.0);
        EXPECT_EQ(io->requests() - before, reads_after(in)) << "step " << s;
        ASSERT_TRUE(at::equal(out, out_ref)) << "step " << s;
      }
      for (const char* what : {"master", "exp_avg", "exp_avg_sq"}) {
        step.read_state(what, 0, n, buf.data());
        EXPECT_TRUE(at::equal(at::from_blob(buf.data(), {n}), at::from_blob(const_cast<float*>(ref.host_state(what, 0, n)), {n})))
            << what;
      }
    }
  fs::remove_all(dir);
}

// A prefetch whose read fails leaves nothing in the sets: the step reads those windows itself, to the
// same bits, and the next prefetch (through a new engine) brings its windows again.
TEST(ShardStepNvme, AFailedPrefetchIsReadAgainByTheStep) {
  constexpr int64_t n = 3 << 20;
  const std::string dir = (fs::temp_directory_path() / ("zeal_shard_step_prefetch_fail_" + std::to_string(::getpid()))).string();
  fs::create_directories(dir);
  for (const int error : {EIO, 0}) {  // 0: a short transfer
    SCOPED_TRACE(error ? "an I/O error" : "a short read");
    StepPair pair(dir, n, n / 3, 2, 5);
    ShardStep &ref = *pair.ref, &step = *pair.step;
    for (int s = 0; s < 3; ++s) {
      pair.set_grads(at::randn({n}) * 1e-2);
      step.finish_writes();
      if (s == 1) {  // one of the prefetch's reads (its fourth request) fails
        offload::IoEngine& e = step.write_engine();
        e.inject({.at_request = e.requests() + 3, .error = error, .short_transfer = error == 0});
      }
      step.prefetch_state();
      EXPECT_EQ(step.prefetched_windows(), s == 1 ? 0 : 2) << "step " << s;
      ref.apply(1e-3, 1.0);
      step.apply(1e-3, 1.0);
      ASSERT_TRUE(at::equal(pair.out, pair.out_ref)) << "step " << s;
    }
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace zeal::zero
