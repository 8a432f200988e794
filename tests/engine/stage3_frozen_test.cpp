// Stage 3 with frozen weights (a LoRA fine-tune): the frozen part of a unit stays gathered from its
// backward to its next forward when stage3_max_reuse_distance and stage3_max_live_parameters allow,
// and the root's frozen part stays through the optimizer step, because no step changes frozen values.
// What every rank receives per step (the kernel's count for its TCP sockets) drops by
// those bytes; the values stay those of stage 0 bit for bit through an eval forward, a frozen
// weight changed by engine.gathered(params, 0), and a load_state that brings older frozen values,
// with the blocks' shards in memory and on disk (offload_param nvme).
// Also on three ranks with two micro-steps a step, within a live-parameter budget that holds some
// blocks, and with the blocks named by type (unit_names) instead of wrapped in zeal::Sharded.
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <netinet/in.h>
#include <linux/tcp.h>  // struct tcp_info with tcpi_bytes_received
#include <sys/socket.h>

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <type_traits>

#include "engine/zero/sharded.h"
#include "tests/engine/token_harness.h"

using namespace zeal_test;

namespace {

constexpr int64_t kDim = 64, kVocab = 200, kRank = 2, kClasses = 5;

// A frozen Linear with a trainable rank-2 adapter beside it: a LoRA-adapted block.
struct AdaptedImpl : torch::nn::Module {
  AdaptedImpl() {
    base = register_module("base", torch::nn::Linear(kDim, kDim));
    a = register_module("a", torch::nn::Linear(torch::nn::LinearOptions(kDim, kRank).bias(false)));
    b = register_module("b", torch::nn::Linear(torch::nn::LinearOptions(kRank, kDim).bias(false)));
    base->weight.set_requires_grad(false);
    base->bias.set_requires_grad(false);
  }
  at::Tensor forward(const at::Tensor& x) { return at::tanh(base(x) + b(a(x))); }
  torch::nn::Linear base{nullptr}, a{nullptr}, b{nullptr};
};
TORCH_MODULE(Adapted);

// A frozen embedding and a trainable head in the root, three adapted blocks as units: each a
// zeal::Sharded<Adapted> (Classifier), or a plain Adapted named by unit_names (ByType).
template <class Block>
struct BlocksImpl : torch::nn::Module {
  BlocksImpl() {
    wte = register_module("wte", torch::nn::Embedding(kVocab, kDim));
    wte->weight.set_requires_grad(false);
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("block" + std::to_string(i), Block()));
    head = register_module("head", torch::nn::Linear(kDim, kClasses));
  }
  at::Tensor forward(const at::Tensor& ids) {
    at::Tensor h = wte(ids);
    for (auto& blk : blocks) h = blk->forward(h);
    return head(h.mean(1));
  }
  torch::nn::Embedding wte{nullptr};
  std::vector<Block> blocks;
  torch::nn::Linear head{nullptr};
};
using Classifier = torch::nn::ModuleHolder<BlocksImpl<zeal::Sharded<Adapted>>>;
using ByType = torch::nn::ModuleHolder<BlocksImpl<Adapted>>;

// Bytes this process's TCP sockets have received (the kernel's tcpi_bytes_received): Gloo's traffic
// between the ranks, and the store's.
int64_t bytes_read() {
  int64_t total = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const std::string target = std::filesystem::read_symlink(e.path(), ec).string();
    if (ec || target.rfind("socket:", 0) != 0) continue;
    tcp_info info{};
    socklen_t len = sizeof info;
    const int fd = std::stoi(e.path().filename().string());
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) == 0 &&
        len >= offsetof(tcp_info, tcpi_bytes_received) + sizeof info.tcpi_bytes_received) {
      total += static_cast<int64_t>(info.tcpi_bytes_received);
    }
  }
  return total;
}

// Writes `tensors` (fp32) as dir/model.safetensors, as transformers would.
void write_safetensors(const std::string& dir, const std::map<std::string, at::Tensor>& tensors) {
  std::filesystem::create_directories(dir);
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const auto& [name, t] : tensors) {
    const at::Tensor c = t.detach().to(at::kFloat).contiguous();
    const size_t begin = data.size();
    data.append(static_cast<const char*>(c.data_ptr()), c.nbytes());
    header[name] = {{"dtype", "F32"}, {"shape", c.sizes().vec()}, {"data_offsets", {begin, data.size()}}};
  }
  const std::string h = header.dump();
  const uint64_t n = h.size();
  std::ofstream f(dir + "/model.safetensors", std::ios::binary);
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << h << data;
}

