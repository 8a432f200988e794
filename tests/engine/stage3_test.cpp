// ZeRO stage 3 cases users hit: gathered-bytes bound with prefetch, a forward order that changes
// between steps with a unit called twice and eval forwards in between, LoRA-style frozen base
// weights inside units, tied weights, gathered() modification, and refused configurations. Each
// against stage 0 on the same ranks (or the initial values, or values set by hand).
#include "tests/engine/engine_harness.h"

#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <gtest/gtest.h>

#include <fstream>
#include <iterator>

#include "engine/memory.h"
#include "engine/optim/optimizer.h"
#include "engine/zero/sharded.h"

using namespace zeal_test;

namespace {

// A model with three units whose order changes with the step, one used twice, and a root head.
struct FlipImpl : torch::nn::Module {
  FlipImpl() {
    for (int i = 0; i < 3; ++i) {
      units.push_back(register_module("u" + std::to_string(i), zeal::Sharded<torch::nn::Linear>(24, 24)));
    }
    head = register_module("head", torch::nn::Linear(24, 5));
  }
  at::Tensor forward(const at::Tensor& x, int step) {
    at::Tensor h = x;
    // Steps 0-2 (and 4): u0, u1, u2, u0 again; steps 3 and 5: u2, u1, u0.
    const bool flipped = step >= 3 && step % 2 == 1;
    const std::vector<int> order = flipped ? std::vector<int>{2, 1, 0} : std::vector<int>{0, 1, 2, 0};
    for (int i : order) h = at::tanh(units[i]->forward(h));
    return head->forward(h);
  }
  std::vector<zeal::Sharded<torch::nn::Linear>> units;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Flip);

// LoRA: a frozen base projection plus trainable low-rank adapters, inside one unit.
struct LoraImpl : torch::nn::Module {
  LoraImpl(int64_t in, int64_t out, int64_t rank) {
    base = register_module("base", torch::nn::Linear(in, out));
    a = register_parameter("lora_a", at::randn({rank, in}) * 0.1);
    b = register_parameter("lora_b", at::randn({out, rank}) * 0.1);
    base->weight.set_requires_grad(false);
    base->bias.set_requires_grad(false);
  }
  at::Tensor forward(const at::Tensor& x) { return base->forward(x) + at::matmul(at::matmul(x, a.t()), b.t()); }
  torch::nn::Linear base{nullptr};
  at::Tensor a, b;
};
TORCH_MODULE(Lora);

struct LoraNetImpl : torch::nn::Module {
  LoraNetImpl() {
    wte = register_module("wte", torch::nn::Embedding(11, 16));
    for (int i = 0; i < 2; ++i) layers.push_back(register_module("l" + std::to_string(i), zeal::Sharded<Lora>(16, 16, 2)));
  }
  // Tied: the embedding matrix is also the output projection (both uses in the root unit).
  at::Tensor forward(const at::Tensor& idx) {
    at::Tensor h = wte->forward(idx);
    for (auto& l : layers) h = at::tanh(l->forward(h));
    return at::matmul(h, wte->weight.t());
  }
  torch::nn::Embedding wte{nullptr};
  std::vector<zeal::Sharded<Lora>> layers;
};
TORCH_MODULE(LoraNet);

// An LM head inside a unit tied to the root's embedding: the shared matrix stays in the root.
struct HeadImpl : torch::nn::Module {
  explicit HeadImpl(at::Tensor w) : weight(register_parameter("weight", std::move(w))) {}
  at::Tensor forward(const at::Tensor& h) { return at::matmul(h, weight.t()); }
  at::Tensor weight;
};
TORCH_MODULE(Head);

struct TiedHeadImpl : torch::nn::Module {
  TiedHeadImpl() {
    wte = register_module("wte", torch::nn::Embedding(11, 16));
    mix = register_module("mix", zeal::Sharded<torch::nn::Linear>(16, 16));
    head = register_module("head", zeal::Sharded<Head>(wte->weight));
  }
  at::Tensor forward(const at::Tensor& idx) { return head->forward(at::tanh(mix->forward(wte->forward(idx)))); }
  torch::nn::Embedding wte{nullptr};
  zeal::Sharded<torch::nn::Linear> mix{nullptr};
  zeal::Sharded<Head> head{nullptr};
};
TORCH_MODULE(TiedHead);

// max|a − b| / max|b| over the whole vector (rel_diff splits by TinyGpt's parameters).
double rel_all(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
}

zeal::Config config(int stage, int64_t max_live = 1'000'000'000, int64_t prefetch = 50'000'000) {
  zeal::Config c = zeal_test::test_config();
  c.zero.stage = stage;
  c.zero.stage3_param_persistence_threshold = {0, false};
  c.zero.stage3_prefetch_bucket_size = {prefetch, false};
  c.zero.stage3_max_live_parameters = max_live;
  c.gradient_clipping = {1.0, false};
  return c;
}

// Trains `Model` (token ids [B, 6] → logits [B, 6, 11]) for 5 AdamW steps on `world` ranks at
// `stage`, each rank on its own rows of the same token table; checks every rank ends with the
// same parameters and returns them. The optimizer gets every trainable parameter once (tied
// matrices are registered twice).
template <class Model>
at::Tensor train_tokens(int world, int stage, const std::string& name) {
  const std::string dir = temp_dir(name);
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(config(stage), rt);
        zeal_test::seed(5);
        Model model;
        std::vector<at::Tensor> trainable;
        for (auto& p : model->parameters()) {
          bool seen = !p.requires_grad();
          for (auto& q : trainable) seen = seen || q.is_same(p);
          if (!seen) trainable.push_back(p);
        }
        torch::optim::AdamW opt(trainable, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
        auto [m, o] = engine.prepare(model, opt);
        auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
        at::Tensor tokens = at::randint(0, 11, {5 * world * 3, 6}, gen);
        for (int step = 0; step < 5; ++step) {
          at::Tensor batch = tokens.narrow(0, (step * world + engine.process_index()) * 3, 3);
          at::Tensor logits = m->forward(batch);
          engine.backward(torch::nn::functional::cross_entropy(logits.reshape({-1, 11}), batch.reshape({-1})));
          o.step();
          o.zero_grad();
        }
        auto g = engine.gathered();
        write_tensor(dir + "/params_" + std::to_string(engine.process_index()), flat_params(*m));
      },
      world);
  EXPECT_EQ(zeal::describe_failures(results), "");
  const at::Tensor p0 = read_tensor(dir + "/params_0");
  for (int r = 1; r < world; ++r) EXPECT_TRUE(at::equal(read_tensor(dir + "/params_" + std::to_string(r)), p0));
  return p0;
}


