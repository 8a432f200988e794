// Stage 3 when ranks go different ways: one rank runs an extra forward and backward, or enters
// engine.gathered() alone. Every rank must end within the timeout with an error naming the unit and
// both ranks — with ZEAL_DEBUG_COLLECTIVES and without it — and never go on with different
// parameters. Also: the config's comm_timeout under zeal::spawn, a rank whose last gather fails at
// shutdown, and the warning when every unit stays gathered.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>

#include "engine/zero/sharded.h"
#include "tests/engine/token_harness.h"

using namespace zeal_test;

namespace {

constexpr int64_t kVocab = 11;

struct BlockImpl : torch::nn::Module {
  BlockImpl() { fc = register_module("fc", torch::nn::Linear(12, 12)); }
  at::Tensor forward(const at::Tensor& x) { return at::tanh(fc(x)); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Block);

struct ChainImpl : torch::nn::Module {
  ChainImpl() {
    wte = register_module("wte", torch::nn::Embedding(kVocab, 12));
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("block" + std::to_string(i), zeal::Sharded<Block>()));
    head = register_module("head", torch::nn::Linear(12, kVocab));
  }
  at::Tensor forward(const at::Tensor& idx) {
    at::Tensor h = wte(idx);
    for (auto& b : blocks) h = b->forward(h);
    return head(h);
  }
  torch::nn::Embedding wte{nullptr};
  std::vector<zeal::Sharded<Block>> blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Chain);

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Runs `body(engine, model, optimizer, rank)` on two ranks in stage 3 with a short timeout; returns
// every rank's failure text (empty when it succeeded) and the seconds the whole run took.
struct Outcome {
  std::vector<std::string> failures;
  double seconds = 0;
  std::string all() const {
    std::string s;
    for (const auto& f : failures) s += f + "\n";
    return s;
  }
};

template <class Body>
Outcome run_two(bool debug, double timeout, Body body) {
  zeal::SpawnOptions so;
  so.comm_timeout = timeout;
  so.debug_collectives = debug;
  so.grace_seconds = timeout + 10;  // let every rank report on its own
  const auto t0 = std::chrono::steady_clock::now();
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        zeal::Config c = zeal_test::test_config();
        c.zero.stage = 3;
        c.zero.stage3_param_persistence_threshold = {0, false};
        zeal::Engine engine(c, rt);
        zeal_test::seed(1);
        Chain model;
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
        auto [m, o] = engine.prepare(model, opt);
        body(engine, m, o, engine.process_index());
      },
      2, so);
  Outcome out;
  out.seconds = seconds_since(t0);
  for (const auto& r : results)  // a rank that failed without an exception text still reads as failed
    out.failures.push_back(r.ok() ? "" : r.failure.empty() ? "exit status " + std::to_string(r.exit_code) : r.failure);
  return out;
}

at::Tensor batch_for(int step, int rank) {
  return at::randint(0, kVocab, {2, 5}, at::make_generator<at::CPUGeneratorImpl>(100 * step + rank));
}

void train_step(zeal::Engine& e, Chain& m, zeal::PreparedOptimizer& o, int step) {
  const at::Tensor b = batch_for(step, e.process_index());
  at::Tensor logits = m->forward(b.narrow(1, 0, 4));
  e.backward(torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), b.narrow(1, 1, 4).reshape({-1})));
  o.step();
  o.zero_grad();
}

}  // namespace

// Rank 0 runs one forward and backward more than rank 1 before the step. Both ranks fail within the
// timeout (plus the reports' few seconds), and what they print names a unit and both ranks.
TEST(Stage3Divergence, ExtraForwardOnOneRankIsNamed) {
  for (bool debug : {false, true}) {
    SCOPED_TRACE(debug ? "ZEAL_DEBUG_COLLECTIVES" : "default");
    const double timeout = 4;
    const Outcome r = run_two(debug, timeout, [](zeal::Engine& e, Chain& m, zeal::PreparedOptimizer& o, int rank) {
      train_step(e, m, o, 0);
      const at::Tensor b = batch_for(1, rank);
      if (rank == 0) {  // the extra micro-step
        at::Tensor logits = m->forward(b.narrow(1, 0, 4));
        e.backward(logits.sum());
      }
      train_step(e, m, o, 1);
    });
    std::printf("[ metric ] %s: both ranks failed after %.1f s (timeout %.0f s):\n%s", debug ? "debug" : "default",
                r.seconds, timeout, r.all().c_str());
    EXPECT_FALSE(r.failures[0].empty());
    EXPECT_FALSE(r.failures[1].empty());
    EXPECT_LT(r.seconds, 3 * timeout + 10);
    const std::string all = r.all();
    EXPECT_NE(all.find("[block"), std::string::npos) << "the unit is named";
    EXPECT_NE(all.find("rank 0"), std::string::npos);
    EXPECT_NE(all.find("rank 1"), std::string::npos);
  }
}

