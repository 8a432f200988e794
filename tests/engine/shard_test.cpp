// Dataset sharding: every sample exactly once per epoch over all ranks (after dropping the
// even_batches padding the way gather_for_metrics does), the same shuffle on every rank, equal
// batch counts with even_batches.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "engine/data/shard.h"
#include "engine/error.h"

namespace zeal::data {
namespace {

struct Case {
  int64_t n;
  int world;
  int64_t batch;
  bool shuffle, even, drop_last;
};

std::string describe(const Case& c) {
  return "n=" + std::to_string(c.n) + " world=" + std::to_string(c.world) + " batch=" + std::to_string(c.batch) +
         (c.shuffle ? " shuffle" : "") + (c.even ? " even" : "") + (c.drop_last ? " drop_last" : "");
}

TEST(Shard, EverySampleExactlyOnceAfterDroppingPadding) {
  std::vector<Case> cases;
  for (int64_t n : {0, 1, 7, 10, 100, 101})
    for (int world : {1, 2, 3, 4})
      for (int64_t batch : {1, 3, 4})
        for (bool shuffle : {false, true})
          for (bool even : {false, true})
            for (bool drop : {false, true}) cases.push_back({n, world, batch, shuffle, even, drop});
  for (const Case& c : cases) {
    SCOPED_TRACE(describe(c));
    ShardOptions o{.batch_size = c.batch, .shuffle = c.shuffle, .seed = 42, .even_batches = c.even, .drop_last = c.drop_last};
    std::vector<ShardPlan> plans;
    for (int r = 0; r < c.world; ++r) plans.emplace_back(c.n, c.world, r, o);
    int64_t batches = 0;
    for (const auto& p : plans) batches = std::max(batches, p.num_batches());
    if (c.even || c.drop_last) {
      for (const auto& p : plans) EXPECT_EQ(p.num_batches(), batches);
    }
    // Gather batch b from every rank in rank order, keep the real samples, as gather_for_metrics does.
    std::vector<int64_t> seen;
    for (int64_t b = 0; b < batches; ++b) {
      std::vector<int64_t> gathered;
      for (const auto& p : plans) {
        auto part = p.batch(b);
        if (c.even) {
          EXPECT_EQ(static_cast<int64_t>(part.size()), c.batch);
        }
        gathered.insert(gathered.end(), part.begin(), part.end());
      }
      const int64_t real = plans[0].real_samples_in_global_batch(b);
      ASSERT_LE(real, static_cast<int64_t>(gathered.size()));
      seen.insert(seen.end(), gathered.begin(), gathered.begin() + real);
    }
    const int64_t global = c.batch * c.world;
    const int64_t expected = c.drop_last ? c.n / global * global : c.n;
    ASSERT_EQ(static_cast<int64_t>(seen.size()), expected);
    std::vector<int64_t> sorted = seen;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_TRUE(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end()) << "a sample appears twice";
    if (!c.drop_last) {
      std::vector<int64_t> all(c.n);
      std::iota(all.begin(), all.end(), int64_t{0});
      EXPECT_EQ(sorted, all);
    }
    if (!c.shuffle) {
      EXPECT_TRUE(std::is_sorted(seen.begin(), seen.end())) << "without shuffle, dataset order";
    }
    if (c.even && !c.drop_last && c.n > 0) {
      EXPECT_EQ(plans[0].padding(), (global - c.n % global) % global);
    }
  }
}

TEST(Shard, ShuffleIsTheSameOnEveryRankAndChangesWithTheEpoch) {
  ShardOptions o{.batch_size = 4, .shuffle = true, .seed = 3};
  ShardPlan a(1000, 4, 0, o), b(1000, 4, 0, o);
  b.set_epoch(0);
  EXPECT_EQ(a.batch(5), b.batch(5)) << "same seed and epoch, same order (as on another rank)";
  b.set_epoch(1);
  EXPECT_NE(a.batch(5), b.batch(5));
  b.set_epoch(0);
  EXPECT_EQ(a.batch(5), b.batch(5));
  ShardOptions other = o;
  other.seed = 4;
  EXPECT_NE(ShardPlan(1000, 4, 0, other).batch(5), a.batch(5));
}

TEST(Shard, SplitBatchesDividesTheGlobalBatch) {
  ShardOptions o{.batch_size = 8, .split_batches = true};
  ShardPlan p(64, 4, 1, o);
  EXPECT_EQ(p.per_rank_batch(), 2);
  EXPECT_EQ(p.num_batches(), 8);
  EXPECT_EQ(p.batch(0), (std::vector<int64_t>{2, 3}));
  o.batch_size = 6;
  try {
    ShardPlan bad(64, 4, 0, o);
    FAIL() << "6 is not divisible by 4";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "split_batches: the batch size 6 is not divisible by the 4 processes");
  }
}

}  // namespace
}  // namespace zeal::data
