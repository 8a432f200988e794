// Memory measured at LibTorch's CPU allocator (zeal::CpuMemoryCounter), not reported by the engine:
// what each stage holds between steps against the ZeRO stage table (docs/concepts.md) computed here from the
// model's sizes, and the root unit released while the optimizer step runs.
#include <torch/optim/sgd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>

#include "engine/host_cache.h"
#include "engine/memory_counter.h"
#include "tests/engine/engine_harness.h"

using namespace zeal_test;

namespace {

const TinyGptOptions kModel{101, 48, 2, 3, 8, 96};

struct Sizes {
  double psi = 0, root = 0;  // trainable elements; the root unit's (everything outside the blocks)
  int units = 0;             // flat buffers stage 3 makes: the root and one per block
};

Sizes sizes() {
  TinyGpt m(kModel);
  Sizes s;
  for (auto& p : m->parameters()) s.psi += static_cast<double>(p.numel());
  s.root = s.psi;
  for (auto& b : m->blocks)
    for (auto& p : b->parameters()) s.root -= static_cast<double>(p.numel());
  s.units = 1 + static_cast<int>(m->blocks.size());
  return s;
}

// The live bytes once LibTorch's own worker threads have let go of what they held: c10d's Gloo works
// drop their tensors a moment after they complete. Polls until the count stays put for 50 ms (two
// seconds at most).
int64_t settled(const zeal::CpuMemoryCounter& c) {
  int64_t last = c.live();
  int same = 0;
  for (int i = 0; i < 200 && same < 5; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const int64_t now = c.live();
    same = now == last ? same + 1 : 0;
    last = now;
  }
  return last;
}

// Each rank: counts from before the model is built; writes the peak of the first optimizer step
// (opt.step(), above what was live before it: the step's own allocations, its fp32 gradient copy
// among them for SGD) and, after the second step and zero_grad, the live bytes (the state between
// steps).
std::vector<std::pair<double, double>> measure(int stage, int world, int64_t persistence, bool sgd) {
  const std::string dir = temp_dir("memory");
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Config c = zeal_test::test_config();
        c.zero.stage = stage;
        c.zero.reduce_bucket_size = {100'000'000, false};
        c.zero.stage3_param_persistence_threshold = {persistence, false};
        zeal::Engine engine(c, rt);
        zeal::CpuMemoryCounter counter;
        zeal_test::seed(3);
        TinyGpt model(kModel);
        std::unique_ptr<torch::optim::Optimizer> opt;
        if (sgd) opt = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(1e-2).momentum(0.9));
        else opt = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3));
        auto prepared = engine.prepare(model, *static_cast<torch::optim::Optimizer*>(opt.get()));
        auto& m = std::get<0>(prepared);
        auto& o = std::get<1>(prepared);
        const at::Tensor tokens = make_tokens(4).narrow(1, 0, kModel.seq + 1);
        int64_t first_step_peak = 0;
        for (int step = 0; step < 2; ++step) {
          at::Tensor logits = m->forward(tokens.narrow(1, 0, kModel.seq));
          engine.backward(logits.pow(2).mean());
          counter.reset_peak();
          const int64_t before = counter.live();
          o.step();
          if (step == 0) first_step_peak = counter.peak() - before;
          o.zero_grad();
        }
        write_tensor(dir + "/m_" + std::to_string(engine.process_index()),
                     at::tensor(std::vector<double>{double(settled(counter)), double(first_step_peak)}, at::kDouble));
      },
      world);
  EXPECT_EQ(zeal::describe_failures(results), "");
  std::vector<std::pair<double, double>> out;
  for (int r = 0; r < world; ++r) {
    const at::Tensor t = read_tensor(dir + "/m_" + std::to_string(r));
    out.push_back({t[0].item<double>(), t[1].item<double>()});
  }
  return out;
}

}  // namespace