// Trains Flip for 6 steps with an eval forward after each; returns the final parameters (rank 0's,
// with every rank checked equal) and writes the gathered peak and the prefetch counts.
at::Tensor train_flip(int world, int stage, int64_t max_live, const std::string& name, std::vector<double>* stats) {
  const std::string dir = temp_dir(name);
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(config(stage, max_live), rt);
        zeal_test::seed(3);
        Flip model;
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
        auto [m, o] = engine.prepare(model, opt);
        auto gen = at::make_generator<at::CPUGeneratorImpl>(99);
        at::Tensor x = at::randn({6 * world * 4, 24}, gen);
        at::Tensor y = at::randint(0, 5, {6 * world * 4}, gen);
        double peak = 0, peak_twice = 0;  // steps without / with a unit used twice
        for (int step = 0; step < 6; ++step) {
          const bool flipped = step >= 3 && step % 2 == 1;
          double& pk = flipped ? peak : peak_twice;
          const int64_t first = (step * world + engine.process_index()) * 4;
          engine.reset_peak_memory();
          at::Tensor loss = torch::nn::functional::cross_entropy(m->forward(x.narrow(0, first, 4), step),
                                                                 y.narrow(0, first, 4));
          pk = std::max(pk, static_cast<double>(engine.memory().gathered_peak));
          engine.backward(loss);
          pk = std::max(pk, static_cast<double>(engine.memory().gathered_peak));
          o.step();
          o.zero_grad();
          {
            c10::NoGradGuard eval;  // an eval forward between steps: no backward points, released at once
            (void)m->forward(x.narrow(0, first, 4), step + 1);
          }
        }
        const auto mem = engine.memory();
        auto g = engine.gathered();
        write_tensor(dir + "/params_" + std::to_string(engine.process_index()), flat_params(*m));
        const auto [gathers, pre, demand] = engine.fetch_counts();
        write_tensor(dir + "/stats_" + std::to_string(engine.process_index()),
                     at::tensor(std::vector<double>{peak, double(mem.gathered_bound), double(pre), double(demand),
                                                    double(mem.gathered), peak_twice},
                                at::kDouble));
      },
      world);
  EXPECT_EQ(zeal::describe_failures(results), "");
  const at::Tensor p0 = read_tensor(dir + "/params_0");
  for (int r = 1; r < world; ++r) EXPECT_TRUE(at::equal(read_tensor(dir + "/params_" + std::to_string(r)), p0));
  if (stats) {
    const at::Tensor st = read_tensor(dir + "/stats_0");
    stats->assign(st.data_ptr<double>(), st.data_ptr<double>() + st.numel());
  }
  return p0;
}

