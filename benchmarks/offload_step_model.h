// offload_bench --step_model: a model's whole training step with its optimizer state, gradients and
// parameters on NVMe against the same step with everything in memory (2 ranks, the same tokens),
// side by side in one run. No LibTorch headers.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace zeal_bench {

struct StepModelOptions {
  std::string model;          // a train_gpt preset (gpt2-medium)
  std::string dir;            // the swap files' directory (the disk measured)
  std::string bin;            // where zeal and train_gpt are
  int64_t seq_len = 256;      // tokens per rank per step (micro batch 1)
  int steps = 4;              // per run; the first is left out of the median
  int rounds = 3;             // runs of each contender, interleaved
  int64_t sub_group_size = 0; // > 0: a third contender, NVMe with this sub_group_size (the window)
};

// Runs the rounds, prints the rows and returns them as JSON (nvme_step_ratio_vs_in_memory: the
// median of the per-round ratios of the NVMe run's median step to the in-memory run's, with the
// config's sub_group_size of 1e9, as configs/ds_zero3_nvme.json has it;
// nvme_sub_group_step_ratio_vs_in_memory with sub_group_size set).
nlohmann::json run_step_model(const StepModelOptions& o);

}  // namespace zeal_bench