// The config both tests train under: `stage`, no unit persistent, the reuse distance given, and
// with `param_swap` set every block's shards on disk there (offload_param nvme).
zeal::Config frozen_config(int stage, int64_t reuse, const std::string& param_swap = "") {
  zeal::Config c = zeal_test::test_config();
  c.zero.stage = stage;
  c.zero.stage3_param_persistence_threshold = {0, false};
  c.zero.stage3_max_reuse_distance = reuse;
  if (!param_swap.empty()) {
    c.zero.offload_param.device = zeal::OffloadDevice::kNvme;
    c.zero.offload_param.nvme_path = param_swap;
    c.zero.offload_param.max_in_cpu = 0;
  }
  return c;
}

// The seeded classifier's trainable parameters (the adapters and the head).
template <class Model>
std::vector<at::Tensor> trainable_of(Model& model) {
  std::vector<at::Tensor> out;
  for (auto& p : model->parameters())
    if (p.requires_grad()) out.push_back(p);
  return out;
}

struct FrozenRun {
  at::Tensor params;          // rank 0's final parameters (every rank checked equal)
  std::vector<double> bytes;  // rank 0's bytes read per step
};

constexpr int kSteps = 7;

// Block 1's frozen weight, where each model keeps it.
at::Tensor block1_frozen_weight(Classifier& model) { return model->blocks[1]->inner->base->weight; }
at::Tensor block1_frozen_weight(ByType& model) { return model->blocks[1]->base->weight; }

// Trains the classifier (Classifier, or ByType with its blocks named by unit_names at stage 3) for
// kSteps AdamW steps on `world` ranks at `stage`, each step `accumulation` micro-steps: a checkpoint
// after step 1, an eval forward after step 2, rank 0 halving block 1's frozen weight through
// engine.gathered after step 3, the checkpoint loaded back after step 4 (its frozen values are the
// older ones).
template <class Model = Classifier>
FrozenRun train(int stage, int64_t reuse, const std::string& name, bool param_nvme = false, int world = 2,
                int accumulation = 1, int64_t max_live = 1'000'000'000) {
  const std::string dir = temp_dir(name);
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Config config = frozen_config(stage, reuse, param_nvme ? dir : "");
        config.gradient_accumulation_steps = {accumulation, false};
        config.zero.stage3_max_live_parameters = max_live;
        if (std::is_same_v<Model, ByType> && stage == 3) config.zero.unit_names = {"Adapted"};
        zeal::Engine engine(config, rt);
        zeal_test::seed(11);
        Model model;
        torch::optim::AdamW opt(trainable_of(model), torch::optim::AdamWOptions(1e-2));
        auto [m, o] = engine.prepare(model, opt);
        auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
        const int64_t rows = kSteps * accumulation * world * 4;
        const at::Tensor ids = at::randint(0, kVocab, {rows, 8}, gen);
        const at::Tensor labels = at::randint(0, kClasses, {rows}, gen);
        const int me = engine.process_index();
        std::vector<double> per_step;
        for (int step = 0; step < kSteps; ++step) {
          const int64_t before = bytes_read(), steps_before = engine.optimizer_steps();
          for (int micro = 0; micro < accumulation; ++micro) {
            const int64_t first = ((step * accumulation + micro) * world + me) * 4;
            auto guard = engine.accumulate(m);
            at::Tensor logits = m->forward(ids.narrow(0, first, 4));
            engine.backward(torch::nn::functional::cross_entropy(logits, labels.narrow(0, first, 4)));
            o.step();
            o.zero_grad();
          }
          if (engine.optimizer_steps() != steps_before + 1) throw zeal::Error("the accumulation did not step once a step");
          per_step.push_back(static_cast<double>(bytes_read() - before));
          if (step == 1) engine.save_state(dir + "/ckpt");
          if (step == 2) {
            c10::NoGradGuard eval;
            (void)m->forward(ids.narrow(0, me * 4, 4));
          }
          if (step == 3) {
            at::Tensor w = block1_frozen_weight(model);
            auto g = engine.gathered({w}, /*modifier_rank=*/0);
            c10::NoGradGuard no_grad;
            if (me == 0) w.mul_(0.5);
          }
          if (step == 4) engine.load_state(dir + "/ckpt");
        }
        auto g = engine.gathered();
        write_tensor(dir + "/params_" + std::to_string(me), flat_params(*m));
        write_tensor(dir + "/bytes_" + std::to_string(me), at::tensor(per_step, at::kDouble));
      },
      world);
  EXPECT_EQ(zeal::describe_failures(results), "");
  FrozenRun r;
  r.params = read_tensor(dir + "/params_0");
  for (int k = 1; k < world; ++k) EXPECT_TRUE(at::equal(read_tensor(dir + "/params_" + std::to_string(k)), r.params));
  const at::Tensor b = read_tensor(dir + "/bytes_0");
  r.bytes.assign(b.data_ptr<double>(), b.data_ptr<double>() + b.numel());
  return r;
}

}  // namespace

