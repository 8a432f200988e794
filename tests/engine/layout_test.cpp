// The flat layout: over all ranks, every element of every parameter is in exactly one shard, at
// the buffer position its offset says; shards are equal and aligned.
#include <gtest/gtest.h>

#include <random>

#include "engine/error.h"
#include "engine/zero/layout.h"

namespace zeal::zero {
namespace {

TEST(FlatLayout, EveryElementInExactlyOneShardAtItsOffset) {
  std::mt19937 rng(1);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<int64_t> numels(1 + rng() % 12);
    for (auto& n : numels) n = rng() % 5 == 0 ? 0 : 1 + rng() % 300;  // some empty parameters too
    const int world = 1 + rng() % 8;
    const int64_t align = trial % 3 == 0 ? 64 : 1;
    FlatLayout l(numels, world, align);
    SCOPED_TRACE("trial " + std::to_string(trial) + " world " + std::to_string(world));
    EXPECT_EQ(l.shard_size() % align, 0);
    EXPECT_GE(l.padded_total(), l.total());
    EXPECT_LT(l.padded_total() - l.total(), world * align) << "padding is less than one aligned row per rank";
    std::vector<int> hits(l.total(), 0);
    for (int r = 0; r < world; ++r) {
      int64_t last_end = 0;
      for (const Piece& p : l.pieces(r)) {
        ASSERT_GT(p.count, 0);
        ASSERT_GE(p.shard_begin, last_end) << "pieces in buffer order, not overlapping";
        ASSERT_LE(p.shard_begin + p.count, l.shard_size());
        ASSERT_LE(p.param_begin + p.count, l.numel(p.param));
        // The piece's position in the buffer agrees with the parameter's offset.
        ASSERT_EQ(l.shard_begin(r) + p.shard_begin, l.offset(p.param) + p.param_begin);
        for (int64_t k = 0; k < p.count; ++k) ++hits[l.offset(p.param) + p.param_begin + k];
        last_end = p.shard_begin + p.count;
      }
    }
    for (int64_t i = 0; i < l.total(); ++i) ASSERT_EQ(hits[i], 1) << "element " << i;
  }
}

TEST(FlatLayout, SmallCaseByHand) {
  // Parameters of 5, 3 and 4 elements over 3 ranks: 12 elements, shards of 4.
  FlatLayout l({5, 3, 4}, 3);
  EXPECT_EQ(l.shard_size(), 4);
  auto r1 = l.pieces(1);  // buffer [4, 8): param 0 element 4, param 1 elements 0..2
  ASSERT_EQ(r1.size(), 2u);
  EXPECT_EQ(r1[0].param, 0);
  EXPECT_EQ(r1[0].param_begin, 4);
  EXPECT_EQ(r1[0].count, 1);
  EXPECT_EQ(r1[1].param, 1);
  EXPECT_EQ(r1[1].shard_begin, 1);
  EXPECT_EQ(r1[1].count, 3);
  EXPECT_THROW(l.pieces(3), Error);
}

}  // namespace
}  // namespace zeal::zero
