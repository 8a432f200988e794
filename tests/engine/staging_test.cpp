// An asynchronous save's staging (engine/checkpoint/staging.h) sized for a state that fits its
// budget: the copy of the whole state completes with no chunk written yet (nothing waits for the
// disk), and a kept staging hands the next save the same chunks, as many as hold the state — for
// states below one chunk's floor, in the middle, and above the largest chunk.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <memory>
#include <vector>

#include "engine/checkpoint/staging.h"

namespace {

using zeal::ckpt::Staging;
using zeal::ckpt::StagingPool;

// Copies `bytes` into a staging sized as a save sizes it for a state that fits; true when the copy
// finished before any chunk was written. Then writes them all (drains).
bool copies_without_waiting(int64_t bytes, const std::shared_ptr<StagingPool>& pool) {
  const int64_t chunk = Staging::chunk_for(bytes + (1 << 20));
  Staging s(Staging::whole_bytes(bytes), pool, /*hold=*/false, chunk);
  std::vector<char> piece(1 << 20, 7);
  auto copy = std::async(std::launch::async, [&] {
    for (int64_t left = bytes; left > 0; left -= static_cast<int64_t>(piece.size())) {
      s.append(piece.data(), std::min<int64_t>(left, static_cast<int64_t>(piece.size())));
    }
    s.close();
  });
  const bool done = copy.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  while (auto* c = s.next()) s.done(c);  // the writer's side (also unblocks a copy that waits)
  copy.get();
  return done;
}

TEST(Staging, AStateThatFitsIsCopiedWholeAndKeptWhole) {
  for (const int64_t bytes : {int64_t{100} << 10, int64_t{3} << 20, int64_t{150} << 20}) {
    const int64_t whole = Staging::whole_bytes(bytes), chunk = Staging::chunk_for(bytes + (1 << 20));
    EXPECT_GE(whole, bytes + (1 << 20)) << bytes;
    EXPECT_EQ(whole % chunk, 0) << bytes;
    auto pool = std::make_shared<StagingPool>();
    EXPECT_TRUE(copies_without_waiting(bytes, pool)) << bytes << " bytes: the copy waited for the writes";
    EXPECT_GE(pool->bytes(), bytes) << bytes << " bytes: the kept staging does not hold the state";
    const int64_t kept = pool->bytes();
    EXPECT_TRUE(copies_without_waiting(bytes, pool)) << bytes << " bytes, kept staging";
    EXPECT_EQ(pool->bytes(), kept) << bytes << " bytes: the next kept save did not reuse the same chunks";
  }
}

}  // namespace
