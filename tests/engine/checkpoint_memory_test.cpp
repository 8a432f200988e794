// The memory a checkpoint costs: with the optimizer state and the parameter shards on NVMe (stage 3,
// 2 ranks, an optimizer state several times the loader's window), saving, resuming, exporting and
// loading Hugging Face-style weights into the prepared model each hold at most the training step's
// own peak plus one window; the optimizer step itself brings in one unit's shards at a time. Measured in each rank's resident set (the kernel's VmHWM, reset before each
// phase), never by the engine's count of its tensors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/optim/adamw.h>

#include "engine/checkpoint/safetensors.h"
#include "engine/memory_tracker.h"
#include "tests/engine/engine_harness.h"

namespace zeal_test {
namespace {

namespace fs = std::filesystem;

// What a load or save may hold beyond the training step's peak: the checkpoint reader's ring of
// three 32 MiB spans, the loader's 8 MiB staging and its fp32 conversion, and a margin for the
// allocator and the I/O engines.
constexpr double kWindowBytes = 3 * 32.0 * (1 << 20) + 2 * 8.0 * (1 << 20);
constexpr double kMarginBytes = 48.0 * (1 << 20);

TEST(CheckpointMemory, SaveAndResumeOnNvmeHoldNoMoreThanTrainingPlusAWindow) {
  TinyGptOptions mo;
  mo.vocab = 64, mo.dim = 1024, mo.heads = 8, mo.layers = 8, mo.seq = 16, mo.hidden = 4096;
  const std::string ckpt = temp_dir("ckpt_mem"), swap = temp_dir("ckpt_mem_swap"), out = temp_dir("ckpt_mem_out");
  const std::string weights = temp_dir("ckpt_mem_weights");
  RunSpec s;
  s.world = 2, s.stage = 3, s.accumulation = 1;
  s.nvme_path = swap, s.param_nvme_path = swap, s.sub_group = 1'000'000;
  // Each rank: two training steps (the second measured), then each phase measured; the peaks
  // (bytes) go to out/<rank>: the training step's, then each phase's.
  const std::vector<std::string> phases{"save", "load", "export", "weights"};
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(make_config(s), rt);
        seed(3);
        TinyGpt model(mo);
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-4));
        auto [m, o] = engine.prepare(model, opt);
        auto gen = at::make_generator<at::CPUGeneratorImpl>(5 + rt.rank());
        const at::Tensor tokens = at::randint(0, mo.vocab, {2, mo.seq}, gen);
        auto backward = [&] {
          at::Tensor logits = m->forward(tokens);
          engine.backward(at::cross_entropy_loss(logits.reshape({-1, mo.vocab}), tokens.reshape({-1})));
        };
        backward();
        o.step();
        o.zero_grad();
        // The training step's peak: its forward and backward, then its optimizer step (whose own
        // growth over the resident set before it is kept too).
        std::vector<double> peaks;
        zeal::detail::reset_resident_peak();
        backward();
        const double before_step = static_cast<double>(zeal::detail::resident_bytes());
        const double fwd_bwd = static_cast<double>(zeal::detail::resident_peak_bytes());
        zeal::detail::reset_resident_peak();
        o.step();
        o.zero_grad();
        const double step = static_cast<double>(zeal::detail::resident_peak_bytes());
        peaks = {std::max(fwd_bwd, step), step - before_step};
        for (const std::string& phase : phases) {
          zeal::detail::reset_resident_peak();
          if (phase == "save") engine.save_state(ckpt);
          if (phase == "load") engine.load_state(ckpt, {.memory_budget = 64 << 20});  // the state is beyond it
          if (phase == "export") engine.save_model(weights);
          if (phase == "weights") zeal::load_checkpoint_in_model(*model, weights);
          peaks.push_back(static_cast<double>(zeal::detail::resident_peak_bytes()));
        }
        write_tensor(fmt::format("{}/{}", out, rt.rank()), at::tensor(peaks, at::kDouble));
      },
      2);
  ASSERT_EQ(zeal::describe_failures(results), "");
  // One unit's trainable shard on a rank (the blocks are the units; the optimizer step brings one
  // in from disk at a time, never all eight).
  int64_t unit = 0;
  for (const auto& p : Block(mo)->parameters()) unit += p.numel();
  const double shard = 4.0 * unit / 2;
  for (int r = 0; r < 2; ++r) {
    const at::Tensor t = read_tensor(fmt::format("{}/{}", out, r));
    const double train = t[0].item<double>(), step = t[1].item<double>();
    std::printf("[ metric ] optimizer step rank %d: grows the resident set by %.0f MiB (a unit's shard %.0f MiB, "
                "all eight %.0f MiB)\n",
                r, step / (1 << 20), shard / (1 << 20), 8 * shard / (1 << 20));
    EXPECT_LE(step, 2 * shard + kMarginBytes) << "rank " << r;
    for (size_t k = 0; k < phases.size(); ++k) {
      const double peak = t[static_cast<int64_t>(k) + 2].item<double>();
      std::printf("[ metric ] %s rank %d: peak resident set %.0f MiB, the training step's %.0f MiB (%+.0f MiB; "
                  "bound %+.0f)\n",
                  phases[k].c_str(), r, peak / (1 << 20), train / (1 << 20), (peak - train) / (1 << 20),
                  (kWindowBytes + kMarginBytes) / (1 << 20));
      EXPECT_LE(peak, train + kWindowBytes + kMarginBytes) << phases[k] << " rank " << r;
    }
  }
  // What the bound is measured against: each rank's optimizer state alone (master, m, v in fp32)
  // is several windows.
  int64_t params = 0;
  for (const auto& p : TinyGpt(mo)->parameters()) params += p.numel();
  EXPECT_GT(12.0 * params / 2, 3 * kWindowBytes);
  for (const auto& d : {ckpt, swap, out, weights}) fs::remove_all(d);
}

