// The memory check's view of a model: stage 3's units formed as the engine forms them (nested units
// counted once, in the innermost), and what a batch adds on top of the prepared peak.
#include <gtest/gtest.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <string>
#include <vector>

#include "engine/config/config.h"
#include "engine/estimate.h"
#include "engine/prepare_check.h"
#include "engine/zero/sharded.h"

namespace {

constexpr int64_t kDim = 48;
constexpr int64_t kLinear = kDim * kDim + kDim;

struct LeafImpl : torch::nn::Module {
  LeafImpl() { fc = register_module("fc", torch::nn::Linear(kDim, kDim)); }
  at::Tensor forward(const at::Tensor& x) { return fc(x); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Leaf);

// A Sharded unit holding another: `pre` is the outer unit's, the inner Leaf's Linear the inner's.
struct OuterImpl : torch::nn::Module {
  OuterImpl() {
    pre = register_module("pre", torch::nn::Linear(kDim, kDim));
    inner = register_module("inner", zeal::Sharded<Leaf>());
  }
  at::Tensor forward(const at::Tensor& x) { return inner->forward(pre(x)); }
  torch::nn::Linear pre{nullptr};
  zeal::Sharded<Leaf> inner{nullptr};
};
TORCH_MODULE(Outer);

// The same, its inner block a plain Leaf (a unit only when unit_names names LeafImpl).
struct OuterPlainImpl : torch::nn::Module {
  OuterPlainImpl() {
    pre = register_module("pre", torch::nn::Linear(kDim, kDim));
    inner = register_module("inner", Leaf());
  }
  at::Tensor forward(const at::Tensor& x) { return inner->forward(pre(x)); }
  torch::nn::Linear pre{nullptr};
  Leaf inner{nullptr};
};
TORCH_MODULE(OuterPlain);

struct NestedNetImpl : torch::nn::Module {
  explicit NestedNetImpl(bool plain_inner) {
    head = register_module("head", torch::nn::Linear(kDim, kDim));
    if (plain_inner) {
      outer_plain = register_module("outer", zeal::Sharded<OuterPlain>());
    } else {
      outer = register_module("outer", zeal::Sharded<Outer>());
    }
    last = register_module("last", zeal::Sharded<Leaf>());
  }
  torch::nn::Linear head{nullptr};
  zeal::Sharded<Outer> outer{nullptr};
  zeal::Sharded<OuterPlain> outer_plain{nullptr};
  zeal::Sharded<Leaf> last{nullptr};
};
TORCH_MODULE(NestedNet);

struct FlatNetImpl : torch::nn::Module {
  FlatNetImpl() {
    head = register_module("head", torch::nn::Linear(kDim, kDim));
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("b" + std::to_string(i), zeal::Sharded<Leaf>()));
  }
  torch::nn::Linear head{nullptr};
  std::vector<zeal::Sharded<Leaf>> blocks;
};
TORCH_MODULE(FlatNet);

zeal::Config stage3() {
  zeal::Config c;
  c.zero.stage = 3;
  return c;
}

TEST(PrepareCheck, NestedUnitsHoldTheirOwnParametersOnly) {
  const zeal::Config c = stage3();
  NestedNet nested(false);
  FlatNet flat;
  const auto n = zeal::detail::prepared_model_shape(*nested, nullptr, c);
  const auto f = zeal::detail::prepared_model_shape(*flat, nullptr, c);
  // The root (head), the outer unit (pre), the inner unit (its Linear), the last: one Linear each,
  // as Stage3 forms them; the outer unit does not count its inner unit's parameters again.
  EXPECT_EQ(n.model.units, (std::vector<int64_t>{kLinear, kLinear, kLinear, kLinear}));
  EXPECT_EQ(n.model.units, f.model.units);
  EXPECT_EQ(n.model.params, 4 * kLinear);
  // So the prediction of the two layouts is the same (their runtime aside).
  zeal::estimate::RunShape r = zeal::detail::run_shape_of(c, 2, false);
  EXPECT_EQ(zeal::estimate::predict(n.model, r).host_peak, zeal::estimate::predict(f.model, r).host_peak);
}

// Parameters offloaded from a GPU in stage 3: the root's and the persistent units' shards stay on
// the device (the engine keeps them there), the rest go to host memory (cpu) or, past max_in_cpu,
// to disk (nvme). Persistence as the config sets it: 0 releases every block, the default 1e5 none
// of these small ones.
TEST(PrepareCheck, OffloadedParametersOfPersistentUnitsStayOnTheDevice) {
  FlatNet flat;  // a root (head) and three blocks, one Linear each
  for (int64_t threshold : {int64_t{0}, int64_t{100'000}}) {
    zeal::Config c = stage3();
    c.zero.offload_param.device = zeal::OffloadDevice::kCpu;
    c.zero.stage3_param_persistence_threshold = {threshold, false};
    const auto shape = zeal::detail::prepared_model_shape(*flat, nullptr, c);
    const auto bytes = [&](const zeal::estimate::Prediction& p, const std::string& name, const std::string& where) {
      int64_t b = 0;
      for (const auto& part : p.parts)
        if (part.name == name && part.where == where) b += part.bytes;
      return b;
    };
    const int world = 2;
    const auto gpu = zeal::estimate::predict(shape.model, zeal::detail::run_shape_of(c, world, /*on_gpu=*/true));
    const int64_t kept = threshold == 0 ? kLinear : 4 * kLinear;  // elements that stay on the device
    SCOPED_TRACE("threshold " + std::to_string(threshold));
    EXPECT_EQ(bytes(gpu, "parameters", "device"), 4 * kept / world);
    EXPECT_EQ(bytes(gpu, "parameters in host memory", "host"), 4 * (4 * kLinear - kept) / world);
    c.zero.offload_param.device = zeal::OffloadDevice::kNvme;
    c.zero.offload_param.max_in_cpu = kLinear / world;  // one block's shard in host memory, the rest on disk
    const auto nvme = zeal::estimate::predict(shape.model, zeal::detail::run_shape_of(c, world, true));
    if (threshold == 0) {
      EXPECT_EQ(bytes(nvme, "parameters in host memory", "host"), 4 * kLinear / world);
      EXPECT_EQ(bytes(nvme, "parameters on disk", "disk"), 4 * 2 * kLinear / world);
    } else {
      EXPECT_EQ(bytes(nvme, "parameters on disk", "disk"), 0);
    }
  }
}

// Stage 3's gathers follow stage3_param_persistence_threshold as configured: with every block
// within it nothing is ever released (every parameter gathered at the peak), and the blocks still
// run, so the peak holds every block's activations; with 0 (and no reuse distance) the blocks are
// released after use: the same activations beside fewer gathered parameters.
TEST(PrepareCheck, AThresholdThatKeepsEveryUnitKeepsItsActivations) {
  const auto m = zeal::estimate::gpt_shape("gpt-tiny", 1000, 64, 4, 64, 4);
  ASSERT_TRUE(m.transformer.has_value());
  zeal::estimate::RunShape r;
  r.stage = 3;
  r.world = 2;
  r.micro_batch = 2;
  r.seq_len = 32;
  r.max_reuse_distance = 0;  // else DeepSpeed's default keeps a used unit for its backward
  const auto part = [](const zeal::estimate::Prediction& p, const std::string& name) {
    int64_t b = 0;
    for (const auto& x : p.parts)
      if (x.name == name) b += x.bytes;
    return b;
  };
  const auto& t = *m.transformer;
  const int64_t activations = t.layers * r.micro_batch * r.seq_len * (8 * t.hidden + 2 * t.ffn) * 4;  // fp32
  r.persistence_threshold = *std::max_element(m.units.begin(), m.units.end());
  const auto kept = zeal::estimate::predict(m, r);
  EXPECT_EQ(part(kept, "gathered units"), 4 * m.params);
  EXPECT_EQ(part(kept, "activations"), activations);
  r.persistence_threshold = 0;
  const auto released = zeal::estimate::predict(m, r);
  EXPECT_LT(part(released, "gathered units"), 4 * m.params);
  EXPECT_EQ(part(released, "activations"), activations);
}

// A persistent unit fetches nothing, so it prefetches nothing either: in three blocks whose last is
// persistent, with nothing kept for reuse, the first block is gathered ahead for its backward while
// the second runs, the second is let go, and at the turnaround (the logits: the peak, with a large
// vocabulary) the gathered parameters are the root's, the last block's and the first block's.
TEST(PrepareCheck, APersistentUnitPrefetchesNothing) {
  auto m = zeal::estimate::gpt_shape("gpt-tiny", 50000, 64, 3, 64, 4);
  m.params -= m.units[3] - 100;
  m.units[3] = 100;  // within the threshold below; the other blocks are not
  zeal::estimate::RunShape r;
  r.stage = 3;
  r.world = 2;
  r.micro_batch = 2;
  r.seq_len = 32;
  r.max_reuse_distance = 0;
  r.persistence_threshold = 1000;
  int64_t gathered = 0;
  for (const auto& x : zeal::estimate::predict(m, r).parts)
    if (x.name == "gathered units") gathered += x.bytes;
  EXPECT_EQ(gathered, 4 * (m.units[0] + m.units[3] + m.units[1]));
}

TEST(PrepareCheck, UnitsByTypeNameInsideASharedUnit) {
  zeal::Config c = stage3();
  c.zero.unit_names = {"LeafImpl"};
  NestedNet nested(true);  // outer: Sharded<OuterPlain> { pre, Leaf }, last: Sharded<Leaf>
  const auto n = zeal::detail::prepared_model_shape(*nested, nullptr, c);
  // The plain Leaf inside the outer unit is a unit of its own; the last Sharded<Leaf>'s block is its
  // member's unit, not a second one.
  EXPECT_EQ(n.model.units, (std::vector<int64_t>{kLinear, kLinear, kLinear, kLinear}));
  c.zero.unit_names.clear();
  const auto without = zeal::detail::prepared_model_shape(*nested, nullptr, c);
  EXPECT_EQ(without.model.units, (std::vector<int64_t>{kLinear, 2 * kLinear, kLinear}));
}

TEST(PrepareCheck, ABatchAddsItsActivationsAndTheLargestThatFitsIsFound) {
  zeal::Config c;
  c.zero.stage = 0;
  const auto model = zeal::estimate::gpt_shape("gpt2-small", 50257, 1024, 12, 768, 12);
  zeal::estimate::RunShape batch;
  batch.seq_len = 1024;
  auto adds = [&](int64_t micro, int64_t prepared, int64_t budget) {
    batch.micro_batch = micro;
    return zeal::detail::predict_batch_memory(model, batch, c, 1, model.params, prepared, budget);
  };
  const int64_t one = adds(1, 0, -1).activations, two = adds(2, 0, -1).activations, four = adds(4, 0, -1).activations;
  EXPECT_GT(one, 0);
  // Each sequence more adds the same (its blocks' activations, logits and softmax): linear in the batch.
  EXPECT_NEAR(static_cast<double>(four - two), 2.0 * static_cast<double>(two - one), 0.01 * static_cast<double>(two - one));
  EXPECT_GT(two - one, int64_t{1} << 30);  // gpt2-small at 1,024 tokens: above 1 GiB a sequence
  // The largest micro-batch predicted to fit with 10 % to spare: its peak fits 90 % of the budget,
  // one more does not.
  const int64_t prepared = int64_t{2} << 30, budget = prepared + 20 * one;
  const auto bm = adds(64, prepared, budget);
  ASSERT_GT(bm.largest_micro_batch, 0);
  ASSERT_LT(bm.largest_micro_batch, 64);
  const int64_t spare = budget - budget / 10;
  EXPECT_LE(prepared + adds(bm.largest_micro_batch, prepared, budget).activations, spare);
  EXPECT_GT(prepared + adds(bm.largest_micro_batch + 1, prepared, budget).activations, spare);
  // Checkpointing every block predicts a lower peak than keeping every block's activations.
  EXPECT_GE(bm.with_checkpointing, 0);
  EXPECT_LT(bm.with_checkpointing, prepared + bm.activations);
  c.activation_checkpointing.enabled = true;
  EXPECT_EQ(adds(64, prepared, budget).with_checkpointing, -1);  // on already: no such remedy to offer
  EXPECT_LT(adds(64, prepared, budget).activations, bm.activations);
}

}  // namespace