TEST(Stage3Frozen, FrozenPartsStayGatheredAcrossStepsWithStageZerosValues) {
  const FrozenRun zero = train(0, 1'000'000'000, "frozen0");
  const FrozenRun kept_frozen = train(3, 1'000'000'000, "frozen3");
  const FrozenRun regathered = train(3, 0, "frozen3_reuse0");  // units' frozen parts gathered every step
  const FrozenRun on_disk = train(3, 1'000'000'000, "frozen3_nvme", /*param_nvme=*/true);
  EXPECT_TRUE(at::equal(kept_frozen.params, zero.params)) << "two ranks, one micro-step: the same sums as stage 0";
  EXPECT_TRUE(at::equal(regathered.params, zero.params));
  EXPECT_TRUE(at::equal(on_disk.params, zero.params)) << "offload_param nvme";

  // Elements, fp32: what each rank receives of an all-gather is half the buffer.
  const double unit_frozen = 3.0 * (kDim * kDim + kDim) * 4 / 2, root_frozen = double(kVocab * kDim) * 4 / 2;
  const double trainable = (3.0 * 2 * kDim * kRank + kDim * kClasses + kClasses) * 4;
  // Steps 2 and 6 are steady: step 0 records the order; an eval forward (after step 2), a change
  // through engine.gathered (after 3) and a load_state (after 4) release the frozen parts they find
  // kept, so steps 3, 4 and 5 gather them again.
  for (int step : {2, 6}) {
    std::printf("[ metric ] step %d: bytes received by rank 0: frozen parts kept %.0f, units regathered %.0f; "
                "frozen halves %.0f (units) + %.0f (root), trainable %.0f\n",
                step, kept_frozen.bytes[step], regathered.bytes[step], unit_frozen, root_frozen, trainable);
    // Kept: the trainable parts' gathers and reductions and the collectives' own messages only.
    EXPECT_LT(kept_frozen.bytes[step], 0.25 * (unit_frozen + root_frozen)) << "step " << step;
    EXPECT_LT(on_disk.bytes[step], 0.25 * (unit_frozen + root_frozen)) << "offload_param nvme, step " << step;
    // The measurement sees the units' frozen gathers where they are not kept.
    EXPECT_GE(regathered.bytes[step] - kept_frozen.bytes[step], 0.9 * unit_frozen) << "step " << step;
  }
}

// Three ranks, two micro-steps a step: the frozen parts stay gathered across the micro-steps and the
// steps, with the bits of the same run that gathers them every time (stage3_max_reuse_distance 0;
// the sums are stage 3's own either way) and stage 0's values within float32 rounding (three ranks
// sum in another order).
TEST(Stage3Frozen, ThreeRanksWithAccumulationKeepFrozenPartsWithTheSameBits) {
  const FrozenRun zero = train(0, 1'000'000'000, "frozen0_w3", false, 3, 2);
  const FrozenRun kept_frozen = train(3, 1'000'000'000, "frozen3_w3", false, 3, 2);
  const FrozenRun regathered = train(3, 0, "frozen3_w3_reuse0", false, 3, 2);
  EXPECT_TRUE(at::equal(kept_frozen.params, regathered.params));
  EXPECT_TRUE(at::allclose(kept_frozen.params, zero.params, 1e-5, 1e-6))
      << "largest difference " << (kept_frozen.params - zero.params).abs().max().item<double>();
  // What a rank receives of an all-gather over 3 ranks: two thirds of the buffer.
  const double unit_frozen = 3.0 * (kDim * kDim + kDim) * 4 * 2 / 3, root_frozen = double(kVocab * kDim) * 4 * 2 / 3;
  for (int step : {2, 6}) {
    std::printf("[ metric ] 3 ranks, 2 micro-steps, step %d: bytes received by rank 0: kept %.0f, units regathered "
                "%.0f; frozen shares %.0f (units) + %.0f (root)\n",
                step, kept_frozen.bytes[step], regathered.bytes[step], unit_frozen, root_frozen);
    // Kept: the trainable parts and the collectives' own messages (three ranks' carry more of those
    // than two ranks' do: about 21 KB here), under three quarters of the root's frozen share, so that
    // one block's share (11 KB) gathered once a step more would cross it.
    EXPECT_LT(kept_frozen.bytes[step], 0.75 * root_frozen) << "step " << step;
    // Two micro-steps: the units' frozen parts gathered at least twice a step without keeping.
    EXPECT_GE(regathered.bytes[step] - kept_frozen.bytes[step], 1.8 * unit_frozen) << "step " << step;
  }
}

// stage3_max_live_parameters 10,000 elements, where a block is 4,416 (its frozen part 4,160): the
// budget holds two blocks' frozen parts beside the block in use, not three. Against the same budget
// with stage3_max_reuse_distance 0, a step receives two blocks' frozen halves less, not three (nor
// one), with stage 0's bits.
TEST(Stage3Frozen, ABudgetForSomeUnitsKeepsOnlyWhatItHolds) {
  const FrozenRun zero = train(0, 1'000'000'000, "frozen0_live");
  const FrozenRun some = train(3, 1'000'000'000, "frozen3_live_some", false, 2, 1, 10'000);
  const FrozenRun none = train(3, 0, "frozen3_live_none", false, 2, 1, 10'000);
  EXPECT_TRUE(at::equal(some.params, zero.params));
  EXPECT_TRUE(at::equal(none.params, zero.params));
  const double unit_share = (kDim * kDim + kDim) * 4 / 2.0;  // one block's frozen part, half of it received
  for (int step : {2, 6}) {
    const double saved = none.bytes[step] - some.bytes[step];
    std::printf("[ metric ] step %d: bytes received by rank 0 within 10,000 live elements: frozen parts kept %.0f, "
                "none kept %.0f: %.2f blocks' frozen halves less\n",
                step, some.bytes[step], none.bytes[step], saved / unit_share);
    EXPECT_GE(saved, 1.8 * unit_share) << "step " << step << ": two blocks keep theirs";
    EXPECT_LT(saved, 2.5 * unit_share) << "step " << step << ": the third, beyond the budget, does not";
  }
}

// Units named by type (unit_names, FSDP's transformer-based wrap): gathered when an op reads their
// parameters, released when the thread moves on. Their frozen parts stay gathered the same way, with
// stage 0's bits through train()'s checkpoint, eval forward, change and load.
TEST(Stage3Frozen, UnitsNamedByTypeKeepTheirFrozenPartsToo) {
  const FrozenRun zero = train<ByType>(0, 1'000'000'000, "bytype0");
  const FrozenRun kept_frozen = train<ByType>(3, 1'000'000'000, "bytype3");
  const FrozenRun regathered = train<ByType>(3, 0, "bytype3_reuse0");
  EXPECT_TRUE(at::equal(kept_frozen.params, zero.params));
  EXPECT_TRUE(at::equal(regathered.params, zero.params));
  // The three blocks' frozen halves and the root's, as each rank receives them.
  const double unit_frozen = 3.0 * (kDim * kDim + kDim) * 4 / 2, root_frozen = double(kVocab * kDim) * 4 / 2;
  for (int step : {2, 6}) {  // steady steps, as in train()
    std::printf("[ metric ] unit_names, step %d: bytes received by rank 0: frozen parts kept %.0f, regathered %.0f; "
                "frozen halves %.0f (blocks) + %.0f (root)\n",
                step, kept_frozen.bytes[step], regathered.bytes[step], unit_frozen, root_frozen);
    // As for zeal::Sharded units: the trainable parts and the collectives' own messages only (a
    // block's frozen half gathered once more a step, at the forward or at the backward, crosses it).
    EXPECT_LT(kept_frozen.bytes[step], 0.25 * (unit_frozen + root_frozen)) << "step " << step;
    EXPECT_GE(regathered.bytes[step] - kept_frozen.bytes[step], 0.9 * unit_frozen) << "step " << step;
  }
}

// load_checkpoint_in_model into modules inside a prepared model (the root's frozen embedding, one
// block with its frozen weights and trainable adapter), names relative to the module: the values
// reach every rank's shards and master weights, as at stage 0 — the export right after equals stage
// 0's, and training on gives stage 0's parameters bit for bit.
TEST(Stage3Frozen, WeightsLoadedIntoASubmoduleReachTheShards) {
  const int world = 2;
  const std::string files = temp_dir("frozen_sub_files");
  {
    zeal_test::seed(99);  // other values than the model's
    Classifier donor;
    write_safetensors(files + "/wte", {{"weight", donor->wte->weight}});
    write_safetensors(files + "/block1", {{"base.weight", donor->blocks[1]->inner->base->weight},
                                          {"base.bias", donor->blocks[1]->inner->base->bias},
                                          {"a.weight", donor->blocks[1]->inner->a->weight},
                                          {"b.weight", donor->blocks[1]->inner->b->weight}});
  }
  std::map<int, std::string> out;
  for (int stage : {0, 3}) {
    const std::string dir = temp_dir("frozen_sub_" + std::to_string(stage));
    out[stage] = dir;
    auto results = zeal::spawn(
        [&](zeal::Runtime& rt) {
          zeal::Engine engine(frozen_config(stage, 1'000'000'000), rt);
          zeal_test::seed(11);
          Classifier model;
          torch::optim::AdamW opt(trainable_of(model), torch::optim::AdamWOptions(1e-2));
          auto [m, o] = engine.prepare(model, opt);
          auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
          const at::Tensor ids = at::randint(0, kVocab, {4 * world * 4, 8}, gen);
          const at::Tensor labels = at::randint(0, kClasses, {4 * world * 4}, gen);
          const int me = engine.process_index();
          auto step = [&](int k) {
            const int64_t first = (k * world + me) * 4;
            engine.backward(torch::nn::functional::cross_entropy(m->forward(ids.narrow(0, first, 4)),
                                                                 labels.narrow(0, first, 4)));
            o.step();
            o.zero_grad();
          };
          step(0);
          step(1);  // frozen parts kept from here
          if (zeal::load_checkpoint_in_model(*model->wte, files + "/wte") != 1) throw zeal::Error("wte: not 1 tensor");
          if (zeal::load_checkpoint_in_model(*model->blocks[1]->inner, files + "/block1") != 4)
            throw zeal::Error("block1: not 4 tensors");
          {  // the values now those of the files, on every rank
            auto g = engine.gathered();
            zeal_test::seed(99);
            Classifier donor;
            const auto& mine = model->blocks[1]->inner;
            const auto& theirs = donor->blocks[1]->inner;
            if (!at::equal(model->wte->weight, donor->wte->weight) || !at::equal(mine->base->weight, theirs->base->weight) ||
                !at::equal(mine->base->bias, theirs->base->bias) || !at::equal(mine->a->weight, theirs->a->weight) ||
                !at::equal(mine->b->weight, theirs->b->weight)) {
              throw zeal::Error("the loaded modules do not hold the files' values");
            }
          }
          engine.save_model(dir + "/export");
          step(2);
          step(3);
          auto g = engine.gathered();
          write_tensor(dir + "/params_" + std::to_string(me), flat_params(*m));
        },
        world);
    ASSERT_EQ(zeal::describe_failures(results), "") << "stage " << stage;
    EXPECT_TRUE(at::equal(read_tensor(dir + "/params_1"), read_tensor(dir + "/params_0"))) << "stage " << stage;
  }
  // Each export read into a fresh model (the files order their tensors differently).
  auto exported = [](const std::string& dir) {
    zeal_test::seed(5);
    Classifier fresh;
    if (zeal::load_checkpoint_in_model(*fresh, dir) != 15) ADD_FAILURE() << dir << ": not 15 tensors";
    return flat_params(*fresh);
  };
  EXPECT_TRUE(at::equal(exported(out[3] + "/export"), exported(out[0] + "/export"))) << "the export right after the loads";
  EXPECT_TRUE(at::equal(read_tensor(out[3] + "/params_0"), read_tensor(out[0] + "/params_0")))
      << "trained on after the loads";
}
