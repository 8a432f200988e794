// The model's buffers (BatchNorm's running statistics, an EMA, a step counter): kept in step across
// ranks by broadcast_buffers (each rank sees other data, so without it they drift apart); saved and
// resumed with the checkpoint, so 3 steps + save + load + 3 steps give the bits of 6 steps in one
// run (dropout on, stages 0-3, CPU and NVMe offload, bf16), and at another layout start from the saved
// buffers and weights; written by save_model under the names the
// model's owner sees, and read back by load_checkpoint_in_model.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include "engine/checkpoint/consolidate.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/error.h"
#include "engine/zero/sharded.h"
#include "tests/engine/engine_harness.h"

namespace zeal_test {
namespace {

namespace fs = std::filesystem;

struct NormBlockImpl : torch::nn::Module {
  NormBlockImpl(int64_t in, int64_t out)
      : fc(register_module("fc", torch::nn::Linear(in, out))), bn(register_module("bn", torch::nn::BatchNorm1d(out))) {}
  at::Tensor forward(const at::Tensor& x) { return at::relu(bn(fc(x))); }
  torch::nn::Linear fc;
  torch::nn::BatchNorm1d bn;
};
TORCH_MODULE(NormBlock);

// Two units (each a Sharded block with a BatchNorm), dropout, a head, and two buffers of its own:
// an EMA of the hidden state's batch mean and a count of training forwards.
struct NetImpl : torch::nn::Module {
  NetImpl()
      : b0(register_module("b0", zeal::Sharded<NormBlock>(8, 16))),
        b1(register_module("b1", zeal::Sharded<NormBlock>(16, 8))),
        drop(register_module("drop", torch::nn::Dropout(0.2))),
        head(register_module("head", torch::nn::Linear(16, 4))) {
    ema = register_buffer("ema", at::zeros({16}));
    count = register_buffer("count", at::zeros({}, at::kLong));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = drop(b0->forward(b1->forward(x)));
    if (is_training()) {
      c10::NoGradGuard no_grad;
      ema.mul_(0.9).add_(h.mean(0), 0.1);
      count.add_(1);
    }
    return head(h);
  }
  zeal::Sharded<NormBlock> b0;
  zeal::Sharded<NormBlock> b1;
  torch::nn::Dropout drop;
  torch::nn::Linear head;
  at::Tensor ema, count;
};
TORCH_MODULE(Net);

// Rank r's batch of step s: other samples on every rank.
at::Tensor batch(int64_t step, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step * 10 + rank);
  return at::randn({6, 16}, gen);
}

// Every buffer of `m`, flattened into one float64 tensor.
at::Tensor buffers_of(torch::nn::Module& m) {
  std::vector<at::Tensor> all;
  for (const auto& b : m.buffers(true)) all.push_back(b.detach().to(at::kDouble).reshape({-1}));
  return at::cat(all);
}

struct Phase {
  int64_t begin = 0, end = 0;
  std::string load, save, out;  // out: <out>_<rank> gets [buffers, eval outputs]
};

void run(const RunSpec& s, const Phase& ph, bool broadcast = true) {
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Config c = make_config(s);
        c.broadcast_buffers = broadcast;
        zeal::Engine engine(c, rt);
        at::manual_seed(11);
        Net net;
        torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
        auto [m, o] = engine.prepare(net, opt);
        const auto mixed = engine.autocast();  // bf16: the inputs' products in bf16, as the weights are
        at::manual_seed(12 + rt.rank());  // each rank its own dropout stream
        // Two passes (nothing kept between the check and the apply): the path a state larger than
        // the memory budget takes; checkpoint_test's resumes take the other.
        if (!ph.load.empty()) engine.load_state(ph.load, {.memory_budget = 0});
        for (int64_t step = ph.begin; step < ph.end; ++step) {
          m->train();
          const at::Tensor x = batch(step, rt.rank());
          engine.backward(m->forward(x).pow(2).mean());
          o.step();
          o.zero_grad();
        }
        if (!ph.save.empty()) engine.save_state(ph.save);
        m->eval();
        at::Tensor y;
        {
          c10::NoGradGuard no_grad;
          y = m->forward(batch(99, 0)).to(at::kDouble).reshape({-1});
        }
        write_tensor(fmt::format("{}_{}", ph.out, rt.rank()), at::cat({buffers_of(*m), y}));
      },
      s.world);
  ASSERT_EQ(zeal::describe_failures(results), "");
}

