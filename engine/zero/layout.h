// The flat-buffer layout every ZeRO stage works on: the trainable parameters laid end to end in
// one buffer, padded so it splits into world_size equal shards, and for each rank the pieces of
// each parameter that fall in its shard (a parameter may straddle shards).
#pragma once

#include <cstdint>
#include <vector>

namespace zeal::zero {

struct Piece {
  int param = 0;            // index into the layout's parameters
  int64_t param_begin = 0;  // first element of the parameter in this piece
  int64_t shard_begin = 0;  // where it sits in the rank's shard
  int64_t count = 0;
};

class FlatLayout {
 public:
  // `numels`: each parameter's element count, in buffer order. Shards are a multiple of
  // `align` elements (e.g. 64 so each shard starts on a cache line for fp32 and SIMD runs whole).
  FlatLayout(std::vector<int64_t> numels, int world_size, int64_t align = 1);

  int world_size() const { return world_; }
  int64_t total() const { return total_; }                 // sum of the parameters
  int64_t shard_size() const { return shard_; }            // elements per rank
  int64_t padded_total() const { return shard_ * world_; }  // buffer length
  int64_t offset(int param) const { return offsets_[param]; }
  int64_t numel(int param) const { return numels_[param]; }
  int num_params() const { return static_cast<int>(numels_.size()); }

  // The pieces of parameters inside `rank`'s shard, in buffer order.
  std::vector<Piece> pieces(int rank) const;
  // The range [begin, end) of the flat buffer that `rank` owns.
  int64_t shard_begin(int rank) const { return shard_ * rank; }

 private:
  std::vector<int64_t> numels_, offsets_;
  int world_;
  int64_t total_ = 0, shard_ = 0;
};

}  // namespace zeal::zero