// Weights into a model engine.init built (stage 3, each rank holding its slices, not yet prepared):
// load_checkpoint_in_model, and load_pretrained with a transform on every 2-D weight, each grow the
// resident set by at most a few MiB of staging, one transform's inputs and result, and a margin —
// not by this rank's slices (200 MiB here) nor by every transformed tensor (the whole model).
TEST(CheckpointMemory, WeightsIntoAnInitModelStreamInsteadOfHoldingThem) {
  TinyGptOptions mo;
  mo.vocab = 64, mo.dim = 1024, mo.heads = 8, mo.layers = 8, mo.seq = 16, mo.hidden = 4096;
  const std::string dir = temp_dir("ckpt_mem_init"), out = temp_dir("ckpt_mem_init_out");
  // The weights, written from a plain model under its own names; the 2-D ones a second time,
  // transposed, under other names (what a transform reads back).
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::map<std::string, std::string> transposed;  // model name → the name of its transposed copy
  int64_t largest = 0;
  {
    seed(3);
    TinyGpt plain(mo);
    for (const auto& item : plain->named_parameters(true)) {
      std::string name = item.key();  // as an export names it: zeal::Sharded's "block" level left out
      if (const auto at = name.find(".block."); at != std::string::npos) name.erase(at, 6);
      tensors.push_back({name, item.value().detach().contiguous()});
      largest = std::max<int64_t>(largest, item.value().numel() * 4);
      if (item.value().dim() == 2) {
        transposed[name] = "t." + name;
        tensors.push_back({"t." + name, item.value().detach().t().contiguous()});
      }
    }
    std::vector<zeal::ckpt::TensorEntry> entries;
    for (const auto& [n, t] : tensors) entries.push_back({n, "F32", t.sizes().vec(), static_cast<int64_t>(t.nbytes()), 0});
    zeal::ckpt::SafetensorsWriter w(dir + "/model.safetensors", entries, {{"format", "pt"}});
    for (const auto& [n, t] : tensors) w.append(t.data_ptr(), static_cast<int64_t>(t.nbytes()));
    w.finish();
  }
  RunSpec s;
  s.world = 2, s.stage = 3, s.init = true;
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(make_config(s), rt);
        seed(4);
        TinyGpt model = engine.init<TinyGpt>(mo);
        std::vector<double> grown;
        for (const bool transforms : {false, true}) {
          const double before = static_cast<double>(zeal::detail::resident_bytes());
          zeal::detail::reset_resident_peak();
          if (transforms) {
            zeal::PretrainedOptions o;
            o.quiet = true;
            for (const auto& [name, copy] : transposed) o.transforms[name] = zeal::transposed(copy);
            zeal::load_pretrained(*model, dir, o);
          } else {
            zeal::load_checkpoint_in_model(*model, dir);
          }
          grown.push_back(static_cast<double>(zeal::detail::resident_peak_bytes()) - before);
        }
        // The values arrived: after prepare, every rank's model is the plain one.
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-4));
        auto [m, unused] = engine.prepare(model, opt);
        (void)unused;
        std::vector<at::Tensor> mine;
        {
          const auto whole = engine.gathered(m->parameters());
          for (const auto& p : m->parameters()) mine.push_back(p.detach().reshape({-1}).to(at::kDouble));
        }
        write_tensor(fmt::format("{}/grown_{}", out, rt.rank()), at::tensor(grown, at::kDouble));
        write_tensor(fmt::format("{}/params_{}", out, rt.rank()), at::cat(mine));
      },
      2);
  ASSERT_EQ(zeal::describe_failures(results), "");
  seed(3);
  const at::Tensor want = flat_params(*TinyGpt(mo));
  for (int r = 0; r < 2; ++r) {
    const at::Tensor g = read_tensor(fmt::format("{}/grown_{}", out, r));
    const double plain = g[0].item<double>(), with_transforms = g[1].item<double>();
    std::printf("[ metric ] rank %d: load_checkpoint_in_model into an init model grows the resident set by %.0f MiB, "
                "load_pretrained with transforms by %.0f MiB (largest tensor %.0f MiB)\n",
                r, plain / (1 << 20), with_transforms / (1 << 20), largest / double(1 << 20));
    EXPECT_LE(plain, 2 * 8.0 * (1 << 20) + kMarginBytes) << "rank " << r;
    EXPECT_LE(with_transforms, 3.0 * largest + 2 * 8.0 * (1 << 20) + kMarginBytes) << "rank " << r;
    EXPECT_TRUE(at::equal(read_tensor(fmt::format("{}/params_{}", out, r)), want)) << "rank " << r;
  }
  for (const auto& d : {dir, out}) fs::remove_all(d);
}

}  // namespace
}  // namespace zeal_test
