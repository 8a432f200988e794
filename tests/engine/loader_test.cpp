// zeal::DataLoader's worker threads (num_workers, prefetch_factor) and device placement: the same
// batches in the same order as without workers, every rank's part, across epochs and restarts; the
// next batch prepared while the loop holds one, no further ahead than asked; an exception rethrown
// at its batch; a batch type's own to_device found, and refused when a device needs one and there
// is none. The ranks' parts come from bind(), as engine.prepare gives them.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "engine/data/loader.h"

namespace {

using Example = torch::data::Example<at::Tensor, at::Tensor>;

// Sample i is [i, i*i]; get() records which indices were asked for and may throw at one index.
struct Numbers {
  int64_t n = 0;
  int64_t throw_at = -1;
  std::shared_ptr<std::mutex> mu = std::make_shared<std::mutex>();
  std::shared_ptr<std::set<int64_t>> asked = std::make_shared<std::set<int64_t>>();
  Example get(size_t i) const {
    {
      std::lock_guard lock(*mu);
      asked->insert(static_cast<int64_t>(i));
    }
    if (static_cast<int64_t>(i) == throw_at) throw std::runtime_error(fmt::format("record {} is bad", i));
    const auto v = static_cast<double>(i);
    return {at::tensor({v, v * v}, at::kDouble), at::full({}, static_cast<int64_t>(i))};
  }
  size_t size() const { return static_cast<size_t>(n); }
  bool was_asked(int64_t i) const {
    std::lock_guard lock(*mu);
    return asked->count(i) != 0;
  }
};

zeal::data::Binding rank_of(int rank, int world) {
  zeal::data::Binding b;
  b.rank = rank;
  b.world_size = world;
  return b;
}

// Every batch of `epochs` epochs, concatenated per epoch.
template <class Loader>
std::vector<std::vector<Example>> run(Loader& loader, int epochs) {
  std::vector<std::vector<Example>> out;
  for (int e = 0; e < epochs; ++e) {
    out.emplace_back();
    for (const auto& b : loader) out.back().push_back(b);
  }
  return out;
}

TEST(LoaderWorkers, GiveTheSameBatchesInTheSameOrder) {
  for (int world : {1, 3}) {
    for (int rank = 0; rank < world; ++rank) {
      zeal::LoaderOptions base{.batch_size = 4, .shuffle = true, .seed = 7};
      zeal::DataLoader plain(Numbers{.n = 37}, base);
      plain.bind(rank_of(rank, world));
      const auto expected = run(plain, 3);
      ASSERT_GT(expected[0].size(), 1u);
      for (int workers : {1, 2, 3}) {
        for (int prefetch : {1, 2, 5}) {
          SCOPED_TRACE(fmt::format("world {} rank {} workers {} prefetch {}", world, rank, workers, prefetch));
          auto o = base;
          o.num_workers = workers;
          o.prefetch_factor = prefetch;
          zeal::DataLoader loader(Numbers{.n = 37}, o);
          loader.bind(rank_of(rank, world));
          const auto got = run(loader, 3);
          ASSERT_EQ(got.size(), expected.size());
          for (size_t e = 0; e < got.size(); ++e) {
            ASSERT_EQ(got[e].size(), expected[e].size());
            for (size_t b = 0; b < got[e].size(); ++b) {
              EXPECT_TRUE(at::equal(got[e][b].data, expected[e][b].data)) << "epoch " << e << " batch " << b;
              EXPECT_TRUE(at::equal(got[e][b].target, expected[e][b].target)) << "epoch " << e << " batch " << b;
            }
          }
          const auto s = loader.stats();
          EXPECT_EQ(s.batches, static_cast<int64_t>(expected.back().size()));
          EXPECT_GT(s.prepare_seconds, 0.0);
        }
      }
    }
  }
}

// Waits up to 20 s for `cond`.
template <class F>
bool eventually(F cond) {
  for (int i = 0; i < 2000; ++i) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return cond();
}

TEST(LoaderWorkers, PrepareTheNextBatchWhileTheLoopHoldsOneAndNoFurther) {
  // Batches of 2, unshuffled: batch k is samples 2k and 2k+1.
  for (int prefetch : {1, 2}) {
    SCOPED_TRACE(fmt::format("prefetch {}", prefetch));
    Numbers data{.n = 12};
    zeal::DataLoader loader(data, {.batch_size = 2, .num_workers = 1, .prefetch_factor = prefetch});
    auto it = loader.begin();
    (void)*it;  // the loop now holds batch 0
    // Batches 1 … prefetch are prepared without being asked for.
    EXPECT_TRUE(eventually([&] { return data.was_asked(2 * prefetch + 1); }));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_FALSE(data.was_asked(2 * (prefetch + 1))) << "prepared beyond prefetch_factor batches ahead";
    ++it;
    (void)*it;
    EXPECT_TRUE(eventually([&] { return data.was_asked(2 * (prefetch + 1) + 1); }));
  }
  // Without workers nothing is prepared before it is used.
  Numbers data{.n = 12};
  zeal::DataLoader loader(data, {.batch_size = 2});
  auto it = loader.begin();
  (void)*it;
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(data.was_asked(2));
}

TEST(LoaderWorkers, AnExceptionIsRethrownAtItsBatchUnchanged) {
  zeal::DataLoader loader(Numbers{.n = 20, .throw_at = 9}, {.batch_size = 3, .num_workers = 2});
  int64_t seen = 0;
  try {
    for (const auto& b : loader) {
      (void)b;
      ++seen;
    }
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "record 9 is bad");
  }
  EXPECT_EQ(seen, 3) << "batches 0-2 come before the one holding sample 9";
}