RunSpec spec(int stage) {
  RunSpec s;
  s.world = 2, s.stage = stage, s.accumulation = 1;
  return s;
}

TEST(Buffers, BroadcastKeepsEveryRankOnRankZerosBuffers) {
  const std::string out = temp_dir("buffers_bcast");
  for (const bool on : {true, false}) {
    run(spec(2), {0, 3, "", "", fmt::format("{}/{}", out, on)}, on);
    const at::Tensor r0 = read_tensor(fmt::format("{}/{}_0", out, on)), r1 = read_tensor(fmt::format("{}/{}_1", out, on));
    if (on) {
      EXPECT_TRUE(at::equal(r0, r1)) << "largest difference " << (r0 - r1).abs().max().item<double>();
    } else {
      EXPECT_GT((r0 - r1).abs().max().item<double>(), 1e-3) << "the ranks' data differ: so should their statistics";
    }
  }
  fs::remove_all(out);
}

struct BufferCase {
  std::string label;
  RunSpec spec;
};
void PrintTo(const BufferCase& c, std::ostream* os) { *os << c.label; }
class BufferResume : public ::testing::TestWithParam<BufferCase> {};

TEST_P(BufferResume, SixStepsEqualThreeSavedAndThreeResumed) {
  RunSpec s = GetParam().spec;
  const std::string dir = temp_dir("buffers_" + GetParam().label), swap = dir + "/swap";
  if (!s.nvme_path.empty()) s.nvme_path = s.param_nvme_path = swap;
  fs::create_directories(swap);
  run(s, {0, 6, "", "", dir + "/whole"});
  run(s, {0, 3, "", dir + "/ckpt", dir + "/first"});
  run(s, {3, 6, dir + "/ckpt", "", dir + "/resumed"});
  for (int r = 0; r < 2; ++r) {
    const at::Tensor whole = read_tensor(fmt::format("{}/whole_{}", dir, r));
    const at::Tensor resumed = read_tensor(fmt::format("{}/resumed_{}", dir, r));
    EXPECT_TRUE(at::equal(whole, resumed)) << "rank " << r << ": largest difference "
                                           << (whole - resumed).abs().max().item<double>();
  }
  fs::remove_all(dir);
}

RunSpec cpu_offload(RunSpec s) {
  s.offload = true;
  return s;
}
RunSpec bf16(RunSpec s) {
  s.precision = "bf16";
  return s;
}
RunSpec nvme(RunSpec s) {
  s.nvme_path = s.param_nvme_path = "x";
  s.sub_group = 1000;
  return s;
}

INSTANTIATE_TEST_SUITE_P(Cases, BufferResume,
                         ::testing::Values(BufferCase{"stage0", spec(0)}, BufferCase{"stage1", spec(1)},
                                           BufferCase{"stage2", spec(2)}, BufferCase{"stage3", spec(3)},
                                           BufferCase{"stage2_cpu_offload", cpu_offload(spec(2))},
                                           BufferCase{"stage3_cpu_offload", cpu_offload(spec(3))},
                                           BufferCase{"stage3_nvme", nvme(spec(3))},
                                           // The BatchNorms' running statistics in bf16 with their weights
                                           BufferCase{"stage1_bf16", bf16(spec(1))},
                                           BufferCase{"stage3_bf16", bf16(spec(3))}),
                         [](const ::testing::TestParamInfo<BufferCase>& i) { return i.param.label; });

