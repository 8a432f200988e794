// Stage 3 with frozen weights (a LoRA fine-tune): the frozen part of a unit stays gathered from its
// backward to its next forward when stage3_max_reuse_distance and stage3_max_live_parameters allow,
// and the root's frozen part stays through the optimizer step, because no step changes frozen values.
// What every rank receives per step (the kernel's count for its TCP sockets) drops by
// those bytes; the values stay those of stage 0 bit for bit through an eval forward, a frozen
// weight changed by engine.gathered(params, 0), and a load_state that brings older frozen values.
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <gtest/gtest.h>

#include <netinet/in.h>
#include <linux/tcp.h>  // struct tcp_info with tcpi_bytes_received
#include <sys/socket.h>

#include <cstddef>
#include <filesystem>
#include <string>

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

// A frozen embedding and a trainable head in the root, three adapted blocks as units.
struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl() {
    wte = register_module("wte", torch::nn::Embedding(kVocab, kDim));
    wte->weight.set_requires_grad(false);
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("block" + std::to_string(i), zeal::Sharded<Adapted>()));
    head = register_module("head", torch::nn::Linear(kDim, kClasses));
  }
  at::Tensor forward(const at::Tensor& ids) {
    at::Tensor h = wte(ids);
    for (auto& blk : blocks) h = blk->forward(h);
    return head(h.mean(1));
  }
  torch::nn::Embedding wte{nullptr};
  std::vector<zeal::Sharded<Adapted>> blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Classifier);

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

struct FrozenRun {
  at::Tensor params;          // rank 0's final parameters (every rank checked equal)
  std::vector<double> bytes;  // rank 0's bytes read per step
};

constexpr int kSteps = 7;

// Trains the classifier for kSteps AdamW steps on 2 ranks at `stage`: a checkpoint after step 1, an
// eval forward after step 2, rank 0 halving block 1's frozen weight through engine.gathered after
// step 3, the checkpoint loaded back after step 4 (its frozen values are the older ones).
FrozenRun train(int stage, int64_t reuse, const std::string& name) {
  const int world = 2;
  const std::string dir = temp_dir(name);
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Config c = zeal_test::test_config();
        c.zero.stage = stage;
        c.zero.stage3_param_persistence_threshold = {0, false};
        c.zero.stage3_max_reuse_distance = reuse;
        zeal::Engine engine(c, rt);
        zeal_test::seed(11);
        Classifier model;
        std::vector<at::Tensor> trainable;
        for (auto& p : model->parameters())
          if (p.requires_grad()) trainable.push_back(p);
        torch::optim::AdamW opt(trainable, torch::optim::AdamWOptions(1e-2));
        auto [m, o] = engine.prepare(model, opt);
        auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
        const at::Tensor ids = at::randint(0, kVocab, {kSteps * world * 4, 8}, gen);
        const at::Tensor labels = at::randint(0, kClasses, {kSteps * world * 4}, gen);
        const int me = engine.process_index();
        std::vector<double> per_step;
        for (int step = 0; step < kSteps; ++step) {
          const int64_t first = (step * world + me) * 4;
          const int64_t before = bytes_read();
          at::Tensor logits = m->forward(ids.narrow(0, first, 4));
          engine.backward(torch::nn::functional::cross_entropy(logits, labels.narrow(0, first, 4)));
          o.step();
          o.zero_grad();
          per_step.push_back(static_cast<double>(bytes_read() - before));
          if (step == 1) engine.save_state(dir + "/ckpt");
          if (step == 2) {
            c10::NoGradGuard eval;
            (void)m->forward(ids.narrow(0, first, 4));
          }
          if (step == 3) {
            at::Tensor w = model->blocks[1]->inner->base->weight;
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
  EXPECT_TRUE(at::equal(read_tensor(dir + "/params_1"), r.params));
  const at::Tensor b = read_tensor(dir + "/bytes_0");
  r.bytes.assign(b.data_ptr<double>(), b.data_ptr<double>() + b.numel());
  return r;
}

}  // namespace

TEST(Stage3Frozen, FrozenPartsStayGatheredAcrossStepsWithStageZerosValues) {
  const FrozenRun zero = train(0, 1'000'000'000, "frozen0");
  const FrozenRun kept_frozen = train(3, 1'000'000'000, "frozen3");
  const FrozenRun regathered = train(3, 0, "frozen3_reuse0");  // units' frozen parts gathered every step
  EXPECT_TRUE(at::equal(kept_frozen.params, zero.params)) << "two ranks, one micro-step: the same sums as stage 0";
  EXPECT_TRUE(at::equal(regathered.params, zero.params));

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
    // The measurement sees the units' frozen gathers where they are not kept.
    EXPECT_GE(regathered.bytes[step] - kept_frozen.bytes[step], 0.9 * unit_frozen) << "step " << step;
  }
}