// A batch read again (a copy of the iterator made before it was read, or a read after an exception)
// is built again, never waited for.
TEST(LoaderWorkers, ABatchReadAgainIsBuiltAgain) {
  zeal::DataLoader loader(Numbers{.n = 12, .throw_at = 5}, {.batch_size = 2, .num_workers = 2});
  auto a = loader.begin();
  auto copy = a;
  const at::Tensor first = (*a).target;
  EXPECT_TRUE(at::equal((*copy).target, first));
  ++a;
  ++a;  // batch 2 holds sample 5
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      (void)*a;
      ADD_FAILURE() << "no exception at attempt " << attempt;
    } catch (const std::runtime_error& e) {
      EXPECT_STREQ(e.what(), "record 5 is bad");
    }
  }
  ++a;
  EXPECT_TRUE(at::equal((*a).target, at::tensor(std::vector<int64_t>{6, 7})));
}

TEST(LoaderWorkers, LeavingAnEpochEarlyThenStartingAgainIsClean) {
  zeal::LoaderOptions o{.batch_size = 2, .shuffle = true, .seed = 3};
  zeal::DataLoader plain(Numbers{.n = 30}, o);
  o.num_workers = 3;
  zeal::DataLoader loader(Numbers{.n = 30}, o);
  for (int round = 0; round < 3; ++round) {
    loader.set_epoch(round);
    plain.set_epoch(round);
    auto a = loader.begin();
    auto p = plain.begin();
    for (int k = 0; k < 2; ++k, ++a, ++p) EXPECT_TRUE(at::equal((*a).target, (*p).target));
  }
  // A whole epoch after the broken ones, and the loader destroyed with its workers idle.
  loader.set_epoch(9);
  plain.set_epoch(9);
  const auto got = run(loader, 1), expected = run(plain, 1);
  ASSERT_EQ(got[0].size(), expected[0].size());
  for (size_t b = 0; b < got[0].size(); ++b) EXPECT_TRUE(at::equal(got[0][b].target, expected[0][b].target));
  auto it = loader.begin();  // workers started, then destroyed mid-epoch with the loader
  (void)*it;
}

TEST(LoaderWorkers, BadSettingsAreNamed) {
  EXPECT_THROW(zeal::DataLoader(Numbers{.n = 4}, {.num_workers = -1}), zeal::Error);
  EXPECT_THROW(zeal::DataLoader(Numbers{.n = 4}, {.num_workers = 1, .prefetch_factor = 0}), zeal::Error);
}

}  // namespace

// A batch type of the user's with its own to_device, found by argument-dependent lookup.
namespace user {
struct Batch {
  at::Tensor ids;
};
inline std::atomic<int> moves{0};
inline Batch to_device(Batch b, at::Device d) {
  ++moves;
  return {b.ids.to(d)};
}
struct Collate {
  Batch operator()(std::vector<Example> items) const {
    std::vector<at::Tensor> t;
    for (auto& e : items) t.push_back(e.target);
    return {at::stack(t)};
  }
};
struct Opaque {
  int64_t n = 0;
};
struct OpaqueCollate {
  Opaque operator()(std::vector<Example> items) const { return {static_cast<int64_t>(items.size())}; }
};
}  // namespace user

namespace {

TEST(LoaderPlacement, ABatchTypesOwnToDeviceIsUsed) {
  user::moves = 0;
  zeal::DataLoader loader(Numbers{.n = 6}, {.batch_size = 2, .num_workers = 1}, user::Collate{});
  for (const auto& b : loader) EXPECT_EQ(b.ids.numel(), 2);
  EXPECT_EQ(user::moves.load(), 3);
}

TEST(LoaderPlacement, ABatchWithoutToDeviceIsRefusedOffTheCpu) {
  zeal::DataLoader loader(Numbers{.n = 6}, {.batch_size = 2}, user::OpaqueCollate{});
  auto b = rank_of(0, 1);
  b.device = at::Device(at::kCUDA, 0);
  loader.bind(b);
  try {
    (void)*loader.begin();
    FAIL() << "no error";
  } catch (const zeal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("to_device(Batch, at::Device)"), std::string::npos) << e.what();
  }
  // On the CPU it is used as it is.
  zeal::DataLoader cpu(Numbers{.n = 6}, {.batch_size = 2}, user::OpaqueCollate{});
  EXPECT_EQ((*cpu.begin()).n, 2);
}

}  // namespace