// At another layout (world size, stage, offload) a resume starts from the saved buffers and
// weights bit for bit: evaluated on one batch, every rank of the resumed run gives the saving run's
// outputs exactly, and holds its buffers. (Training on from there is not compared with a run that
// never stopped: BatchNorm's statistics are each rank's own batch's, so a model with BatchNorm
// trains differently at another world size, beyond any rounding, as it does in DDP without
// SyncBatchNorm; the weights' own resume across layouts is checkpoint_test's Resume.)
TEST(Buffers, AResumeAtAnotherLayoutStartsFromTheSavedBuffersAndWeights) {
  struct Layouts {
    const char* label;
    RunSpec saved, resumed;
  };
  RunSpec world3 = spec(1), world1 = spec(0), stage3_world3 = cpu_offload(spec(3));
  world3.world = 3, world1.world = 1, stage3_world3.world = 3;
  for (const Layouts& l : {Layouts{"stage3_to_stage1_world3", spec(3), world3},
                           Layouts{"stage3_nvme_to_stage0_world1", nvme(spec(3)), world1},
                           Layouts{"stage2_offload_to_stage3_offload_world3", cpu_offload(spec(2)), stage3_world3}}) {
    SCOPED_TRACE(l.label);
    const std::string dir = temp_dir(std::string("buffers_layout_") + l.label), swap = dir + "/swap";
    fs::create_directories(swap);
    RunSpec saved = l.saved, resumed = l.resumed;
    for (RunSpec* s : {&saved, &resumed}) {
      if (!s->nvme_path.empty()) s->nvme_path = s->param_nvme_path = swap;
    }
    run(saved, {0, 3, "", dir + "/ckpt", dir + "/saved"});
    run(resumed, {3, 3, dir + "/ckpt", "", dir + "/resumed"});
    const at::Tensor want = read_tensor(dir + "/saved_0");
    for (int r = 0; r < resumed.world; ++r) {
      const at::Tensor got = read_tensor(fmt::format("{}/resumed_{}", dir, r));
      EXPECT_TRUE(at::equal(got, want)) << "rank " << r << ": largest difference " << (got - want).abs().max().item<double>();
    }
    fs::remove_all(dir);
  }
}

// save_model writes the buffers with the owner's names (no Sharded level), rank 0's values, and
// load_checkpoint_in_model puts them into a fresh model.
TEST(Buffers, ExportsHoldThemUnderTheOwnersNames) {
  const std::string dir = temp_dir("buffers_export");
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(make_config(spec(3)), rt);
        at::manual_seed(11);
        Net net;
        torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
        auto [m, o] = engine.prepare(net, opt);
        for (int64_t step = 0; step < 2; ++step) {
          engine.backward(m->forward(batch(step, rt.rank())).pow(2).mean());
          o.step();
          o.zero_grad();
        }
        engine.save_model(dir + "/export");
        if (rt.rank() == 0) write_tensor(dir + "/buffers", buffers_of(*m));
      },
      2);
  ASSERT_EQ(zeal::describe_failures(results), "");
  const auto header = zeal::ckpt::read_safetensors_header(dir + "/export/model.safetensors");
  for (const char* name : {"b0.bn.running_mean", "b0.bn.running_var", "b0.bn.num_batches_tracked", "b1.bn.running_mean",
                           "ema", "count", "b0.fc.weight"}) {
    EXPECT_TRUE(header.tensors.count(name)) << name;
  }
  for (const auto& [name, e] : header.tensors) EXPECT_EQ(name.find(".block."), std::string::npos) << name;
  at::manual_seed(5);
  Net fresh;
  EXPECT_EQ(zeal::load_checkpoint_in_model(*fresh, dir + "/export"), static_cast<int64_t>(header.tensors.size()));
  EXPECT_TRUE(at::equal(buffers_of(*fresh), read_tensor(dir + "/buffers")));
  fs::remove_all(dir);
}

// Two model names that would be written under one export name are refused by the consolidation,
// naming both (the manifest's export_names edited to make them collide).
TEST(Buffers, ExportNamesThatCollideAreRefusedNamingBoth) {
  const std::string dir = temp_dir("buffers_collide");
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(make_config(spec(0)), rt);
        Net net;
        torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
        auto [m, o] = engine.prepare(net, opt);
        engine.save_state(dir + "/ckpt");
      },
      1);
  ASSERT_EQ(zeal::describe_failures(results), "");
  const std::string manifest = dir + "/ckpt/manifest.json";
  nlohmann::json mf = nlohmann::json::parse(std::ifstream(manifest));
  mf["export_names"]["b0.block.fc.weight"] = "fc.weight";
  mf["export_names"]["b1.block.fc.weight"] = "fc.weight";
  std::ofstream(manifest) << mf.dump();
  try {
    zeal::ckpt::consolidate(dir + "/ckpt", dir + "/out", {});
    ADD_FAILURE() << "two tensors written as one name";
  } catch (const zeal::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'b0.block.fc.weight' and 'b1.block.fc.weight'"), std::string::npos) << msg;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace zeal_test
