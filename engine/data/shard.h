// How a dataset is split over ranks (Accelerate's sharded batch sampler, as index arithmetic).
//
// The dataset's indices, shuffled the same way on every rank (seed + epoch), are cut into global
// batches of world × per-rank batch; rank r takes the r-th slice of each. Concatenating the ranks'
// batch b in rank order therefore gives global batch b in dataset order, which is what
// gather_for_metrics relies on to drop exactly the padding.
//
// even_batches (the default): the last global batch is completed with indices from the start, so
// every rank runs the same number of full batches. Without it and without drop_last, the last
// global batch is split as evenly as possible (ranks may get batches of different sizes, or
// none). drop_last drops an incomplete last global batch.
#pragma once

#include <cstdint>
#include <vector>

namespace zeal::data {

struct ShardOptions {
  int64_t batch_size = 1;      // per rank; with split_batches, the global batch
  bool split_batches = false;  // batch_size is global and is divided by the world size
  bool shuffle = false;
  uint64_t seed = 0;
  bool even_batches = true;
  bool drop_last = false;
};

class ShardPlan {
 public:
  // Throws zeal::Error for a batch size the world size does not divide (split_batches) or < 1.
  ShardPlan(int64_t dataset_size, int world_size, int rank, const ShardOptions& options);

  // Reshuffles for `epoch` (identical on every rank).
  void set_epoch(int64_t epoch);

  int64_t num_batches() const;                // this rank's batches per epoch
  std::vector<int64_t> batch(int64_t b) const;  // this rank's batch b: dataset indices
  int64_t per_rank_batch() const { return per_rank_; }
  // Of global batch b gathered from all ranks (rank order), how many leading samples are real
  // (the rest are even_batches padding).
  int64_t real_samples_in_global_batch(int64_t b) const;
  int64_t padding() const { return padded_size_ - size_; }  // repeated samples per epoch

 private:
  std::vector<int64_t> order_;  // dataset order for this epoch, padded
  int64_t size_;
  int world_, rank_;
  ShardOptions o_;
  int64_t per_rank_, global_;
  int64_t padded_size_;
};

}  // namespace zeal::data
