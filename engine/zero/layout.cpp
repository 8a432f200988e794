#include "engine/zero/layout.h"

#include <algorithm>

#include <fmt/format.h>

#include "engine/error.h"

namespace zeal::zero {

FlatLayout::FlatLayout(std::vector<int64_t> numels, int world_size, int64_t align)
    : numels_(std::move(numels)), world_(world_size) {
  if (world_size < 1) throw Error(fmt::format("world size must be at least 1, got {}", world_size));
  if (align < 1) throw Error(fmt::format("alignment must be at least 1, got {}", align));
  offsets_.reserve(numels_.size());
  for (size_t i = 0; i < numels_.size(); ++i) {
    if (numels_[i] < 0) throw Error(fmt::format("parameter {} has a negative size", i));
    offsets_.push_back(total_);
    total_ += numels_[i];
  }
  const int64_t per = (total_ + world_ - 1) / world_;
  shard_ = (per + align - 1) / align * align;
}

std::vector<Piece> FlatLayout::pieces(int rank) const {
  if (rank < 0 || rank >= world_) throw Error(fmt::format("rank {} is not in a world of {}", rank, world_));
  const int64_t lo = shard_begin(rank), hi = lo + shard_;
  std::vector<Piece> out;
  // The first parameter ending after lo.
  auto it = std::upper_bound(offsets_.begin(), offsets_.end(), lo);
  int p = static_cast<int>(it - offsets_.begin()) - 1;
  for (p = std::max(p, 0); p < num_params() && offsets_[p] < hi; ++p) {
    const int64_t b = std::max(lo, offsets_[p]), e = std::min(hi, offsets_[p] + numels_[p]);
    if (e <= b) continue;
    out.push_back({p, b - offsets_[p], b - lo, e - b});
  }
  return out;
}

}  // namespace zeal::zero