// Flip trained in one process as `world` ranks would train it (train_flip's data, AdamW at 1e-2
// with weight decay 0.1, the config's clipping at 1.0), for the summation-order bound.
ReferenceTrainer flip_trainer(int world) {
  struct State {
    Flip model{nullptr};
    std::vector<at::Tensor> params;
    std::unique_ptr<torch::optim::AdamW> opt;
    std::unique_ptr<zeal::optim::Optimizer> zeal_opt;
    at::Tensor x, y;
  };
  auto st = std::make_shared<State>();
  zeal_test::seed(3);
  st->model = Flip();
  st->params = st->model->parameters();
  st->opt = std::make_unique<torch::optim::AdamW>(st->params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  st->zeal_opt = zeal::optim::make_fused_adamw({.lr = 1e-2, .weight_decay = 0.1});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(99);
  st->x = at::randn({6 * world * 4, 24}, gen);
  st->y = at::randint(0, 5, {6 * world * 4}, gen);
  ReferenceTrainer t;
  t.params = st->params;
  t.backward = [st, world](int step, int rank, int) {
    for (auto& p : st->params) p.mutable_grad() = at::Tensor();
    const int64_t first = (step * world + rank) * 4;
    at::Tensor loss = torch::nn::functional::cross_entropy(st->model->forward(st->x.narrow(0, first, 4), step),
                                                           st->y.narrow(0, first, 4));
    loss.backward();
    return loss.item<double>();
  };
  t.update = [st] { return clip_and_step(st->params, 1.0, *st->opt, st->zeal_opt.get()); };
  t.flat = [st] { return flat_params(*st->model); };
  return t;
}

}  // namespace

// The order of units changes every step (one unit runs twice in the even steps) and eval forwards
// run in between: stage 3 still matches stage 0, the recorded order is abandoned and re-traced
// (on-demand fetches counted), and the gathered bytes never pass max_live + largest unit + root.
TEST(Stage3, ChangingOrderTwiceUsedUnitAndEvalMatchStageZero) {
  for (int world : {2, 3}) {
    const at::Tensor zero = train_flip(world, 0, 0, "flip0", nullptr);
    std::vector<double> st;
    const int64_t unit_elems = 24 * 24 + 24;
    const at::Tensor three = train_flip(world, 3, unit_elems, "flip3", &st);
    const double err = rel_all(three, zero);
    std::printf("[ metric ] world %d: stage 3 vs stage 0 with a changing order: %.3g; gathered peak %.0f B "
                "(%.0f B with a unit used twice), bound %.0f B; %.0f prefetches, %.0f re-traces\n",
                world, err, st[0], st[5], st[1], st[2], st[3]);
    if (world == 2) {
      EXPECT_TRUE(at::equal(three, zero)) << "two ranks, one micro-step: the same sums (engine_test.cpp)";
    } else {
      EXPECT_LE(err, sum_order_spread([&] { return flip_trainer(world); }, world, 1, 6, rel_all).params);
    }
    // The bound, computed here: one unit's worth of live parameters, the largest unit (padded to
    // whole shards of 16 elements), the root (head) kept gathered.
    const auto padded = [&](int64_t n) { return (n + 16 * world - 1) / (16 * world) * (16 * world) * 4; };
    const double bound = unit_elems * 4 + padded(unit_elems) + padded(24 * 5 + 5);
    EXPECT_EQ(st[1], bound);
    EXPECT_LE(st[0], bound);
    // A unit used twice stays gathered from its second use's backward until its gradients are
    // complete (after its first use's backward): one unit more than the bound.
    EXPECT_LE(st[5], bound + padded(unit_elems));
    EXPECT_GT(st[0], padded(24 * 5 + 5));  // units really were gathered
    EXPECT_GT(st[2], 0) << "the stable steps should have prefetched along the recorded order";
    EXPECT_GT(st[3], 0) << "the changing order should have been noticed";
    // After the last eval forward the units its recorded order uses next stay prefetched, within the
    // bound (they are released before the next optimizer step, so they never hold old values).
    EXPECT_LE(st[4], bound);
  }
}

