// StreamApplier, a load's second pass applying checked bytes: whatever pieces the bytes come in
// (elements split between pieces, pieces at addresses not aligned for their type, one byte at a
// time), every element of 2-, 4- and 8-byte types lands where it belongs, read after read.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include <ATen/ATen.h>

#include "engine/checkpoint/state_stream.h"

namespace zeal::ckpt {
namespace {

TEST(StreamApplier, SplitAndMisalignedPiecesLandWhereTheyBelong) {
  std::mt19937 gen(7);
  struct Case {
    at::ScalarType type;
    const char* dtype;
    int64_t es;
  };
  const std::vector<Case> cases{{at::kBFloat16, "BF16", 2}, {at::kFloat, "F32", 4}, {at::kLong, "I64", 8}};
  for (const int64_t max_piece : {int64_t{1}, int64_t{7}, int64_t{4099}, int64_t{3} << 20}) {
    SCOPED_TRACE(max_piece);
    // Three reads in a row, one per type, into the middle of each range (elements 5 .. 5 + n).
    std::vector<at::Tensor> want, got;
    std::vector<zero::StateRange> ranges(cases.size());
    std::vector<LoadItem> items;
    std::vector<std::pair<size_t, int64_t>> read_to;
    for (size_t k = 0; k < cases.size(); ++k) {
      const int64_t n = 300001 + static_cast<int64_t>(k);  // odd counts: the tensors after shift
      want.push_back(at::randint(-1000, 1000, {n}, at::TensorOptions().dtype(at::kLong)).to(cases[k].type));
      got.push_back(at::zeros({n + 10}, at::TensorOptions().dtype(cases[k].type)));
      ranges[k].name = cases[k].dtype;
      ranges[k].count = n + 10;
      ranges[k].values = got.back();
    }
    for (size_t k = 0; k < cases.size(); ++k) {
      items.push_back({&ranges[k], "param", cases[k].dtype, cases[k].es});
      read_to.push_back({k, 5});
    }
    StreamApplier apply(items, read_to, nullptr);
    for (size_t k = 0; k < cases.size(); ++k) {
      // The bytes one past an aligned address (as a file packs tensors after an odd bf16 count).
      const int64_t bytes = static_cast<int64_t>(want[k].nbytes());
      std::vector<char> src(static_cast<size_t>(bytes) + 16);
      char* base = src.data() + 1;
      std::memcpy(base, want[k].data_ptr(), static_cast<size_t>(bytes));
      for (int64_t at = 0; at < bytes;) {
        const int64_t n = std::min(bytes - at, std::uniform_int_distribution<int64_t>(1, max_piece)(gen));
        apply.take(k, at, base + at, n);
        at += n;
      }
    }
    apply.flush();
    EXPECT_TRUE(apply.applied());
    for (size_t k = 0; k < cases.size(); ++k) {
      EXPECT_TRUE(at::equal(got[k].narrow(0, 5, want[k].numel()), want[k])) << cases[k].dtype;
      EXPECT_EQ(got[k].narrow(0, 0, 5).abs().sum().item<double>(), 0) << cases[k].dtype << ": written before its range";
      EXPECT_EQ(got[k].narrow(0, 5 + want[k].numel(), 5).abs().sum().item<double>(), 0) << cases[k].dtype;
    }
  }
}

}  // namespace
}  // namespace zeal::ckpt
