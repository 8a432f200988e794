// The memory check at prepare (config key memory_check): this rank's predicted peak, from the
// prepared module and the config through engine/estimate.h's model, against the memory it may use
// (engine/memory_budget.h).
#pragma once

#include <cstdint>
#include <string>

#include "engine/estimate.h"
#include "engine/memory_budget.h"

namespace torch::nn {
class Module;
}

namespace zeal {
struct Config;
namespace zero {
class InitShards;
}

namespace detail {

struct PrepareMemory {
  int64_t predicted = 0;   // host bytes at the peak, activations left out
  MemoryBudget budget;
  std::string parts;       // the largest parts of the prediction, for the message
  std::string remedies;    // the settings that would lower it, each with its predicted peak
  // Bytes the rank's swap files will take (offload to nvme): the parameters' (offload_param) and
  // the optimizer's (master weights, Adam states, gradients; offload_optimizer).
  int64_t disk_params = 0, disk_optimizer = 0;
  bool fits() const { return budget.bytes < 0 || predicted <= budget.bytes; }
};

// The prepared model as the estimator sees it (every parameter at its full size, stage 3's units as
// the engine forms them), its trainable elements and the bytes its tensors hold in host memory now.
struct PreparedShape {
  estimate::ModelShape model;
  int64_t trainable = 0, present = 0;
};
PreparedShape prepared_model_shape(torch::nn::Module& module, zero::InitShards* shards, const Config& config);

// `shards`: the slices engine.init kept (null or empty when the model was built whole).
PrepareMemory predict_prepare_memory(torch::nn::Module& module, zero::InitShards* shards, const Config& config,
                                     int world, int local_world, bool on_gpu);

// The estimator's run shape from the config's keys (stage, offload, precision, buffers,
// activation checkpointing) for `world` ranks.
estimate::RunShape run_shape_of(const Config& config, int world, bool on_gpu);

// What a batch adds to the peak prepare predicted: `batch`'s micro_batch × seq_len tokens (and its
// chunked_loss, loss_chunk) through `model`, on top of the config's run shape. Host bytes.
struct BatchMemory {
  int64_t activations = 0;        // the batch's own bytes at the peak (the prediction's growth from one token)
  int64_t largest_micro_batch = 0;  // the largest micro-batch whose peak fits 90 % of `budget` (0: none)
  int64_t with_checkpointing = -1;  // the peak with every unit checkpointed (-1: already on)
};
BatchMemory predict_batch_memory(const estimate::ModelShape& model, const estimate::RunShape& batch, const Config& config,
                                 int world, int64_t trainable, int64_t prepared_peak, int64_t budget);

// The swap files of every rank on this machine against the free space of their file systems,
// before anything is written: "" when they fit, else the message (naming each folder and both sizes).
std::string check_swap_space(const PrepareMemory& pm, const Config& config, int local_world);

}  // namespace detail
}  // namespace zeal