// Prefetch along a stable order: the same numbers as fetching every unit on demand (that
// prefetches are issued is asserted in the changing-order test).
TEST(Stage3, PrefetchChangesNothingButTiming) {
  RunSpec s;
  s.world = 2;
  s.stage = 3;
  s.accumulation = 2;
  s.prefetch = 0;
  const RunResult off = run_engine(s, "noprefetch");
  s.prefetch = 50'000'000;
  const RunResult on = run_engine(s, "prefetch");
  EXPECT_TRUE(at::equal(on.params[0], off.params[0]));
  EXPECT_GT(on.memory[0][7].item<double>(), 0) << "prefetches were issued in this run";
  EXPECT_EQ(off.memory[0][7].item<double>(), 0) << "none without prefetch";
}

// LoRA inside units: frozen base weights sharded, gathered, never changed; adapters trained as in
// stage 0. Tied embedding/output weights (root) get both uses' gradients, as in stage 0.
TEST(Stage3, FrozenBaseWeightsAndTiedEmbeddingMatchStageZero) {
  const int world = 2;
  std::map<int, at::Tensor> final_params;
  at::Tensor initial;
  for (int stage : {0, 3}) final_params[stage] = train_tokens<LoraNet>(world, stage, "lora" + std::to_string(stage));
  zeal_test::seed(5);
  LoraNet init;
  initial = flat_params(*init);
  std::printf("[ metric ] LoRA + tied, stage 3 vs stage 0: %.3g\n", rel_all(final_params[3], final_params[0]));
  // Two ranks, one micro-step: the same arithmetic as stage 0 (engine_test.cpp, same_arithmetic).
  EXPECT_TRUE(at::equal(final_params[3], final_params[0]));
  // Frozen base weights bit for bit; adapters and the tied embedding moved.
  int64_t offset = 0;
  for (const auto& item : init->named_parameters()) {
    const int64_t n = item.value().numel();
    const at::Tensor before = initial.narrow(0, offset, n), after = final_params[3].narrow(0, offset, n);
    if (item.key().find(".base.") != std::string::npos) {
      EXPECT_TRUE(at::equal(before, after)) << item.key();
    } else {
      EXPECT_GT(rel_all(after, before), 1e-3) << item.key();
    }
    offset += n;
  }
}

// gathered(params, modifier_rank): rank 1 writes values; every rank sees them afterwards, in the
// parameters and in training (the shards and the master took them).
TEST(Stage3, GatheredModificationReachesEveryRank) {
  const int world = 3;
  const std::string dir = temp_dir("gathered");
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Engine engine(config(3), rt);
        zeal_test::seed(3);
        Flip model;
        torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.0));  // lr 0: values stay
        auto [m, o] = engine.prepare(model, opt);
        {
          auto g = engine.gathered(std::vector<at::Tensor>{m->units[1]->inner->weight}, /*modifier_rank=*/1);
          if (engine.process_index() == 1) m->units[1]->inner->weight.detach().fill_(0.25);
        }
        at::Tensor x = at::randn({4, 24});
        engine.backward(m->forward(x, 0).sum());
        o.step();
        o.zero_grad();
        auto g = engine.gathered();
        const at::Tensor w = m->units[1]->inner->weight.detach();
        write_tensor(dir + "/w_" + std::to_string(engine.process_index()), w);
      },
      world);
  ASSERT_EQ(zeal::describe_failures(results), "");
  for (int r = 0; r < world; ++r) {
    const at::Tensor w = read_tensor(dir + "/w_" + std::to_string(r));
    EXPECT_TRUE(at::equal(w, at::full_like(w, 0.25))) << "rank " << r;
  }
}

// A parameter shared by two Sharded members is refused with both names.
struct HolderImpl : torch::nn::Module {
  explicit HolderImpl(const at::Tensor& w) { weight = register_parameter("w", w); }
  at::Tensor forward(const at::Tensor& x) { return at::matmul(x, weight); }
  at::Tensor weight;
};
TORCH_MODULE(Holder);

struct TiedUnitsImpl : torch::nn::Module {
  TiedUnitsImpl() {
    at::Tensor shared = at::randn({4, 4});
    a = register_module("a", zeal::Sharded<Holder>(shared));
    b = register_module("b", zeal::Sharded<Holder>(shared));
  }
  zeal::Sharded<Holder> a{nullptr}, b{nullptr};
};
TORCH_MODULE(TiedUnits);