// Between steps each rank holds, beyond what every stage holds alike, the stage table's model states
// (P = G = 4 bytes in fp32, K = 8: Adam's m, v; fp32 parameters are their own master weights):
// stage 0 (P+G+K)Ψ, stage 1 (P+G)Ψ + KΨ/N, stage 2 PΨ + (G+K)Ψ/N, stage 3 (P+G+K)Ψ/N plus the root
// unit gathered (PΨ_root); and stages 1-3
// the Gloo reduce-scatter's scratch, three windows of min(2 segments of 4 MiB, the largest shard
// reduced). Measured as the difference from stage 0, which cancels what is common; the flat
// buffers' padding (under world × 16 elements of each kind per buffer) is the only other difference.
TEST(Memory, EveryStageHoldsWhatTheTableSays) {
  const int world = 2;
  const Sizes z = sizes();
  const double n = world;
  // The largest shard each stage reduce-scatters: the one bucket's, or the largest unit's (a block).
  auto shard = [&](double elems) { return std::ceil(elems / n / 16) * 16; };
  auto scratch = [&](double largest) { return 3 * 4 * std::min(2.0 * (1 << 20), shard(largest)); };
  const double block = (z.psi - z.root) / (z.units - 1);
  const double table[4] = {16 * z.psi, 8 * z.psi + 8 * z.psi / n + scratch(z.psi),
                           4 * z.psi + 12 * z.psi / n + scratch(z.psi), 16 * z.psi / n + 4 * z.root + scratch(block)};
  std::vector<std::vector<std::pair<double, double>>> got;
  for (int stage = 0; stage < 4; ++stage) got.push_back(measure(stage, world, 0, false));
  for (int stage = 1; stage < 4; ++stage) {
    const double buffers = stage == 3 ? z.units + 1 : 2;  // its buffers and stage 0's one
    const double padding = buffers * world * 16 * 16;
    for (int r = 0; r < world; ++r) {
      const double measured = got[stage][r].first - got[0][r].first;
      const double expected = table[stage] - table[0];
      std::printf("[ metric ] stage %d rank %d: %.0f B more than stage 0, the table says %.0f (padding up to %.0f)\n",
                  stage, r, measured, expected, padding);
      EXPECT_LE(std::abs(measured - expected), padding) << "stage " << stage << " rank " << r;
    }
  }
}

// The root unit (embeddings, final norm, head) is released while the optimizer step runs and
// gathered again with the new values after it. With SGD, whose step makes an fp32 copy of the
// gradients, the step's peak is lower by the root's bytes than when the root is kept (a persistence
// threshold above the root's size and below a block's).
TEST(Memory, RootIsReleasedDuringTheStep) {
  const Sizes z = sizes();
  const int64_t between = static_cast<int64_t>(z.root) + 1;  // the root persistent, the blocks not
  const auto released = measure(3, 2, 0, true), kept = measure(3, 2, between, true);
  for (int r = 0; r < 2; ++r) {
    const double saved = kept[r].second - released[r].second;
    std::printf("[ metric ] rank %d: the step's peak %.0f B with the root released, %.0f B with it kept: %.0f B "
                "less (the root: %.0f B)\n",
                r, released[r].second, kept[r].second, saved, 4 * z.root);
    EXPECT_NEAR(saved, 4 * z.root, 2 * 16 * 4) << "rank " << r;
  }
}

namespace {

int64_t resident_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

}  // namespace

// Once an engine exists, a LibTorch CPU tensor of a MiB or more leaves the resident set when it is
// freed, the tenth as well as the first. With glibc's default the first free raises malloc's mmap
// threshold to that size and every later tensor under it stays in the heap after it is freed, so a
// training process keeps its largest step's temporaries on top of its model states.
TEST(Memory, FreedTensorsLeaveTheResidentSet) {
  // Without the host cache glibc unmaps each block when it is freed; with it (the default) the
  // blocks stay for reuse until the cache is trimmed (a phase's end, save, load, the engine's end).
  for (bool cache : {false, true}) {
  SCOPED_TRACE(cache ? "host cache on" : "host cache off");
  auto results = zeal::spawn(
      [cache](zeal::Runtime& rt) {
        if (!cache) setenv("ZEAL_HOST_CACHE", "off", 1);
        zeal::Engine engine(zeal_test::test_config(), rt);
        if (zeal::host_cache_stats().installed != cache) throw std::runtime_error("the host cache is not as asked");
        for (int64_t mib : {16, 8, 16, 4, 24, 16, 2, 16, 8, 16}) {
          at::Tensor t = at::ones({mib << 18});  // floats: mib MiB, every page touched
          const int64_t held = resident_bytes();
          t.reset();
          zeal::host_cache_trim();  // no-op without the cache
          const int64_t freed = held - resident_bytes();
          if (freed < (mib << 20) - (256 << 10)) {
            throw std::runtime_error("freeing a " + std::to_string(mib) + " MiB tensor lowered the resident set by " +
                                     std::to_string(freed) + " B only");
          }
        }
      },
      1);
  EXPECT_EQ(zeal::describe_failures(results), "");
  }
}

// offload_optimizer nvme: sub_group_size is the window, as in DeepSpeed, up to 2^26 elements; a
// larger one (DeepSpeed's default of 1e9, 64 GB of buffers per rank) gives the 2^21 default. The
// engine, the step's spool and the estimator all take the window from this function.
TEST(NvmeWindow, SubGroupSizeIsTheWindowUpTo2To26) {
  EXPECT_EQ(zeal::nvme_window_elems(1000), 1000);
  EXPECT_EQ(zeal::nvme_window_elems(int64_t{1} << 24), int64_t{1} << 24);
  EXPECT_EQ(zeal::nvme_window_elems(zeal::kMaxNvmeSubGroup), zeal::kMaxNvmeSubGroup);
  EXPECT_EQ(zeal::nvme_window_elems(zeal::kMaxNvmeSubGroup + 1), zeal::kDefaultNvmeWindowElems);
  EXPECT_EQ(zeal::nvme_window_elems(1'000'000'000), int64_t{1} << 21);
}
