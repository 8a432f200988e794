#include "engine/data/shard.h"

#include <algorithm>
#include <numeric>
#include <random>

#include <fmt/format.h>

#include "engine/error.h"

namespace zeal::data {

ShardPlan::ShardPlan(int64_t dataset_size, int world_size, int rank, const ShardOptions& o)
    : size_(dataset_size), world_(world_size), rank_(rank), o_(o) {
  if (dataset_size < 0) throw Error("dataset size is negative");
  if (o.batch_size < 1) throw Error(fmt::format("batch_size must be at least 1, got {}", o.batch_size));
  if (o.split_batches && o.batch_size % world_size != 0) {
    throw Error(fmt::format("split_batches: the batch size {} is not divisible by the {} processes", o.batch_size,
                            world_size));
  }
  per_rank_ = o.split_batches ? o.batch_size / world_size : o.batch_size;
  global_ = per_rank_ * world_size;
  set_epoch(0);
}

void ShardPlan::set_epoch(int64_t epoch) {
  order_.resize(size_);
  std::iota(order_.begin(), order_.end(), int64_t{0});
  if (o_.shuffle) {
    // Fisher–Yates with a fixed generator: the same permutation on every rank and platform.
    std::mt19937_64 rng(o_.seed + static_cast<uint64_t>(epoch));
    for (int64_t i = size_ - 1; i > 0; --i) {
      const int64_t j = static_cast<int64_t>(rng() % static_cast<uint64_t>(i + 1));
      std::swap(order_[i], order_[j]);
    }
  }
  padded_size_ = size_;
  const int64_t rem = size_ % global_;
  if (rem != 0 && o_.drop_last) {
    padded_size_ = size_ - rem;
    order_.resize(padded_size_);
  } else if (rem != 0 && o_.even_batches && size_ > 0) {
    padded_size_ = size_ + (global_ - rem);
    for (int64_t i = 0; static_cast<int64_t>(order_.size()) < padded_size_; ++i) order_.push_back(order_[i % size_]);
  }
}

int64_t ShardPlan::num_batches() const {
  const int64_t full = static_cast<int64_t>(order_.size()) / global_;
  const int64_t rem = static_cast<int64_t>(order_.size()) % global_;
  if (rem == 0) return full;
  // Uneven last global batch (even_batches off): rank r gets a part of it, if any.
  return full + (batch(full).empty() ? 0 : 1);
}

std::vector<int64_t> ShardPlan::batch(int64_t b) const {
  const int64_t n = static_cast<int64_t>(order_.size());
  const int64_t start = b * global_;
  if (b < 0 || start >= n) return {};
  const int64_t in_batch = std::min(global_, n - start);
  int64_t begin, end;
  if (in_batch == global_) {
    begin = rank_ * per_rank_;
    end = begin + per_rank_;
  } else {
    // Split what is left as evenly as possible, in rank order (the first ranks get one more).
    const int64_t base = in_batch / world_, extra = in_batch % world_;
    begin = rank_ * base + std::min<int64_t>(rank_, extra);
    end = begin + base + (rank_ < extra ? 1 : 0);
  }
  return std::vector<int64_t>(order_.begin() + start + begin, order_.begin() + start + end);
}

int64_t ShardPlan::real_samples_in_global_batch(int64_t b) const {
  const int64_t start = b * global_;
  const int64_t limit = o_.drop_last ? padded_size_ : size_;
  return std::clamp<int64_t>(limit - start, 0, std::min<int64_t>(global_, padded_size_ - start));
}

}  // namespace zeal::data