TEST(Stage3, ParameterTiedAcrossUnitsIsRefused) {
  const std::string msg = error_on_one_rank("tied_units", [](zeal::Runtime& rt) {
    zeal::Engine engine(config(3), rt);
    TiedUnits model;
    torch::optim::AdamW opt(std::vector<at::Tensor>{model->a->inner->weight}, torch::optim::AdamWOptions(1e-3));
    (void)engine.prepare(model, opt);
  });
  EXPECT_NE(msg.find("'a'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'b'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tied"), std::string::npos) << msg;
}

// engine.init with zero3_init_flag: each block keeps only this rank's slice as soon as it exists.
// Ranks are seeded differently; the values are rank 0's, i.e. those of one process seeded like
// rank 0, bit for bit. Construction held at most the largest block + the root + the slices (the
// bound is computed here from the reference model), which is well under the whole model.
TEST(Stage3, InitBuildsPartitionedWithOneProcessValues) {
  const int world = 3;
  const TinyGptOptions opts{37, 32, 2, 6, 8, 128};
  const std::string dir = temp_dir("init");
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Config c = config(3);
        c.zero.zero3_init_flag = true;
        zeal::Engine engine(c, rt);
        zeal_test::seed(engine.process_index() == 0 ? 11 : 100 + engine.process_index());
        TinyGpt model = engine.init<TinyGpt>(opts);
        double held = 0;  // parameter storage this rank holds between init and prepare
        for (auto& p : model->parameters()) held += static_cast<double>(p.storage().nbytes());
        const auto mem = engine.memory();
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
        auto [m, o] = engine.prepare(model, opt);
        auto g = engine.gathered();
        const std::string me = std::to_string(engine.process_index());
        write_tensor(dir + "/params_" + me, flat_params(*m));
        write_tensor(dir + "/stats_" + me,
                     at::tensor(std::vector<double>{double(mem.construction_peak), double(mem.construction_bound),
                                                    held},
                                at::kDouble));
      },
      world);
  ASSERT_EQ(zeal::describe_failures(results), "");
  zeal_test::seed(11);
  TinyGpt ref(opts);
  const at::Tensor want = flat_params(*ref);
  int64_t whole = 0, block = 0, slices = 0;
  for (auto& p : ref->parameters()) whole += p.nbytes();
  for (auto& p : ref->blocks[0]->parameters()) {
    block += p.nbytes();
    slices += opts.layers * ((p.numel() + world - 1) / world) * 4;
  }
  const int64_t root = whole - opts.layers * block;
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(at::equal(read_tensor(dir + "/params_" + std::to_string(r)), want)) << "rank " << r;
    const at::Tensor st = read_tensor(dir + "/stats_" + std::to_string(r));
    const double peak = st[0].item<double>(), bound = st[1].item<double>(), held = st[2].item<double>();
    if (r == 0) {
      std::printf("[ metric ] world %d: construction peak %.0f B, bound %.0f B (largest block %lld + root %lld + "
                  "slices %lld), whole model %lld B\n",
                  world, peak, bound, (long long)block, (long long)root, (long long)slices, (long long)whole);
    }
    EXPECT_EQ(bound, double(block + root + slices)) << "rank " << r;
    EXPECT_LE(peak, bound) << "rank " << r;
    EXPECT_GT(peak, double(block)) << "rank " << r << ": construction was measured";
    EXPECT_LT(bound, 0.6 * double(whole));
    EXPECT_EQ(held, double(root)) << "rank " << r << ": only the root's parameters exist whole before prepare";
  }
}

// A model built by engine.init trains like stage 0 built normally, from the same initial values.
TEST(Stage3, InitTrainsLikeStageZero) {
  RunSpec s;
  s.world = 3;
  s.accumulation = 2;
  s.steps = 5;
  const RunResult zero = run_engine(s, "init_stage0");
  s.stage = 3;
  s.init = true;
  const RunResult three = run_engine(s, "init_stage3");
  EXPECT_TRUE(at::equal(three.trajectory[0][0], zero.trajectory[0][0])) << "initial values differ";
  const double err = rel_all(three.params[0], zero.params[0]);
  const double tol = tolerances(s).zeal_vs_zeal().params;
  std::printf("[ metric ] world 3, built by engine.init: stage 3 vs stage 0 %.3g (tolerance %.3g)\n", err, tol);
  EXPECT_LE(err, tol);
}