// Rank 0 enters engine.gathered() and rank 1 does not: the agreement point at its entry (through the
// store, before any collective) names both ranks and where the other one is; no parameter changes.
TEST(Stage3Divergence, GatheredOnOneRankIsNamed) {
  for (bool debug : {false, true}) {
    SCOPED_TRACE(debug ? "ZEAL_DEBUG_COLLECTIVES" : "default");
    const double timeout = 4;
    const Outcome r = run_two(debug, timeout, [](zeal::Engine& e, Chain& m, zeal::PreparedOptimizer& o, int rank) {
      train_step(e, m, o, 0);
      if (rank == 0) {
        auto g = e.gathered({}, 0);
        m->blocks[1]->inner->fc->weight.detach().fill_(7.0f);
      }
      train_step(e, m, o, 1);
    });
    std::printf("[ metric ] %s: both ranks failed after %.1f s:\n%s", debug ? "debug" : "default", r.seconds,
                r.all().c_str());
    EXPECT_FALSE(r.failures[0].empty());
    EXPECT_FALSE(r.failures[1].empty());
    EXPECT_LT(r.seconds, 3 * timeout + 10);
    const std::string all = r.all();
    EXPECT_NE(all.find("engine.gathered()"), std::string::npos) << all;
    EXPECT_NE(all.find("[block"), std::string::npos) << "where the other rank is: a unit's collective";
    EXPECT_NE(all.find("rank 1"), std::string::npos);
  }
}

// The same runs without divergence succeed: the checks cost no false alarm.
TEST(Stage3Divergence, AgreeingRanksPassEveryCheck) {
  for (bool debug : {false, true}) {
    const Outcome r = run_two(debug, 20, [](zeal::Engine& e, Chain& m, zeal::PreparedOptimizer& o, int) {
      for (int step = 0; step < 3; ++step) train_step(e, m, o, step);
      {
        auto g = e.gathered({}, 1);
      }
      train_step(e, m, o, 3);
      const at::Tensor g = e.full_grad(m->blocks[0]->inner->fc->weight);
      EXPECT_EQ(g.sizes(), m->blocks[0]->inner->fc->weight.sizes());
    });
    EXPECT_EQ(r.all(), "\n\n");
  }
}

// A comm_timeout set in the config applies to the ranks zeal::spawn starts (whose own default is
// 60 s): a rank that never arrives is reported after the config's 3 s.
TEST(Stage3Divergence, ConfigTimeoutAppliesUnderSpawn) {
  zeal::SpawnOptions so;
  so.comm_timeout = 120;
  so.grace_seconds = 30;
  const auto t0 = std::chrono::steady_clock::now();
  auto results = zeal::spawn(
      [](zeal::Runtime& rt) {
        zeal::Config c = zeal_test::test_config();
        c.set("comm_timeout", "3", {zeal::Origin::Kind::kFlag, "--comm_timeout"});
        zeal::Engine engine(c, rt);
        if (engine.process_index() == 0) engine.wait_for_everyone();  // rank 1 never comes
        else std::this_thread::sleep_for(std::chrono::seconds(20));
      },
      2, so);
  const double took = seconds_since(t0);
  EXPECT_FALSE(results[0].ok());
  EXPECT_NE(results[0].failure.find("timed out after 3 s"), std::string::npos) << results[0].failure;
  EXPECT_LT(took, 30);
}

// A rank whose last gather (the engine leaving the model whole at shutdown) fails exits non-zero.
TEST(Stage3Divergence, FailedGatherAtShutdownExitsNonZero) {
  const Outcome out = run_two(false, 5, [](zeal::Engine& e, Chain& m, zeal::PreparedOptimizer& o, int rank) {
    train_step(e, m, o, 0);
    e.wait_for_everyone();
    new Chain(m);  // the program still holds the model when the engine goes: it is gathered then
    if (rank == 1) std::_Exit(0);  // gone without the shutdown gather
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  });
  EXPECT_EQ(out.failures[1], "");
  EXPECT_NE(out.failures[0], "") << "rank 0 could not gather at shutdown and must say so with its exit status";
}

// A model whose last handle goes with the engine is not gathered at shutdown (no collective: rank 0
// exits cleanly though rank 1 is gone; gathering would put the whole model in memory for nothing).
TEST(Stage3Divergence, ModelGoingWithTheEngineIsNotGathered) {
  const Outcome out = run_two(false, 5, [](zeal::Engine& e, Chain& m, zeal::PreparedOptimizer& o, int rank) {
    train_step(e, m, o, 0);
    e.wait_for_everyone();
    if (rank == 1) std::_Exit(0);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  });
  EXPECT_EQ(out.failures[1], "");
  EXPECT_EQ(out.failures[0], "") << "rank 0 gathered a model nobody holds";
}

// Every unit under the persistence threshold: stage 3 says once that nothing is sharded.
TEST(Stage3Divergence, EveryUnitPersistentIsSaidOnce) {
  const std::string dir = temp_dir("persist_warning");
  auto results = zeal::spawn(
      [&](zeal::Runtime& rt) {
        if (rt.rank() == 0) (void)!std::freopen((dir + "/stderr").c_str(), "w", stderr);
        zeal::Config c = zeal_test::test_config();
        c.zero.stage = 3;
        c.zero.stage3_param_persistence_threshold = {1'000'000, false};
        zeal::Engine engine(c, rt);
        Chain model;
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
        auto [m, o] = engine.prepare(model, opt);
        train_step(engine, m, o, 0);
        std::fflush(stderr);
      },
      2);
  ASSERT_EQ(zeal::describe_failures(results), "");
  std::ifstream f(dir + "/stderr");
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  size_t count = 0;
  for (size_t at = text.find("every unit stays gathered"); at != std::string::npos;
       at = text.find("every unit stays gathered", at + 1))
    ++count;
  EXPECT_EQ(count, 1u) << text;
}