// Tied across the root and a unit (embedding and LM head): the matrix stays in the root and gets
// the sum of both uses' gradients, as in stage 0.
TEST(Stage3, HeadTiedToRootEmbeddingMatchesStageZero) {
  const at::Tensor zero = train_tokens<TiedHead>(2, 0, "tiedhead0");
  const at::Tensor three = train_tokens<TiedHead>(2, 3, "tiedhead3");
  std::printf("[ metric ] head tied to the root's embedding: stage 3 vs stage 0 %.3g\n", rel_all(three, zero));
  EXPECT_TRUE(at::equal(three, zero)) << "two ranks, one micro-step: the same arithmetic as stage 0";
}

namespace {
struct ChainImpl : torch::nn::Module {
  ChainImpl() {
    for (int i = 0; i < 3; ++i) units.push_back(register_module("u" + std::to_string(i), zeal::Sharded<torch::nn::Linear>(24, 24)));
  }
  at::Tensor forward(at::Tensor h) {
    for (auto& u : units) h = at::tanh(u->forward(h));
    return h.sum(1);
  }
  std::vector<zeal::Sharded<torch::nn::Linear>> units;
};
TORCH_MODULE(Chain);
}  // namespace

// stage3_max_reuse_distance: a unit whose next use in the recorded order comes after fewer than
// that many elements of other units' fetches stays gathered (0: none does). Three units of 600 elements in a chain: the
// last one's backward follows its forward directly (distance 0), the middle one's after 1200
// elements (u2 forward and backward), the first one's after 2400. Per step from the second on:
// distance 0 → 6 gathers, 600 → 5, 1e9 → 3; the values are the same bit for bit.
TEST(Stage3, ReuseDistanceKeepsUnitsGathered) {
  const int world = 2, steps = 4;
  std::vector<at::Tensor> params;
  for (int64_t reuse : {int64_t{0}, int64_t{600}, int64_t{1'000'000'000}}) {
    const std::string dir = temp_dir("reuse");
    auto results = zeal::spawn(
        [&](zeal::Runtime& rt) {
          zeal::Config c = config(3);
          c.zero.stage3_max_reuse_distance = reuse;
          zeal::Engine engine(c, rt);
          zeal_test::seed(4);
          Chain model;
          torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
          auto [m, o] = engine.prepare(model, opt);
          std::vector<double> per_step;
          double peak = 0;
          for (int step = 0; step < steps; ++step) {
            const int64_t before = engine.fetch_counts().gathers;
            engine.reset_peak_memory();
            at::Tensor x = at::randn({3, 24}, at::make_generator<at::CPUGeneratorImpl>(step * world + engine.process_index()));
            engine.backward(m->forward(x).pow(2).mean());
            o.step();
            o.zero_grad();
            per_step.push_back(double(engine.fetch_counts().gathers - before));
            peak = std::max(peak, double(engine.memory().gathered_peak));
          }
          per_step.push_back(peak);
          per_step.push_back(double(engine.memory().gathered_bound));
          auto g = engine.gathered();
          const std::string me = std::to_string(engine.process_index());
          write_tensor(dir + "/params_" + me, flat_params(*m));
          write_tensor(dir + "/counts_" + me, at::tensor(per_step, at::kDouble));
        },
        world);
    ASSERT_EQ(zeal::describe_failures(results), "");
    const at::Tensor counts = read_tensor(dir + "/counts_0");
    const int64_t want = reuse == 0 ? 6 : reuse == 600 ? 5 : 3;
    std::printf("[ metric ] reuse distance %lld: gathers per step %.0f %.0f %.0f %.0f, peak %.0f B, bound %.0f B\n",
                (long long)reuse, counts[0].item<double>(), counts[1].item<double>(), counts[2].item<double>(),
                counts[3].item<double>(), counts[steps].item<double>(), counts[steps + 1].item<double>());
    EXPECT_EQ(counts[0].item<double>(), 6) << "the first step records the order: nothing is kept";
    for (int step = 1; step < steps; ++step) EXPECT_EQ(counts[step].item<double>(), want) << "reuse " << reuse;
    EXPECT_LE(counts[steps].item<double>(), counts[steps + 1].item<double>());
    params.push_back(read_tensor(dir + "/params_0"));
    EXPECT_TRUE(at::equal(read_tensor(dir + "/params_1"), params.back()));
  }
  EXPECT_TRUE(at::equal(params[1], params[0]));
  EXPECT_TRUE(at::equal(params[2], params[0]));
}
